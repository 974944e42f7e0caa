// KvPeerService: the kvcache.v1.KvPeer gRPC service, a hand-off's source side
// (docs/DISAGGREGATION.md). Another kvcached importing a sequence calls ExportSequence
// (the sequence is frozen and described), reads its KV blocks (over UCX with the keys the
// export carries, or with ReadExportedKv), and calls FinishExport. The bookkeeping is the
// ExportTable's (cache_manager/handoff/exports.h); this layer authenticates, translates
// and schedules: ExportSequence runs on the sequence's engine thread, FinishExport on an
// engine thread, and ReadExportedKv copies blocks out of the pool on the gRPC thread (a
// bounded copy per message, no engine work).
//
// Trust: served only to peers. With --auth_tokens_file, a token whose line carries the
// role 'peer'; with --peer_ca_file, a client certificate that CA issued; either is
// enough. With neither configured, every caller is trusted, as every caller of KvCache is.
// The export names the tenant the import runs as: a peer is trusted to say it.
#ifndef KVCM_SERVER_KV_PEER_SERVICE_H_
#define KVCM_SERVER_KV_PEER_SERVICE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cache_manager/handoff/exports.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/step_executor.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/ucx_sidecar.h"

namespace kvcm::server {

namespace internal {
using KvPeer = ::kvcache::v1::KvPeer;
using KvPeerServiceBase = KvPeer::WithRawCallbackMethod_ExportSequence<
    KvPeer::WithRawCallbackMethod_ReadExportedKv<
        KvPeer::WithRawCallbackMethod_FinishExport<KvPeer::Service>>>;
}  // namespace internal

// Who may call KvPeer.
struct PeerTrust {
  const BearerTokens* tokens = nullptr;  // --auth_tokens_file; null: none
  std::string peer_ca_pem;               // --peer_ca_file's contents; "": none
};

class KvPeerService final : public internal::KvPeerServiceBase {
 public:
  // `pools` and `ucx` may be null. None is owned.
  KvPeerService(ExportTable* exports, const KvPools* pools, UcxSidecar* ucx,
                StepExecutor* executor, ServerMetrics* metrics, PeerTrust trust);

  // Raw: ExportSequenceRequest in, ExportSequenceResponse out.
  grpc::ServerUnaryReactor* ExportSequence(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  // Raw: a ReadExportedKvRequest in, ExportedKvChunks out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ReadExportedKv(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  // Raw: FinishExportRequest in, FinishExportResponse out.
  grpc::ServerUnaryReactor* FinishExport(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

  // OK for a trusted peer (the returned tenant is ""; the request names the tenant);
  // UNAUTHENTICATED or PERMISSION_DENIED saying what a peer must present otherwise.
  absl::StatusOr<std::string> AuthenticatePeer(const grpc::CallbackServerContext* context) const;

 private:
  ExportTable* const exports_;
  const KvPools* const pools_;
  UcxSidecar* const ucx_;
  StepExecutor* const executor_;
  ServerMetrics* const metrics_;
  const PeerTrust trust_;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_KV_PEER_SERVICE_H_

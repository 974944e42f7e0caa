// Importer: the target's side of a hand-off (ImportSequence; docs/DISAGGREGATION.md).
// An import pulls a sequence from the source kvcached that holds it:
//   1. ExportSequence on the source (KvPeer): the source freezes the sequence and returns
//      its record (the snapshot format's) and each rank's KV blocks;
//   2. on the sequence's engine thread here, the table builds it from the record, with
//      as many fresh blocks per rank as the source's lease holds (not findable yet);
//   3. the K/V of those blocks is copied block for block: one-sided UCX reads of the
//      source's registered pools, or a ReadExportedKv stream (--kv_transfer);
//   4. FinishExport(commit) on the source, which closes it there; then, on the engine
//      thread, the sequence becomes findable here and the reply carries its slot tables.
// A failure before the commit aborts the export (the source serves the sequence again,
// unchanged) and gives back everything taken here, so nothing is half done.
//
// Imports run on their own threads (each waits on the network; gRPC threads never do),
// from a bounded queue; the K/V bytes of imports in progress are bounded too. Both refuse
// with RESOURCE_EXHAUSTED, before anything is leased.
//
// Thread-safe.
#ifndef KVCM_SERVER_IMPORTER_H_
#define KVCM_SERVER_IMPORTER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "server/metrics.h"
#include "server/server_options.h"
#include "server/ucx_sidecar.h"

namespace kvcm::server {

// How this daemon reaches sources: the token it presents, and TLS (roots, its own
// certificate) when --peer_ca_file is set.
struct PeerCredentials {
  std::string token;  // "": none
  std::string ca_pem;  // "": plaintext
  std::string cert_pem;
  std::string key_pem;
};
// Reads --peer_token_file and, with --peer_ca_file, the PEM files (INVALID_ARGUMENT
// naming the flag when one cannot be read).
absl::StatusOr<PeerCredentials> ReadPeerCredentials(const ServerOptions& options);

class Importer {
 public:
  using Done = absl::AnyInvocable<void(const absl::Status&,
                                       const ::kvcache::v1::ImportSequenceResponse&)>;

  // `pools` and `ucx` may be null (no pools; no UCX: K/V over gRPC). None is owned.
  Importer(const ServerOptions& options, PeerCredentials credentials, SequenceTable* table,
           KvPools* pools, StepExecutor* executor, UcxSidecar* ucx, ServerMetrics* metrics);
  // Queued imports are answered UNAVAILABLE; running ones finish (bounded by their
  // deadline) before the threads join.
  ~Importer();

  Importer(const Importer&) = delete;
  Importer& operator=(const Importer&) = delete;

  // Queues the import of `request` for `tenant`; `done` is called once, on an import
  // thread, with the outcome. RESOURCE_EXHAUSTED (done not called) when the queue is full;
  // UNAVAILABLE once stopping.
  absl::Status Submit(std::string tenant, ::kvcache::v1::ImportSequenceRequest request,
                      Done done) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops taking imports (the drain).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    std::string tenant;
    ::kvcache::v1::ImportSequenceRequest request;
    Done done;
  };
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // One import, start to reply.
  absl::Status Run(const Job& job, ::kvcache::v1::ImportSequenceResponse* response);
  // After the source exported it: prepare here, copy, commit there, install here; or
  // abort there and give back what was taken here.
  absl::Status ImportExported(const Job& job, ::kvcache::v1::KvPeer::Stub& stub,
                              const ::kvcache::v1::ExportSequenceResponse& exported,
                              absl::Time deadline, ::kvcache::v1::ImportSequenceResponse* response);
  // Decodes the export's `record` and checks it, takes its bytes from the in-flight budget
  // (`kv_bytes`, 0 when refused) and builds the sequence here, not findable yet.
  absl::Status Prepare(const Job& job, const ::kvcache::v1::ExportSequenceResponse& exported,
                       SequenceRecord* record,
                       std::optional<SequenceTable::PendingImport>* pending, int64_t* kv_bytes);
  // Copies the source's blocks into `here`'s; returns the transport ("ucx", "grpc",
  // "none" without pools).
  absl::StatusOr<std::string> CopyKv(::kvcache::v1::KvPeer::Stub& stub, const std::string& source,
                                     const ::kvcache::v1::ExportSequenceResponse& exported,
                                     const SequenceRecord& record,
                                     const std::vector<BlockLeaseState>& here, absl::Time deadline);
  absl::Status ReadOverGrpc(::kvcache::v1::KvPeer::Stub& stub, const std::string& source,
                            uint64_t export_id, int32_t rank,
                            const std::vector<int32_t>& target_blocks, absl::Time deadline);
  // FinishExport(commit), retried when the answer is lost; whether the source committed.
  absl::StatusOr<bool> Commit(::kvcache::v1::KvPeer::Stub& stub, const std::string& source,
                              uint64_t export_id, absl::Time deadline);
  // FinishExport(abort); whether the source had committed it already.
  absl::StatusOr<bool> Abort(::kvcache::v1::KvPeer::Stub& stub, uint64_t export_id);
  // Makes the committed sequence findable and fills the reply with its state.
  void Install(const Job& job, SequenceTable::PendingImport pending,
               ::kvcache::v1::ImportSequenceResponse* response);
  void SetUp(grpc::ClientContext* context, absl::Time deadline) const;
  bool UseUcx() const;
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& source) ABSL_LOCKS_EXCLUDED(mu_);

  const ServerOptions options_;
  const PeerCredentials credentials_;
  SequenceTable* const table_;
  KvPools* const pools_;
  StepExecutor* const executor_;
  UcxSidecar* const ucx_;
  ServerMetrics* const metrics_;
  ByteBudget bytes_in_flight_;
  Mutex mu_;
  std::condition_variable_any wake_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  int64_t idle_threads_ ABSL_GUARDED_BY(mu_) = 0;  // import threads waiting for a job
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_IMPORTER_H_

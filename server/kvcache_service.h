// KvCacheService: the kvcache.v1.KvCache gRPC service on the callback API. A thin layer:
// every RPC is decoded and authenticated on the gRPC thread, and its table work posted to
// an engine thread (StepExecutor), which finishes the call: Open, Close and Inspect on
// their sequence's thread, so that they run in order with its steps (an Inspect or Close
// sent after a step is answered after that step, waiting for its slot there and not on a
// gRPC thread); ListSequences and the WatchKvEvents subscription on the tenant's thread.
// Steps go through the StepBatchProcessor, which posts them the same way. Only work that
// never waits for the engine (DescribeKvPools, score regions) runs on the gRPC thread.
// Nothing here blocks. A full engine queue refuses the call with RESOURCE_EXHAUSTED naming
// it; a stopping engine with UNAVAILABLE.
//
// Accounting: every RPC, streams included, is counted through one RpcAccount
// (server/step_batch_processor.h): unary calls by the UnaryCall wrapper here, step
// batches by the processor, stream refusals and bad messages by their reactor.
// StepStream runs one reactor per worker rank, WatchKvEvents one per subscriber
// (server/kv_events_reactor.h).
//
// The RPCs whose requests carry strings (sequence ids, region names) take their request
// as bytes and parse it here (ParseRequest): a message gRPC fails to parse (a string that
// is not valid UTF-8) would otherwise be answered UNIMPLEMENTED with no message, or end a
// stream as if the client had closed it; here it is INVALID_ARGUMENT saying so. Every RPC
// takes its request as bytes for the same reason.
//
// Authentication: with bearer tokens (server/auth.h) every call is first checked
// (UNAUTHENTICATED before its request is even parsed) and then runs as the token's tenant,
// seeing only that tenant's sequences, events and score regions. A StepStream or
// WatchKvEvents call is checked once, when it starts: a token removed later does not end
// streams already open (their next call is refused).
#ifndef KVCM_SERVER_KVCACHE_SERVICE_H_
#define KVCM_SERVER_KVCACHE_SERVICE_H_

#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/score_regions.h"
#include "cache_manager/table/sequence_table.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/server_options.h"
#include "server/step_batch_processor.h"

namespace kvcm::server {

class Importer;
class StepStreamReactor;

namespace internal {
using KvCache = ::kvcache::v1::KvCache;
// Raw (bytes) for the RPCs whose requests carry strings, typed for the rest. Built on the
// plain Service: the raw StepStream cannot sit on top of CallbackService's typed one.
using KvCacheServiceBase = KvCache::WithRawCallbackMethod_OpenSequence<
    KvCache::WithRawCallbackMethod_CloseSequence<KvCache::WithRawCallbackMethod_InspectSequence<
        KvCache::WithRawCallbackMethod_ListSequences<KvCache::WithRawCallbackMethod_Step<
            KvCache::WithRawCallbackMethod_StepStream<
                KvCache::WithRawCallbackMethod_DescribeKvPools<
                    KvCache::WithRawCallbackMethod_RegisterScoreRegion<
                        KvCache::WithRawCallbackMethod_CreateScoreRegion<
                            KvCache::WithRawCallbackMethod_UnregisterScoreRegion<
                                KvCache::WithRawCallbackMethod_WatchKvEvents<
                                    KvCache::WithRawCallbackMethod_ImportSequence<
                                        KvCache::Service>>>>>>>>>>>>;
}  // namespace internal

// Parses `raw` into `out`; INVALID_ARGUMENT naming the message type when it does not
// parse (a string field that is not valid UTF-8, or bytes that are not that message).
template <typename Message>
absl::Status ParseRequest(const grpc::ByteBuffer& raw, Message* out) {
  grpc::ByteBuffer bytes(raw);  // Deserialize consumes its buffer; this shares the slices
  if (grpc::SerializationTraits<Message>::Deserialize(&bytes, out).ok()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the request does not parse as ", Message::descriptor()->full_name(),
      ": a string field (a sequence id, a name) is not valid UTF-8, or the bytes are not "
      "that message"));
}

class KvCacheService final : public internal::KvCacheServiceBase {
 public:
  // `pools` may be null (no KV pools), `regions` too (score regions not allowed), `tokens`
  // too (no authentication: every caller is tenant "").
  KvCacheService(const ServerOptions& options, SequenceTable* table, const KvPools* pools,
                 StepExecutor* executor, ScoreRegions* regions, ServerMetrics* metrics,
                 const BearerTokens* tokens = nullptr);
  ~KvCacheService() override;

  // Raw: OpenSequenceRequest, CloseSequenceRequest, InspectSequenceRequest in; their
  // responses out.
  grpc::ServerUnaryReactor* OpenSequence(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSequence(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* InspectSequence(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  // Raw: a StepBatch in, a DecisionBatch out (the stream: one of each per message).
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StepStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* DescribeKvPools(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  // Raw: RegisterScoreRegionRequest in, RegisterScoreRegionResponse out.
  grpc::ServerUnaryReactor* RegisterScoreRegion(grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) override;
  // Raw: CreateScoreRegionRequest in, CreateScoreRegionResponse out.
  grpc::ServerUnaryReactor* CreateScoreRegion(grpc::CallbackServerContext* context,
                                              const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterScoreRegion(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) override;
  // Raw: a WatchKvEventsRequest in, KvEvents out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchKvEvents(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;

  // Raw: ImportSequenceRequest in, ImportSequenceResponse out. Runs on the importer's
  // threads (server/importer.h), which finish the call.
  grpc::ServerUnaryReactor* ImportSequence(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  // The importer ImportSequence hands its calls to (null: the RPC is refused). Set before
  // serving; not owned.
  void set_importer(Importer* importer) { importer_ = importer; }

  // Draining: new streams are refused; open ones keep being answered until their clients
  // close them (or the server's drain deadline cancels them). KV event watches end now.
  void StartDraining();

  // Called by a stream reactor when it is done.
  void StreamDone();

  // OK when score regions are on (--allow_shm_scores), else FAILED_PRECONDITION saying so.
  absl::Status RegionsAllowed() const;

 private:
  // The caller's tenant: "" without tokens; UNAUTHENTICATED without a known token.
  absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext* context) const;
  // WatchKvEvents' subscription for `tenant`, its snapshot taken (on an engine thread);
  // UNAVAILABLE once draining.
  absl::StatusOr<std::unique_ptr<KvEventSubscription>> Subscribe(
      const ::kvcache::v1::WatchKvEventsRequest& request, const std::string& tenant)
      ABSL_LOCKS_EXCLUDED(mu_);

  const ServerOptions options_;
  SequenceTable* const table_;
  const KvPools* const pools_;
  StepExecutor* const executor_;
  ScoreRegions* const regions_;
  ServerMetrics* const metrics_;
  const BearerTokens* const tokens_;
  Importer* importer_ = nullptr;
  StepBatchProcessor processor_;
  Mutex mu_;
  int64_t open_streams_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_KVCACHE_SERVICE_H_

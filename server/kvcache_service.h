// KvCacheService: the kvcache.v1.KvCache gRPC service on the callback API. A thin layer:
// every RPC is decoded, handed to the sequence table (steps through the
// StepBatchProcessor, which runs them on the engine threads), and its status recorded by
// one wrapper (UnaryCall). StepStream runs one reactor per worker rank, WatchKvEvents one
// per subscriber (server/kv_events_reactor.h). Nothing here blocks and no engine work
// runs on a gRPC thread.
#ifndef KVCM_SERVER_KVCACHE_SERVICE_H_
#define KVCM_SERVER_KVCACHE_SERVICE_H_

#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "cache_manager/mutex.h"
#include "cache_manager/sequence_table.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "server/metrics.h"
#include "server/score_regions.h"
#include "server/server_options.h"
#include "server/step_batch_processor.h"

namespace kvcm::server {

class StepStreamReactor;

class KvCacheService final : public ::kvcache::v1::KvCache::CallbackService {
 public:
  // `pools` may be null (no KV pools), `regions` too (score regions not allowed).
  KvCacheService(const ServerOptions& options, SequenceTable* table, const KvPools* pools,
                 StepExecutor* executor, ScoreRegions* regions, ServerMetrics* metrics);
  ~KvCacheService() override;

  grpc::ServerUnaryReactor* OpenSequence(grpc::CallbackServerContext* context,
                                         const ::kvcache::v1::OpenSequenceRequest* request,
                                         ::kvcache::v1::OpenSequenceResponse* response) override;
  grpc::ServerUnaryReactor* CloseSequence(grpc::CallbackServerContext* context,
                                          const ::kvcache::v1::CloseSequenceRequest* request,
                                          ::kvcache::v1::CloseSequenceResponse* response) override;
  grpc::ServerUnaryReactor* InspectSequence(
      grpc::CallbackServerContext* context, const ::kvcache::v1::InspectSequenceRequest* request,
      ::kvcache::v1::InspectSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext* context,
                                          const ::kvcache::v1::ListSequencesRequest* request,
                                          ::kvcache::v1::ListSequencesResponse* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const ::kvcache::v1::StepBatch* request,
                                 ::kvcache::v1::DecisionBatch* response) override;
  grpc::ServerBidiReactor<::kvcache::v1::StepBatch, ::kvcache::v1::DecisionBatch>* StepStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* DescribeKvPools(
      grpc::CallbackServerContext* context, const ::kvcache::v1::DescribeKvPoolsRequest* request,
      ::kvcache::v1::DescribeKvPoolsResponse* response) override;
  grpc::ServerUnaryReactor* RegisterScoreRegion(
      grpc::CallbackServerContext* context,
      const ::kvcache::v1::RegisterScoreRegionRequest* request,
      ::kvcache::v1::RegisterScoreRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterScoreRegion(
      grpc::CallbackServerContext* context,
      const ::kvcache::v1::UnregisterScoreRegionRequest* request,
      ::kvcache::v1::UnregisterScoreRegionResponse* response) override;
  grpc::ServerWriteReactor<::kvcache::v1::KvEvent>* WatchKvEvents(
      grpc::CallbackServerContext* context,
      const ::kvcache::v1::WatchKvEventsRequest* request) override;

  // Draining: new streams are refused; open ones keep being answered until their clients
  // close them (or the server's drain deadline cancels them). KV event watches end now.
  void StartDraining();

  // Called by a stream reactor when it is done.
  void StreamDone();

 private:
  const ServerOptions options_;
  SequenceTable* const table_;
  const KvPools* const pools_;
  ScoreRegions* const regions_;
  ServerMetrics* const metrics_;
  StepBatchProcessor processor_;
  Mutex mu_;
  int64_t open_streams_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_KVCACHE_SERVICE_H_

// StepStreamReactor: one StepStream call, i.e. one worker rank. Reads StepBatches one after
// another, hands each to the StepBatchProcessor, and writes each DecisionBatch when it is
// complete (in completion order; the client matches them by batch_id).
//
// Lifetime: replies for tensor-parallel steps may complete after the client went away.
// They reach the reactor through `Link`, a shared object the reactor detaches from in
// OnDone; a late reply then finds no reactor and is dropped. Lock order: Link::mu, then
// StepStreamReactor::mu_.
#ifndef KVCM_SERVER_STEP_STREAM_REACTOR_H_
#define KVCM_SERVER_STEP_STREAM_REACTOR_H_

#include <deque>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/metrics.h"
#include "server/step_batch_processor.h"

namespace kvcm::server {

class KvCacheService;

class StepStreamReactor
    : public grpc::ServerBidiReactor<::kvcache::v1::StepBatch, ::kvcache::v1::DecisionBatch> {
 public:
  StepStreamReactor(KvCacheService* service, StepBatchProcessor* processor,
                    ServerMetrics* metrics);

  // Starts reading, or ends the call at once with `refusal` when it is not OK.
  void Start(const grpc::Status& refusal);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  struct Link {
    absl::Mutex mu;
    StepStreamReactor* reactor ABSL_GUARDED_BY(mu);
  };

  void Deliver(::kvcache::v1::DecisionBatch reply);
  // When the call should end now, marks it finished and returns the status to finish with
  // (the caller calls Finish after unlocking).
  std::optional<grpc::Status> TakeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvCacheService* const service_;
  StepBatchProcessor* const processor_;
  ServerMetrics* const metrics_;
  const std::shared_ptr<Link> link_;

  ::kvcache::v1::StepBatch request_;  // owned by the pending read
  absl::Mutex mu_;
  std::deque<::kvcache::v1::DecisionBatch> writes_ ABSL_GUARDED_BY(mu_);  // front is in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // batches read and not yet answered
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool accepted_ = false;  // counted in kvcache_streams_open
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_STEP_STREAM_REACTOR_H_

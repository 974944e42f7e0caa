// StepBatchProcessor: carries out one StepBatch, the shared core of the unary Step and
// StepStream RPCs. Each report is decoded and submitted to the sequence table on its own;
// a bad report fails only its own Decision. The reply is delivered once every report is
// decided, which for tensor-parallel sequences may be when another rank's report arrives.
// Thread-safe; holds no lock while the engine works or a reply is delivered.
#ifndef KVCM_SERVER_STEP_BATCH_PROCESSOR_H_
#define KVCM_SERVER_STEP_BATCH_PROCESSOR_H_

#include "absl/functional/any_invocable.h"
#include "cache_manager/sequence_table.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/metrics.h"

namespace kvcm::server {

class StepBatchProcessor {
 public:
  // Called exactly once per batch with the complete reply, on the thread that decided the
  // last of its reports (possibly inside Process).
  using ReplyCallback = absl::AnyInvocable<void(::kvcache::v1::DecisionBatch reply)>;

  StepBatchProcessor(SequenceTable* table, ServerMetrics* metrics)
      : table_(table), metrics_(metrics) {}

  // `batch` is read only during the call (scores are stepped in place or copied by the
  // tensor-parallel join).
  void Process(const ::kvcache::v1::StepBatch& batch, Rpc rpc, ReplyCallback on_reply);

 private:
  SequenceTable* const table_;
  ServerMetrics* const metrics_;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_STEP_BATCH_PROCESSOR_H_

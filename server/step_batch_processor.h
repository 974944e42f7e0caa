// StepBatchProcessor: carries out StepBatches, the shared core of the unary Step and the
// StepStream RPCs. The calling (gRPC) thread only groups a batch's reports by the engine
// thread their sequence is pinned to and posts one task per engine thread; each engine
// thread decodes its reports (inline bytes or a score-region range), submits them to the
// sequence table, and writes their Decisions. A bad report fails only its own Decision.
// The batch completes once every report is decided, which for tensor-parallel sequences
// may be when another rank's report arrives; then its BatchCompletion is told, once.
//
// Steady state allocates nothing per report: a PendingBatch and its reply are reused by
// whoever owns them (a stream keeps one per in-flight batch), and an engine thread's
// scratch is its own. Thread-safe.
#ifndef KVCM_SERVER_STEP_BATCH_PROCESSOR_H_
#define KVCM_SERVER_STEP_BATCH_PROCESSOR_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cache_manager/kv/score_regions.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/metrics.h"
#include "server/rpc_account.h"

namespace kvcm::server {

class PendingBatch;

// The one place an RPC's calls are counted: kvcache_requests_total and
// kvcache_received_bytes_total per request (a unary call, a watch, or one StepBatch of a
// stream), kvcache_errors_total by code per failure (a call's status, a refused stream, a
// stream message that does not parse, or one sequence's failed Decision in a step batch).
// Told when a batch is complete, on the thread that decided its last report (possibly
// inside Process). Must not block.
class BatchCompletion {
 public:
  virtual void BatchDone(PendingBatch* batch) = 0;

 protected:
  ~BatchCompletion() = default;
};

// One StepBatch in flight and its reply. Owned by the caller of Process, which must keep
// it (and the request it points to) alive until BatchDone; reusable afterwards.
class PendingBatch final : public DecisionSink {
 public:
  PendingBatch() = default;
  ~PendingBatch();
  PendingBatch(const PendingBatch&) = delete;
  PendingBatch& operator=(const PendingBatch&) = delete;

  const ::kvcache::v1::StepBatch& request() const { return *request_; }
  // Complete once BatchDone was called: one Decision per report, in report order.
  ::kvcache::v1::DecisionBatch& reply() { return reply_; }

  void OnDecided(int64_t tag, const absl::Status& status,
                 const EvictionDecision& decision) override;

 private:
  friend class StepBatchProcessor;
  // The executor's context for one engine thread's share of the batch.
  struct ShardTask {
    PendingBatch* batch = nullptr;
  };

  void Fail(int64_t index, const absl::Status& status);
  void Release();
  // Gives the reply's bytes back to the memory budget before the batch is reused or
  // destroyed (dropping a large reply's buffers, which Clear would keep).
  void ReleaseReply();

  class StepBatchProcessor* processor_ = nullptr;
  BatchCompletion* completion_ = nullptr;
  const ::kvcache::v1::StepBatch* request_ = nullptr;
  std::string tenant_;
  RpcAccount account_{Rpc::kStep, nullptr};  // set by Process
  absl::Time start_;
  std::atomic<int64_t> remaining_{0};
  ::kvcache::v1::DecisionBatch reply_;
  // The reply's decision payloads (evicted positions, masks) as they are written, charged
  // to the table's memory budget once the batch is done, until it is reused.
  std::atomic<int64_t> reply_bytes_{0};
  int64_t charged_reply_bytes_ = 0;
  std::vector<int32_t> report_shard_;  // [reports] the engine thread of each report
  std::vector<int32_t> next_;          // [threads] scratch of the counting sort
  std::vector<int32_t> by_shard_;     // report indices, grouped by engine thread
  std::vector<int32_t> shard_begin_;  // [threads + 1] offsets into by_shard_
  std::vector<ShardTask> tasks_;      // [threads]
};

class StepBatchProcessor {
 public:
  // `regions` may be null (score regions not allowed). None are owned.
  StepBatchProcessor(SequenceTable* table, StepExecutor* executor, const ScoreRegions* regions,
                     ServerMetrics* metrics);

  // Starts `batch` on `request` for `tenant`, counting the batch as one request of
  // `account` and each failed report as one of its errors. Returns at once; `completion`
  // is told when every report is decided.
  void Process(const ::kvcache::v1::StepBatch& request, absl::string_view tenant,
               RpcAccount account, PendingBatch* batch, BatchCompletion* completion);
  // The same, counted in this processor's metrics for `rpc` (benchmarks, the fuzzer).
  void Process(const ::kvcache::v1::StepBatch& request, absl::string_view tenant, Rpc rpc,
               PendingBatch* batch, BatchCompletion* completion) {
    Process(request, tenant, RpcAccount(rpc, metrics_), batch, completion);
  }

 private:
  friend class PendingBatch;
  static void RunShard(void* task, int32_t shard);
  // Decodes report `index` of `batch` and submits it (on its engine thread).
  void Submit(PendingBatch& batch, int32_t index, int32_t shard);

  SequenceTable* const table_;
  StepExecutor* const executor_;
  const ScoreRegions* const regions_;
  ServerMetrics* const metrics_;
  // Per engine thread: scratch for scores whose bytes are not aligned to their dtype.
  std::vector<std::vector<uint32_t>> aligned_;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_STEP_BATCH_PROCESSOR_H_

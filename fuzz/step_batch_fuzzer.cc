// Fuzzes the StepBatch path: a step case (fuzz/fuzz_support.h) opens a few sequences in a
// real SequenceTable, then its batches go through the daemon's StepBatchProcessor on a
// real StepExecutor, as the Step and StepStream RPCs send them. Checked beyond "no crash,
// no leak, no sanitizer report": every batch completes (a tensor-parallel step still
// waiting at the end is abandoned, and its ranks must be told), with one Decision per
// report naming that report's sequence and step, every rejected report explains why, and
// closing the sequences gives every KV block back.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/block_pool.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "fuzz/fuzz_support.h"
#include "server/metrics.h"
#include "server/step_batch_processor.h"
#include "server/translate.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm::fuzz {
namespace {

namespace v1 = ::kvcache::v1;

// Two engine threads, so that a batch's reports are split across shards as in the daemon.
constexpr int32_t kEngineThreads = 2;

// KV pools of two ranks, small enough that a few sequences fill them: steps then move
// slots (compaction) and meet a full pool, as in a daemon run with --kv_pool_bytes.
constexpr int32_t kPoolRanks = 2;
constexpr int64_t kPoolBlocks = 512;
// A prefill the pools cannot hold is refused at its KV lease, after its engine state was
// allocated and filled (SequenceTable::Open): past twice what they hold, a longer prefill
// reaches no other code, only costs a larger allocation. Up to 2^16 tokens that was most
// of an input's time (page faults of fresh ASan memory).
const int64_t kMaxStepCaseTokens = 2 * kPoolBlocks * testing::SmallKvLayout().tokens_per_block;

struct Env {
  StepExecutor executor{kEngineThreads, /*queue_capacity=*/1024};
  server::ServerMetrics metrics{server::BuildInfo{"fuzz", false, false}};
  std::unique_ptr<KvPools> pools = testing::SmallHostKvPools(kPoolRanks, kPoolBlocks);
};

// Counts completed batches; the fuzzer thread waits on it.
class Completions final : public server::BatchCompletion {
 public:
  void BatchDone(server::PendingBatch*) override {
    MutexLock lock(&mu_);
    ++done_;
    changed_.notify_all();
  }
  void WaitFor(int64_t n) {
    MutexLock lock(&mu_);
    while (done_ < n) mu_.Wait(&changed_);
  }
  int64_t done() {
    MutexLock lock(&mu_);
    return done_;
  }

 private:
  Mutex mu_;
  std::condition_variable_any changed_;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
};

// Returns once every task posted to the executor before it has run: each shard runs its
// tasks in order, so a marker task behind them says they are done.
void DrainExecutor(StepExecutor& executor) {
  struct Marker {
    Mutex mu;
    std::condition_variable_any ran;
    int32_t pending ABSL_GUARDED_BY(mu) = 0;
  } marker;
  {
    MutexLock lock(&marker.mu);
    marker.pending = executor.threads();
  }
  const auto run = [](void* context, int32_t) {
    auto& m = *static_cast<Marker*>(context);
    MutexLock lock(&m.mu);
    --m.pending;
    m.ran.notify_all();
  };
  for (int32_t s = 0; s < executor.threads(); ++s) {
    while (!executor.Post(s, {run, &marker})) std::this_thread::yield();  // queue full: wait
  }
  MutexLock lock(&marker.mu);
  while (marker.pending > 0) marker.mu.Wait(&marker.ran);
}

void CheckReply(const v1::StepBatch& request, const v1::DecisionBatch& reply) {
  KVCM_CHECK(reply.batch_id() == request.batch_id());
  KVCM_CHECK(reply.decisions_size() == request.reports_size());
  for (int i = 0; i < reply.decisions_size(); ++i) {
    const v1::Decision& d = reply.decisions(i);
    KVCM_CHECK(d.sequence_id() == request.reports(i).sequence_id());
    KVCM_CHECK(d.step() == request.reports(i).step());
    if (d.code() != 0) {
      KVCM_CHECK(!d.message().empty());  // a rejected report says why
    } else {
      KVCM_CHECK(d.cache_size() >= 0);
    }
  }
}

}  // namespace
}  // namespace kvcm::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcm::fuzz::QuietProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm;
  using namespace kvcm::fuzz;
  static Env* const env = new Env;  // threads and metrics live for the whole run

  StepCase input;
  if (!ParseStepCase(data, size, &input)) return -1;  // -1: not worth keeping in the corpus

  SequenceTableOptions options;
  options.max_sequences = kMaxOpens - 1;  // one open more than fits exercises the limit
  options.max_tp_world_size = 4;
  options.max_pending_join_bytes = int64_t{1} << 20;
  options.kv_pools = env->pools.get();
  SequenceTable table(options);
  server::StepBatchProcessor processor(&table, &env->executor, /*regions=*/nullptr,
                                       &env->metrics);
  for (const auto& open : input.opens) {
    if (TooSlowToFuzz(open, kMaxStepCaseTokens)) continue;
    absl::StatusOr<server::OpenParams> params = server::FromProto(open);
    if (!params.ok()) continue;
    (void)table.Open(params->id, params->options, params->tp_world_size, params->score_dtype);
  }

  Completions completions;
  std::vector<std::unique_ptr<server::PendingBatch>> pending;
  for (const auto& batch : input.batches) {
    pending.push_back(std::make_unique<server::PendingBatch>());
    processor.Process(batch, "fuzz-tenant", server::Rpc::kStepStream, pending.back().get(),
                      &completions);
    // One batch at a time keeps a run reproducible; a tensor-parallel report may still be
    // waiting for its other ranks after this, as in the daemon.
    DrainExecutor(env->executor);
  }
  // What a stopping daemon does: waiting ranks are told, so every batch completes.
  table.AbandonPendingSteps(absl::AbortedError("fuzz: end of input"));
  completions.WaitFor(static_cast<int64_t>(pending.size()));
  for (size_t i = 0; i < pending.size(); ++i) CheckReply(input.batches[i], pending[i]->reply());

  for (const SequenceInfo& info : table.List()) KVCM_CHECK(table.Close(info.id).ok());
  // Closed sequences give every KV block back.
  for (const BlockPoolUsage& usage : env->pools->Usage()) KVCM_CHECK(usage.used_blocks == 0);
  return 0;
}

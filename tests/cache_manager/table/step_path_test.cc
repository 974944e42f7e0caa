// The engine side of the step path: the step executor, the registry's checks before it
// builds anything, the every-rank rejection of a tensor-parallel step, and the cap on
// pending partial sums.
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

SequenceOptions Options(int64_t prefill, int64_t budget, const char* preset = "inertia") {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = BudgetSpec::Tokens(budget);
  o.preset = preset;
  return o;
}

// ---- StepExecutor ------------------------------------------------------------------

struct OrderLog {
  std::atomic<int> next{0};
  std::vector<int> seen = std::vector<int>(1000, -1);
};
struct Tagged {
  OrderLog* log;
  int tag;
};
void Record(void* context, int32_t /*shard*/) {
  auto* t = static_cast<Tagged*>(context);
  t->log->seen[static_cast<size_t>(t->log->next.fetch_add(1))] = t->tag;
}

TEST(StepExecutorTest, RunsTheTasksOfOneShardInTheOrderPosted) {
  OrderLog log;
  std::vector<Tagged> tasks;
  for (int i = 0; i < 1000; ++i) tasks.push_back({&log, i});
  {
    StepExecutor executor(3, 2000);
    for (Tagged& t : tasks) ASSERT_TRUE(executor.Post(1, {&Record, &t}));
  }  // the destructor runs everything posted
  ASSERT_EQ(log.next.load(), 1000);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(log.seen[static_cast<size_t>(i)], i);
}

TEST(StepExecutorTest, PinsEachSequenceToOneShard) {
  StepExecutor executor(4, 8);
  std::vector<int> used(4, 0);
  for (int i = 0; i < 400; ++i) {
    const std::string id = "seq-" + std::to_string(i);
    const int32_t shard = executor.ShardOf(id);
    ASSERT_GE(shard, 0);
    ASSERT_LT(shard, 4);
    EXPECT_EQ(executor.ShardOf(id), shard);
    ++used[static_cast<size_t>(shard)];
  }
  for (int n : used) EXPECT_GT(n, 40);  // spread, not all on one thread
}

void Block(void* context, int32_t /*shard*/) {
  static_cast<absl::Notification*>(context)->WaitForNotification();
}
void Nothing(void* /*context*/, int32_t /*shard*/) {}

TEST(StepExecutorTest, RefusesPastItsQueueCapacityAndAcceptsAgainOnceDrained) {
  absl::Notification release;
  StepExecutor executor(1, 2);
  ASSERT_TRUE(executor.Post(0, {&Block, &release}));
  // The blocking task may or may not have left the queue yet; fill what is left.
  while (executor.QueuedTasks() > 0) std::this_thread::yield();
  EXPECT_TRUE(executor.Post(0, {&Nothing, nullptr}));
  EXPECT_TRUE(executor.Post(0, {&Nothing, nullptr}));
  EXPECT_FALSE(executor.Post(0, {&Nothing, nullptr}));  // 2 queued behind the blocked one
  EXPECT_EQ(executor.QueuedTasks(), 2);
  release.Notify();
  while (executor.QueuedTasks() > 0) std::this_thread::yield();
  EXPECT_TRUE(executor.Post(0, {&Nothing, nullptr}));
}

// ---- Registry: checks before building -----------------------------------------------

kernels::KvBlockLayout Layout() {
  kernels::KvBlockLayout l;
  l.tokens_per_block = 4;
  l.layers = 1;
  l.kv_heads = 1;
  l.head_dim = 2;
  l.dtype = kernels::KvDtype::kFloat16;
  return l;
}

TEST(SequenceRegistryTest, ADuplicateOrAFullTableIsRefusedBeforeAnyKvIsLeased) {
  // Room for exactly one 40-token prefill: a second lease would fail with "pool full".
  auto pools = *KvPools::Create(1, Layout(), 10 * Layout().BlockBytes(),
                                [](const BlockPoolOptions& o) { return BlockPool::CreateHost(o); });
  SequenceTable table(SequenceTableOptions{.max_sequences = 1, .kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("a", Options(40, 8)).ok());
  const absl::Status duplicate = table.Open("a", Options(40, 8)).status();
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kAlreadyExists) << duplicate;
  const absl::Status full = table.Open("b", Options(40, 8)).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("maximum of 1 sequences"));
  EXPECT_EQ(pools->Usage()[0].used_blocks, 10);  // only a's lease
}

TEST(SequenceRegistryTest, AFailedOpenGivesItsIdBack) {
  SequenceTable table;
  SequenceOptions bad = Options(40, 8);
  bad.budget = BudgetSpec::Tokens(0);
  EXPECT_EQ(table.Open("a", bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Inspect("a", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Open("a", Options(40, 8)).ok());
  EXPECT_EQ(table.Totals().open_sequences, 1);
}

// ---- Tensor-parallel: every rank, and the join budget ---------------------------------

struct Recorder final : DecisionSink {
  void OnDecided(int64_t tag, const absl::Status& status,
                 const EvictionDecision& decision) override {
    results.push_back({tag, status, status.ok() ? decision.evicted : std::vector<int64_t>{}});
  }
  struct Result {
    int64_t tag;
    absl::Status status;
    std::vector<int64_t> evicted;
  };
  std::vector<Result> results;
};

RankReport Report(int32_t rank, int64_t step, const std::vector<float>& sums, int64_t tokens) {
  RankReport r;
  r.rank = rank;
  r.step = step;
  r.head_count = 1;
  r.partial_sums = kernels::ScoreMatrix::Dense(sums.data(), kernels::ScoreDtype::kFloat32,
                                               static_cast<int64_t>(sums.size()) / tokens, tokens);
  return r;
}

TEST(TensorParallelRejectionTest, ARejectedRankRejectsTheStepOnEveryRankWithOneStatus) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("tp", Options(4, 2), 3).ok());
  const std::vector<float> good = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f};
  const std::vector<float> bad = {0.1f, -0.2f, 0.3f, 0.4f, 0.5f};
  Recorder sink;
  ASSERT_TRUE(table.SubmitRankReport("tp", Report(0, 1, good, 5), {&sink, 0}).ok());
  const absl::Status refused = table.SubmitRankReport("tp", Report(1, 1, bad, 5), {&sink, 1});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("rank 1"));
  // Rank 0 was waiting: told at once, with the same status.
  ASSERT_EQ(sink.results.size(), 1u);
  EXPECT_EQ(sink.results[0].tag, 0);
  EXPECT_EQ(sink.results[0].status, refused);
  // Rank 2 had not reported: told when it does, even with a good report.
  EXPECT_EQ(table.SubmitRankReport("tp", Report(2, 1, good, 5), {&sink, 2}), refused);
  EXPECT_EQ(sink.results.size(), 1u);
  EXPECT_EQ(table.Inspect("tp", false)->last_step, 0);  // nothing changed
  // Every rank has been told: the step may be sent again, and it is decided, each rank
  // with its own partial sums this time. Every rank gets what the engine alone decides
  // given the joined row, their sum over the 3 heads: it keeps positions 4 and 0, which
  // no rank's own row would.
  const std::vector<std::vector<float>> partials = {{0.9f, 0.1f, 0.4f, 0.2f, 0.3f},
                                                    {0.1f, 0.8f, 0.1f, 0.3f, 0.6f},
                                                    {0.3f, 0.0f, 0.6f, 0.1f, 0.5f}};
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(
        table.SubmitRankReport("tp", Report(r, 1, partials[static_cast<size_t>(r)], 5),
                               {&sink, 10 + r})
            .ok());
  }
  std::vector<float> joined(5);
  for (size_t i = 0; i < joined.size(); ++i) {
    joined[i] = static_cast<float>((static_cast<double>(partials[0][i]) + partials[1][i] +
                                    partials[2][i]) / 3.0);
  }
  std::unique_ptr<Sequence> alone = *Sequence::Create("alone", Options(4, 2));
  EvictionDecision expected;
  ASSERT_TRUE(testing::StepWith(*alone, 1, {joined}, &expected).ok());
  ASSERT_EQ(expected.evicted.size(), 3u);
  ASSERT_EQ(sink.results.size(), 4u);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_TRUE(sink.results[i].status.ok()) << sink.results[i].status;
    EXPECT_EQ(sink.results[i].evicted, expected.evicted) << "rank " << sink.results[i].tag - 10;
  }
  EXPECT_EQ(table.Inspect("tp", false)->last_step, 1);
}

TEST(TensorParallelRejectionTest, AStrayReportIsRefusedAloneAndTheStepGoesOn) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("tp", Options(4, 2), 2).ok());
  const std::vector<float> good = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f};
  Recorder sink;
  ASSERT_TRUE(table.SubmitRankReport("tp", Report(0, 1, good, 5), {&sink, 0}).ok());
  // The same rank again, a rank outside the world, a step out of order: not members.
  EXPECT_EQ(table.SubmitRankReport("tp", Report(0, 1, good, 5), {&sink, 1}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table.SubmitRankReport("tp", Report(5, 1, good, 5), {&sink, 2}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.SubmitRankReport("tp", Report(1, 3, good, 5), {&sink, 3}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(sink.results.empty());
  ASSERT_TRUE(table.SubmitRankReport("tp", Report(1, 1, good, 5), {&sink, 4}).ok());
  ASSERT_EQ(sink.results.size(), 2u);
  EXPECT_TRUE(sink.results[0].status.ok());
}

TEST(PendingJoinBudgetTest, APartialPastTheCapIsRefusedAndTheBytesComeBack) {
  // Each report: 2 layers x 5 tokens x 4 bytes = 40 bytes; the cap holds two.
  SequenceTable table(SequenceTableOptions{.max_pending_join_bytes = 80});
  ASSERT_TRUE(table.Open("tp", Options(4, 2), 4).ok());
  ASSERT_TRUE(table.Open("other", Options(4, 2), 2).ok());
  const std::vector<float> sums(10, 0.1f);
  Recorder sink;
  ASSERT_TRUE(table.SubmitRankReport("tp", Report(0, 1, sums, 5), {&sink, 0}).ok());
  ASSERT_TRUE(table.SubmitRankReport("other", Report(0, 1, sums, 5), {&sink, 1}).ok());
  EXPECT_EQ(table.pending_join_bytes(), 80);
  const absl::Status refused = table.SubmitRankReport("tp", Report(1, 1, sums, 5), {&sink, 2});
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("sequence 'tp'"));
  EXPECT_THAT(refused.message(), HasSubstr("--max_pending_join_bytes"));
  // tp's step is rejected on its waiting rank too, and its bytes are given back.
  ASSERT_EQ(sink.results.size(), 1u);
  EXPECT_EQ(sink.results[0].status, refused);
  EXPECT_EQ(table.pending_join_bytes(), 40);
  // "other" completes and returns its bytes; closing returns the rest.
  ASSERT_TRUE(table.SubmitRankReport("other", Report(1, 1, sums, 5), {&sink, 3}).ok());
  EXPECT_EQ(table.pending_join_bytes(), 0);
  ASSERT_TRUE(table.Close("tp").ok());
  EXPECT_EQ(table.pending_join_bytes(), 0);
}

TEST(PendingJoinBudgetTest, AbandonedAndClosedStepsGiveTheirBytesBack) {
  SequenceTable table(SequenceTableOptions{.max_pending_join_bytes = 1 << 20});
  ASSERT_TRUE(table.Open("a", Options(4, 2), 2).ok());
  ASSERT_TRUE(table.Open("b", Options(4, 2), 2).ok());
  const std::vector<float> sums(10, 0.1f);
  Recorder sink;
  ASSERT_TRUE(table.SubmitRankReport("a", Report(0, 1, sums, 5), {&sink, 0}).ok());
  ASSERT_TRUE(table.SubmitRankReport("b", Report(0, 1, sums, 5), {&sink, 1}).ok());
  EXPECT_EQ(table.pending_join_bytes(), 80);
  table.AbandonPendingSteps(absl::AbortedError("stopping"));
  EXPECT_EQ(table.pending_join_bytes(), 0);
  ASSERT_EQ(sink.results.size(), 2u);
  EXPECT_EQ(sink.results[0].status.code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(table.SubmitRankReport("a", Report(0, 1, sums, 5), {&sink, 2}).ok());
  ASSERT_TRUE(table.Close("a").ok());
  EXPECT_EQ(table.pending_join_bytes(), 0);
}

}  // namespace
}  // namespace kvcm

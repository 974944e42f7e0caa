// Request validation that must hold for every value a client can send: overflow-safe sums
// of client fields, limits on a sequence's tokens and on the daemon's memory, and what a
// refused request leaves behind (nothing).
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/engine/momentum_state.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/policy/policy.h"
#include "cache_manager/table/sequence_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

using ::kvcm::testing::PresetOptions;

// What a sequence with a prefill of `prefill` tokens holds before its first step.
int64_t OpenBytes(int64_t prefill) {
  return MomentumState::BytesFor(prefill + 1, kernels::CpuBackend());
}

// A step with no scores (for policies that never read them).
absl::Status StepWithoutScores(SequenceTable& table, const std::string& id, int64_t step) {
  EvictionDecision decision;
  return table.Step(id, step, nullptr, &decision);
}

TEST(RequestOverflowTest, ProtectionsWhoseSumWrapsAreRejected) {
  Policy p;
  p.protect_sinks = kMax;
  p.protect_recent = 1;  // kMax + 1 wraps to a negative sum
  absl::Status s = p.Validate(10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("budget"));
  p.protect_sinks = kMax / 2 + 1;
  p.protect_recent = kMax / 2 + 1;
  EXPECT_EQ(p.Validate(kMax).code(), absl::StatusCode::kInvalidArgument);
  p.protect_sinks = 1;
  p.protect_recent = kMax;
  EXPECT_EQ(p.Validate(kMax).code(), absl::StatusCode::kInvalidArgument);
  // At the limit exactly: sinks + recent == budget is fine.
  p.protect_sinks = kMax - 5;
  p.protect_recent = 5;
  EXPECT_TRUE(p.Validate(kMax).ok());
}

TEST(RequestOverflowTest, ARatioBudgetOfTheLargestPrefillDoesNotWrap) {
  // (1 - 0) * INT64_MAX rounds up to 2^63 in double, one past what int64 holds.
  EXPECT_EQ(*ResolveBudget(kMax, BudgetSpec::Ratio(0.0)), kMax);
  EXPECT_GT(*ResolveBudget(kMax, BudgetSpec::Ratio(0.5)), kMax / 4);
}

TEST(RequestOverflowTest, ASequenceWithWrappingProtectionsIsNeverOpened) {
  for (Aggregation aggregation : {Aggregation::kEma, Aggregation::kRandom}) {
    SequenceOptions o;
    o.prefill_len = 16;
    o.budget = BudgetSpec::Tokens(8);
    o.policy.aggregation = aggregation;
    o.policy.protect_sinks = kMax;
    o.policy.protect_recent = 2;
    absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("wrap", o);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument)
        << AggregationName(aggregation);
    SequenceTable table;
    EXPECT_EQ(table.Open("wrap", o).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(table.Totals().open_sequences, 0);
  }
}

TEST(RequestOverflowTest, ABudgetOfTheLargestTokenCountGrowsTheCacheWithoutWrapping) {
  // The growth of the engine state is capped at budget + 1 tokens: INT64_MAX + 1 wrapped
  // (UBSan; fuzz/regressions/open_sequence/budget-plus-one-overflow).
  SequenceTable table;
  ASSERT_TRUE(table.Open("max", PresetOptions(16, kMax, "streaming_llm")).ok());
  for (int64_t step = 1; step <= 40; ++step) {
    ASSERT_TRUE(StepWithoutScores(table, "max", step).ok()) << step;
  }
  absl::StatusOr<SequenceInfo> info = table.Inspect("max", false);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->cache_size, 56);  // nothing evicted
  // The arrays doubled, 17 -> 34 -> 68 slots; the wrapped cap grew them one slot a step.
  EXPECT_GE(table.memory_bytes(), MomentumState::BytesFor(68, kernels::CpuBackend()));
}

TEST(MemoryTest, AHugeBudgetHoldsOnlyThePrefillAndGrowsWithTheCache) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("big", PresetOptions(16, 50'000'000, "streaming_llm")).ok());
  EXPECT_EQ(table.memory_bytes(), OpenBytes(16));  // it used to reserve for the budget
  for (int64_t step = 1; step <= 100; ++step) {
    ASSERT_TRUE(StepWithoutScores(table, "big", step).ok()) << step;
  }
  // 116 tokens cached: the arrays doubled from 17 to at most 2 x 116 slots.
  EXPECT_GE(table.memory_bytes(), MomentumState::BytesFor(117, kernels::CpuBackend()));
  EXPECT_LE(table.memory_bytes(), MomentumState::BytesFor(2 * 117, kernels::CpuBackend()));
  ASSERT_TRUE(table.Close("big").ok());
  EXPECT_EQ(table.memory_bytes(), 0);
}

TEST(MemoryTest, TheMemoryLimitHoldsAtItsByteExactly) {
  SequenceTable table(SequenceTableOptions{.memory_limit_bytes = OpenBytes(100)});
  ASSERT_TRUE(table.Open("fits", PresetOptions(100, 10)).ok());
  EXPECT_EQ(table.memory_bytes(), OpenBytes(100));
  const absl::Status refused = table.Open("over", PresetOptions(1, 1)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("sequence 'over'"));
  EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat(OpenBytes(1), " bytes asked")));
  EXPECT_THAT(refused.message(), HasSubstr("0 left (--memory_limit_bytes)"));
  // A refused Open changes nothing: not the accounting, not the table.
  EXPECT_EQ(table.memory_bytes(), OpenBytes(100));
  EXPECT_EQ(table.Totals().open_sequences, 1);
  ASSERT_TRUE(table.Close("fits").ok());
  EXPECT_EQ(table.memory_bytes(), 0);
  ASSERT_TRUE(table.Open("over", PresetOptions(1, 1)).ok());

  SequenceTable one_short(SequenceTableOptions{.memory_limit_bytes = OpenBytes(100) - 1});
  EXPECT_EQ(one_short.Open("fits", PresetOptions(100, 10)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(one_short.memory_bytes(), 0);
}

TEST(MemoryTest, AStepThatWouldGrowPastTheLimitIsRefusedAndChangesNothing) {
  // Room for the prefill of 4 and the first step's token, not for the arrays to grow.
  SequenceTable table(SequenceTableOptions{.memory_limit_bytes = OpenBytes(4)});
  ASSERT_TRUE(table.Open("grow", PresetOptions(4, 100, "streaming_llm")).ok());
  ASSERT_TRUE(StepWithoutScores(table, "grow", 1).ok());
  const absl::Status refused = StepWithoutScores(table, "grow", 2);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("sequence 'grow' step 2"));
  EXPECT_THAT(refused.message(), HasSubstr("--memory_limit_bytes"));
  absl::StatusOr<SequenceInfo> info = table.Inspect("grow", /*with_cache=*/true);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->last_step, 1);
  EXPECT_EQ(info->cache_size, 5);
  EXPECT_EQ(table.memory_bytes(), OpenBytes(4));
}

TEST(MemoryTest, AnOpenRefusedForAFullTableAllocatesNothing) {
  SequenceTable table(SequenceTableOptions{.max_sequences = 1});
  ASSERT_TRUE(table.Open("one", PresetOptions(8, 4)).ok());
  const int64_t held = table.memory_bytes();
  SequenceOptions big = PresetOptions(1 << 20, 50'000'000);
  EXPECT_EQ(table.Open("two", big).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(table.memory_bytes(), held);
}

TEST(MemoryTest, TensorParallelPartialSumsCountAgainstTheMemoryLimit) {
  // The sequence's state, and 20 bytes more: a 40-byte partial does not fit.
  SequenceTable table(SequenceTableOptions{.memory_limit_bytes = OpenBytes(4) + 20});
  ASSERT_TRUE(table.Open("tp", PresetOptions(4, 2), 2).ok());
  const std::vector<float> sums(10, 0.1f);  // 2 layers x 5 tokens
  RankReport report;
  report.rank = 0;
  report.step = 1;
  report.head_count = 1;
  report.partial_sums = kernels::ScoreMatrix::Dense(sums.data(), kernels::ScoreDtype::kFloat32, 2, 5);
  const absl::Status refused =
      table.SubmitRankReport("tp", report, [](const absl::StatusOr<EvictionDecision>&) {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("--memory_limit_bytes"));
  EXPECT_EQ(table.pending_join_bytes(), 0);
  EXPECT_EQ(table.memory_bytes(), OpenBytes(4));
}

TEST(SequenceTokensTest, PrefillPlusDecodeStopsAtTheLimitExactly) {
  SequenceTable table(SequenceTableOptions{.max_sequence_tokens = 10});
  const absl::Status over = table.Open("long", PresetOptions(11, 4, "streaming_llm")).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_THAT(over.message(), HasSubstr("prefill of 11 tokens"));
  EXPECT_THAT(over.message(), HasSubstr("--max_sequence_tokens=10"));
  EXPECT_EQ(table.memory_bytes(), 0);
  ASSERT_TRUE(table.Open("edge", PresetOptions(8, 4, "streaming_llm")).ok());
  ASSERT_TRUE(StepWithoutScores(table, "edge", 1).ok());
  ASSERT_TRUE(StepWithoutScores(table, "edge", 2).ok());  // 8 + 2 = 10 tokens
  const absl::Status past = StepWithoutScores(table, "edge", 3);
  EXPECT_EQ(past.code(), absl::StatusCode::kResourceExhausted) << past;
  EXPECT_THAT(past.message(), HasSubstr("sequence 'edge' step 3"));
  EXPECT_EQ(table.Inspect("edge", false)->last_step, 2);
  // The limit is the sequence's whole life, so prefill_len == limit is allowed too.
  ASSERT_TRUE(table.Open("full", PresetOptions(10, 4, "streaming_llm")).ok());
  EXPECT_EQ(StepWithoutScores(table, "full", 1).code(), absl::StatusCode::kResourceExhausted);
}

TEST(SequenceIdTest, EveryCallRefusesATooLongIdWithoutEchoingIt) {
  SequenceTable table;
  const std::string huge(1 << 20, 'x');
  for (const absl::Status& s :
       {table.Close(huge).status(), table.Inspect(huge, false).status(),
        table.DefaultScoreDtype(huge).status(), StepWithoutScores(table, huge, 1),
        table.Open(huge, PresetOptions(4, 2)).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s.ToString().substr(0, 100);
    EXPECT_LT(s.message().size(), 100u);
    EXPECT_THAT(s.message(), HasSubstr("1 to 256 bytes"));
  }
}

}  // namespace
}  // namespace kvcm

#include "cache_manager/table/sequence_table.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

SequenceOptions Options(int64_t prefill = 10, int64_t budget = 4, const char* preset = "inertia") {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = BudgetSpec::Tokens(budget);
  o.preset = preset;
  return o;
}

TEST(SequenceTableTenantTest, IdsArePerTenantAndOthersSeeAnUnknownId) {
  SequenceTable table(SequenceTableOptions{.tenant_max_sequences = 1});
  ASSERT_TRUE(table.Open("s", Options(10), 1, kernels::ScoreDtype::kFloat32, "a").ok());
  ASSERT_TRUE(table.Open("s", Options(20), 1, kernels::ScoreDtype::kFloat32, "b").ok());
  EXPECT_EQ(table.Inspect("s", false, "a")->prefill_len, 10);
  EXPECT_EQ(table.Inspect("s", false, "b")->prefill_len, 20);
  EXPECT_EQ(table.Inspect("s", false, "b")->tenant, "b");
  const absl::Status unknown = table.Inspect("s", false, "c").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.message(), "sequence 's' is not open");
  EXPECT_EQ(table.Close("s", "c").status().message(), "sequence 's' is not open");
  EXPECT_EQ(table.List("a").size(), 1u);
  EXPECT_TRUE(table.List("c").empty());
  EXPECT_EQ(table.ListEveryTenant().size(), 2u);
  const absl::Status full =
      table.Open("t", Options(), 1, kernels::ScoreDtype::kFloat32, "a").status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("tenant 'a' already holds its maximum of 1"));
  ASSERT_TRUE(table.Close("s", "a").ok());
  EXPECT_TRUE(table.Open("t", Options(), 1, kernels::ScoreDtype::kFloat32, "a").ok());
  EXPECT_TRUE(table.Inspect("s", false, "b").ok());
}

TEST(SequenceTableTest, OpenStepInspectClose) {
  SequenceTable table;
  absl::StatusOr<SequenceInfo> opened = table.Open("a", Options());
  ASSERT_TRUE(opened.ok());
  EXPECT_EQ(opened->budget, 4);
  EXPECT_TRUE(opened->next_needs_scores);
  EXPECT_EQ(opened->policy.preset, "inertia");

  testing::DenseScores scores(testing::Layers{std::vector<float>(11, 0.5f)});
  EvictionDecision d;
  ASSERT_TRUE(table.Step("a", 1, &scores.matrix, &d).ok());
  EXPECT_EQ(d.evicted.size(), 7u);

  absl::StatusOr<SequenceInfo> info = table.Inspect("a", /*with_cache=*/true);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->last_step, 1);
  EXPECT_EQ(info->cache_size, 4);
  EXPECT_EQ(info->positions.size(), 4u);
  EXPECT_EQ(info->momentum.size(), 4u);
  EXPECT_EQ(info->stats.tokens_evicted, 7);
  EXPECT_TRUE(table.Inspect("a", false)->positions.empty());

  EXPECT_EQ(table.List().size(), 1u);
  EXPECT_EQ(table.Totals().open_sequences, 1);
  EXPECT_EQ(table.Totals().cached_tokens, 4);
  absl::StatusOr<SequenceInfo> closed = table.Close("a");
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(closed->stats.tokens_evicted, 7);
  EXPECT_EQ(table.Close("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Inspect("a", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Step("a", 2, nullptr, &d).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.List().empty());
}

TEST(SequenceTableTest, RejectsDuplicateUnknownAndInvalid) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("a", Options()).ok());
  absl::Status dup = table.Open("a", Options()).status();
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.message(), HasSubstr("'a'"));
  EXPECT_EQ(table.Open("", Options()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Open(std::string(300, 'x'), Options()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Open("b", Options(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Open("b", Options(0)).status().code(), absl::StatusCode::kInvalidArgument);
  EvictionDecision d;
  absl::Status missing = table.Step("zzz", 1, nullptr, &d);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("'zzz'"));
  EXPECT_EQ(table.List().size(), 1u);  // nothing half-registered
}

TEST(SequenceTableTest, LimitsTheNumberOfSequences) {
  SequenceTable table(SequenceTableOptions{.max_sequences = 2});
  ASSERT_TRUE(table.Open("a", Options()).ok());
  ASSERT_TRUE(table.Open("b", Options()).ok());
  EXPECT_EQ(table.Open("c", Options()).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(table.Close("a").ok());
  EXPECT_TRUE(table.Open("c", Options()).ok());
}

TEST(SequenceTableTest, TensorParallelSequencesRefuseSingleRankSteps) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("tp", Options(), 2).ok());
  EvictionDecision d;
  absl::Status s = table.Step("tp", 1, nullptr, &d);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("2 tensor-parallel ranks"));
}

TEST(SequenceTableTest, ReclaimsIdleSequencesAndAbortsTheirWaitingRanks) {
  ManualClock clock;
  SequenceTable table(SequenceTableOptions{.clock = &clock});
  ASSERT_TRUE(table.Open("idle", Options(10, 4, "streaming_llm"), 2).ok());
  ASSERT_TRUE(table.Open("busy", Options(10, 4, "streaming_llm")).ok());
  std::vector<absl::Status> results;
  RankReport r;
  r.rank = 0;
  r.step = 1;
  ASSERT_TRUE(table
                  .SubmitRankReport("idle", r,
                                    [&](const absl::StatusOr<EvictionDecision>& d) {
                                      results.push_back(d.status());
                                    })
                  .ok());
  clock.Advance(absl::Seconds(50));
  EvictionDecision d;
  ASSERT_TRUE(table.Step("busy", 1, nullptr, &d).ok());
  clock.Advance(absl::Seconds(20));
  const std::vector<SequenceInfo> reclaimed = table.ReclaimIdle(absl::Seconds(60));
  ASSERT_EQ(reclaimed.size(), 1u);
  EXPECT_EQ(reclaimed[0].id, "idle");
  EXPECT_EQ(reclaimed[0].policy.preset, "streaming_llm");
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kAborted);
  EXPECT_THAT(results[0].message(), HasSubstr("reclaimed"));
  EXPECT_EQ(table.Inspect("idle", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Inspect("busy", false).ok());
  // Inspect counts as activity; 60 s later without it, "busy" goes too.
  clock.Advance(absl::Seconds(61));
  const std::vector<SequenceInfo> second = table.ReclaimIdle(absl::Seconds(60));
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].id, "busy");
}

TEST(SequenceTableTest, ClosingAbortsRanksWaitingOnAStep) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("tp", Options(10, 4, "streaming_llm"), 3).ok());
  int aborted = 0;
  for (int32_t rank : {0, 2}) {
    RankReport r;
    r.rank = rank;
    r.step = 1;
    ASSERT_TRUE(table
                    .SubmitRankReport("tp", r,
                                      [&](const absl::StatusOr<EvictionDecision>& d) {
                                        if (d.status().code() == absl::StatusCode::kAborted) ++aborted;
                                      })
                    .ok());
  }
  EXPECT_EQ(table.Inspect("tp", false)->ranks_reported, 2);
  ASSERT_TRUE(table.Close("tp").ok());
  EXPECT_EQ(aborted, 2);
}

TEST(SequenceTableTest, RejectedRankReportChangesNothing) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("tp", Options(3, 2), 2).ok());
  std::vector<float> sums = {0.1f, 0.2f, 0.3f, 0.4f};
  RankReport r;
  r.rank = 0;
  r.step = 1;
  r.head_count = 1;
  r.partial_sums = kernels::ScoreMatrix::Dense(sums.data(), kernels::ScoreDtype::kFloat32, 1, 4);
  bool called = false;
  auto cb = [&](const absl::StatusOr<EvictionDecision>&) { called = true; };
  RankReport bad = r;
  bad.step = 2;
  EXPECT_EQ(table.SubmitRankReport("tp", bad, cb).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(called);
  EXPECT_EQ(table.Inspect("tp", false)->ranks_reported, 0);
  EXPECT_EQ(table.SubmitRankReport("nope", r, cb).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(table.SubmitRankReport("tp", r, cb).ok());
  EXPECT_FALSE(called);
  r.rank = 1;
  ASSERT_TRUE(table.SubmitRankReport("tp", r, cb).ok());
  EXPECT_TRUE(called);
  EXPECT_EQ(table.Inspect("tp", false)->last_step, 1);
}

TEST(SequenceTableTest, PooledSingleRankReportStepsInPlace) {
  SequenceTable table;
  ASSERT_TRUE(table.Open("one", Options(3, 2, "tova"), 1, kernels::ScoreDtype::kFloat16).ok());
  EXPECT_EQ(*table.DefaultScoreDtype("one"), kernels::ScoreDtype::kFloat16);
  EXPECT_EQ(table.DefaultScoreDtype("two").status().code(), absl::StatusCode::kNotFound);
  std::vector<float> pooled = {1.0f, 0.1f, 0.5f, 0.2f};
  RankReport r;
  r.step = 1;
  r.partial_sums = kernels::ScoreMatrix::Dense(pooled.data(), kernels::ScoreDtype::kFloat32, 1, 4);
  RankReport wrong_rank = r;
  wrong_rank.rank = 1;
  auto ignore = [](const absl::StatusOr<EvictionDecision>&) {};
  EXPECT_EQ(table.SubmitRankReport("one", wrong_rank, ignore).code(),
            absl::StatusCode::kInvalidArgument);
  RankReport bad_step = r;
  bad_step.step = 2;
  EXPECT_EQ(table.SubmitRankReport("one", bad_step, ignore).code(),
            absl::StatusCode::kFailedPrecondition);
  EvictionDecision got;
  ASSERT_TRUE(table
                  .SubmitRankReport("one", r,
                                    [&](const absl::StatusOr<EvictionDecision>& d) { got = *d; })
                  .ok());
  EXPECT_EQ(got.evicted, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(got.preset, "tova");
  EXPECT_EQ(got.aggregation, Aggregation::kSingleStep);
  EXPECT_EQ(table.Inspect("one", false)->score_dtype, kernels::ScoreDtype::kFloat16);
}

TEST(SequenceTableTest, SingleRankReportIsDividedByItsHeadCount) {
  // world size 1 through the join: sums over 4 heads.
  SequenceTable table;
  ASSERT_TRUE(table.Open("one", Options(3, 2, "tova"), 1).ok());
  std::vector<float> sums = {4.0f, 0.4f, 2.0f, 0.8f};
  RankReport r;
  r.rank = 0;
  r.step = 1;
  r.head_count = 4;
  r.partial_sums = kernels::ScoreMatrix::Dense(sums.data(), kernels::ScoreDtype::kFloat32, 1, 4);
  std::vector<int64_t> evicted;
  ASSERT_TRUE(table
                  .SubmitRankReport("one", r,
                                    [&](const absl::StatusOr<EvictionDecision>& d) {
                                      evicted = d->evicted;
                                    })
                  .ok());
  EXPECT_EQ(evicted, (std::vector<int64_t>{1, 3}));
  SequenceInfo info = *table.Inspect("one", true);
  EXPECT_EQ(info.momentum, (std::vector<float>{1.0f, 0.5f}));
}

}  // namespace
}  // namespace kvcm

namespace kvcm {
namespace {

TEST(SequenceTableTest, AStepMissingRanksIsAbandonedAfterTheJoinTimeout) {
  ManualClock clock;
  SequenceTable table(SequenceTableOptions{.clock = &clock});
  ASSERT_TRUE(table.Open("tp", Options(10, 4, "streaming_llm"), 3).ok());
  std::vector<absl::Status> results;
  auto record = [&](const absl::StatusOr<EvictionDecision>& d) { results.push_back(d.status()); };
  RankReport r;
  r.step = 1;
  r.rank = 1;
  ASSERT_TRUE(table.SubmitRankReport("tp", r, record).ok());
  clock.Advance(absl::Seconds(20));
  EXPECT_EQ(table.AbortStaleJoins(absl::Seconds(30)), 0);
  clock.Advance(absl::Seconds(11));
  EXPECT_EQ(table.AbortStaleJoins(absl::Seconds(30)), 1);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(results[0].message(), HasSubstr("sequence 'tp' step 1: rank(s) 0, 2 did not report"));
  // Nothing changed: the whole step can be sent again and completes.
  EXPECT_EQ(table.Inspect("tp", false)->ranks_reported, 0);
  EXPECT_EQ(table.Inspect("tp", false)->last_step, 0);
  for (int32_t rank : {2, 0, 1}) {
    r.rank = rank;
    ASSERT_TRUE(table.SubmitRankReport("tp", r, record).ok());
  }
  ASSERT_EQ(results.size(), 4u);
  EXPECT_TRUE(results[3].ok());
  EXPECT_EQ(table.Inspect("tp", false)->last_step, 1);
}

}  // namespace
}  // namespace kvcm

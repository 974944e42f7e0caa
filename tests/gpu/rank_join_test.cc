// The host tensor-parallel join (SequenceTable::SubmitRankReport) with the query heads
// split among 1, 2, 4 and 8 ranks, each reporting the sum of its own heads: every split
// decides exactly like one rank sent the pooled scores. The reference for the NCCL join
// (nccl_join_test.cc); needs no GPU.
#include <numeric>
#include <string>
#include <vector>

#include "cache_manager/table/sequence_table.h"
#include "gtest/gtest.h"
#include "tests/gpu/rank_join_fixture.h"

namespace kvcm {
namespace {

using testing::HeadRows;
using testing::kJoinPresets;
using testing::kTotalHeads;

constexpr int64_t kSteps = 40;
constexpr uint64_t kSeed = 2718;

// One step of a `ranks`-rank sequence: every rank submits the sums of its heads, in a
// scrambled order; every rank must receive the same decision once the last has reported.
absl::Status SubmitSplitStep(SequenceTable& table, int32_t ranks, int64_t step,
                             const HeadRows* rows, EvictionDecision* decision) {
  const int64_t heads_per_rank = kTotalHeads / ranks;
  std::vector<EvictionDecision> received;
  std::vector<std::vector<float>> sums(static_cast<size_t>(ranks));
  for (int32_t i = 0; i < ranks; ++i) {
    const int32_t rank = static_cast<int32_t>((i * 5 + step) % ranks);
    RankReport report;
    report.rank = rank;
    report.step = step;
    report.head_count = heads_per_rank;
    if (rows != nullptr) {
      std::vector<float>& mine = sums[static_cast<size_t>(rank)];
      mine = testing::PartialSums(*rows, rank * heads_per_rank, heads_per_rank);
      report.partial_sums = kernels::ScoreMatrix::Dense(mine.data(), kernels::ScoreDtype::kFloat32,
                                                        rows->layers, rows->tokens);
    }
    absl::Status status = table.SubmitRankReport(
        "split", report, [&received](const absl::StatusOr<EvictionDecision>& d) {
          EXPECT_TRUE(d.ok()) << d.status();
          if (d.ok()) received.push_back(*d);
        });
    if (!status.ok()) return status;
  }
  if (static_cast<int32_t>(received.size()) != ranks) {
    return absl::InternalError("not every rank received the decision");
  }
  for (const EvictionDecision& d : received) EXPECT_EQ(d.evicted, received.front().evicted);
  *decision = received.front();
  return absl::OkStatus();
}

class HostRankJoinTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(HostRankJoinTest, AnyHeadSplitDecidesLikeOneRankWithPooledScores) {
  const int32_t ranks = GetParam();
  for (const char* preset : kJoinPresets) {
    SCOPED_TRACE(std::string(preset) + ", " + std::to_string(ranks) + " ranks");
    SequenceTable table;
    ASSERT_TRUE(table.Open("split", testing::JoinTestSequence(preset), ranks).ok());
    const std::vector<EvictionDecision> got = testing::RunJoinedSteps(
        preset, kSteps, kSeed, [&](int64_t step, const HeadRows* rows, EvictionDecision* d) {
          return SubmitSplitStep(table, ranks, step, rows, d);
        });
    testing::ExpectSameDecisions(got, testing::ReferenceDecisions(preset, kSteps, kSeed));
    // The run evicted: step 1 of a 90% policy over 300 tokens keeps 30.
    ASSERT_FALSE(got.empty());
    EXPECT_EQ(got.front().cache_size, 30);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, HostRankJoinTest, ::testing::Values(1, 2, 4, 8));

}  // namespace
}  // namespace kvcm

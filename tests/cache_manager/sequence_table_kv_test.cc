// The sequence table with KV pools: every sequence's slots follow its cache.
#include <set>
#include <random>

#include "cache_manager/kv_pools.h"
#include "cache_manager/sequence_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<KvPools> Pools(int32_t ranks, int64_t blocks) {
  return testing::SmallHostKvPools(ranks, blocks);
}

SequenceOptions Options(int64_t prefill, int64_t budget, const char* preset = "inertia") {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = BudgetSpec::Tokens(budget);
  o.preset = preset;
  return o;
}

// Each rank's slots: one per cached token, all distinct.
void ExpectSlotsFollowTheCache(SequenceTable& table, const std::string& id, int32_t ranks) {
  absl::StatusOr<SequenceInfo> info = table.Inspect(id, /*with_cache=*/true);
  ASSERT_TRUE(info.ok());
  ASSERT_EQ(static_cast<int32_t>(info->kv_slots.size()), ranks);
  for (const auto& slots : info->kv_slots) {
    EXPECT_EQ(static_cast<int64_t>(slots.size()), info->cache_size);
    EXPECT_EQ(std::set<int64_t>(slots.begin(), slots.end()).size(), slots.size());
  }
}

TEST(SequenceTableKvTest, LeasesFollowStepsAndCompactionReturnsBlocks) {
  auto pools = Pools(2, 64);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("a", Options(40, 8)).ok());
  EXPECT_EQ(pools->Usage()[0].used_blocks, 10);  // 40 tokens / 4 per block
  ExpectSlotsFollowTheCache(table, "a", 2);

  std::mt19937_64 rng(1);
  testing::DenseScores first(testing::RandomLayers(rng, 2, 41, false));
  EvictionDecision d;
  ASSERT_TRUE(table.Step("a", 1, &first.matrix, &d).ok());
  ASSERT_EQ(d.evicted.size(), 33u);
  ASSERT_EQ(d.evicted_indices.size(), 33u);
  ASSERT_EQ(d.kv.size(), 2u);
  for (const KvSlotChanges& k : d.kv) {
    EXPECT_GE(k.new_token_slot, 0);
    EXPECT_FALSE(k.released_blocks.empty());  // 33 of 41 gone: whole blocks come back
  }
  // 8 survivors fit in 2 blocks.
  EXPECT_EQ(pools->Usage()[0].used_blocks, 2);
  EXPECT_EQ(pools->Usage()[1].used_blocks, 2);
  ExpectSlotsFollowTheCache(table, "a", 2);

  // Steady steps (one in, one out) keep the block count and never move anything.
  for (int64_t t = 2; t <= 30; ++t) {
    testing::DenseScores s(testing::RandomLayers(rng, 2, 9, false));
    ASSERT_TRUE(table.Step("a", t, &s.matrix, &d).ok());
    EXPECT_EQ(d.evicted.size(), 1u);
    for (const KvSlotChanges& k : d.kv) EXPECT_TRUE(k.moves.empty());
  }
  EXPECT_LE(pools->Usage()[0].used_blocks, 3);
  ExpectSlotsFollowTheCache(table, "a", 2);
  ASSERT_TRUE(table.Close("a").ok());
  EXPECT_EQ(pools->Usage()[0].used_blocks, 0);
  EXPECT_EQ(pools->Usage()[1].used_blocks, 0);
}

TEST(SequenceTableKvTest, AFullPoolRejectsOpenAndStepsWithoutChangingAnything) {
  auto pools = Pools(1, 3);  // 12 slots
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  absl::Status too_big = table.Open("big", Options(13, 13)).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.message(), HasSubstr("sequence 'big'"));
  EXPECT_TRUE(table.List().empty());
  EXPECT_EQ(pools->Usage()[0].used_blocks, 0);

  // 12 tokens and a budget of 20: the 13th token has nowhere to go.
  ASSERT_TRUE(table.Open("a", Options(12, 20, "streaming_llm")).ok());
  EvictionDecision d;
  absl::Status full = table.Step("a", 1, nullptr, &d);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("sequence 'a' step 1: no KV slot for the new token"));
  EXPECT_EQ(table.Inspect("a", false)->last_step, 0);
  EXPECT_EQ(table.Inspect("a", false)->cache_size, 12);
  ExpectSlotsFollowTheCache(table, "a", 1);
}

TEST(SequenceTableKvTest, ARejectedStepGivesItsSlotBack) {
  auto pools = Pools(1, 8);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("a", Options(8, 4)).ok());
  EvictionDecision d;
  EXPECT_EQ(table.Step("a", 1, nullptr, &d).code(), absl::StatusCode::kInvalidArgument);
  ExpectSlotsFollowTheCache(table, "a", 1);  // 8 cached, 8 slots: the 9th was given back
  EXPECT_EQ(table.Step("a", 5, nullptr, &d).code(), absl::StatusCode::kFailedPrecondition);
  ExpectSlotsFollowTheCache(table, "a", 1);
}

TEST(SequenceTableKvTest, TensorParallelStepsMoveEveryRanksSlots) {
  auto pools = Pools(2, 32);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("tp", Options(20, 6), 2).ok());
  std::mt19937_64 rng(4);
  int64_t cache = 20;
  for (int64_t t = 1; t <= 5; ++t) {
    testing::DenseScores s(testing::RandomLayers(rng, 1, cache + 1, false));
    std::vector<EvictionDecision> got;
    for (int32_t rank : {1, 0}) {
      RankReport r;
      r.rank = rank;
      r.step = t;
      r.head_count = 1;
      r.partial_sums = s.matrix;
      ASSERT_TRUE(table
                      .SubmitRankReport("tp", r,
                                        [&](const absl::StatusOr<EvictionDecision>& d) {
                                          ASSERT_TRUE(d.ok()) << d.status();
                                          got.push_back(*d);
                                        })
                      .ok());
    }
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].kv.size(), 2u);
    cache = got[0].cache_size;
  }
  ExpectSlotsFollowTheCache(table, "tp", 2);
}

}  // namespace
}  // namespace kvcm

// The sequence table with KV pools: every sequence's slots follow its cache.
#include <map>
#include <random>
#include <set>
#include <vector>

#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"
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

// A worker's slot table for one rank, kept only from the decisions it receives: where
// the K/V of each cached position lives.
using SlotTable = std::map<int64_t, int64_t>;  // position -> slot

SlotTable SlotsOf(const SequenceInfo& info, int32_t rank) {
  SlotTable table;
  for (size_t i = 0; i < info.positions.size(); ++i) {
    table[info.positions[i]] = info.kv_slots[static_cast<size_t>(rank)][i];
  }
  return table;
}

// What a worker does with one step's decision (clients/python PooledKvCache.apply):
// forget the evicted positions, follow the compaction's moves (all at once: a slot moved
// away may receive another), then put the new token at its slot.
void Apply(const EvictionDecision& d, const KvSlotChanges& change, int64_t new_position,
           SlotTable* table) {
  for (const int64_t p : d.evicted) table->erase(p);
  std::map<int64_t, int64_t> moved;  // src -> dst
  for (const kernels::KvMove& move : change.moves) {
    EXPECT_TRUE(moved.emplace(move.src_slot, move.dst_slot).second)
        << "slot " << move.src_slot << " moved twice";
  }
  int64_t followed = 0;
  for (auto& [position, slot] : *table) {
    if (auto it = moved.find(slot); it != moved.end()) {
      slot = it->second;
      ++followed;
    }
  }
  // The compaction runs with the new token already in the lease, so at most one move is
  // of a slot the worker does not hold yet: the new token's, which it writes after.
  EXPECT_GE(followed + 1, static_cast<int64_t>(moved.size()))
      << "moves of slots no cached token occupies";
  if (change.new_token_slot >= 0) (*table)[new_position] = change.new_token_slot;
}

TEST(SequenceTableKvTest, TensorParallelStepsMoveEveryRanksSlots) {
  constexpr int32_t kRanks = 2;
  constexpr int64_t kPrefill = 20;
  auto pools = Pools(kRanks, 32);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("tp", Options(kPrefill, 6), kRanks).ok());
  absl::StatusOr<SequenceInfo> start = table.Inspect("tp", /*with_cache=*/true);
  ASSERT_TRUE(start.ok());
  std::vector<SlotTable> worker = {SlotsOf(*start, 0), SlotsOf(*start, 1)};
  std::mt19937_64 rng(4);
  int64_t cache = kPrefill;
  int64_t moves = 0;
  for (int64_t t = 1; t <= 5; ++t) {
    testing::DenseScores s(testing::RandomLayers(rng, 1, cache + 1, false));
    std::vector<EvictionDecision> got;
    for (int32_t rank : {1, 0}) {
      RankReport r;
      r.rank = rank;
      r.step = t;
      r.head_count = 1;
      r.partial_sums = s.matrix;
      absl::Status decided;
      ASSERT_TRUE(table
                      .SubmitRankReport("tp", r,
                                        [&](const absl::StatusOr<EvictionDecision>& d) {
                                          decided = d.status();
                                          if (d.ok()) got.push_back(*d);
                                        })
                      .ok());
      ASSERT_TRUE(decided.ok()) << decided;
    }
    ASSERT_EQ(got.size(), 2u);
    const EvictionDecision& d = got[0];
    EXPECT_EQ(got[1].evicted, d.evicted);
    ASSERT_EQ(d.kv.size(), static_cast<size_t>(kRanks));
    // Every rank's worker, applying its own rank's changes, ends with the slots the table
    // holds for it.
    absl::StatusOr<SequenceInfo> after = table.Inspect("tp", /*with_cache=*/true);
    ASSERT_TRUE(after.ok());
    for (int32_t rank = 0; rank < kRanks; ++rank) {
      const KvSlotChanges& change = d.kv[static_cast<size_t>(rank)];
      ASSERT_EQ(change.rank, rank);
      moves += static_cast<int64_t>(change.moves.size());
      Apply(d, change, /*new_position=*/kPrefill + t - 1, &worker[static_cast<size_t>(rank)]);
      EXPECT_EQ(worker[static_cast<size_t>(rank)], SlotsOf(*after, rank))
          << "step " << t << " rank " << rank;
    }
    cache = d.cache_size;
  }
  // 20 tokens cut to 6 leaves holes in the blocks: the compaction must have moved some.
  EXPECT_GT(moves, 0);
  ExpectSlotsFollowTheCache(table, "tp", kRanks);
}

}  // namespace
}  // namespace kvcm

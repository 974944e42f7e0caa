// What the pools tell a metrics scrape about capacity: the tokens their leases cache
// (BlockPoolUsage::cached_tokens) and the requests they refused for lack of blocks
// (KvPools::refused), counted once per request and never for other errors.
#include "cache_manager/kv/kv_pools.h"

#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

using kernels::KvBlockLayout;
using kernels::KvDtype;
using Asker = KvPools::Asker;

// 4 tokens per block, 1 layer, 1 kv head of 4 fp32: 128-byte blocks.
constexpr KvBlockLayout kLayout{4, 1, 1, 4, KvDtype::kFloat32};
constexpr int64_t kBlockBytes = 128;

// Two ranks; rank 1's pool has `rank1_blocks` blocks, rank 0's `rank0_blocks`.
std::unique_ptr<KvPools> MakePools(int64_t rank0_blocks, int64_t rank1_blocks) {
  absl::StatusOr<std::unique_ptr<KvPools>> pools = KvPools::Create(
      2, kLayout, rank0_blocks * kBlockBytes, [rank1_blocks](const BlockPoolOptions& given) {
        BlockPoolOptions options = given;
        if (options.rank == 1) options.memory_bytes = rank1_blocks * kBlockBytes;
        return BlockPool::CreateHost(options);
      });
  EXPECT_TRUE(pools.ok()) << pools.status();
  return pools.ok() ? *std::move(pools) : nullptr;
}

std::vector<int64_t> CachedTokens(const KvPools& pools) {
  std::vector<int64_t> cached;
  for (const BlockPoolUsage& usage : pools.Usage()) cached.push_back(usage.cached_tokens);
  return cached;
}

std::vector<int64_t> Refusals(const KvPools& pools) {
  return {pools.refused(Asker::kOpen), pools.refused(Asker::kImport), pools.refused(Asker::kStep)};
}

TEST(KvPoolsRefusalTest, AnOpenThatLacksBlocksCountsOnceAndTakesNothing) {
  auto pools = MakePools(/*rank0_blocks=*/8, /*rank1_blocks=*/4);
  ASSERT_NE(pools, nullptr);
  absl::StatusOr<SequenceKv> first = SequenceKv::Lease(*pools, 12, "a");  // 3 blocks a rank
  ASSERT_TRUE(first.ok()) << first.status();
  // Rank 0 has the 2 blocks; rank 1 has 1: refused once, rank 0's lease given back.
  absl::StatusOr<SequenceKv> second = SequenceKv::Lease(*pools, 8, "b");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{12, 12}));
  EXPECT_EQ(pools->Usage()[0].used_blocks, 3);

  // A bad token count is not a lack of blocks.
  EXPECT_EQ(SequenceKv::Lease(*pools, -1, "c").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{1, 0, 0}));
  ASSERT_TRUE(SequenceKv::Lease(*pools, 4, "d").ok());  // exactly the last block fits
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{1, 0, 0}));
}

TEST(KvPoolsRefusalTest, AnImportThatLacksBlocksCountsButAMalformedOneDoesNot) {
  auto pools = MakePools(4, 4);
  ASSERT_NE(pools, nullptr);
  absl::StatusOr<SequenceKv> leased = SequenceKv::Lease(*pools, 10, "held");  // 3 blocks a rank
  ASSERT_TRUE(leased.ok());
  std::optional<SequenceKv> held(*std::move(leased));
  // Another node's sequence of 5 tokens in 2 blocks: one block is free here.
  const BlockLeaseState foreign{{7, 3}, {28, 29, 30, 12, 13}};
  const std::vector<BlockLeaseState> both = {foreign, foreign};
  absl::StatusOr<SequenceKv> imported = SequenceKv::LeaseLike(*pools, both, 5, "imported");
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{0, 1, 0}));
  EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{10, 10}));

  const BlockLeaseState twice{{7, 7}, {28}};
  const std::vector<BlockLeaseState> malformed = {twice, twice};
  EXPECT_EQ(SequenceKv::LeaseLike(*pools, malformed, 1, "bad").status().code(),
            absl::StatusCode::kInvalidArgument);
  // A snapshot's leases whose blocks are taken: not a refusal for lack of blocks either.
  const std::vector<BlockLeaseState> taken = held->State();
  EXPECT_EQ(SequenceKv::Restore(*pools, taken, 10, "restored").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{0, 1, 0}));

  held.reset();  // gives the 3 blocks back
  imported = SequenceKv::LeaseLike(*pools, both, 5, "imported");
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{5, 5}));
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{0, 1, 0}));
}

TEST(KvPoolsRefusalTest, AStepWhoseTokenFindsNoSlotCountsAndLeavesTheCacheAsItWas) {
  auto pools = MakePools(3, 2);
  ASSERT_NE(pools, nullptr);
  absl::StatusOr<SequenceKv> kv = SequenceKv::Lease(*pools, 7, "s");  // 2 blocks, 1 slot free
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(kv->AppendToken("s", 1).ok());
  EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{8, 8}));
  // Rank 0 could take a third block, rank 1 cannot: rank 0's slot is given back (the block
  // stays with its lease, a spare for the next step).
  EXPECT_EQ(kv->AppendToken("s", 2).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{0, 0, 1}));
  EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(kv->AppendToken("s", 2).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Refusals(*pools), (std::vector<int64_t>{0, 0, 2}));
}

// The pool's count against the sum of its leases' sizes through appends, evictions,
// compactions, undone appends, moves and drops, on every rank.
TEST(KvPoolsCachedTokensTest, EqualsTheTokensTheLeasesHoldThroughEveryChange) {
  auto pools = MakePools(64, 64);
  ASSERT_NE(pools, nullptr);
  std::mt19937_64 rng(11);
  std::vector<SequenceKv> sequences;
  std::vector<KvSlotChanges> changes;
  const auto expect_sum = [&](int round) {
    int64_t held = 0;
    for (const SequenceKv& s : sequences) held += static_cast<int64_t>(s.Slots()[0].size());
    EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{held, held})) << "round " << round;
  };
  for (int round = 0; round < 300; ++round) {
    const uint64_t action = rng() % 8;
    if (action == 0 || sequences.empty()) {
      absl::StatusOr<SequenceKv> kv = SequenceKv::Lease(*pools, static_cast<int64_t>(rng() % 30), "s");
      if (kv.ok()) sequences.push_back(*std::move(kv));
    } else if (action == 1) {
      sequences.erase(sequences.begin() + static_cast<std::ptrdiff_t>(rng() % sequences.size()));
    } else {
      SequenceKv& kv = sequences[rng() % sequences.size()];
      if (!kv.AppendToken("s", round).ok()) continue;
      if (action == 2) {
        kv.UndoAppend();
      } else {
        // Evict a random subset of the cache (the new token included), sometimes most of it
        // so that ApplyEvictions compacts.
        const int64_t size = static_cast<int64_t>(kv.Slots()[0].size());
        const uint64_t evict_one_in = action == 3 ? 1 : 8;
        std::vector<int64_t> evicted;
        for (int64_t i = 0; i < size; ++i) {
          if (rng() % evict_one_in == 0 && (action != 3 || rng() % 4 != 0)) evicted.push_back(i);
        }
        kv.ApplyEvictions(evicted, &changes);
      }
    }
    expect_sum(round);
  }
  sequences.clear();
  EXPECT_EQ(CachedTokens(*pools), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(Refusals(*pools)[2], 0);
}

}  // namespace
}  // namespace kvcm

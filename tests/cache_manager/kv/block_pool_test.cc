#include "cache_manager/kv/block_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/kv/kv_storage.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/kv/kv_pattern.h"

namespace kvcm {
namespace {

using kernels::KvBlockLayout;
using kernels::KvDtype;
using testing::CheckToken;
using testing::WriteToken;

// 16 tokens per block, 2 layers, 2 kv heads of 8 fp16: 32-byte rows, 2 KiB blocks.
constexpr KvBlockLayout kLayout{16, 2, 2, 8, KvDtype::kFloat16};
constexpr int64_t kBlockBytes = 2048;

std::unique_ptr<BlockPool> MakePool(int64_t blocks, int32_t rank = 0) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = blocks * kBlockBytes + kBlockBytes / 2;  // the remainder is unused
  options.rank = rank;
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::CreateHost(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

// A lease and the id of the token in each of its slots (tokens get ids 0, 1, 2, ... as
// they are appended), with every token's pattern written into the pool.
struct TrackedLease {
  BlockPool* pool;
  BlockLease lease;
  std::vector<int64_t> ids;
  int64_t next_id = 0;

  absl::Status Append(int64_t n) {
    const absl::Status status = lease.Append(n);
    if (!status.ok()) return status;
    for (int64_t i = lease.size() - n; i < lease.size(); ++i) {
      WriteToken(pool->storage().data(), kLayout, lease.slots()[static_cast<size_t>(i)], next_id);
      ids.push_back(next_id++);
    }
    return status;
  }
  absl::Status Evict(const std::vector<int64_t>& indices) {
    const absl::Status status = lease.Evict(indices);
    if (!status.ok()) return status;
    for (auto it = indices.rbegin(); it != indices.rend(); ++it) ids.erase(ids.begin() + *it);
    return status;
  }
  // "" when every live token's K and V are in the slot the lease names for it.
  std::string CheckContents() const {
    for (size_t i = 0; i < ids.size(); ++i) {
      std::string error = CheckToken(pool->storage().data(), kLayout, lease.slots()[i], ids[i]);
      if (!error.empty()) return error;
    }
    return "";
  }
};

TEST(BlockPoolTest, CapacityIsTheMemoryCapOverTheBlockSize) {
  std::unique_ptr<BlockPool> pool = MakePool(5, /*rank=*/3);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(kLayout.BlockBytes(), kBlockBytes);
  const BlockPoolUsage usage = pool->Usage();
  EXPECT_EQ(usage.rank, 3);
  EXPECT_EQ(usage.space, MemorySpace::kHost);
  EXPECT_EQ(usage.capacity_blocks, 5);
  EXPECT_EQ(usage.used_blocks, 0);
  EXPECT_EQ(usage.free_blocks(), 5);
  EXPECT_EQ(usage.block_bytes, kBlockBytes);
  EXPECT_EQ(usage.tokens_per_block, 16);
  EXPECT_EQ(usage.leases, 0);
  EXPECT_EQ(pool->storage().bytes(), 5 * kBlockBytes);
  EXPECT_EQ(pool->memory_export().kind, MemoryExport::Kind::kNone);
  EXPECT_EQ(static_cast<char*>(pool->BlockData(2)) - static_cast<char*>(pool->BlockData(0)),
            2 * kBlockBytes);
}

TEST(BlockPoolTest, RejectsABadGeometryOrACapBelowOneBlock) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = kBlockBytes - 1;
  EXPECT_EQ(BlockPool::CreateHost(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.memory_bytes = kBlockBytes;
  EXPECT_TRUE(BlockPool::CreateHost(options).ok());
  for (int field = 0; field < 4; ++field) {
    BlockPoolOptions bad = options;
    int64_t* fields[] = {&bad.layout.tokens_per_block, &bad.layout.layers, &bad.layout.kv_heads,
                         &bad.layout.head_dim};
    *fields[field] = 0;
    EXPECT_EQ(BlockPool::CapacityBlocks(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "field " << field;
  }
  BlockPoolOptions huge = options;
  huge.layout.layers = 4096;
  huge.layout.kv_heads = 4096;
  huge.layout.head_dim = 65536;
  EXPECT_EQ(BlockPool::CapacityBlocks(huge).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockLeaseTest, ALeaseTakesWholeBlocksAndNamesADistinctSlotPerToken) {
  std::unique_ptr<BlockPool> pool = MakePool(8);
  absl::StatusOr<BlockLease> lease = pool->Lease(33);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(lease->valid());
  EXPECT_EQ(lease->size(), 33);
  EXPECT_EQ(lease->block_count(), 3);
  EXPECT_EQ(lease->free_slots(), 15);
  EXPECT_EQ(pool->Usage().used_blocks, 3);
  EXPECT_EQ(pool->Usage().leases, 1);
  const std::set<int32_t> blocks(lease->blocks().begin(), lease->blocks().end());
  std::set<int64_t> slots;
  for (int64_t slot : lease->slots()) {
    EXPECT_TRUE(blocks.count(static_cast<int32_t>(slot / 16))) << slot;
    slots.insert(slot);
  }
  EXPECT_EQ(slots.size(), 33u);
}

TEST(BlockLeaseTest, GrowthFillsTheLastBlockBeforeTakingANewOne) {
  std::unique_ptr<BlockPool> pool = MakePool(8);
  absl::StatusOr<BlockLease> lease = pool->Lease(20);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->block_count(), 2);
  for (int i = 0; i < 12; ++i) ASSERT_TRUE(lease->Append(1).ok());
  EXPECT_EQ(lease->block_count(), 2);
  EXPECT_EQ(lease->free_slots(), 0);
  ASSERT_TRUE(lease->Append(1).ok());
  EXPECT_EQ(lease->block_count(), 3);
  EXPECT_EQ(lease->size(), 33);
  EXPECT_EQ(pool->Usage().used_blocks, 3);
}

TEST(BlockLeaseTest, ASteadyDecodeReusesEvictedSlotsAndHoldsConstantBlocks) {
  std::unique_ptr<BlockPool> pool = MakePool(8);
  TrackedLease t{pool.get(), *pool->Lease(0), {}};
  ASSERT_TRUE(t.Append(32).ok());
  std::mt19937_64 rng(7);
  for (int step = 0; step < 200; ++step) {
    ASSERT_TRUE(t.Append(1).ok());
    ASSERT_TRUE(t.Evict({static_cast<int64_t>(rng() % static_cast<uint64_t>(t.lease.size()))}).ok());
    ASSERT_EQ(t.lease.size(), 32);
    ASSERT_EQ(t.lease.block_count(), 3) << "step " << step;
  }
  EXPECT_EQ(t.CheckContents(), "");
  EXPECT_EQ(pool->Usage().used_blocks, 3);
}

TEST(BlockLeaseTest, AFullPoolIsResourceExhaustedAndChangesNothing) {
  std::unique_ptr<BlockPool> pool = MakePool(4, /*rank=*/2);
  absl::StatusOr<BlockLease> lease = pool->Lease(40);  // 3 blocks, 8 free slots
  ASSERT_TRUE(lease.ok());
  const std::vector<int64_t> slots_before(lease->slots().begin(), lease->slots().end());

  const absl::Status grow = lease->Append(30);  // 8 from free slots + 2 new blocks; 1 is left
  EXPECT_EQ(grow.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(grow.message().find("rank 2"), absl::string_view::npos) << grow.message();
  EXPECT_EQ(lease->size(), 40);
  EXPECT_EQ(lease->block_count(), 3);
  EXPECT_EQ(lease->free_slots(), 8);
  EXPECT_EQ(std::vector<int64_t>(lease->slots().begin(), lease->slots().end()), slots_before);
  EXPECT_EQ(pool->Usage().used_blocks, 3);

  EXPECT_EQ(pool->Lease(17).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Usage().leases, 1);  // the failed lease is gone
  EXPECT_TRUE(lease->Append(24).ok());  // exactly what is left
  EXPECT_EQ(pool->Usage().free_blocks(), 0);
  EXPECT_EQ(lease->Append(1).code(), absl::StatusCode::kResourceExhausted);
}

TEST(BlockLeaseTest, DroppingALeaseReturnsItsBlocks) {
  std::unique_ptr<BlockPool> pool = MakePool(8);
  {
    absl::StatusOr<BlockLease> a = pool->Lease(64);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(pool->Usage().used_blocks, 4);
  }
  EXPECT_EQ(pool->Usage().used_blocks, 0);
  EXPECT_EQ(pool->Usage().leases, 0);
}

TEST(BlockLeaseTest, MovingALeaseMovesItsBlocksAndReturnsThemOnce) {
  std::unique_ptr<BlockPool> pool = MakePool(8);
  BlockLease a = *pool->Lease(20);
  BlockLease b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_EQ(a.size(), 0);
  EXPECT_EQ(b.size(), 20);
  EXPECT_EQ(pool->Usage().leases, 1);
  BlockLease c = *pool->Lease(16);
  EXPECT_EQ(pool->Usage().used_blocks, 3);
  c = std::move(b);  // c's own block goes back first
  EXPECT_EQ(pool->Usage().used_blocks, 2);
  EXPECT_EQ(pool->Usage().leases, 1);
  c.Release();
  EXPECT_TRUE(c.valid());
  EXPECT_EQ(c.size(), 0);
  EXPECT_EQ(pool->Usage().used_blocks, 0);
  ASSERT_TRUE(c.Append(3).ok());  // a released lease grows again
  EXPECT_EQ(pool->Usage().used_blocks, 1);
}

TEST(BlockLeaseTest, EvictRejectsIndicesThatAreNotAscendingDistinctAndInRange) {
  std::unique_ptr<BlockPool> pool = MakePool(4);
  BlockLease lease = *pool->Lease(10);
  const std::vector<int64_t> before(lease.slots().begin(), lease.slots().end());
  for (const std::vector<int64_t>& bad : std::vector<std::vector<int64_t>>{
           {3, 2}, {4, 4}, {10}, {-1}, {0, 11}}) {
    EXPECT_EQ(lease.Evict(bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::vector<int64_t>(lease.slots().begin(), lease.slots().end()), before);
    EXPECT_EQ(lease.free_slots(), 6);
  }
  ASSERT_TRUE(lease.Evict(std::vector<int64_t>{0, 9}).ok());
  EXPECT_EQ(lease.size(), 8);
  EXPECT_EQ(lease.slots()[0], before[1]);
  EXPECT_EQ(lease.slots()[7], before[8]);
  EXPECT_EQ(lease.free_slots(), 8);
}

// Checks the plan against its contract; returns "" when it holds.
std::string CheckPlan(const BlockLease& lease, const CompactionPlan& plan, int64_t tpb) {
  std::vector<int64_t> live_per_block;
  std::vector<int32_t> blocks(lease.blocks().begin(), lease.blocks().end());
  live_per_block.assign(blocks.size(), 0);
  const auto index_of = [&](int64_t slot) {
    return std::find(blocks.begin(), blocks.end(), static_cast<int32_t>(slot / tpb)) -
           blocks.begin();
  };
  for (int64_t slot : lease.slots()) ++live_per_block[static_cast<size_t>(index_of(slot))];
  const int64_t keep = (lease.size() + tpb - 1) / tpb;
  if (static_cast<int64_t>(plan.kept_blocks.size()) != keep) return "wrong number of kept blocks";
  if (plan.kept_blocks.size() + plan.released_blocks.size() != blocks.size()) {
    return "kept + released is not the lease's blocks";
  }
  const std::set<int32_t> kept(plan.kept_blocks.begin(), plan.kept_blocks.end());
  // Minimal: the kept blocks hold the most live tokens.
  std::vector<int64_t> sorted = live_per_block;
  std::sort(sorted.rbegin(), sorted.rend());
  int64_t best_kept_live = 0;
  for (int64_t i = 0; i < keep; ++i) best_kept_live += sorted[static_cast<size_t>(i)];
  if (static_cast<int64_t>(plan.moves.size()) != lease.size() - best_kept_live) {
    return "not the fewest moves";
  }
  // Sources: exactly the live slots outside kept blocks, in cache order.
  std::vector<int64_t> expected_sources;
  for (int64_t slot : lease.slots()) {
    if (!kept.count(static_cast<int32_t>(slot / tpb))) expected_sources.push_back(slot);
  }
  const std::set<int64_t> live(lease.slots().begin(), lease.slots().end());
  std::set<int64_t> destinations;
  for (size_t i = 0; i < plan.moves.size(); ++i) {
    if (plan.moves[i].src_slot != expected_sources[i]) return "unexpected source";
    const int64_t dst = plan.moves[i].dst_slot;
    if (!kept.count(static_cast<int32_t>(dst / tpb))) return "destination outside kept blocks";
    if (live.count(dst)) return "destination holds a live token";
    if (!destinations.insert(dst).second) return "destination used twice";
  }
  return "";
}

TEST(BlockLeaseTest, CompactionPacksSurvivorsIntoTheFewestBlocksAndMovesTheirBytes) {
  std::mt19937_64 rng(2024);
  for (int round = 0; round < 60; ++round) {
    std::unique_ptr<BlockPool> pool = MakePool(64);
    TrackedLease t{pool.get(), *pool->Lease(0), {}};
    ASSERT_TRUE(t.Append(1 + static_cast<int64_t>(rng() % 700)).ok());
    // Rounds of scattered eviction and growth, like a first step and some decode steps.
    for (int phase = 0; phase < 3; ++phase) {
      std::vector<int64_t> evict;
      const uint64_t keep_one_in = 2 + rng() % 9;
      for (int64_t i = 0; i < t.lease.size(); ++i) {
        if (rng() % keep_one_in != 0) evict.push_back(i);
      }
      ASSERT_TRUE(t.Evict(evict).ok());
      ASSERT_TRUE(t.Append(static_cast<int64_t>(rng() % 20)).ok());
    }
    const CompactionPlan plan = t.lease.PlanCompaction();
    ASSERT_EQ(CheckPlan(t.lease, plan, 16), "") << "round " << round;

    const int64_t used_before = pool->Usage().used_blocks;
    absl::StatusOr<CompactionPlan> done = t.lease.Compact();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->moves.size(), plan.moves.size());
    EXPECT_EQ(t.lease.block_count(), (t.lease.size() + 15) / 16);
    EXPECT_EQ(pool->Usage().used_blocks,
              used_before - static_cast<int64_t>(plan.released_blocks.size()));
    ASSERT_EQ(t.CheckContents(), "") << "round " << round;
    EXPECT_EQ(t.lease.free_slots(), t.lease.block_count() * 16 - t.lease.size());
    // Compacting a compact lease is a no-op, and the lease keeps working.
    EXPECT_TRUE(t.lease.PlanCompaction().moves.empty());
    ASSERT_TRUE(t.Append(17).ok());
    ASSERT_EQ(t.CheckContents(), "");
  }
}

TEST(BlockLeaseTest, CompactionReleasesEmptyBlocksWithoutMoves) {
  std::unique_ptr<BlockPool> pool = MakePool(8);
  BlockLease lease = *pool->Lease(48);
  std::vector<int64_t> middle_block(16);
  for (int64_t i = 0; i < 16; ++i) middle_block[static_cast<size_t>(i)] = 16 + i;
  ASSERT_TRUE(lease.Evict(middle_block).ok());
  const int32_t middle = lease.blocks()[1];
  absl::StatusOr<CompactionPlan> plan = lease.Compact();
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->moves.empty());
  EXPECT_EQ(plan->released_blocks, std::vector<int32_t>{middle});
  EXPECT_EQ(lease.block_count(), 2);
  EXPECT_EQ(pool->Usage().used_blocks, 2);

  ASSERT_TRUE(lease.Evict(std::vector<int64_t>{0, 1, 2}).ok());
  lease.Release();
  absl::StatusOr<CompactionPlan> empty = lease.Compact();
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->kept_blocks.empty());
}

std::string UniqueShmName(absl::string_view tag) {
  return "/kvcm-test-" + std::to_string(getpid()) + "-" + std::string(tag);
}

TEST(HostKvStorageTest, ASharedMemoryPoolIsVisibleThroughAnotherMapping) {
  const std::string name = UniqueShmName("visible");
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = 4 * kBlockBytes;
  {
    absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::CreateHost(options, {name});
    ASSERT_TRUE(pool.ok()) << pool.status();
    const MemoryExport& exported = (*pool)->memory_export();
    EXPECT_EQ(exported.kind, MemoryExport::Kind::kPosixShm);
    EXPECT_EQ(exported.shm_name, name);
    EXPECT_EQ(exported.bytes, 4 * kBlockBytes);
    // The name is taken while the pool lives.
    EXPECT_EQ(BlockPool::CreateHost(options, {name}).status().code(),
              absl::StatusCode::kAlreadyExists);

    // What a worker process would do: open the name and map it.
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    void* mapped = mmap(nullptr, static_cast<size_t>(exported.bytes), PROT_READ | PROT_WRITE,
                        MAP_SHARED, fd, 0);
    close(fd);
    ASSERT_NE(mapped, MAP_FAILED);
    BlockLease lease = *(*pool)->Lease(20);
    for (int64_t i = 0; i < lease.size(); ++i) {  // the worker writes K/V ...
      WriteToken(mapped, kLayout, lease.slots()[static_cast<size_t>(i)], 1000 + i);
    }
    ASSERT_TRUE(lease.Evict(std::vector<int64_t>{0, 1, 2, 3, 4, 5}).ok());
    ASSERT_TRUE(lease.Compact().ok());  // ... the daemon compacts in its own mapping
    for (int64_t i = 0; i < lease.size(); ++i) {
      EXPECT_EQ(CheckToken(mapped, kLayout, lease.slots()[static_cast<size_t>(i)], 1006 + i), "");
    }
    munmap(mapped, static_cast<size_t>(exported.bytes));
  }
  // Destroying the pool unlinks the name.
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
}

TEST(HostKvStorageTest, RejectsABadSharedMemoryName) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = kBlockBytes;
  for (const std::string& bad : {std::string("no-slash"), std::string("/a/b"), std::string("/")}) {
    EXPECT_EQ(BlockPool::CreateHost(options, {bad}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace kvcm

namespace kvcm {
namespace {

// A pool a snapshot keeps for the restart is held by no process between the drain and the
// start: marked kept, the sweep for dead instances' objects leaves it; unmarked, it goes.
TEST(SharedMemorySweepTest, AnObjectMarkedKeptForARestartIsNotSwept) {
  const std::string kept = absl::StrCat("/kvcm-sweep-test-", getpid(), "-kept");
  const std::string stale = absl::StrCat("/kvcm-sweep-test-", getpid(), "-stale");
  for (const std::string& name : {kept, stale}) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    close(fd);
  }
  ASSERT_TRUE(MarkSharedMemoryKept(kept).ok());
  const std::string prefix = absl::StrCat("kvcm-sweep-test-", getpid());
  const std::vector<std::string> removed = RemoveStaleSharedMemory(
      [&](absl::string_view name) { return absl::StartsWith(name, prefix); });
  EXPECT_EQ(removed, std::vector<std::string>{stale});
  EXPECT_EQ(shm_unlink(kept.c_str()), 0) << "the kept object was removed";
  EXPECT_EQ(MarkSharedMemoryKept("/kvcm-sweep-test-no-such-object").code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvcm

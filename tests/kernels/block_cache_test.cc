#include "kernels/block_cache.h"

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm::kernels {
namespace {

// The underlying allocator: malloc, counted, failing on request.
std::atomic<int> g_allocations = 0;
std::atomic<int> g_frees = 0;
std::atomic<bool> g_fail = false;

absl::Status CountedAllocate(size_t bytes, void** ptr) {
  if (g_fail) return absl::ResourceExhaustedError("cudaMallocHost: out of memory (injected)");
  ++g_allocations;
  *ptr = std::malloc(bytes);
  return absl::OkStatus();
}

void CountedFree(void* ptr) {
  ++g_frees;
  std::free(ptr);
}

class BlockCacheTest : public ::testing::Test {
 protected:
  BlockCacheTest() {
    g_allocations = 0;
    g_frees = 0;
    g_fail = false;
  }
};

TEST_F(BlockCacheTest, SizeClassesArePowersOfTwoFrom256) {
  EXPECT_EQ(BlockCache::BlockBytes(0), 256u);
  EXPECT_EQ(BlockCache::BlockBytes(1), 256u);
  EXPECT_EQ(BlockCache::BlockBytes(256), 256u);
  EXPECT_EQ(BlockCache::BlockBytes(257), 512u);
  EXPECT_EQ(BlockCache::BlockBytes(3000), 4096u);
  EXPECT_EQ(BlockCache::BlockBytes(size_t{1} << 30), size_t{1} << 30);
}

TEST_F(BlockCacheTest, AReleasedBlockServesTheNextRequestOfItsClassWithoutTheAllocator) {
  BlockCache cache(&CountedAllocate, &CountedFree, 1 << 20);
  void* a = nullptr;
  ASSERT_TRUE(cache.Allocate(1000, &a).ok());
  EXPECT_EQ(g_allocations, 1);
  cache.Release(a);
  EXPECT_EQ(g_frees, 0) << "kept for reuse";
  EXPECT_EQ(cache.stats().cached_bytes, 1024u);
  void* b = nullptr;
  ASSERT_TRUE(cache.Allocate(600, &b).ok());  // same class (1024)
  EXPECT_EQ(b, a);
  EXPECT_EQ(g_allocations, 1) << "a grown-and-shrunk array reuses its block";
  void* c = nullptr;
  ASSERT_TRUE(cache.Allocate(2000, &c).ok());  // another class
  EXPECT_NE(c, a);
  EXPECT_EQ(g_allocations, 2);
  const BlockCache::Stats stats = cache.stats();
  EXPECT_EQ(stats.live_bytes, 1024u + 2048u);
  EXPECT_EQ(stats.cached_bytes, 0u);
  cache.Release(b);
  cache.Release(c);
  cache.Release(nullptr);  // ignored
  EXPECT_EQ(cache.stats().live_bytes, 0u);
}

TEST_F(BlockCacheTest, WhatItKeepsIsBoundedAndTheRestIsFreed) {
  {
    BlockCache cache(&CountedAllocate, &CountedFree, 4096);
    std::vector<void*> blocks(5, nullptr);
    for (void*& b : blocks) ASSERT_TRUE(cache.Allocate(1024, &b).ok());
    EXPECT_EQ(g_allocations, 5);
    for (void* b : blocks) cache.Release(b);
    EXPECT_EQ(cache.stats().cached_bytes, 4096u) << "four 1 KiB blocks fit the bound";
    EXPECT_EQ(g_frees, 1) << "the fifth went back to the allocator";
    EXPECT_EQ(cache.stats().free_calls, 1);
  }
  EXPECT_EQ(g_frees, 5) << "the cache frees what it kept when it goes";
}

TEST_F(BlockCacheTest, TheAllocatorsErrorIsReturnedAndNothingIsHeld) {
  BlockCache cache(&CountedAllocate, &CountedFree, 1 << 20);
  g_fail = true;
  void* p = reinterpret_cast<void*>(1);
  const absl::Status status = cache.Allocate(100, &p);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(p, nullptr);
  EXPECT_EQ(cache.stats().live_bytes, 0u);
}

TEST_F(BlockCacheTest, ThreadsShareItSafely) {
  BlockCache cache(&CountedAllocate, &CountedFree, 1 << 16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      std::vector<void*> mine;
      for (int i = 0; i < 500; ++i) {
        void* p = nullptr;
        ASSERT_TRUE(cache.Allocate(static_cast<size_t>(64 << ((i + t) % 6)), &p).ok());
        static_cast<char*>(p)[0] = static_cast<char>(i);
        mine.push_back(p);
        if (mine.size() > 8) {
          cache.Release(mine.front());
          mine.erase(mine.begin());
        }
      }
      for (void* p : mine) cache.Release(p);
    });
  }
  for (std::thread& thread : threads) thread.join();
  const BlockCache::Stats stats = cache.stats();
  EXPECT_EQ(stats.live_bytes, 0u);
  EXPECT_LE(stats.cached_bytes, size_t{1} << 16);
  EXPECT_EQ(stats.allocator_calls, g_allocations.load());
  EXPECT_EQ(stats.free_calls, g_frees.load()) << "every block freed was counted";
}

TEST_F(BlockCacheTest, ReleasingABlockItDidNotHandOutStopsTheProcess) {
  BlockCache cache(&CountedAllocate, &CountedFree, 1 << 20);
  int not_a_block = 0;
  EXPECT_DEATH(cache.Release(&not_a_block), "did not hand out");
}

}  // namespace
}  // namespace kvcm::kernels

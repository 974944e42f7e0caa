// ByteBudget (cache_manager/base/byte_budget.h): limits, the parent's rollback, the counters,
// and many threads taking and giving against a child and its parent without either ever
// holding more than its limit.
#include "cache_manager/base/byte_budget.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(ByteBudgetTest, TakesUpToItsLimitAndRefusesPastIt) {
  ByteBudget budget(100, "--limit");
  EXPECT_TRUE(budget.TryTake(60));
  EXPECT_TRUE(budget.TryTake(40));
  const ByteBudget* refused_by = nullptr;
  EXPECT_FALSE(budget.TryTake(1, &refused_by));
  EXPECT_EQ(refused_by, &budget);
  EXPECT_EQ(budget.used(), 100);
  EXPECT_EQ(budget.left(), 0);
  EXPECT_EQ(budget.refused(), 1);
  budget.Give(40);
  EXPECT_EQ(budget.used(), 60);
  EXPECT_EQ(budget.freed(), 0);  // a reservation handed back is not memory freed
  budget.Release(60);
  EXPECT_EQ(budget.used(), 0);
  EXPECT_EQ(budget.freed(), 60);
}

TEST(ByteBudgetTest, AChildRefusedByItsParentKeepsNothing) {
  ByteBudget parent(100, "--memory_limit_bytes");
  ByteBudget child(80, "--max_pending_join_bytes", &parent);
  ASSERT_TRUE(parent.TryTake(50));  // someone else's bytes
  const ByteBudget* refused_by = nullptr;
  EXPECT_FALSE(child.TryTake(60, &refused_by));  // fits the child, not the parent
  EXPECT_EQ(refused_by, &parent);
  EXPECT_EQ(child.used(), 0);
  EXPECT_EQ(parent.used(), 50);
  EXPECT_EQ(parent.refused(), 1);
  EXPECT_TRUE(child.TryTake(50));
  EXPECT_EQ(parent.used(), 100);
  child.Release(50);
  EXPECT_EQ(parent.used(), 50);
  EXPECT_EQ(parent.freed(), 50);
}

TEST(ByteBudgetTest, TakeGoesPastTheLimitSoThatTheNextTryTakeIsRefused) {
  ByteBudget parent(10);
  ByteBudget child(10, "", &parent);
  child.Take(15);  // memory already allocated
  EXPECT_EQ(parent.used(), 15);
  EXPECT_EQ(child.left(), 0);
  EXPECT_FALSE(child.TryTake(1));
}

TEST(ByteBudgetTest, RefusalNamesTheHolderTheFlagAndWhatIsLeft) {
  ByteBudget budget(1000, "--tenant_memory_share", nullptr, "tenant 'a'");
  ASSERT_TRUE(budget.TryTake(900));
  EXPECT_EQ(budget.Refusal(200),
            "200 bytes asked, 900 of tenant 'a''s 1000 bytes in use, 100 left "
            "(--tenant_memory_share)");
}

// Threads take and give on two children of one parent. Whatever the interleaving, neither
// budget is ever seen above its limit, every refused TryTake left nothing behind, and all
// is given back at the end.
TEST(ByteBudgetTest, ConcurrentTakersNeverPassAnyLimitAndLeaveNothingBehind) {
  constexpr int64_t kParentLimit = 1000, kChildLimit = 700;
  ByteBudget parent(kParentLimit, "--memory_limit_bytes");
  ByteBudget a(kChildLimit, "a", &parent), b(kChildLimit, "b", &parent);
  std::atomic<bool> over{false};
  std::atomic<int64_t> granted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      ByteBudget& child = (t % 2 == 0) ? a : b;
      for (int i = 0; i < 20000; ++i) {
        const int64_t bytes = 1 + (i * 7 + t * 13) % 97;
        if (child.TryTake(bytes)) {
          granted.fetch_add(1, std::memory_order_relaxed);
          if (parent.used() > kParentLimit || child.used() > kChildLimit) over = true;
          if (i % 3 == 0) {
            child.Release(bytes);
          } else {
            child.Give(bytes);
          }
        } else {
          refused.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_FALSE(over.load());
  EXPECT_EQ(a.used(), 0);
  EXPECT_EQ(b.used(), 0);
  EXPECT_EQ(parent.used(), 0);
  EXPECT_GT(granted.load(), 0);
  // Every refusal is counted once, by the budget that had no room.
  EXPECT_EQ(a.refused() + b.refused() + parent.refused(), refused.load());
  EXPECT_EQ(parent.freed(), a.freed() + b.freed());
}

}  // namespace
}  // namespace kvcm

// ByteBudget: a lock-free cap on bytes, with an optional parent that must have room for
// every byte taken here too. What every layer uses to bound memory that requests make the
// daemon hold (engine state, pending tensor-parallel sums, created score regions).
#ifndef KVCM_CACHE_MANAGER_BASE_BYTE_BUDGET_H_
#define KVCM_CACHE_MANAGER_BASE_BYTE_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

namespace kvcm {

// A cap on bytes held for requests, all sequences together: the engine state of every
// sequence (--memory_limit_bytes), or the partial sums of tensor-parallel steps waiting
// for their other ranks (--max_pending_join_bytes, whose bytes also count against the
// memory limit: its parent). Thread-safe (lock-free).
class ByteBudget {
 public:
  // `flag` names the limit in messages, `holder` whose limit it is ("the daemon",
  // "tenant 'a'"). `parent` (may be null; must outlive this one) must have room for every
  // byte taken here too.
  explicit ByteBudget(int64_t limit, std::string flag = "", ByteBudget* parent = nullptr,
                      std::string holder = "the daemon")
      : limit_(limit), flag_(std::move(flag)), holder_(std::move(holder)), parent_(parent) {}
  ByteBudget(const ByteBudget&) = delete;
  ByteBudget& operator=(const ByteBudget&) = delete;

  // Takes `bytes` when they fit under this limit and the parent's; otherwise takes
  // nothing, returns false and, when `refused_by` is given, points it at the budget
  // that had no room. REQUIRES: bytes >= 0.
  bool TryTake(int64_t bytes, const ByteBudget** refused_by = nullptr);
  // Takes `bytes` even past the limit: for memory that is already allocated (a step that
  // happened cannot be undone), so that what comes next is refused instead.
  void Take(int64_t bytes);
  void Give(int64_t bytes);
  // Give, for bytes that were freed (a closed sequence's state, a shrunk array), as opposed
  // to a reservation handed back unused; counted by freed() here and in the parents.
  void Release(int64_t bytes);

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  // Every byte ever Released (a counter): how much memory was freed since a past reading.
  int64_t freed() const { return freed_.load(std::memory_order_relaxed); }
  // TryTakes this budget had no room for (a counter; a child's refusals count where they
  // happened): how many requests the limit refused.
  int64_t refused() const { return refused_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }
  // What is left under the limit (0 when at or past it).
  int64_t left() const;
  const std::string& flag() const { return flag_; }
  // For a refusal: "N bytes asked, U of <holder>'s L bytes in use, R left (--flag)".
  std::string Refusal(int64_t bytes) const;

 private:
  bool TryTakeHere(int64_t bytes);

  const int64_t limit_;
  const std::string flag_;
  const std::string holder_;
  ByteBudget* const parent_;
  std::atomic<int64_t> used_{0};
  std::atomic<int64_t> freed_{0};
  std::atomic<int64_t> refused_{0};
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_BASE_BYTE_BUDGET_H_

// Clock: the time source of the sequence table (idle reclaim), injected so that tests can
// drive time by hand. Implementations are thread-safe.
#ifndef KVCM_CACHE_MANAGER_BASE_CLOCK_H_
#define KVCM_CACHE_MANAGER_BASE_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_manager/base/mutex.h"

namespace kvcm {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;

  // The process-wide wall clock. Never deleted.
  static const Clock* Real();
};

// A clock that moves only when told to.
class ManualClock : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::UnixEpoch()) : now_(start) {}
  absl::Time Now() const override {
    MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_BASE_CLOCK_H_

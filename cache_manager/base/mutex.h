// kvcm::Mutex: the engine's mutex. A reader-writer lock with Clang thread-safety
// annotations (ABSL_GUARDED_BY and friends work with it as with absl::Mutex), built on
// std::shared_mutex.
//
// Why not absl::Mutex: Debian ships Abseil prebuilt without ThreadSanitizer
// instrumentation, so TSan cannot see absl::Mutex's happens-before edges and reports
// every access it guards as a race. pthread locks are intercepted by TSan, which keeps the
// engine's concurrency tests meaningful under it.
#ifndef KVCM_CACHE_MANAGER_BASE_MUTEX_H_
#define KVCM_CACHE_MANAGER_BASE_MUTEX_H_

#include <condition_variable>
#include <shared_mutex>

#include "absl/base/thread_annotations.h"

namespace kvcm {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }
  // Releases the (exclusively held) mutex while blocked on `cv`, and holds it again on
  // return. Callers loop on their condition: wake-ups may be spurious.
  void Wait(std::condition_variable_any* cv) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) { cv->wait(mu_); }

 private:
  std::shared_mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->ReaderLock();
  }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_BASE_MUTEX_H_

// StepExecutor: the engine's threads. Every sequence is pinned to one of them (its shard,
// from a hash of its id), so a sequence's steps run in the order they were posted and
// its slot's lock is never contended by another step; different sequences run in
// parallel, each thread on device streams of its own (kernels/stream_lanes.h). The gRPC
// threads only decode and post here: no engine work runs on them.
//
// A task is a function pointer and a context, so posting allocates nothing. Each shard's
// queue is bounded: Post refuses (false) when it is full, and the caller answers
// RESOURCE_EXHAUSTED; with the daemon's per-stream in-flight limit the bound is never
// reached in normal operation. Thread-safe.
#ifndef KVCM_CACHE_MANAGER_TABLE_STEP_EXECUTOR_H_
#define KVCM_CACHE_MANAGER_TABLE_STEP_EXECUTOR_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache_manager/base/mutex.h"

namespace kvcm {

class StepExecutor {
 public:
  struct Task {
    void (*run)(void* context, int32_t shard) = nullptr;
    void* context = nullptr;
  };

  // `threads` >= 1 engine threads, each with a queue of at most `queue_capacity` tasks.
  StepExecutor(int32_t threads, int64_t queue_capacity);
  // Runs every task already posted, then joins the threads.
  ~StepExecutor();

  StepExecutor(const StepExecutor&) = delete;
  StepExecutor& operator=(const StepExecutor&) = delete;

  int32_t threads() const { return static_cast<int32_t>(shards_.size()); }
  // The shard a sequence is pinned to.
  int32_t ShardOf(absl::string_view sequence_id) const;

  // Queues `task` to run on `shard`'s thread. False (nothing queued) when that queue
  // holds `queue_capacity` tasks, or the executor is shutting down.
  bool Post(int32_t shard, Task task);
  // Post, saying why when it refuses: RESOURCE_EXHAUSTED naming the shard's queue and its
  // capacity (retry later), or UNAVAILABLE when the executor is shutting down (no later).
  // For callers whose caller must tell the two apart.
  absl::Status TryPost(int32_t shard, Task task);

  // Tasks queued and not yet started, all shards together (for a gauge).
  int64_t QueuedTasks() const;

 private:
  struct Shard {
    mutable Mutex mu;
    std::condition_variable_any ready;
    // Posted tasks; the thread swaps it with its own batch, so both keep their capacity.
    std::vector<Task> queue ABSL_GUARDED_BY(mu);
    bool stopping ABSL_GUARDED_BY(mu) = false;
    std::thread thread;
  };

  void Run(int32_t index);

  const int64_t queue_capacity_;
  std::vector<std::unique_ptr<Shard>> shards_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TABLE_STEP_EXECUTOR_H_

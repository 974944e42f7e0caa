#include "cache_manager/table/step_executor.h"

#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "kernels/stream_lanes.h"

namespace kvcm {

StepExecutor::StepExecutor(int32_t threads, int64_t queue_capacity)
    : queue_capacity_(queue_capacity) {
  KVCM_CHECK(threads >= 1 && queue_capacity >= 1);
  shards_.reserve(static_cast<size_t>(threads));
  for (int32_t i = 0; i < threads; ++i) shards_.push_back(std::make_unique<Shard>());
  for (int32_t i = 0; i < threads; ++i) {
    shards_[static_cast<size_t>(i)]->thread = std::thread([this, i] { Run(i); });
  }
}

StepExecutor::~StepExecutor() {
  for (auto& shard : shards_) {
    {
      MutexLock lock(&shard->mu);
      shard->stopping = true;
    }
    shard->ready.notify_all();
  }
  for (auto& shard : shards_) shard->thread.join();
}

int32_t StepExecutor::ShardOf(absl::string_view sequence_id) const {
  return static_cast<int32_t>(absl::HashOf(sequence_id) % shards_.size());
}

bool StepExecutor::Post(int32_t shard_index, Task task) {
  return TryPost(shard_index, task).ok();
}

absl::Status StepExecutor::TryPost(int32_t shard_index, Task task) {
  Shard& shard = *shards_[static_cast<size_t>(shard_index)];
  bool was_empty;
  {
    MutexLock lock(&shard.mu);
    if (shard.stopping) {
      return absl::UnavailableError("the engine threads are stopping: nothing new is queued");
    }
    if (static_cast<int64_t>(shard.queue.size()) >= queue_capacity_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "engine thread ", shard_index, "'s queue is full (", queue_capacity_,
          " tasks): the engine is behind; retry later"));
    }
    was_empty = shard.queue.empty();
    shard.queue.push_back(task);
  }
  if (was_empty) shard.ready.notify_one();
  return absl::OkStatus();
}

int64_t StepExecutor::QueuedTasks() const {
  int64_t queued = 0;
  for (const auto& shard : shards_) {
    ReaderMutexLock lock(&shard->mu);
    queued += static_cast<int64_t>(shard->queue.size());
  }
  return queued;
}

void StepExecutor::Run(int32_t index) {
  // A device stream of this thread's own: its steps never wait behind another thread's.
  kernels::SetThreadStreamLane(kernels::EngineThreadStreamLane(index));
  Shard& shard = *shards_[static_cast<size_t>(index)];
  std::vector<Task> batch;
  while (true) {
    {
      MutexLock lock(&shard.mu);
      while (shard.queue.empty() && !shard.stopping) shard.mu.Wait(&shard.ready);
      if (shard.queue.empty()) return;  // stopping, and everything posted has run
      batch.swap(shard.queue);
    }
    for (const Task& task : batch) task.run(task.context, index);
    batch.clear();
  }
}

}  // namespace kvcm

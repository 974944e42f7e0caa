#include "kernels/block_cache.h"

#include <bit>
#include <cstdio>
#include <cstdlib>

namespace kvcm::kernels {

BlockCache::BlockCache(AllocateFn allocate, FreeFn free, size_t max_cached_bytes)
    : allocate_(allocate), free_(free), max_cached_bytes_(max_cached_bytes) {}

BlockCache::~BlockCache() {
  for (std::vector<void*>& blocks : cached_) {
    for (void* block : blocks) free_(block);
  }
}

size_t BlockCache::BlockBytes(size_t bytes) {
  return std::bit_ceil(bytes < 256 ? size_t{256} : bytes);
}

int BlockCache::ClassOf(size_t block_bytes) { return std::countr_zero(block_bytes); }

absl::Status BlockCache::Allocate(size_t bytes, void** ptr) {
  *ptr = nullptr;
  const size_t block_bytes = BlockBytes(bytes);
  if (block_bytes == 0) {  // bit_ceil overflowed: no block is that large
    return absl::ResourceExhaustedError("a block of more than half the address space");
  }
  std::vector<void*>& cached = cached_[ClassOf(block_bytes)];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cached.empty()) {
      *ptr = cached.back();
      cached.pop_back();
      stats_.cached_bytes -= block_bytes;
      stats_.live_bytes += block_bytes;
      live_.emplace(*ptr, block_bytes);
      return absl::OkStatus();
    }
  }
  // Outside the lock: the underlying allocator may be slow (it may wait for a device).
  void* block = nullptr;
  absl::Status made = allocate_(block_bytes, &block);
  if (!made.ok()) return made;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.allocator_calls;
  stats_.live_bytes += block_bytes;
  live_.emplace(block, block_bytes);
  *ptr = block;
  return absl::OkStatus();
}

void BlockCache::Release(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = live_.find(ptr);
    if (it == live_.end()) {  // a caller's bug: freeing it would corrupt the allocator
      std::fprintf(stderr, "BlockCache::Release of %p, which it did not hand out\n", ptr);
      std::abort();
    }
    const size_t block_bytes = it->second;
    live_.erase(it);
    stats_.live_bytes -= block_bytes;
    if (stats_.cached_bytes + block_bytes <= max_cached_bytes_) {
      cached_[ClassOf(block_bytes)].push_back(ptr);
      stats_.cached_bytes += block_bytes;
      return;
    }
    ++stats_.free_calls;
  }
  free_(ptr);
}

BlockCache::Stats BlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kvcm::kernels

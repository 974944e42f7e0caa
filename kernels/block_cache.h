// BlockCache: memory blocks kept for reuse, so that allocating and freeing them does not
// reach an expensive allocator each time. The CUDA backend keeps its pinned host staging
// here: cudaMallocHost and cudaFreeHost synchronize the device (and can stall an NCCL
// group), and a sequence's staging arrays grow with its cache on the step path.
//
//   BlockCache cache(&PinnedAllocate, &PinnedFree, /*max_cached_bytes=*/64 << 20);
//   void* p = nullptr;
//   RETURN_IF_ERROR(cache.Allocate(1000, &p));  // a 1024-byte block
//   cache.Release(p);                           // kept for the next Allocate of <= 1024
//
// Blocks come in size classes (powers of two from 256 bytes), so a released block serves
// any later request of its class. Released blocks are kept while the cache holds at most
// `max_cached_bytes` of them; a release beyond that frees the block for real, so what the
// cache holds on top of the live blocks is bounded. Thread-safe.
#ifndef KVCM_KERNELS_BLOCK_CACHE_H_
#define KVCM_KERNELS_BLOCK_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"

namespace kvcm::kernels {

class BlockCache {
 public:
  using AllocateFn = absl::Status (*)(size_t bytes, void** ptr);
  using FreeFn = void (*)(void* ptr);

  BlockCache(AllocateFn allocate, FreeFn free, size_t max_cached_bytes);
  // Frees the cached blocks. REQUIRES: every block was released.
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block of at least `bytes` (of BlockBytes(bytes)): a cached one of that class, or a
  // new one from the underlying allocator (whose error is returned as it is).
  absl::Status Allocate(size_t bytes, void** ptr);
  // Gives back a block of Allocate; nullptr is ignored.
  void Release(void* ptr);

  // The size class of a request: the smallest power of two >= max(bytes, 256).
  static size_t BlockBytes(size_t bytes);

  struct Stats {
    int64_t allocator_calls = 0;  // blocks the underlying allocator made
    int64_t free_calls = 0;       // blocks given back to it
    size_t live_bytes = 0;        // in blocks handed out and not released
    size_t cached_bytes = 0;      // in released blocks kept for reuse
  };
  Stats stats() const;

 private:
  static constexpr int kClasses = 64;
  static int ClassOf(size_t block_bytes);

  const AllocateFn allocate_;
  const FreeFn free_;
  const size_t max_cached_bytes_;
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> live_;      // block -> its bytes
  std::vector<void*> cached_[kClasses];         // released blocks, by class
  Stats stats_;
};

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_BLOCK_CACHE_H_

// The sizes of device memory exported by CUDA IPC handle. cudaIpcGetMemHandle names the
// allocator's whole underlying allocation, not the range cudaMalloc returned: a small
// cudaMalloc sits inside a larger block with its neighbours (another tenant's score region,
// the engine's arrays), and a worker that opens the handle reaches all of them. Allocations
// of whole 2 MiB units (the granularity of the device's large pages and of IPC mappings)
// get a block of their own, so every exported allocation is rounded up to one, and the
// rounded size is what is charged against the limits: the accounting then counts the
// memory the device gave. Pure functions; no CUDA needed (the CPU build tests them).
#ifndef KVCM_CACHE_MANAGER_KV_IPC_EXPORT_SIZE_H_
#define KVCM_CACHE_MANAGER_KV_IPC_EXPORT_SIZE_H_

#include <cstdint>

namespace kvcm {

inline constexpr int64_t kCudaIpcGranularity = int64_t{2} << 20;

// `bytes` (>= 1) rounded up to whole IPC units: what an exported allocation of `bytes`
// takes. 0 when the rounding would overflow int64 (no device has that much memory; the
// caller refuses the size).
constexpr int64_t CudaIpcAllocationBytes(int64_t bytes) {
  if (bytes > INT64_MAX - (kCudaIpcGranularity - 1)) return 0;
  return (bytes + kCudaIpcGranularity - 1) / kCudaIpcGranularity * kCudaIpcGranularity;
}

// The part of a memory cap that exported allocations can use: `cap` rounded down to whole
// IPC units, so that an allocation sized within it, once rounded up, still fits the cap.
constexpr int64_t CudaIpcUsableCap(int64_t cap) {
  return cap <= 0 ? 0 : cap / kCudaIpcGranularity * kCudaIpcGranularity;
}

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_IPC_EXPORT_SIZE_H_

#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/block_cache.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/kv_compaction_cuda.h"
#include "kernels/cuda/momentum_update_cuda.h"
#include "kernels/cuda/score_validation_cuda.h"
#include "kernels/cuda/selection_cuda.h"
#include "kernels/cuda/span_pool_cuda.h"
#include "kernels/cuda/token_arrays_cuda.h"
#include "kernels/stream_lanes.h"

namespace kvcm::kernels::cuda {

// The compile-time parity of the twins: every CUDA kernel has exactly the CPU reference's
// signature (same parameters, same types, same order).
#define KVCM_CHECK_CUDA_SIGNATURE(kernel, entry)                                    \
  static_assert(std::is_same_v<decltype(&cuda::kernel), decltype(&cpu::kernel)>, \
                "kernels::cuda::" #kernel " must have the signature of kernels::cpu::" #kernel);
KVCM_KERNEL_ENTRIES(KVCM_CHECK_CUDA_SIGNATURE)
#undef KVCM_CHECK_CUDA_SIGNATURE

namespace {

absl::Status SetDevice(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return absl::OkStatus();
  return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

// The memory pool of a device, set up once: what the runtime frees into it is kept for
// reuse (release threshold: no limit) instead of going back to the driver at the next
// synchronize, so that a sequence's arrays can grow on the step path without a driver
// allocation. What it keeps is bounded by the peak the engine's byte budgets allow.
struct DevicePools {
  std::mutex mu;
  std::vector<int8_t> state;  // by device: 0 unknown, 1 pools, -1 no pools (cudaMalloc)
};

DevicePools& Pools() {
  static DevicePools* const pools = new DevicePools;  // never destroyed: used until exit
  return *pools;
}

// Whether `device` allocates from its memory pool; sets the pool up on first use.
absl::StatusOr<bool> UsesMemoryPool(int device) {
  DevicePools& pools = Pools();
  std::lock_guard<std::mutex> lock(pools.mu);
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device));
  if (static_cast<size_t>(device) >= pools.state.size()) {
    pools.state.resize(static_cast<size_t>(device) + 1, 0);
  }
  int8_t& state = pools.state[static_cast<size_t>(device)];
  if (state != 0) return state > 0;
  int supported = 0;
  absl::Status status = CudaStatus(
      cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device),
      absl::StrCat("cudaDeviceGetAttribute(MemoryPoolsSupported) of device ", device));
  if (!status.ok()) return status;
  if (supported != 0) {
    cudaMemPool_t pool = nullptr;
    status = CudaStatus(cudaDeviceGetDefaultMemPool(&pool, device),
                        absl::StrCat("cudaDeviceGetDefaultMemPool of device ", device));
    uint64_t keep_everything = UINT64_MAX;
    if (status.ok()) {
      status = CudaStatus(
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
          absl::StrCat("setting the release threshold of device ", device, "'s memory pool"));
    }
    if (!status.ok()) return status;
  }
  state = supported != 0 ? 1 : -1;
  return state > 0;
}

absl::Status Allocate(size_t bytes, StreamHandle stream, void** ptr) {
  *ptr = nullptr;
  int device = -1;
  const absl::Status current = CudaStatus(cudaGetDevice(&device), "cudaGetDevice");
  if (!current.ok()) return current;
  const absl::StatusOr<bool> pooled = UsesMemoryPool(device);
  if (!pooled.ok()) return pooled.status();
  const size_t size = bytes == 0 ? 1 : bytes;
  if (*pooled) {
    return CudaStatus(cudaMallocAsync(ptr, size, static_cast<cudaStream_t>(stream)),
                      absl::StrCat("cudaMallocAsync of ", bytes, " bytes"));
  }
  // A device without memory pools: the synchronous allocator, outside any NCCL group.
  std::lock_guard<std::mutex> lock(SynchronizingCallMutex());
  return CudaStatus(cudaMalloc(ptr, size), absl::StrCat("cudaMalloc of ", bytes, " bytes"));
}

void Release(void* ptr, StreamHandle stream) {
  if (ptr == nullptr) return;
  int device = -1;
  const absl::StatusOr<bool> pooled =
      cudaGetDevice(&device) == cudaSuccess ? UsesMemoryPool(device) : absl::StatusOr<bool>(false);
  if (pooled.ok() && *pooled) {
    cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));
    return;
  }
  std::lock_guard<std::mutex> lock(SynchronizingCallMutex());
  cudaFree(ptr);
}

absl::Status PinnedAllocate(size_t bytes, void** ptr) {
  std::lock_guard<std::mutex> lock(SynchronizingCallMutex());
  return CudaStatus(cudaMallocHost(ptr, bytes), absl::StrCat("cudaMallocHost of ", bytes, " bytes"));
}

void PinnedFree(void* ptr) {
  std::lock_guard<std::mutex> lock(SynchronizingCallMutex());
  cudaFreeHost(ptr);
}

// Pinned staging kept for reuse, up to 64 MiB beyond the blocks in use: a sequence's
// staging grows and shrinks with its cache, and each cudaMallocHost/cudaFreeHost would
// synchronize the device.
BlockCache& Staging() {
  static BlockCache* const cache = new BlockCache(&PinnedAllocate, &PinnedFree, size_t{64} << 20);
  return *cache;
}

absl::Status AllocateStaging(size_t bytes, void** ptr) { return Staging().Allocate(bytes, ptr); }

void ReleaseStaging(void* ptr) { Staging().Release(ptr); }

absl::Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind, StreamHandle stream) {
  if (bytes == 0) return absl::OkStatus();
  const cudaMemcpyKind direction = kind == CopyKind::kHostToBackend   ? cudaMemcpyHostToDevice
                                   : kind == CopyKind::kBackendToHost ? cudaMemcpyDeviceToHost
                                                                      : cudaMemcpyDeviceToDevice;
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, direction, static_cast<cudaStream_t>(stream)),
                    "cudaMemcpyAsync");
}

// The streams of every (device, lane), made on first use and never destroyed (work may be
// queued on them until exit). Each thread keeps the handles it was given, so the step
// path takes no lock.
struct LaneStreams {
  std::mutex mu;
  std::vector<std::array<cudaStream_t, kStreamLanes>> by_device;
};

absl::Status DeviceStream(int device, StreamHandle* stream) {
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device));
  thread_local std::vector<cudaStream_t> mine;  // by device, for this thread's lane
  thread_local int mine_lane = -1;
  const int lane = ThreadStreamLane();
  if (mine_lane != lane) {  // a lane set after the first use: forget the other lane's
    mine.clear();
    mine_lane = lane;
  }
  const auto d = static_cast<size_t>(device);
  if (d < mine.size() && mine[d] != nullptr) {
    *stream = mine[d];
    return absl::OkStatus();
  }
  static LaneStreams* const all = new LaneStreams;  // never freed
  std::lock_guard<std::mutex> lock(all->mu);
  if (d >= all->by_device.size()) {
    std::array<cudaStream_t, kStreamLanes> none{};
    all->by_device.resize(d + 1, none);
  }
  cudaStream_t& s = all->by_device[d][static_cast<size_t>(lane)];
  if (s == nullptr) {
    ScopedDevice on_device(device);
    if (!on_device.status().ok()) return on_device.status();
    const absl::Status made =
        CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                   absl::StrCat("cudaStreamCreate on device ", device, " for lane ", lane));
    if (!made.ok()) {
      s = nullptr;
      return made;
    }
  }
  if (d >= mine.size()) mine.resize(d + 1, nullptr);
  mine[d] = s;
  *stream = s;
  return absl::OkStatus();
}

absl::Status Synchronize(StreamHandle stream, const char* what) {
  const absl::Status launched = LaunchStatus(what);
  const absl::Status done = SyncStatus(stream, what);
  return launched.ok() ? done : launched;
}

#define KVCM_CUDA_KERNEL_ENTRY(kernel, entry) &cuda::kernel,

constexpr KernelBackend kCuda{
    "cuda", MemorySpace::kDevice, KVCM_KERNEL_ENTRIES(KVCM_CUDA_KERNEL_ENTRY)
    BackendMemory{&SetDevice, &Allocate, &Release, &AllocateStaging, &ReleaseStaging, &Copy,
                  &DeviceStream, &Synchronize}};

#undef KVCM_CUDA_KERNEL_ENTRY

}  // namespace

const KernelBackend& CudaBackend() { return kCuda; }

}  // namespace kvcm::kernels::cuda

#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/kv_compaction_cuda.h"
#include "kernels/cuda/momentum_update_cuda.h"
#include "kernels/cuda/score_validation_cuda.h"
#include "kernels/cuda/selection_cuda.h"
#include "kernels/cuda/span_pool_cuda.h"
#include "kernels/cuda/token_arrays_cuda.h"

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

absl::Status Allocate(size_t bytes, void** ptr) {
  return CudaStatus(cudaMalloc(ptr, bytes == 0 ? 1 : bytes),
                    absl::StrCat("cudaMalloc of ", bytes, " bytes"));
}

void Release(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

absl::Status AllocateStaging(size_t bytes, void** ptr) {
  return CudaStatus(cudaMallocHost(ptr, bytes == 0 ? 1 : bytes),
                    absl::StrCat("cudaMallocHost of ", bytes, " bytes"));
}

void ReleaseStaging(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

absl::Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind, StreamHandle stream) {
  if (bytes == 0) return absl::OkStatus();
  const cudaMemcpyKind direction = kind == CopyKind::kHostToBackend   ? cudaMemcpyHostToDevice
                                   : kind == CopyKind::kBackendToHost ? cudaMemcpyDeviceToHost
                                                                      : cudaMemcpyDeviceToDevice;
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, direction, static_cast<cudaStream_t>(stream)),
                    "cudaMemcpyAsync");
}

absl::Status DeviceStream(int device, StreamHandle* stream) {
  static std::mutex mu;
  static std::vector<cudaStream_t>* streams = new std::vector<cudaStream_t>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device));
  if (static_cast<size_t>(device) >= streams->size()) {
    streams->resize(static_cast<size_t>(device) + 1, nullptr);
  }
  cudaStream_t& s = (*streams)[static_cast<size_t>(device)];
  if (s == nullptr) {
    ScopedDevice on_device(device);
    if (!on_device.status().ok()) return on_device.status();
    const absl::Status made = CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                         absl::StrCat("cudaStreamCreate on device ", device));
    if (!made.ok()) {
      s = nullptr;
      return made;
    }
  }
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

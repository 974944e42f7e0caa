// The one place where CUDA runtime results become absl::Status. Kernel launchers only
// enqueue work and leave failures in the runtime's per-thread last error; callers that
// own a step (pools, the NCCL join, tests, benchmarks) turn them into errors here:
//
//   kernels::cuda::UpdateMomentum(...);
//   RETURN_IF_ERROR(kernels::cuda::LaunchStatus("UpdateMomentum"));
//
// Failures are INTERNAL with the runtime's own words, e.g.
// "UpdateMomentum: cudaErrorInvalidDevicePointer: invalid device pointer".
// Thread-safe (the CUDA runtime's error state is per host thread).
#ifndef KVCM_KERNELS_CUDA_CUDA_ADAPTER_H_
#define KVCM_KERNELS_CUDA_CUDA_ADAPTER_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcm::kernels::cuda {

// OK for cudaSuccess, else INTERNAL "what: cudaErrorName: description".
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// The status of the kernels launched on this thread since the last check (it clears the
// runtime's last error). Reports launch failures, not faults of kernels still running:
// synchronize the stream (SyncStatus) to see those.
absl::Status LaunchStatus(absl::string_view what);

// Waits for `stream` (a cudaStream_t; nullptr: the legacy default stream) and reports
// any failure of the work enqueued on it.
absl::Status SyncStatus(void* stream, absl::string_view what);

// CUDA devices this process can use; 0 when there is no device or no driver (not an
// error: a build with CUDA runs on machines without a GPU).
int VisibleDeviceCount();

// Makes `device` current on this thread for the guard's lifetime, then restores the
// previous one. Check status() before relying on it.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_CUDA_ADAPTER_H_

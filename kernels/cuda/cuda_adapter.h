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

#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm::kernels::cuda {

// OK for cudaSuccess, else INTERNAL "what: cudaErrorName: description". A sticky error
// (IsStickyContextError) is also recorded for StickyContextError.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// Whether `error` leaves the CUDA context unusable for good (a kernel's illegal address,
// misaligned access, trap or assert, an uncorrectable ECC or NVLink error...): every later
// call of the process fails with it, cudaGetLastError cannot clear it, and only a new
// process gets a working device again.
bool IsStickyContextError(cudaError_t error);

// The first sticky error CudaStatus (and so LaunchStatus, SyncStatus) turned into a status
// in this process, as FAILED_PRECONDITION naming it and where it was seen; OK while there
// was none. The daemon reports NOT_SERVING on it, so that it is restarted. Thread-safe.
absl::Status StickyContextError();

// Held around every call of this process that may synchronize a device to allocate or
// free memory (cudaMalloc, cudaFree, cudaMallocHost, cudaFreeHost, making an NCCL
// communicator) and around the enqueueing of an NCCL group. A call that waits for a device
// while another thread is between launching one rank's part of a group and the next can
// hang the group (NCCL's documentation warns of exactly this): with the mutex, a group is
// enqueued whole before such a call runs, or after it. The step path makes none of these
// calls (kernels/backend.h). Never held while waiting for a join to finish.
std::mutex& SynchronizingCallMutex();

// The status of the kernels launched on this thread since the last check (it clears the
// runtime's last error). Reports launch failures, not faults of kernels still running:
// synchronize the stream (SyncStatus) to see those.
absl::Status LaunchStatus(absl::string_view what);

// Waits for `stream` (a cudaStream_t; nullptr: the legacy default stream) and reports
// any failure of the work enqueued on it.
absl::Status SyncStatus(void* stream, absl::string_view what);

// CUDA devices this process can use. 0 when the machine has no GPU (or none is visible:
// cudaErrorNoDevice, e.g. CUDA_VISIBLE_DEVICES=""), which is not an error: a build with
// CUDA runs on machines without one. A GPU the runtime cannot use is an error, not 0:
// INTERNAL with the runtime's words when the driver is missing or too old although the
// machine has an NVIDIA GPU, or on any other failure, so that GPU tests fail there
// instead of skipping.
absl::StatusOr<int> VisibleDeviceCount();

// The decision VisibleDeviceCount makes, as a pure function of what it observed:
// cudaGetDeviceCount's result and count, cudaDriverGetVersion's version (0: no driver
// could be loaded), and whether the machine shows an NVIDIA GPU (/proc/driver/nvidia/gpus
// or a /dev/nvidiaN node).
absl::StatusOr<int> ClassifyDeviceCount(cudaError_t error, int count, int driver_version,
                                        bool gpu_present);

// Whether the machine shows an NVIDIA GPU to the operating system (driver loaded or
// device nodes present), whatever the CUDA runtime makes of it.
bool NvidiaGpuPresent();

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx": a device UUID as nvidia-smi -L and
// CUDA_VISIBLE_DEVICES write it.
std::string FormatDeviceUuid(const cudaUUID_t& uuid);

// What ScopedDevice does, as a pure function of what the thread had when it was made:
// whether a CUDA context was current (`had_context`), the device the runtime reported
// (`previous`; without a context that is only the runtime's choice for the next call,
// 0 by default, not a GPU this thread uses) and the device asked for.
//   - switch: cudaSetDevice(device) now; never when previous == device (the call would
//     do nothing but, since CUDA 12, may initialize a context).
//   - restore: put the previous context back on destruction; only when there was one.
//     Restoring a thread that had none would make device 0's context current and so
//     create one on a GPU that may belong to an inference rank.
struct DeviceSwitch {
  bool switch_device = false;
  bool restore = false;
};
DeviceSwitch PlanDeviceSwitch(bool had_context, int previous, int device);

// Makes `device` current on this thread for the guard's lifetime, then restores the
// context that was current before (exactly that context, through the driver API reached
// by cudaGetDriverEntryPointByVersion, so that this build does not link libcuda); a
// thread that had no current context keeps `device`'s (PlanDeviceSwitch). Check status()
// before relying on it.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  void* previous_context_ = nullptr;  // CUcontext current before; null: none
  bool restore_ = false;
  absl::Status status_;
};

// Whether a CUDA context is current on this thread (driver API cuCtxGetCurrent). INTERNAL
// when the driver's entry point cannot be had.
absl::StatusOr<bool> ThreadHasCurrentContext();

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_CUDA_ADAPTER_H_

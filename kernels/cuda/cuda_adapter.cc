#include "kernels/cuda/cuda_adapter.h"

#include <cuda.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace kvcm::kernels::cuda {

namespace {

// The first sticky error seen; written once, under its mutex.
struct StickyRecord {
  std::mutex mu;
  std::atomic<bool> seen{false};
  std::string message;
};

StickyRecord& Sticky() {
  static StickyRecord* const record = new StickyRecord;
  return *record;
}

}  // namespace

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), ": ",
                                     cudaGetErrorString(error));
  if (IsStickyContextError(error) && !Sticky().seen.load(std::memory_order_acquire)) {
    StickyRecord& record = Sticky();
    std::lock_guard<std::mutex> lock(record.mu);
    if (!record.seen.load(std::memory_order_relaxed)) {
      record.message = message;
      record.seen.store(true, std::memory_order_release);
    }
  }
  return absl::InternalError(message);
}

bool IsStickyContextError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
      return true;
    default:
      return false;
  }
}

absl::Status StickyContextError() {
  StickyRecord& record = Sticky();
  if (!record.seen.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(record.mu);
  return absl::FailedPreconditionError(absl::StrCat(
      "the CUDA context is unusable until the process restarts (", record.message, ")"));
}

std::mutex& SynchronizingCallMutex() {
  static std::mutex* const mu = new std::mutex;  // never destroyed: used until exit
  return *mu;
}

absl::Status LaunchStatus(absl::string_view what) {
  return CudaStatus(cudaGetLastError(), what);
}

absl::Status SyncStatus(void* stream, absl::string_view what) {
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), what);
}

absl::StatusOr<int> ClassifyDeviceCount(cudaError_t error, int count, int driver_version,
                                        bool gpu_present) {
  if (error == cudaSuccess) return count;
  if (error == cudaErrorNoDevice) return 0;
  if (error == cudaErrorInsufficientDriver && driver_version == 0 && !gpu_present) {
    return 0;  // no driver and no GPU: a machine without one
  }
  std::string why = absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(error), ": ",
                                 cudaGetErrorString(error));
  if (error == cudaErrorInsufficientDriver) {
    absl::StrAppend(&why, driver_version == 0
                              ? " (an NVIDIA GPU is present but no CUDA driver could be loaded)"
                              : absl::StrCat(" (driver supports CUDA ", driver_version / 1000,
                                             ".", (driver_version % 1000) / 10,
                                             ", this build needs ", CUDART_VERSION / 1000,
                                             ".", (CUDART_VERSION % 1000) / 10, ")"));
  }
  return absl::InternalError(why);
}

bool NvidiaGpuPresent() {
  std::error_code ignored;
  const std::filesystem::path gpus("/proc/driver/nvidia/gpus");
  if (std::filesystem::is_directory(gpus, ignored) &&
      std::filesystem::directory_iterator(gpus, ignored) != std::filesystem::directory_iterator()) {
    return true;
  }
  for (int i = 0; i < 16; ++i) {
    if (std::filesystem::exists(absl::StrCat("/dev/nvidia", i), ignored)) return true;
  }
  return false;
}

absl::StatusOr<int> VisibleDeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaSuccess) return count;
  cudaGetLastError();  // clear it so that later checks start clean
  int driver_version = 0;
  if (cudaDriverGetVersion(&driver_version) != cudaSuccess) driver_version = 0;
  return ClassifyDeviceCount(error, count, driver_version, NvidiaGpuPresent());
}

std::string FormatDeviceUuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof(text),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return text;
}

namespace {

// The two driver calls ScopedDevice needs, found once through the runtime: linking
// libcuda would stop every binary from starting on a machine without a driver.
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
using CtxSetCurrentFn = CUresult (*)(CUcontext);

struct DriverContextCalls {
  CtxGetCurrentFn get = nullptr;
  CtxSetCurrentFn set = nullptr;
  absl::Status status;
};

const DriverContextCalls& ContextCalls() {
  static const DriverContextCalls* const calls = [] {
    auto* found = new DriverContextCalls;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult get_found = cudaDriverEntryPointSymbolNotFound;
    cudaDriverEntryPointQueryResult set_found = cudaDriverEntryPointSymbolNotFound;
    found->status = CudaStatus(cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 4000,
                                                                cudaEnableDefault, &get_found),
                               "cudaGetDriverEntryPointByVersion(cuCtxGetCurrent)");
    if (found->status.ok()) {
      found->status = CudaStatus(cudaGetDriverEntryPointByVersion(
                                     "cuCtxSetCurrent", &set, 4000, cudaEnableDefault, &set_found),
                                 "cudaGetDriverEntryPointByVersion(cuCtxSetCurrent)");
    }
    if (found->status.ok() &&
        (get_found != cudaDriverEntryPointSuccess || set_found != cudaDriverEntryPointSuccess)) {
      found->status = absl::InternalError("the CUDA driver lacks cuCtxGetCurrent/cuCtxSetCurrent");
    }
    if (found->status.ok()) {
      found->get = reinterpret_cast<CtxGetCurrentFn>(get);
      found->set = reinterpret_cast<CtxSetCurrentFn>(set);
    } else {
      cudaGetLastError();  // leave no error behind for the caller's next check
    }
    return found;
  }();
  return *calls;
}

absl::StatusOr<CUcontext> CurrentContext() {
  const DriverContextCalls& calls = ContextCalls();
  if (!calls.status.ok()) return calls.status;
  CUcontext context = nullptr;
  const CUresult result = calls.get(&context);
  if (result != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuCtxGetCurrent: CUresult ", static_cast<int>(result)));
  }
  return context;
}

}  // namespace

DeviceSwitch PlanDeviceSwitch(bool had_context, int previous, int device) {
  DeviceSwitch plan;
  plan.switch_device = previous != device;
  plan.restore = plan.switch_device && had_context;
  return plan;
}

absl::StatusOr<bool> ThreadHasCurrentContext() {
  absl::StatusOr<CUcontext> context = CurrentContext();
  if (!context.ok()) return context.status();
  return *context != nullptr;
}

ScopedDevice::ScopedDevice(int device) {
  status_ = CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice");
  if (!status_.ok()) return;
  absl::StatusOr<CUcontext> context = CurrentContext();
  if (!context.ok()) {
    status_ = context.status();
    return;
  }
  previous_context_ = *context;
  const DeviceSwitch plan = PlanDeviceSwitch(previous_context_ != nullptr, previous_, device);
  if (!plan.switch_device) return;
  status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  restore_ = status_.ok() && plan.restore;
}

ScopedDevice::~ScopedDevice() {
  if (restore_) ContextCalls().set(static_cast<CUcontext>(previous_context_));
}

}  // namespace kvcm::kernels::cuda

#include "kernels/cuda/cuda_adapter.h"

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace kvcm::kernels::cuda {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), ": ",
                                          cudaGetErrorString(error)));
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

ScopedDevice::ScopedDevice(int device) {
  status_ = CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice");
  if (status_.ok() && previous_ != device) {
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
}

ScopedDevice::~ScopedDevice() {
  if (status_.ok()) cudaSetDevice(previous_);
}

}  // namespace kvcm::kernels::cuda

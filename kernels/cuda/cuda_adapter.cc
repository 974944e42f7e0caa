#include "kernels/cuda/cuda_adapter.h"

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

int VisibleDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear it so later checks start clean
    return 0;
  }
  return count;
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

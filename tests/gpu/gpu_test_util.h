// Helpers for the GPU tests: skipping without a device, and device arrays that copy to
// and from host vectors. Failures of the CUDA runtime are reported as test failures.
#ifndef KVCM_TESTS_GPU_GPU_TEST_UTIL_H_
#define KVCM_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_adapter.h"

// Skips the test when this machine has no GPU (CI without one), and FAILS it when the
// machine has one the runtime cannot use (a broken or missing driver must not pass as
// "no GPU"; see kernels::cuda::VisibleDeviceCount).
#define KVCM_SKIP_WITHOUT_GPU()                                                     \
  do {                                                                              \
    const ::absl::StatusOr<int> kvcm_devices_ = ::kvcm::kernels::cuda::VisibleDeviceCount(); \
    ASSERT_TRUE(kvcm_devices_.ok()) << kvcm_devices_.status();                      \
    if (*kvcm_devices_ == 0) GTEST_SKIP() << "no CUDA device on this machine";      \
  } while (0)


// Fails the test (and returns) when a CUDA call fails.
#define KVCM_ASSERT_CUDA(expr)                                                        \
  do {                                                                                \
    const ::absl::Status kvcm_cuda_status_ = ::kvcm::kernels::cuda::CudaStatus((expr), #expr); \
    ASSERT_TRUE(kvcm_cuda_status_.ok()) << kvcm_cuda_status_;                         \
  } while (0)

// Waits for the default stream and fails the test on any error of the work before it.
#define KVCM_ASSERT_KERNELS_OK(what)                                                  \
  do {                                                                                \
    const ::absl::Status kvcm_launch_ = ::kvcm::kernels::cuda::LaunchStatus(what);    \
    ASSERT_TRUE(kvcm_launch_.ok()) << kvcm_launch_;                                   \
    const ::absl::Status kvcm_sync_ = ::kvcm::kernels::cuda::SyncStatus(nullptr, what); \
    ASSERT_TRUE(kvcm_sync_.ok()) << kvcm_sync_;                                       \
  } while (0)

namespace kvcm::testing {

// The number of usable devices, or 0 after failing the test on a broken driver.
inline int GpuCountOrFail() {
  const absl::StatusOr<int> devices = kernels::cuda::VisibleDeviceCount();
  EXPECT_TRUE(devices.ok()) << devices.status();
  return devices.ok() ? *devices : 0;
}

// `n` elements of T in device memory on the current device, freed on destruction.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    const cudaError_t error = cudaMalloc(reinterpret_cast<void**>(&data_), (n == 0 ? 1 : n) * sizeof(T));
    if (error != cudaSuccess) {
      ADD_FAILURE() << kernels::cuda::CudaStatus(error, "cudaMalloc");
      data_ = nullptr;
    }
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  size_t size() const { return n_; }

  // Waits for the copy to land: a pageable cudaMemcpy may return before its DMA is done,
  // and kernels on a non-blocking stream are not ordered after the legacy stream.
  void Upload(const std::vector<T>& host) {
    EXPECT_EQ(host.size(), n_);
    cudaError_t error =
        cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    if (error == cudaSuccess) error = cudaDeviceSynchronize();
    EXPECT_EQ(error, cudaSuccess) << kernels::cuda::CudaStatus(error, "upload");
  }
  // Waits for every stream first (work on a non-blocking stream is not ordered before
  // the legacy stream's copy).
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    cudaError_t error = cudaDeviceSynchronize();
    if (error == cudaSuccess) {
      error = cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    }
    EXPECT_EQ(error, cudaSuccess) << kernels::cuda::CudaStatus(error, "download");
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t n_;
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_GPU_GPU_TEST_UTIL_H_

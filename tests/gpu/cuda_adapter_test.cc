// The CUDA status adapter and the device count need no device: they run (and must pass)
// everywhere. The count's classification is tested on the errors a machine can give; the
// real count must be OK here, and equal KVCM_EXPECT_GPUS when tests/gpu/run.sh sets it
// (from nvidia-smi), and be at least 1 where the kernel shows a GPU and
// CUDA_VISIBLE_DEVICES hides none, so that a broken driver cannot pass as "no GPU".
#include "kernels/cuda/cuda_adapter.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace kvcm::kernels::cuda {
namespace {

TEST(CudaAdapterTest, SuccessIsOk) { EXPECT_TRUE(CudaStatus(cudaSuccess, "anything").ok()); }

TEST(CudaAdapterTest, AnErrorIsInternalWithTheRuntimeMessage) {
  const absl::Status status = CudaStatus(cudaErrorInvalidValue, "UpdateMomentum");
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(),
            std::string("UpdateMomentum: cudaErrorInvalidValue: ") +
                cudaGetErrorString(cudaErrorInvalidValue));
}

TEST(DeviceCountTest, NoDeviceAndNoDriverWithoutAGpuAreZero) {
  EXPECT_EQ(*ClassifyDeviceCount(cudaErrorNoDevice, 0, 13000, /*gpu_present=*/true), 0);
  EXPECT_EQ(*ClassifyDeviceCount(cudaErrorNoDevice, 0, 0, false), 0);
  EXPECT_EQ(*ClassifyDeviceCount(cudaErrorInsufficientDriver, -1, 0, false), 0);
  EXPECT_EQ(*ClassifyDeviceCount(cudaSuccess, 8, 13000, true), 8);
}

TEST(DeviceCountTest, AGpuTheRuntimeCannotUseIsAnError) {
  // The driver library is missing although the kernel shows a GPU.
  const absl::StatusOr<int> no_library = ClassifyDeviceCount(cudaErrorInsufficientDriver, -1, 0, true);
  ASSERT_FALSE(no_library.ok());
  EXPECT_EQ(no_library.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(no_library.status().message().find("no CUDA driver could be loaded"),
            std::string::npos)
      << no_library.status();
  // A driver older than the runtime.
  const absl::StatusOr<int> old = ClassifyDeviceCount(cudaErrorInsufficientDriver, -1, 12020, true);
  ASSERT_FALSE(old.ok());
  EXPECT_NE(old.status().message().find("driver supports CUDA 12.2"), std::string::npos)
      << old.status();
  // Anything else the runtime says is a failure, never "0 devices".
  for (cudaError_t error : {cudaErrorInitializationError, cudaErrorSystemDriverMismatch,
                            cudaErrorDevicesUnavailable, cudaErrorUnknown}) {
    EXPECT_FALSE(ClassifyDeviceCount(error, 0, 13000, true).ok()) << cudaGetErrorName(error);
    EXPECT_FALSE(ClassifyDeviceCount(error, 0, 0, false).ok()) << cudaGetErrorName(error);
  }
}

TEST(DeviceCountTest, ThisMachinesCountIsReadWithoutError) {
  const absl::StatusOr<int> count = VisibleDeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  if (const char* expected = std::getenv("KVCM_EXPECT_GPUS"); expected != nullptr && *expected) {
    EXPECT_EQ(*count, std::atoi(expected)) << "nvidia-smi and the CUDA runtime disagree";
  } else if (!NvidiaGpuPresent()) {
    EXPECT_EQ(*count, 0) << "no NVIDIA GPU is visible to the kernel, yet CUDA counts some";
  } else if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible == nullptr) {
    // A GPU the kernel shows and nothing hides from the runtime: it must count it, or a
    // broken runtime would pass as "no GPU" and every GPU test would skip.
    EXPECT_GE(*count, 1) << "the kernel shows an NVIDIA GPU, yet CUDA counts none";
  }
}

}  // namespace
}  // namespace kvcm::kernels::cuda

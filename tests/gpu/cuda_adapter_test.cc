// The CUDA status adapter and the device count need no device: they run (and must pass)
// everywhere. The count's classification is tested on the errors a machine can give; the
// real count must be OK here, and equal KVCM_EXPECT_GPUS when tests/gpu/run.sh sets it
// (from nvidia-smi), and be at least 1 where the kernel shows a GPU and
// CUDA_VISIBLE_DEVICES hides none, so that a broken driver cannot pass as "no GPU".
// Sticky context errors are recorded for the daemon's health. ScopedDevice's plan is a
// pure function tested everywhere; the guard itself on a GPU:
// a thread without a context is left on the device it asked for (no context made on
// device 0), one with a context gets it back.
#include "kernels/cuda/cuda_adapter.h"

#include <cuda.h>

#include <cstdlib>
#include <string>
#include <thread>

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

TEST(StickyContextErrorTest, OnlyErrorsThatSpoilTheContextAreSticky) {
  for (cudaError_t error : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
                            cudaErrorMisalignedAddress, cudaErrorECCUncorrectable}) {
    EXPECT_TRUE(IsStickyContextError(error)) << cudaGetErrorName(error);
  }
  for (cudaError_t error : {cudaSuccess, cudaErrorInvalidValue, cudaErrorMemoryAllocation,
                            cudaErrorNotReady, cudaErrorNoDevice, cudaErrorInvalidDevice}) {
    EXPECT_FALSE(IsStickyContextError(error)) << cudaGetErrorName(error);
  }
}

// Process-wide state: nothing else in this binary reports a sticky error.
TEST(StickyContextErrorTest, TheFirstStickyErrorIsKeptForTheDaemonsHealth) {
  EXPECT_TRUE(StickyContextError().ok());
  EXPECT_FALSE(CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc").ok());
  EXPECT_TRUE(StickyContextError().ok()) << "an out-of-memory error is not sticky";
  EXPECT_FALSE(CudaStatus(cudaErrorIllegalAddress, "UpdateMomentum").ok());
  EXPECT_FALSE(CudaStatus(cudaErrorLaunchFailure, "SelectTopK").ok());
  const absl::Status sticky = StickyContextError();
  EXPECT_EQ(sticky.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(sticky.message().find("UpdateMomentum: cudaErrorIllegalAddress"), std::string::npos)
      << sticky;
  EXPECT_EQ(sticky.message().find("SelectTopK"), std::string::npos) << "the first one is kept";
}

TEST(ScopedDeviceTest, RestoresOnlyAThreadThatHadAContext) {
  // No context: switch, and keep the device (restoring would make device 0 current and
  // create a context there).
  EXPECT_TRUE(PlanDeviceSwitch(false, 0, 3).switch_device);
  EXPECT_FALSE(PlanDeviceSwitch(false, 0, 3).restore);
  // A context on another device: switch and restore it.
  EXPECT_TRUE(PlanDeviceSwitch(true, 1, 3).switch_device);
  EXPECT_TRUE(PlanDeviceSwitch(true, 1, 3).restore);
  // Already there: nothing to do, with or without a context.
  for (bool had_context : {false, true}) {
    EXPECT_FALSE(PlanDeviceSwitch(had_context, 2, 2).switch_device);
    EXPECT_FALSE(PlanDeviceSwitch(had_context, 2, 2).restore);
  }
}

int DeviceCountOrZero() {
  const absl::StatusOr<int> count = VisibleDeviceCount();
  return count.ok() ? *count : 0;
}

// Whether device 0's primary context is active in this process (driver API through the
// runtime, as cuda_adapter.cc does; this test does not link libcuda either).
bool DeviceZeroContextActive() {
  using PrimaryCtxGetStateFn = CUresult (*)(CUdevice, unsigned int*, int*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 7000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    std::abort();
  }
  unsigned int flags = 0;
  int active = 0;
  if (reinterpret_cast<PrimaryCtxGetStateFn>(fn)(0, &flags, &active) != CUDA_SUCCESS) std::abort();
  return active != 0;
}

TEST(ScopedDeviceTest, AThreadWithoutAContextMakesNoneOnDeviceZero) {
  const int devices = DeviceCountOrZero();
  if (devices == 0) GTEST_SKIP() << "no CUDA device on this machine";
  if (devices < 2) GTEST_SKIP() << "needs 2 GPUs (a guard for device 1 must not touch device 0)";
  // In a fresh process (the threadsafe death-test style re-runs this binary), where no
  // context exists yet: a guard for the last device on a new thread must leave device 0
  // without a context.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        bool ok = !DeviceZeroContextActive();
        std::thread([&] {
          const absl::StatusOr<bool> before = ThreadHasCurrentContext();
          ok = ok && before.ok() && !*before;
          {
            ScopedDevice on(devices - 1);
            ok = ok && on.status().ok();
            ok = ok && cudaFree(nullptr) == cudaSuccess;  // makes the context of devices - 1
          }
          int now = -1;
          ok = ok && cudaGetDevice(&now) == cudaSuccess && now == devices - 1;
          const absl::StatusOr<bool> after = ThreadHasCurrentContext();
          ok = ok && after.ok() && *after;
        }).join();
        std::exit(ok && !DeviceZeroContextActive() ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ScopedDeviceTest, AThreadWithAContextGetsItBack) {
  const int devices = DeviceCountOrZero();
  if (devices == 0) GTEST_SKIP() << "no CUDA device on this machine";
  std::thread([&] {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // device 0's context, current
    const absl::StatusOr<bool> before = ThreadHasCurrentContext();
    ASSERT_TRUE(before.ok() && *before) << before.status();
    {
      ScopedDevice on(devices - 1);
      ASSERT_TRUE(on.status().ok()) << on.status();
      int inside = -1;
      ASSERT_EQ(cudaGetDevice(&inside), cudaSuccess);
      EXPECT_EQ(inside, devices - 1);
    }
    int after = -1;
    ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
    EXPECT_EQ(after, 0);
    const absl::StatusOr<bool> restored = ThreadHasCurrentContext();
    EXPECT_TRUE(restored.ok() && *restored) << restored.status();
  }).join();
}

}  // namespace
}  // namespace kvcm::kernels::cuda

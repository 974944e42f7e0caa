// The CUDA status adapter needs no device: it runs (and must pass) everywhere.
#include "kernels/cuda/cuda_adapter.h"

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

TEST(CudaAdapterTest, DeviceCountIsZeroOrMoreWithoutFailing) {
  EXPECT_GE(VisibleDeviceCount(), 0);
}

}  // namespace
}  // namespace kvcm::kernels::cuda

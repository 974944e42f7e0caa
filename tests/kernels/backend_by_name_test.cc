// BackendByName: every name of kernels/backend_by_name.h, and the refusals.
#include "kernels/backend_by_name.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::kernels {
namespace {

using ::testing::HasSubstr;

TEST(BackendByNameTest, HostNamesGiveTheirTablesOnAnyDevice) {
  for (int device : {0, 7}) {
    absl::StatusOr<const KernelBackend*> cpu = BackendByName("cpu", device);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    EXPECT_EQ(*cpu, &CpuBackend());
    absl::StatusOr<const KernelBackend*> emulated = BackendByName("emulated", device);
    ASSERT_TRUE(emulated.ok()) << emulated.status();
    EXPECT_EQ(*emulated, &EmulatedDeviceBackend());
  }
}

TEST(BackendByNameTest, UnknownNameIsRefusedListingTheNames) {
  absl::StatusOr<const KernelBackend*> got = BackendByName("gpu", 0);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("'gpu'"));
  EXPECT_THAT(got.status().message(), HasSubstr("cpu, cuda, emulated, auto"));
}

TEST(BackendByNameTest, EveryListedNameIsKnown) {
  for (absl::string_view name : BackendNames()) {
    EXPECT_NE(BackendByName(name, 0).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
}

// cuda either gives the CUDA table (a GPU is visible) or says why not; it never falls
// back to the CPU. auto falls back exactly when cuda is absent.
TEST(BackendByNameTest, CudaNeverFallsBackAndAutoDoes) {
  absl::StatusOr<const KernelBackend*> cuda = BackendByName("cuda", 0);
  absl::StatusOr<const KernelBackend*> automatic = BackendByName("auto", 0);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  if (cuda.ok()) {
    EXPECT_STREQ((*cuda)->name, "cuda");
    EXPECT_EQ(*automatic, *cuda);
  } else {
    EXPECT_THAT(cuda.status().code(), ::testing::AnyOf(absl::StatusCode::kUnimplemented,
                                                       absl::StatusCode::kUnavailable));
    EXPECT_EQ(*automatic, &CpuBackend());
  }
}

TEST(BackendByNameTest, CudaRefusesADeviceThatIsNotVisible) {
  absl::StatusOr<const KernelBackend*> got = BackendByName("cuda", 1 << 20);
  EXPECT_FALSE(got.ok());
  EXPECT_NE(got.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm::kernels

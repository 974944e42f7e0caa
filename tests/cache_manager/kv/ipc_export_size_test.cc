// The sizes of memory exported by CUDA IPC handle (cache_manager/kv/ipc_export_size.h):
// every exported allocation is whole 2 MiB units, a pool's cap is counted in whole units,
// and a created score region is charged what its allocation took, not what was asked.
// Needs no GPU: the region's allocator here rounds host memory the way NewCudaKvStorage
// rounds device memory.
#include "cache_manager/kv/ipc_export_size.h"

#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/kv/kv_storage.h"
#include "cache_manager/kv/score_regions.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

constexpr int64_t kUnit = int64_t{2} << 20;

TEST(IpcExportSizeTest, AnAllocationIsRoundedUpToWholeTwoMebibyteUnits) {
  EXPECT_EQ(kCudaIpcGranularity, kUnit);
  EXPECT_EQ(CudaIpcAllocationBytes(1), kUnit);
  EXPECT_EQ(CudaIpcAllocationBytes(4096), kUnit);
  EXPECT_EQ(CudaIpcAllocationBytes(kUnit - 1), kUnit);
  EXPECT_EQ(CudaIpcAllocationBytes(kUnit), kUnit);
  EXPECT_EQ(CudaIpcAllocationBytes(kUnit + 1), 2 * kUnit);
  EXPECT_EQ(CudaIpcAllocationBytes(int64_t{5} << 30), int64_t{5} << 30);
  EXPECT_EQ(CudaIpcAllocationBytes(INT64_MAX), 0) << "overflow is refused, not wrapped";
}

TEST(IpcExportSizeTest, APoolsCapCountsOnlyWholeUnits) {
  EXPECT_EQ(CudaIpcUsableCap(0), 0);
  EXPECT_EQ(CudaIpcUsableCap(kUnit - 1), 0);
  EXPECT_EQ(CudaIpcUsableCap(kUnit), kUnit);
  EXPECT_EQ(CudaIpcUsableCap(3 * kUnit + 12345), 3 * kUnit);
  // Any allocation within the usable cap, rounded up, stays within the cap.
  for (int64_t cap : {kUnit, 3 * kUnit + 1, (int64_t{40} << 30) + 7}) {
    for (int64_t bytes : {int64_t{1}, CudaIpcUsableCap(cap) - 1, CudaIpcUsableCap(cap)}) {
      EXPECT_LE(CudaIpcAllocationBytes(bytes), cap) << "cap " << cap << " bytes " << bytes;
    }
  }
}

class RoundedRegionsTest : public ::testing::Test {
 protected:
  RoundedRegionsTest() : budget_(3 * kUnit, "--score_region_bytes") {
    ScoreRegionsOptions options;
    options.allocate = [](int64_t bytes, const std::string& shm_name, int /*device*/) {
      HostStorageOptions host;
      host.shm_name = shm_name;
      return NewHostKvStorage(CudaIpcAllocationBytes(bytes), host);
    };
    options.created_budget = &budget_;
    options.created_name_prefix = absl::StrCat("/kvcm-ipc-size-test-", getpid(), "-");
    regions_ = std::make_unique<ScoreRegions>(options);
  }

  ByteBudget budget_;
  std::unique_ptr<ScoreRegions> regions_;
};

TEST_F(RoundedRegionsTest, ACreatedRegionIsChargedTheWholeUnitsItTakes) {
  absl::StatusOr<CreatedScoreRegion> first = regions_->Create("t", 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(budget_.used(), kUnit);
  EXPECT_EQ(regions_->mapped_bytes(), kUnit);
  absl::StatusOr<CreatedScoreRegion> second = regions_->Create("t", kUnit + 1);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(budget_.used(), 3 * kUnit);
  // 4096 bytes fit the limit as asked, not as taken: refused, and nothing stays charged.
  absl::StatusOr<CreatedScoreRegion> third = regions_->Create("t", 4096);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_EQ(budget_.used(), 3 * kUnit);
  EXPECT_EQ(regions_->count(), 2);
  ASSERT_TRUE(regions_->Unregister("t", first->region).ok());
  EXPECT_EQ(budget_.used(), 2 * kUnit);
  ASSERT_TRUE(regions_->Unregister("t", second->region).ok());
  EXPECT_EQ(budget_.used(), 0);
}

}  // namespace
}  // namespace kvcm

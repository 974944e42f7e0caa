// How long a created score region lives (cache_manager/kv/score_regions.h): a host one
// idle for the timeout is dropped, but device memory exported by CUDA IPC handle is not,
// since a worker may still have the handle open and the freed range would go to the next
// allocation while that worker can write it. Needs no GPU: the exported storage here is
// host memory that says it is exported by IPC, which is all ScoreRegions looks at.
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/base/clock.h"
#include "cache_manager/kv/ipc_availability.h"
#include "cache_manager/kv/kv_storage.h"
#include "cache_manager/kv/score_regions.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// Host bytes presented as device memory exported by IPC handle; counts its destruction.
class ExportedStorage final : public KvStorage {
 public:
  // `unavailable` non-empty: a GPU that cannot export (no export, that reason).
  ExportedStorage(int64_t bytes, int* freed, const std::string& unavailable = "")
      : bytes_(bytes), data_(std::aligned_alloc(256, static_cast<size_t>(bytes))), freed_(freed) {
    exported_.unavailable = unavailable;
    if (!unavailable.empty()) return;
    exported_.kind = MemoryExport::Kind::kCudaIpc;
    exported_.cuda_ipc_handle.assign(64, 'h');
    exported_.device = 0;
    exported_.bytes = bytes;
  }
  ~ExportedStorage() override {
    std::free(data_);
    ++*freed_;
  }
  MemorySpace space() const override { return MemorySpace::kDevice; }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  const MemoryExport& memory_export() const override { return exported_; }
  absl::Status CopyOut(int64_t, void*, int64_t) const override { return absl::OkStatus(); }
  absl::Status CopyIn(int64_t, const void*, int64_t) override { return absl::OkStatus(); }
  absl::Status MoveTokens(const kernels::KvBlockLayout&,
                          std::span<const kernels::KvMove>) override {
    return absl::OkStatus();
  }

 private:
  const int64_t bytes_;
  void* const data_;
  int* const freed_;
  MemoryExport exported_;
};

class ScoreRegionLifetimeTest : public ::testing::TestWithParam<bool> {
 protected:
  // Param: whether the allocator exports by IPC (a CUDA engine) or makes host shared memory.
  ScoreRegionLifetimeTest() : budget_(int64_t{1} << 20, "--max_created_score_region_bytes") {
    ScoreRegionsOptions options;
    const bool exported = GetParam();
    options.allocate = [this, exported](int64_t bytes, const std::string& shm_name,
                                        int /*device*/) -> absl::StatusOr<std::unique_ptr<KvStorage>> {
      if (exported) return std::unique_ptr<KvStorage>(new ExportedStorage(bytes, &freed_));
      HostStorageOptions host;
      host.shm_name = shm_name;
      return NewHostKvStorage(bytes, host);
    };
    options.created_in_backend = exported;
    options.created_budget = &budget_;
    options.created_name_prefix = absl::StrCat("/kvcm-lifetime-test-", getpid(), "-");
    options.clock = &clock_;
    regions_ = std::make_unique<ScoreRegions>(options);
  }

  ManualClock clock_{absl::FromUnixSeconds(1000)};
  ByteBudget budget_;
  int freed_ = 0;
  std::unique_ptr<ScoreRegions> regions_;
};

TEST_P(ScoreRegionLifetimeTest, OnlyMemoryNoOtherProcessCanMapIsDroppedForIdleness) {
  const bool exported = GetParam();
  absl::StatusOr<CreatedScoreRegion> created = regions_->Create("t", 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  clock_.Advance(absl::Minutes(11));
  EXPECT_EQ(regions_->DropIdle(absl::Minutes(10), clock_.Now()), exported ? 0 : 1);
  EXPECT_EQ(regions_->count(), exported ? 1 : 0);
  EXPECT_EQ(budget_.used(), exported ? 4096 : 0) << "a kept region stays charged";
  const absl::StatusOr<ScoreRegions::View> view = regions_->Resolve("t", {created->region, 0, 16});
  EXPECT_EQ(view.ok(), exported) << view.status();
  if (!exported) return;
  EXPECT_EQ(freed_, 0) << "device memory a worker may still map was freed";
  // Its worker unregisters it (after closing its mapping): then it goes.
  ASSERT_TRUE(regions_->Unregister("t", created->region).ok());
  EXPECT_EQ(freed_, 0) << "the View above still pins it";
}

TEST_P(ScoreRegionLifetimeTest, UnregisterFreesOnceTheLastReaderIsDone) {
  absl::StatusOr<CreatedScoreRegion> created = regions_->Create("t", 4096);
  ASSERT_TRUE(created.ok()) << created.status();
  absl::StatusOr<ScoreRegions::View> view = regions_->Resolve("t", {created->region, 0, 16});
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_TRUE(regions_->Unregister("t", created->region).ok());
  EXPECT_EQ(budget_.used(), 4096) << "a reader still holds it";
  view = absl::FailedPreconditionError("done");  // the reader lets go
  EXPECT_EQ(budget_.used(), 0);
  if (GetParam()) {
    EXPECT_EQ(freed_, 1);
  }
}

// A CUDA engine on a GPU that cannot export its memory (exclusive-process compute mode):
// no region, the reason quoted, nothing kept or charged.
TEST(ScoreRegionExportTest, MemoryNoWorkerCanMapIsRefusedWithTheReason) {
  ByteBudget budget(int64_t{1} << 20, "--max_created_score_region_bytes");
  int freed = 0;
  const std::string why =
      IpcExportUnavailableReason(0, GpuComputeMode::kExclusiveProcess, /*handle_supported=*/true);
  ScoreRegionsOptions options;
  options.allocate = [&](int64_t bytes, const std::string&,
                         int) -> absl::StatusOr<std::unique_ptr<KvStorage>> {
    return std::unique_ptr<KvStorage>(new ExportedStorage(bytes, &freed, why));
  };
  options.created_in_backend = true;
  options.created_budget = &budget;
  ScoreRegions regions(options);
  const absl::StatusOr<CreatedScoreRegion> created = regions.Create("t", 4096);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kFailedPrecondition) << created.status();
  EXPECT_THAT(created.status().message(), HasSubstr("exclusive-process compute mode"));
  EXPECT_THAT(created.status().message(), HasSubstr("send the scores inline"));
  EXPECT_EQ(regions.count(), 0);
  EXPECT_EQ(budget.used(), 0);
  EXPECT_EQ(freed, 1);
}

TEST(IpcAvailabilityTest, EveryModeThatKeepsWorkersOutSaysSoAndHowToFixIt) {
  EXPECT_EQ(IpcExportUnavailableReason(2, GpuComputeMode::kDefault, true), "");
  const std::string exclusive =
      IpcExportUnavailableReason(2, GpuComputeMode::kExclusiveProcess, true);
  EXPECT_THAT(exclusive, HasSubstr("GPU 2 is in exclusive-process compute mode"));
  EXPECT_THAT(exclusive, HasSubstr("nvidia-smi -c DEFAULT"));
  EXPECT_NE(IpcExportUnavailableReason(0, GpuComputeMode::kExclusiveThread, true), "");
  EXPECT_THAT(IpcExportUnavailableReason(1, GpuComputeMode::kProhibited, true),
              HasSubstr("GPU 1 is in prohibited compute mode"));
  EXPECT_THAT(IpcExportUnavailableReason(3, GpuComputeMode::kDefault, false),
              HasSubstr("GPU 3 does not support CUDA IPC"));
  // The mode is the first reason: fixing IPC support would not let a worker in.
  EXPECT_EQ(IpcExportUnavailableReason(2, GpuComputeMode::kExclusiveProcess, false), exclusive);
}

INSTANTIATE_TEST_SUITE_P(Memory, ScoreRegionLifetimeTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& memory) {
                           return memory.param ? "CudaIpcExported" : "HostSharedMemory";
                         });

}  // namespace
}  // namespace kvcm

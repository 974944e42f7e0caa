// A steady batch of reports through the table allocates nothing, for the ids serving engines
// use (request ids of about 40 bytes, and any up to kMaxSequenceIdBytes) under a tenant: the
// registry's key is built on the stack (SequenceKey). This binary counts heap allocations
// (tests/cache_manager/count_allocations.h).
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cache_manager/table/sequence_table.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/count_allocations.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::DenseScores;
using ::kvcm::testing::PresetOptions;
using ::kvcm::testing::RandomLayers;

// Counts decisions; allocates nothing.
class CountingSink final : public DecisionSink {
 public:
  void OnDecided(int64_t /*tag*/, const absl::Status& status,
                 const EvictionDecision& /*decision*/) override {
    (status.ok() ? ok : failed) += 1;
  }
  int64_t ok = 0;
  int64_t failed = 0;
};

// An id of `bytes` bytes, distinct per `n`.
std::string IdOf(size_t bytes, int n) {
  std::string id = "cmpl-" + std::to_string(n) + "-";
  id.resize(bytes, 'x');
  return id;
}

// Opens 16 sequences with ids of `id_bytes`, steps them once (the first step sizes every
// buffer), then counts the allocations of 50 steady batches of 16 reports.
int64_t AllocationsOfSteadyBatches(size_t id_bytes, const std::string& tenant) {
  constexpr int kSequences = 16;
  constexpr int64_t kPrefill = 512, kBudget = 64, kLayers = 4;
  SequenceTable table;
  std::vector<std::string> ids;
  for (int n = 0; n < kSequences; ++n) {
    ids.push_back(IdOf(id_bytes, n));
    EXPECT_TRUE(table.Open(ids.back(), PresetOptions(kPrefill, kBudget), 1,
                           kernels::ScoreDtype::kFloat32, tenant)
                    .ok());
  }
  std::mt19937_64 rng(11);
  DenseScores first(RandomLayers(rng, kLayers, kPrefill + 1, false));
  DenseScores steady(RandomLayers(rng, kLayers, kBudget + 1, false));
  CountingSink sink;
  RankReport report;
  report.rank = 0;
  const auto step_all = [&](int64_t step, const DenseScores& scores) {
    report.step = step;
    report.partial_sums = scores.matrix;
    for (const std::string& id : ids) {
      EXPECT_TRUE(table.SubmitRankReport(id, report, DecisionWaiter{&sink, step}, tenant).ok());
    }
  };
  step_all(1, first);
  step_all(2, steady);  // warm up the steady shape
  const int64_t before = ::kvcm::testing::AllocationCount();
  for (int64_t step = 3; step < 53; ++step) step_all(step, steady);
  const int64_t allocations = ::kvcm::testing::AllocationCount() - before;
  EXPECT_EQ(sink.failed, 0);
  EXPECT_EQ(sink.ok, 52 * kSequences);
  return allocations;
}

TEST(SteadyBatchAllocationTest, FortyByteIdsAllocateNothingPerReport) {
  EXPECT_EQ(AllocationsOfSteadyBatches(40, "team-a"), 0);
}

TEST(SteadyBatchAllocationTest, IdsOfTheMaximumLengthAllocateNothingPerReport) {
  EXPECT_EQ(AllocationsOfSteadyBatches(kMaxSequenceIdBytes, "a-tenant-with-a-long-name"), 0);
}

TEST(SequenceKeyTest, TenantAndIdAreUnambiguous) {
  // The tenant's length is part of the key, so no split of the same bytes collides.
  EXPECT_NE(SequenceKey("ab", "c").view(), SequenceKey("a", "bc").view());
  EXPECT_NE(SequenceKey("", "1:ab").view(), SequenceKey("ab", "").view());
  EXPECT_EQ(SequenceKey("team", "req-1").view(), "4:teamreq-1");
}

}  // namespace
}  // namespace kvcm

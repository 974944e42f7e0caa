// MomentumState's one implementation on a host backend: the memory accounting, and what
// host memory lets it skip. A steady step must neither allocate from the backend nor copy
// through it (the scores are read in place, the results where the kernels wrote them),
// and a device backend (the CPU's emulated device) must reach the same cache.
#include "cache_manager/engine/momentum_state.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace kvcm {
namespace {

int64_t g_allocations = 0;
int64_t g_copies = 0;

absl::Status CountingAllocate(size_t bytes, kernels::StreamHandle stream, void** ptr) {
  ++g_allocations;
  return kernels::CpuBackend().mem.allocate(bytes, stream, ptr);
}

absl::Status CountingAllocateStaging(size_t bytes, void** ptr) {
  ++g_allocations;
  return kernels::CpuBackend().mem.allocate_staging(bytes, ptr);
}

absl::Status CountingCopy(void* dst, const void* src, size_t bytes, kernels::CopyKind kind,
                          kernels::StreamHandle stream) {
  ++g_copies;
  return kernels::CpuBackend().mem.copy(dst, src, bytes, kind, stream);
}

// The CPU backend with its allocations and copies counted.
const kernels::KernelBackend& CountingHostBackend() {
  static const kernels::KernelBackend backend = [] {
    kernels::KernelBackend b = kernels::CpuBackend();
    b.mem.allocate = &CountingAllocate;
    b.mem.allocate_staging = &CountingAllocateStaging;
    b.mem.copy = &CountingCopy;
    return b;
  }();
  return backend;
}

// One scoring step at the budget: the new token, scores (token i scores i % 7), and the
// eviction of the lowest unprotected token. `span_pool`: as ApplyScores takes it.
void Step(MomentumState& state, int64_t position, std::vector<float>& scores,
          std::vector<int64_t>* evicted, std::vector<int64_t>* indices, int64_t span_pool = 0) {
  state.Append(position, 0.0f);
  scores.resize(static_cast<size_t>(state.size()));
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(i % 7);
  const auto matrix = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32,
                                                  1, state.size());
  ASSERT_EQ(state.ApplyScores(matrix, kernels::MomentumUpdateOptions{},
                              MomentumState::ScoreSpace::kHost, span_pool),
            0);
  state.EvictLowest(state.FirstUnprotectedSinkIndex(2), state.size() - 1, 1, evicted, indices);
}

TEST(MomentumStateTest, BytesPerTokenOfCapacity) {
  EXPECT_EQ(MomentumState::BytesFor(10, kernels::CpuBackend()), 320);
  EXPECT_EQ(MomentumState::BytesFor(10, kernels::EmulatedDeviceBackend()), 640);
  const MomentumState host(9, 16, false);
  EXPECT_EQ(host.reserved_bytes(), MomentumState::BytesFor(10, kernels::CpuBackend()));
}

TEST(MomentumStateTest, SteadyHostStepsNeitherAllocateNorCopyThroughTheBackend) {
  constexpr int64_t kBudget = 32;
  MomentumState state(kBudget, kBudget, /*momentum_is_position=*/false, CountingHostBackend());
  ASSERT_TRUE(state.status().ok());
  ASSERT_GT(g_allocations, 0);  // the arrays came from the counted backend
  std::vector<float> scores;
  std::vector<int64_t> evicted;
  std::vector<int64_t> indices;
  evicted.reserve(1000);
  indices.reserve(1000);
  scores.reserve(kBudget + 1);
  Step(state, kBudget, scores, &evicted, &indices);  // warm-up
  const int64_t allocations = g_allocations;
  const int64_t copies = g_copies;
  for (int64_t position = kBudget + 1; position < kBudget + 200; position += 2) {
    Step(state, position, scores, &evicted, &indices);
    state.Append(position + 1, 0.0f);  // a rejected step's token, undone
    state.PopBack();
    state.AppendAtMean(position + 1);
    state.EvictLowest(2, state.size() - 1, 1, &evicted, &indices);
  }
  EXPECT_EQ(g_allocations - allocations, 0);
  EXPECT_EQ(g_copies - copies, 0);
  EXPECT_EQ(state.size(), kBudget);
  EXPECT_TRUE(state.status().ok());
}

// Span pooling's buffer is allocated once, by the first pooled step, and reused.
TEST(MomentumStateTest, SteadySpanPooledStepsAllocateOnlyOnce) {
  constexpr int64_t kBudget = 32;
  MomentumState state(kBudget, kBudget, /*momentum_is_position=*/false, CountingHostBackend());
  ASSERT_TRUE(state.status().ok());
  std::vector<float> scores;
  std::vector<int64_t> evicted;
  std::vector<int64_t> indices;
  evicted.reserve(1000);
  indices.reserve(1000);
  scores.reserve(kBudget + 1);
  Step(state, kBudget, scores, &evicted, &indices);  // warm-up without pooling
  const int64_t allocations = g_allocations;
  Step(state, kBudget + 1, scores, &evicted, &indices, /*span_pool=*/7);
  EXPECT_EQ(g_allocations - allocations, 1);  // the pooled rows
  for (int64_t position = kBudget + 2; position < kBudget + 100; ++position) {
    Step(state, position, scores, &evicted, &indices, /*span_pool=*/7);
  }
  EXPECT_EQ(g_allocations - allocations, 1);
  EXPECT_TRUE(state.status().ok());
}

TEST(MomentumStateTest, HostAndEmulatedDeviceReachTheSameCache) {
  MomentumState host(40, 24, /*momentum_is_position=*/true, kernels::CpuBackend());
  MomentumState device(40, 24, /*momentum_is_position=*/true, kernels::EmulatedDeviceBackend());
  std::vector<float> scores;
  std::vector<int64_t> host_evicted, host_indices, device_evicted, device_indices;
  for (int64_t position = 40; position < 80; position += 2) {
    Step(host, position, scores, &host_evicted, &host_indices);
    Step(device, position, scores, &device_evicted, &device_indices);
    const std::vector<int64_t> chosen = {3, 5};
    host.EvictIndices(chosen, &host_evicted, &host_indices);
    device.EvictIndices(chosen, &device_evicted, &device_indices);
    host.AppendAtMean(position + 1);
    device.AppendAtMean(position + 1);
  }
  ASSERT_TRUE(device.status().ok());
  EXPECT_EQ(host_evicted, device_evicted);
  EXPECT_EQ(host_indices, device_indices);
  const auto hp = host.positions();
  const auto dp = device.positions();
  EXPECT_EQ(std::vector<int64_t>(hp.begin(), hp.end()),
            std::vector<int64_t>(dp.begin(), dp.end()));
  const auto hm = host.momentum();
  const auto dm = device.momentum();
  EXPECT_EQ(std::vector<float>(hm.begin(), hm.end()), std::vector<float>(dm.begin(), dm.end()));
  EXPECT_EQ(host.MeanMomentum(), device.MeanMomentum());
}

}  // namespace
}  // namespace kvcm

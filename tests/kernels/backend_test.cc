// The kernel backend tables (kernels/backend.h): the CPU table runs the reference kernels,
// the emulated-device table runs the same kernels behind the device memory contract, and
// the CPU twins of the join halves (WidenPartialSums, ScaleJoinedSums) compose to the
// one-pass join. The CUDA table's signatures are checked when it compiles
// (kernels/cuda/cuda_backend.cc); its results by tests/gpu.
#include "kernels/backend.h"
#include "kernels/stream_lanes.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half_float.h"

namespace kvcm::kernels {
namespace {

TEST(KernelBackendTest, TheCpuTableIsTheReferenceOverHostMemory) {
  const KernelBackend& cpu = CpuBackend();
  EXPECT_STREQ(cpu.name, "cpu");
  EXPECT_EQ(cpu.memory, MemorySpace::kHost);
  EXPECT_EQ(cpu.update_momentum, &cpu::UpdateMomentum);
  EXPECT_EQ(cpu.mean_momentum, &cpu::MeanMomentum);
  EXPECT_EQ(cpu.convert_to_float32, &cpu::ConvertToFloat32);
  EXPECT_EQ(cpu.join_rank_partials, &cpu::JoinRankPartials);
  EXPECT_EQ(cpu.widen_partial_sums, &cpu::WidenPartialSums);
  EXPECT_EQ(cpu.scale_joined_sums, &cpu::ScaleJoinedSums);
  EXPECT_EQ(cpu.count_invalid_scores, &cpu::CountInvalidScores);
  EXPECT_EQ(cpu.select_lowest, &cpu::SelectLowest);
  EXPECT_EQ(cpu.remove_entries, &cpu::RemoveEntries);
  EXPECT_EQ(cpu.append_entry, &cpu::AppendEntry);
  EXPECT_EQ(cpu.gather_positions, &cpu::GatherPositions);
  EXPECT_EQ(cpu.compact_kv, &cpu::CompactKv);
}

TEST(KernelBackendTest, TheEmulatedDeviceRunsTheSameKernelsBehindDeviceMemory) {
  const KernelBackend& emulated = EmulatedDeviceBackend();
  EXPECT_EQ(emulated.memory, MemorySpace::kDevice);
  EXPECT_EQ(emulated.update_momentum, CpuBackend().update_momentum);
  EXPECT_EQ(emulated.select_lowest, CpuBackend().select_lowest);
  StreamHandle stream = nullptr;
  ASSERT_TRUE(emulated.mem.device_stream(0, &stream).ok());
  EXPECT_EQ(stream, EmulatedStream(ThreadStreamLane()));
  void* device = nullptr;
  void* staging = nullptr;
  ASSERT_TRUE(emulated.mem.allocate(100, stream, &device).ok());
  ASSERT_TRUE(emulated.mem.allocate_staging(100, &staging).ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(device) % 256, 0u);
  const char text[] = "kv cache";
  ASSERT_TRUE(emulated.mem.copy(device, text, sizeof(text), CopyKind::kHostToBackend, stream).ok());
  ASSERT_TRUE(emulated.mem.copy(staging, device, sizeof(text), CopyKind::kBackendToHost, stream).ok());
  ASSERT_TRUE(emulated.mem.synchronize(stream, "copy").ok());
  EXPECT_STREQ(static_cast<const char*>(staging), text);
  emulated.mem.release(device, stream);
  emulated.mem.release_staging(staging);
  emulated.mem.release(nullptr, stream);  // ignored
}

TEST(KernelBackendTest, WidenThenScaleEqualsTheOnePassJoinBitForBit) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(0.0f, 4.0f);
  constexpr int64_t kLayers = 3;
  constexpr int64_t kTokens = 111;
  constexpr int64_t kStride = kTokens + 5;
  constexpr int kRanks = 4;
  std::vector<std::vector<float>> f32(kRanks);
  std::vector<std::vector<uint16_t>> f16(kRanks);
  std::vector<ScoreMatrix> views;
  for (int r = 0; r < kRanks; ++r) {
    f32[r].assign(static_cast<size_t>(kLayers * kStride), -1.0f);
    f16[r].assign(static_cast<size_t>(kLayers * kStride), 0xbc00);
    for (int64_t i = 0; i < kLayers * kStride; ++i) {
      const float v = u(rng);
      f32[r][static_cast<size_t>(i)] = v;
      f16[r][static_cast<size_t>(i)] = FloatToFloat16(v);
    }
    // Alternate dtypes across ranks, as mixed workers might send.
    views.push_back(r % 2 == 0 ? ScoreMatrix{f32[r].data(), ScoreDtype::kFloat32, kLayers, kTokens, kStride}
                               : ScoreMatrix{f16[r].data(), ScoreDtype::kFloat16, kLayers, kTokens, kStride});
  }
  const int64_t heads = 13;
  std::vector<float> want(static_cast<size_t>(kLayers * kTokens));
  cpu::JoinRankPartials(views.data(), kRanks, heads, want.data(), nullptr);

  // What each rank and the all-reduce do: widen, sum in rank order, scale.
  std::vector<double> total(static_cast<size_t>(kLayers * kTokens), 0.0);
  std::vector<double> wide(total.size());
  for (int r = 0; r < kRanks; ++r) {
    cpu::WidenPartialSums(views[static_cast<size_t>(r)], wide.data(), nullptr);
    for (size_t i = 0; i < wide.size(); ++i) total[i] += wide[i];
  }
  std::vector<float> got(total.size());
  cpu::ScaleJoinedSums(total.data(), static_cast<int64_t>(total.size()), heads, got.data(), nullptr);
  ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

TEST(KernelBackendTest, WidenKeepsTheSignOfZero) {
  const float values[] = {-0.0f, 0.0f, 1.5f};
  double wide[3] = {7, 7, 7};
  cpu::WidenPartialSums(ScoreMatrix::Dense(values, ScoreDtype::kFloat32, 1, 3), wide, nullptr);
  EXPECT_TRUE(std::signbit(wide[0]));
  EXPECT_FALSE(std::signbit(wide[1]));
  EXPECT_EQ(wide[2], 1.5);
}

TEST(TokenArraysTest, AppendEntryWritesTheValueOrTheMean) {
  std::vector<float> momentum(4, -1.0f);
  std::vector<int64_t> positions(4, -1);
  cpu::AppendEntry(momentum.data(), positions.data(), 2, 17, 0.25f, nullptr, nullptr);
  EXPECT_EQ(momentum[2], 0.25f);
  EXPECT_EQ(positions[2], 17);
  const double mean = 1.0 / 3.0;
  cpu::AppendEntry(momentum.data(), positions.data(), 3, 18, 0.25f, &mean, nullptr);
  EXPECT_EQ(momentum[3], static_cast<float>(mean));
  EXPECT_EQ(positions[3], 18);
  EXPECT_EQ(momentum[1], -1.0f);  // nothing else is touched
}

TEST(TokenArraysTest, GatherPositionsReadsTheChosenEntries) {
  const std::vector<int64_t> positions = {10, 11, 12, 13, 14};
  const std::vector<int64_t> indices = {0, 3, 4};
  std::vector<int64_t> out(3, -1);
  cpu::GatherPositions(positions.data(), indices.data(), 3, out.data(), nullptr);
  EXPECT_EQ(out, (std::vector<int64_t>{10, 13, 14}));
  cpu::GatherPositions(positions.data(), indices.data(), 0, out.data(), nullptr);  // k = 0
}

}  // namespace
}  // namespace kvcm::kernels

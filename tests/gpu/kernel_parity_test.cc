// Parity of the CUDA kernels with the CPU reference: both run on the same seeded inputs
// at odd sizes (1, 7, 111, 4096, 65537) with strided layers, and every element must match
// bit for bit, MeanMomentum included (both compute the exact sum of kernels/exact_sum.h).
// Then the step at its real shapes: the first step of a 128k context (131,073 tokens x
// 32 layers, 117,966 evicted) and a steady step at a 6,400-token budget (6,401 tokens,
// k = 1), update + select + remove on both, compared element by element.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/kv_compaction_cuda.h"
#include "kernels/cuda/momentum_update_cuda.h"
#include "kernels/cuda/score_validation_cuda.h"
#include "kernels/cuda/selection_cuda.h"
#include "kernels/cuda/span_pool_cuda.h"
#include "kernels/cuda/token_arrays_cuda.h"
#include "kernels/half_float.h"
#include "kernels/kv_compaction.h"
#include "kernels/momentum_update.h"
#include "kernels/score_validation.h"
#include "kernels/selection.h"
#include "kernels/span_pool.h"
#include "kernels/token_arrays.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvcm::kernels {
namespace {

using testing::DeviceArray;

constexpr int64_t kSizes[] = {1, 7, 111, 4096, 65537};
constexpr ScoreDtype kDtypes[] = {ScoreDtype::kFloat32, ScoreDtype::kFloat16,
                                  ScoreDtype::kBFloat16};
constexpr int64_t kLayers = 5;
constexpr int64_t kPad = 3;  // layer_stride = tokens + kPad

// Scores of one dtype, rows `tokens + pad` apart. The padding holds -1 (an invalid score),
// so a kernel that ignores the stride is caught by its invalid count.
struct HostScores {
  ScoreDtype dtype;
  int64_t layers;
  int64_t tokens;
  int64_t stride;
  std::vector<uint8_t> bytes;

  ScoreMatrix At(const void* data) const { return ScoreMatrix{data, dtype, layers, tokens, stride}; }
  ScoreMatrix Host() const { return At(bytes.data()); }
};

void Store(ScoreDtype dtype, float v, uint8_t* dst) {
  if (dtype == ScoreDtype::kFloat32) {
    std::memcpy(dst, &v, 4);
    return;
  }
  const uint16_t h = dtype == ScoreDtype::kFloat16 ? FloatToFloat16(v) : FloatToBFloat16(v);
  std::memcpy(dst, &h, 2);
}

// `bad` elements (at random places) are negative, NaN or infinite.
HostScores MakeScores(ScoreDtype dtype, int64_t layers, int64_t tokens, int64_t pad,
                      uint64_t seed, int bad = 0) {
  HostScores s{dtype, layers, tokens, tokens + pad, {}};
  const size_t size = ScoreDtypeSize(dtype);
  s.bytes.resize(static_cast<size_t>(layers * s.stride) * size);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < s.stride; ++i) {
      const float v = i < tokens ? uniform(rng) : -1.0f;
      Store(dtype, v, s.bytes.data() + static_cast<size_t>(l * s.stride + i) * size);
    }
  }
  const float poison[] = {-0.5f, std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()};
  for (int b = 0; b < bad; ++b) {
    const int64_t l = static_cast<int64_t>(rng() % static_cast<uint64_t>(layers));
    const int64_t i = static_cast<int64_t>(rng() % static_cast<uint64_t>(tokens));
    Store(dtype, poison[b % 3], s.bytes.data() + static_cast<size_t>(l * s.stride + i) * size);
  }
  return s;
}

std::vector<float> RandomMomentum(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 2.0f);
  std::vector<float> m(static_cast<size_t>(n));
  for (float& x : m) x = uniform(rng);
  return m;
}

// Index of the first element whose bits differ, or -1.
template <typename T>
int64_t FirstMismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

std::string Describe(ScoreDtype dtype, int64_t n) {
  return std::string(ScoreDtypeName(dtype)) + " n=" + std::to_string(n);
}

class ScoreKernelParityTest
    : public ::testing::TestWithParam<std::tuple<int64_t, ScoreDtype>> {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
  int64_t n() const { return std::get<0>(GetParam()); }
  ScoreDtype dtype() const { return std::get<1>(GetParam()); }
};

TEST_P(ScoreKernelParityTest, UpdateMomentumIsBitIdenticalForEveryAggregation) {
  const HostScores layer_rows =
      MakeScores(dtype(), kLayers, n(), kPad, 11 + static_cast<uint64_t>(n()));
  const HostScores folded_row = MakeScores(dtype(), 1, n(), kPad, 17 + static_cast<uint64_t>(n()));
  DeviceArray<uint8_t> device_layer_rows(layer_rows.bytes);
  DeviceArray<uint8_t> device_folded_row(folded_row.bytes);
  const std::vector<float> momentum = RandomMomentum(n(), 5);
  // Folded decays: ema alpha 0.8 over 32 layers, cumulative, single_step, arbitrary.
  const MomentumUpdateOptions cases[] = {
      {ScoreAggregation::kEma, 0.8},        {ScoreAggregation::kEma, 0.0},
      {ScoreAggregation::kEma, 0.37},       {ScoreAggregation::kCumulative, 0.8},
      {ScoreAggregation::kSingleStep, 0.8}, {ScoreAggregation::kFolded, 0.8, 0.00079228162514264},
      {ScoreAggregation::kFolded, 0.8, 1.0}, {ScoreAggregation::kFolded, 0.8, 0.0},
      {ScoreAggregation::kFolded, 0.8, 0.37},
  };
  for (const MomentumUpdateOptions& options : cases) {
    // A folded update takes one row.
    const bool folded = options.aggregation == ScoreAggregation::kFolded;
    const HostScores& scores = folded ? folded_row : layer_rows;
    const DeviceArray<uint8_t>& device_scores = folded ? device_folded_row : device_layer_rows;
    SCOPED_TRACE(Describe(dtype(), n()) + " aggregation " +
                 std::to_string(static_cast<int>(options.aggregation)) + " alpha " +
                 std::to_string(options.alpha) + " decay " + std::to_string(options.decay));
    std::vector<float> cpu_out(momentum.size());
    int64_t cpu_invalid = -1;
    cpu::UpdateMomentum(momentum.data(), cpu_out.data(), n(), scores.Host(), options,
                        &cpu_invalid, nullptr);

    // Out of place, then in place (momentum_out aliasing momentum_in).
    DeviceArray<float> in(momentum);
    DeviceArray<float> out(momentum.size());
    DeviceArray<int64_t> invalid(1);
    cuda::UpdateMomentum(in.get(), out.get(), n(), scores.At(device_scores.get()), options,
                         invalid.get(), nullptr);
    KVCM_ASSERT_KERNELS_OK("UpdateMomentum");
    EXPECT_EQ(invalid.Download()[0], 0);
    EXPECT_EQ(cpu_invalid, 0);
    EXPECT_EQ(FirstMismatch(out.Download(), cpu_out), -1);

    cuda::UpdateMomentum(in.get(), in.get(), n(), scores.At(device_scores.get()), options,
                         invalid.get(), nullptr);
    KVCM_ASSERT_KERNELS_OK("UpdateMomentum in place");
    EXPECT_EQ(FirstMismatch(in.Download(), cpu_out), -1);
  }
}

TEST_P(ScoreKernelParityTest, InvalidScoresAreCountedAlike) {
  const int bad = n() >= 7 ? 7 : 1;
  const std::vector<float> momentum = RandomMomentum(n(), 6);
  // The default (ema) update over kLayers rows, and a folded update of one row.
  const MomentumUpdateOptions folded{ScoreAggregation::kFolded, 0.8, 0.5};
  for (const MomentumUpdateOptions& options : {MomentumUpdateOptions{}, folded}) {
    const bool one_row = options.aggregation == ScoreAggregation::kFolded;
    SCOPED_TRACE(one_row ? "folded" : "ema");
    const HostScores scores = MakeScores(dtype(), one_row ? 1 : kLayers, n(), kPad, 99, bad);
    DeviceArray<uint8_t> device_scores(scores.bytes);

    int64_t cpu_update = -1;
    std::vector<float> cpu_out(momentum.size());
    cpu::UpdateMomentum(momentum.data(), cpu_out.data(), n(), scores.Host(), options,
                        &cpu_update, nullptr);
    int64_t cpu_count = -1;
    cpu::CountInvalidScores(scores.Host(), &cpu_count, nullptr);
    ASSERT_GT(cpu_count, 0);
    EXPECT_EQ(cpu_update, cpu_count);

    DeviceArray<float> in(momentum);
    DeviceArray<int64_t> invalid(1);
    cuda::UpdateMomentum(in.get(), in.get(), n(), scores.At(device_scores.get()), options,
                         invalid.get(), nullptr);
    KVCM_ASSERT_KERNELS_OK("UpdateMomentum");
    EXPECT_EQ(invalid.Download()[0], cpu_count);
    cuda::CountInvalidScores(scores.At(device_scores.get()), invalid.get(), nullptr);
    KVCM_ASSERT_KERNELS_OK("CountInvalidScores");
    EXPECT_EQ(invalid.Download()[0], cpu_count);
  }
}

TEST_P(ScoreKernelParityTest, ValidScoresCountZero) {
  const HostScores scores = MakeScores(dtype(), kLayers, n(), kPad, 3);
  DeviceArray<uint8_t> device_scores(scores.bytes);
  DeviceArray<int64_t> invalid(std::vector<int64_t>{12345});
  cuda::CountInvalidScores(scores.At(device_scores.get()), invalid.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("CountInvalidScores");
  EXPECT_EQ(invalid.Download()[0], 0);
}

TEST_P(ScoreKernelParityTest, ConvertToFloat32IsExact) {
  const HostScores scores = MakeScores(dtype(), 1, n(), 0, 21);
  DeviceArray<uint8_t> device_scores(scores.bytes);
  std::vector<float> cpu_out(static_cast<size_t>(n()));
  cpu::ConvertToFloat32(scores.bytes.data(), dtype(), n(), cpu_out.data(), nullptr);
  DeviceArray<float> out(static_cast<size_t>(n()));
  cuda::ConvertToFloat32(device_scores.get(), dtype(), n(), out.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("ConvertToFloat32");
  EXPECT_EQ(FirstMismatch(out.Download(), cpu_out), -1);
}

TEST_P(ScoreKernelParityTest, JoinRankPartialsIsBitIdentical) {
  for (int64_t ranks : {1, 2, 3, 8}) {
    SCOPED_TRACE(Describe(dtype(), n()) + " ranks " + std::to_string(ranks));
    std::vector<HostScores> host;
    std::vector<std::unique_ptr<DeviceArray<uint8_t>>> device;
    std::vector<ScoreMatrix> host_views;
    std::vector<ScoreMatrix> device_views;
    for (int64_t r = 0; r < ranks; ++r) {
      // Mixed dtypes and strides across ranks.
      const ScoreDtype d = kDtypes[(static_cast<size_t>(dtype()) + static_cast<size_t>(r)) % 3];
      host.push_back(MakeScores(d, kLayers, n(), r + 1, 1000 + static_cast<uint64_t>(r)));
    }
    for (const HostScores& h : host) {
      device.push_back(std::make_unique<DeviceArray<uint8_t>>(h.bytes));
      host_views.push_back(h.Host());
      device_views.push_back(h.At(device.back()->get()));
    }
    const int64_t heads = 2 * ranks + 1;
    std::vector<float> cpu_out(static_cast<size_t>(kLayers * n()));
    cpu::JoinRankPartials(host_views.data(), ranks, heads, cpu_out.data(), nullptr);
    DeviceArray<float> out(cpu_out.size());
    cuda::JoinRankPartials(device_views.data(), ranks, heads, out.get(), nullptr);
    KVCM_ASSERT_KERNELS_OK("JoinRankPartials");
    EXPECT_EQ(FirstMismatch(out.Download(), cpu_out), -1);
  }
}

TEST_P(ScoreKernelParityTest, WidenAndScaleMatchTheirCpuTwins) {
  const HostScores scores = MakeScores(dtype(), kLayers, n(), kPad, 23);
  DeviceArray<uint8_t> device_scores(scores.bytes);
  const size_t count = static_cast<size_t>(kLayers * n());
  std::vector<double> cpu_wide(count);
  cpu::WidenPartialSums(scores.Host(), cpu_wide.data(), nullptr);
  DeviceArray<double> wide(count);
  cuda::WidenPartialSums(scores.At(device_scores.get()), wide.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("WidenPartialSums");
  EXPECT_EQ(FirstMismatch(wide.Download(), cpu_wide), -1);
  std::vector<float> cpu_scaled(count);
  cpu::ScaleJoinedSums(cpu_wide.data(), static_cast<int64_t>(count), 7, cpu_scaled.data(), nullptr);
  DeviceArray<float> scaled(count);
  cuda::ScaleJoinedSums(wide.get(), static_cast<int64_t>(count), 7, scaled.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("ScaleJoinedSums");
  EXPECT_EQ(FirstMismatch(scaled.Download(), cpu_scaled), -1);
}

TEST_P(ScoreKernelParityTest, AnInvalidOutOfPlaceUpdateLeavesTheMomentumUntouched) {
  // The engine's double buffer: it updates into a second buffer and keeps the first when
  // any score is invalid. The kernel must not write its input.
  const HostScores scores = MakeScores(dtype(), kLayers, n(), kPad, 31, /*bad=*/1);
  DeviceArray<uint8_t> device_scores(scores.bytes);
  const std::vector<float> momentum = RandomMomentum(n(), 12);
  DeviceArray<float> in(momentum);
  DeviceArray<float> out(momentum.size());
  DeviceArray<int64_t> invalid(1);
  cuda::UpdateMomentum(in.get(), out.get(), n(), scores.At(device_scores.get()),
                       MomentumUpdateOptions{}, invalid.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("UpdateMomentum");
  EXPECT_EQ(invalid.Download()[0], 1);
  EXPECT_EQ(FirstMismatch(in.Download(), momentum), -1);
}

// Span pooling (kernels/span_pool.h): the deque of the CPU and the binary search of the
// GPU pool the same windows over positions with gaps; an invalid score is NaN on both.
TEST_P(ScoreKernelParityTest, SpanMaxPoolIsBitIdenticalOverPositionsWithGaps) {
  std::mt19937_64 rng(static_cast<uint64_t>(n()));
  std::vector<int64_t> positions;
  for (int64_t i = 0, p = 3; i < n(); ++i, p += 1 + static_cast<int64_t>(rng() % 4)) {
    positions.push_back(p);
  }
  DeviceArray<int64_t> device_positions(positions);
  for (int bad : {0, 3}) {
    const HostScores scores = MakeScores(dtype(), kLayers, n(), kPad, 77, bad);
    DeviceArray<uint8_t> device_scores(scores.bytes);
    for (int64_t width : {3, 15, 255}) {
      SCOPED_TRACE(Describe(dtype(), n()) + " width " + std::to_string(width) + " bad " +
                   std::to_string(bad));
      std::vector<float> cpu_out(static_cast<size_t>(kLayers * n()));
      cpu::SpanMaxPool(scores.Host(), positions.data(), width, cpu_out.data(), nullptr);
      DeviceArray<float> out(static_cast<size_t>(kLayers * n()));
      cuda::SpanMaxPool(scores.At(device_scores.get()), device_positions.get(), width, out.get(),
                        nullptr);
      KVCM_ASSERT_KERNELS_OK("SpanMaxPool");
      const std::vector<float> gpu_out = out.Download();
      for (int64_t l = 0; l < kLayers; ++l) {
        for (int64_t i = 0; i < n(); ++i) {
          const size_t at = static_cast<size_t>(l * n() + i);
          const float own = ScoreAt(scores.Host(), l, i);
          if (!(own >= 0.0f && own <= FLT_MAX)) {
            ASSERT_TRUE(std::isnan(cpu_out[at]) && std::isnan(gpu_out[at])) << l << "," << i;
          } else if (bad == 0) {
            ASSERT_EQ(cpu_out[at], gpu_out[at]) << "layer " << l << " index " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    SizesAndDtypes, ScoreKernelParityTest,
    ::testing::Combine(::testing::ValuesIn(kSizes), ::testing::ValuesIn(kDtypes)),
    [](const ::testing::TestParamInfo<std::tuple<int64_t, ScoreDtype>>& param_info) {
      return std::string(ScoreDtypeName(std::get<1>(param_info.param))) + "_n" +
             std::to_string(std::get<0>(param_info.param));
    });

class ArrayKernelParityTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
  int64_t n() const { return GetParam(); }
};

// Momentum as the engine holds it (attention-like: many tiny values, a few large), with
// zeros and, when `wide`, subnormals and large values too: the exact sum then needs
// several levels.
std::vector<float> EngineLikeMomentum(int64_t n, uint64_t seed, bool wide) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<float> m(static_cast<size_t>(n));
  for (float& x : m) {
    const float y = uniform(rng);
    x = y * y * y * 1e-3f;
    if (rng() % 61 == 0) x = 0.0f;
    if (wide && rng() % 97 == 0) x = std::ldexp(1.0f, -140) * static_cast<float>(rng() % 1000);
    if (wide && rng() % 89 == 0) x = 3e7f * y;
  }
  return m;
}

TEST_P(ArrayKernelParityTest, MeanMomentumIsBitIdentical) {
  DeviceArray<double> mean(1);
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("n=" + std::to_string(n()) + " variant " + std::to_string(variant));
    const std::vector<float> momentum =
        variant == 0 ? RandomMomentum(n(), 8) : EngineLikeMomentum(n(), 9, variant == 2);
    double cpu_mean = -1.0;
    cpu::MeanMomentum(momentum.data(), n(), &cpu_mean, nullptr);
    DeviceArray<float> device(momentum);
    cuda::MeanMomentum(device.get(), n(), mean.get(), nullptr);
    KVCM_ASSERT_KERNELS_OK("MeanMomentum");
    const double gpu_mean = mean.Download()[0];
    EXPECT_EQ(std::memcmp(&gpu_mean, &cpu_mean, sizeof(double)), 0)
        << "gpu " << gpu_mean << " cpu " << cpu_mean;
  }
  cuda::MeanMomentum(nullptr, 0, mean.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("MeanMomentum of nothing");
  EXPECT_EQ(mean.Download()[0], 0.0);
}

TEST_P(ArrayKernelParityTest, AppendEntryAndGatherPositionsMatch) {
  std::vector<float> momentum = RandomMomentum(n() + 1, 10);
  std::vector<int64_t> positions(static_cast<size_t>(n() + 1));
  std::iota(positions.begin(), positions.end(), int64_t{7});
  DeviceArray<float> m(momentum);
  DeviceArray<int64_t> p(positions);
  DeviceArray<double> mean(std::vector<double>{1.0 / 3.0});
  cuda::AppendEntry(m.get(), p.get(), n(), 999, 0.0f, mean.get(), nullptr);
  const double third = 1.0 / 3.0;
  cpu::AppendEntry(momentum.data(), positions.data(), n(), 999, 0.0f, &third, nullptr);
  if (n() > 1) {
    cuda::AppendEntry(m.get(), p.get(), 0, -5, 0.75f, nullptr, nullptr);
    cpu::AppendEntry(momentum.data(), positions.data(), 0, -5, 0.75f, nullptr, nullptr);
  }
  KVCM_ASSERT_KERNELS_OK("AppendEntry");
  EXPECT_EQ(FirstMismatch(m.Download(), momentum), -1);
  EXPECT_EQ(p.Download(), positions);

  std::vector<int64_t> indices;
  for (int64_t i = 0; i <= n(); i += 3) indices.push_back(i);
  std::vector<int64_t> want(indices.size());
  cpu::GatherPositions(positions.data(), indices.data(), static_cast<int64_t>(indices.size()),
                       want.data(), nullptr);
  DeviceArray<int64_t> device_indices(indices);
  DeviceArray<int64_t> out(indices.size());
  cuda::GatherPositions(p.get(), device_indices.get(), static_cast<int64_t>(indices.size()),
                        out.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("GatherPositions");
  EXPECT_EQ(out.Download(), want);
}

// Values with many exact ties (multiples of 1/16), zeros of both signs.
std::vector<float> TiedValues(int64_t n, uint64_t seed, bool coarse) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (float& x : v) {
    x = coarse ? static_cast<float>(rng() % 17) / 16.0f : uniform(rng);
    if (rng() % 50 == 0) x = (rng() % 2 == 0) ? -0.0f : 0.0f;
  }
  return v;
}

TEST_P(ArrayKernelParityTest, SelectLowestPicksTheSameIndicesInTheSameOrder) {
  for (bool coarse : {true, false}) {
    const std::vector<float> values = TiedValues(n(), 40 + static_cast<uint64_t>(n()), coarse);
    DeviceArray<float> device_values(values);
    const std::pair<int64_t, int64_t> ranges[] = {{0, n()}, {n() / 3, n()}, {0, n() - n() / 4}};
    for (const auto& [begin, end] : ranges) {
      const int64_t count = end - begin;
      std::vector<int64_t> ks = {0, 1, 2, count / 3, count / 2 + 1, count - 1, count};
      std::sort(ks.begin(), ks.end());
      ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
      for (int64_t k : ks) {
        if (k < 0 || k > count) continue;
        SCOPED_TRACE("n=" + std::to_string(n()) + " coarse=" + std::to_string(coarse) +
                     " range [" + std::to_string(begin) + ", " + std::to_string(end) +
                     ") k=" + std::to_string(k));
        std::vector<int64_t> cpu_selected(static_cast<size_t>(k), -1);
        std::vector<uint64_t> scratch(static_cast<size_t>(count));
        cpu::SelectLowest(values.data(), begin, end, k, cpu_selected.data(), scratch.data(),
                          nullptr);
        DeviceArray<int64_t> selected(std::vector<int64_t>(static_cast<size_t>(k), -1));
        cuda::SelectLowest(device_values.get(), begin, end, k, selected.get(), nullptr, nullptr);
        KVCM_ASSERT_KERNELS_OK("SelectLowest");
        EXPECT_EQ(selected.Download(), cpu_selected);
      }
    }
  }
}

TEST_P(ArrayKernelParityTest, RemoveEntriesKeepsTheSameSurvivorsInOrder) {
  std::mt19937_64 rng(77);
  const std::vector<float> momentum = RandomMomentum(n(), 9);
  std::vector<int64_t> positions(static_cast<size_t>(n()));
  std::iota(positions.begin(), positions.end(), int64_t{1000});
  std::vector<std::vector<int64_t>> patterns;
  patterns.push_back({0});
  patterns.push_back({n() - 1});
  std::vector<int64_t> all(static_cast<size_t>(n()));
  std::iota(all.begin(), all.end(), int64_t{0});
  patterns.push_back(all);
  for (int keep_one_in : {2, 10, 1000}) {
    std::vector<int64_t> some;
    for (int64_t i = 0; i < n(); ++i) {
      if (rng() % static_cast<uint64_t>(keep_one_in) != 0) some.push_back(i);
    }
    patterns.push_back(some);
  }
  std::vector<int64_t> run;  // one contiguous run in the middle
  for (int64_t i = n() / 3; i < 2 * n() / 3; ++i) run.push_back(i);
  patterns.push_back(run);

  for (const std::vector<int64_t>& indices : patterns) {
    const int64_t k = static_cast<int64_t>(indices.size());
    SCOPED_TRACE("n=" + std::to_string(n()) + " k=" + std::to_string(k));
    std::vector<float> cpu_m = momentum;
    std::vector<int64_t> cpu_p = positions;
    cpu::RemoveEntries(cpu_m.data(), cpu_p.data(), n(), indices.data(), k, nullptr);
    cpu_m.resize(static_cast<size_t>(n() - k));
    cpu_p.resize(static_cast<size_t>(n() - k));

    DeviceArray<float> m(momentum);
    DeviceArray<int64_t> p(positions);
    DeviceArray<int64_t> device_indices(indices);
    cuda::RemoveEntries(m.get(), p.get(), n(), device_indices.get(), k, nullptr);
    KVCM_ASSERT_KERNELS_OK("RemoveEntries");
    std::vector<float> gpu_m = m.Download();
    std::vector<int64_t> gpu_p = p.Download();
    gpu_m.resize(static_cast<size_t>(n() - k));
    gpu_p.resize(static_cast<size_t>(n() - k));
    EXPECT_EQ(FirstMismatch(gpu_m, cpu_m), -1);
    EXPECT_EQ(gpu_p, cpu_p);
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, ArrayKernelParityTest, ::testing::ValuesIn(kSizes));

// A whole step at the shapes that matter: update (out of place), select, remove.
struct StepShape {
  const char* name;
  int64_t tokens;  // the cache before the step plus the new token
  int64_t evict;
};
constexpr StepShape kStepShapes[] = {
    {"FirstStep128k", 131073, 131073 - 13107},  // 90% of a 131,072-token prefill: 117,966
    {"SteadyStep6400", 6401, 1},                // one in, one out at a 6,400-token budget
};

class StepShapeParityTest
    : public ::testing::TestWithParam<std::tuple<StepShape, ScoreDtype>> {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
};

TEST_P(StepShapeParityTest, UpdateSelectAndRemoveMatchTheCpuElementByElement) {
  const auto& [shape, dtype] = GetParam();
  constexpr int64_t kStepLayers = 32;
  const int64_t n = shape.tokens;
  ASSERT_EQ(shape.evict, shape.tokens == 131073 ? 117966 : 1);
  // Attention-like scores (mostly tiny, a few large), dense rows as a worker sends them.
  HostScores scores{dtype, kStepLayers, n, n, {}};
  const size_t size = ScoreDtypeSize(dtype);
  scores.bytes.resize(static_cast<size_t>(kStepLayers * n) * size);
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (int64_t i = 0; i < kStepLayers * n; ++i) {
    const float x = uniform(rng);
    Store(dtype, x * x * x * 1e-3f, scores.bytes.data() + static_cast<size_t>(i) * size);
  }
  std::vector<float> momentum(static_cast<size_t>(n));
  for (float& m : momentum) m = uniform(rng) * 1e-3f;
  momentum.back() = 0.0f;  // the new token joins a scoring step at 0
  std::vector<int64_t> positions(static_cast<size_t>(n));
  std::iota(positions.begin(), positions.end(), int64_t{0});

  // CPU reference.
  const MomentumUpdateOptions options;
  std::vector<float> cpu_m(momentum.size());
  int64_t cpu_invalid = -1;
  cpu::UpdateMomentum(momentum.data(), cpu_m.data(), n, scores.Host(), options, &cpu_invalid,
                      nullptr);
  ASSERT_EQ(cpu_invalid, 0);
  std::vector<int64_t> cpu_selected(static_cast<size_t>(shape.evict));
  std::vector<uint64_t> scratch(static_cast<size_t>(n));
  cpu::SelectLowest(cpu_m.data(), 0, n, shape.evict, cpu_selected.data(), scratch.data(), nullptr);
  std::vector<float> cpu_updated = cpu_m;
  std::vector<int64_t> cpu_p = positions;
  cpu::RemoveEntries(cpu_m.data(), cpu_p.data(), n, cpu_selected.data(), shape.evict, nullptr);
  cpu_m.resize(static_cast<size_t>(n - shape.evict));
  cpu_p.resize(static_cast<size_t>(n - shape.evict));

  // CUDA.
  DeviceArray<uint8_t> device_scores(scores.bytes);
  DeviceArray<float> in(momentum);
  DeviceArray<float> out(momentum.size());
  DeviceArray<int64_t> p(positions);
  DeviceArray<int64_t> invalid(1);
  DeviceArray<int64_t> selected(static_cast<size_t>(shape.evict));
  cuda::UpdateMomentum(in.get(), out.get(), n, scores.At(device_scores.get()), options,
                       invalid.get(), nullptr);
  KVCM_ASSERT_KERNELS_OK("UpdateMomentum");
  EXPECT_EQ(invalid.Download()[0], 0);
  EXPECT_EQ(FirstMismatch(out.Download(), cpu_updated), -1);
  cuda::SelectLowest(out.get(), 0, n, shape.evict, selected.get(), nullptr, nullptr);
  KVCM_ASSERT_KERNELS_OK("SelectLowest");
  const std::vector<int64_t> gpu_selected = selected.Download();
  ASSERT_EQ(FirstMismatch(gpu_selected, cpu_selected), -1);
  cuda::RemoveEntries(out.get(), p.get(), n, selected.get(), shape.evict, nullptr);
  KVCM_ASSERT_KERNELS_OK("RemoveEntries");
  std::vector<float> gpu_m = out.Download();
  std::vector<int64_t> gpu_p = p.Download();
  gpu_m.resize(cpu_m.size());
  gpu_p.resize(cpu_p.size());
  EXPECT_EQ(FirstMismatch(gpu_m, cpu_m), -1);
  EXPECT_EQ(FirstMismatch(gpu_p, cpu_p), -1);
}

INSTANTIATE_TEST_SUITE_P(
    RealShapes, StepShapeParityTest,
    ::testing::Combine(::testing::ValuesIn(kStepShapes),
                       ::testing::Values(ScoreDtype::kFloat32, ScoreDtype::kFloat16)),
    [](const ::testing::TestParamInfo<std::tuple<StepShape, ScoreDtype>>& param_info) {
      return std::string(std::get<0>(param_info.param).name) + "_" +
             ScoreDtypeName(std::get<1>(param_info.param));
    });

class CompactKvParityTest
    : public ::testing::TestWithParam<std::tuple<int64_t, KvBlockLayout>> {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
};

TEST_P(CompactKvParityTest, MovesTheSameBytes) {
  const auto& [num_moves, layout] = GetParam();
  const int64_t blocks = (2 * num_moves + 16) / layout.tokens_per_block + 1;
  const int64_t slots = blocks * layout.tokens_per_block;
  std::mt19937_64 rng(static_cast<uint64_t>(num_moves) * 31 + static_cast<uint64_t>(layout.head_dim));
  std::vector<uint8_t> storage(static_cast<size_t>(blocks * layout.BlockBytes()));
  for (uint8_t& b : storage) b = static_cast<uint8_t>(rng());
  // Sources and destinations from one shuffle: disjoint, as a plan makes them.
  std::vector<int64_t> order(static_cast<size_t>(slots));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<KvMove> moves(static_cast<size_t>(num_moves));
  for (int64_t m = 0; m < num_moves; ++m) {
    moves[static_cast<size_t>(m)] = {order[static_cast<size_t>(m)],
                                     order[static_cast<size_t>(num_moves + m)]};
  }

  DeviceArray<uint8_t> device_storage(storage);
  DeviceArray<KvMove> device_moves(moves);
  cpu::CompactKv(storage.data(), layout, moves.data(), num_moves, nullptr);
  cuda::CompactKv(device_storage.get(), layout, device_moves.get(), num_moves, nullptr);
  KVCM_ASSERT_KERNELS_OK("CompactKv");
  EXPECT_EQ(FirstMismatch(device_storage.Download(), storage), -1);
}

INSTANTIATE_TEST_SUITE_P(
    MovesAndLayouts, CompactKvParityTest,
    ::testing::Combine(
        ::testing::Values(1, 7, 111, 4096),
        ::testing::Values(KvBlockLayout{16, 2, 8, 128, KvDtype::kFloat16},   // 16-byte units
                          KvBlockLayout{16, 3, 1, 4, KvDtype::kFloat32},     // 16-byte units
                          KvBlockLayout{8, 2, 1, 2, KvDtype::kFloat32},      // 8-byte units
                          KvBlockLayout{16, 3, 2, 5, KvDtype::kBFloat16},    // 4-byte units
                          KvBlockLayout{4, 2, 1, 3, KvDtype::kFloat16})),    // 2-byte units
    [](const ::testing::TestParamInfo<std::tuple<int64_t, KvBlockLayout>>& param_info) {
      const KvBlockLayout& l = std::get<1>(param_info.param);
      return "moves" + std::to_string(std::get<0>(param_info.param)) + "_tpb" +
             std::to_string(l.tokens_per_block) + "_layers" + std::to_string(l.layers) +
             "_heads" + std::to_string(l.kv_heads) + "_dim" + std::to_string(l.head_dim) +
             "_bytes" + std::to_string(KvDtypeSize(l.dtype));
    });

}  // namespace
}  // namespace kvcm::kernels

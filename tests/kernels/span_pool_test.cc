// SpanMaxPool's CPU reference (kernels/span_pool.h) against the definition read literally
// (docs/SPEC.md, "Span pooling"): an O(tokens * tokens) scan per element, on random rows
// over random positions with gaps, every dtype, widths 3 to 255, strided matrices, and
// tokens 0, 1, small and large.
#include "kernels/span_pool.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/score_validation.h"

namespace kvcm::kernels {
namespace {

// Strictly ascending positions with gaps of 1 to `max_gap` (a cache after evictions).
std::vector<int64_t> RandomPositions(std::mt19937_64& rng, int64_t tokens, int64_t max_gap) {
  std::vector<int64_t> positions;
  int64_t p = static_cast<int64_t>(rng() % 5);
  for (int64_t i = 0; i < tokens; ++i) {
    positions.push_back(p);
    p += 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_gap));
  }
  return positions;
}

// A matrix of `dtype` in `storage`: [layers, stride] elements, every value valid, and the
// padding between rows a large valid value that a kernel reading it would pool.
ScoreMatrix RandomMatrix(std::mt19937_64& rng, ScoreDtype dtype, int64_t layers, int64_t tokens,
                         int64_t stride, std::vector<uint32_t>* storage) {
  const size_t elements = static_cast<size_t>(layers * stride);
  storage->assign(elements + 1, 0);
  // Half-width dtypes use the first half of the storage as uint16 elements.
  auto* half = reinterpret_cast<uint16_t*>(storage->data());
  for (size_t at = 0; at < elements; ++at) {
    if (dtype == ScoreDtype::kFloat32) {
      (*storage)[at] = std::bit_cast<uint32_t>(1e30f);
    } else {
      half[at] = dtype == ScoreDtype::kBFloat16 ? 0x7f00 : 0x7bff;  // 1.7e38, 65504
    }
  }
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t i = 0; i < tokens; ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(u(rng) * u(rng));
      const size_t at = static_cast<size_t>(layer * stride + i);
      if (dtype == ScoreDtype::kFloat32) {
        (*storage)[at] = bits;
      } else {
        half[at] = dtype == ScoreDtype::kBFloat16 ? static_cast<uint16_t>(bits >> 16)
                                                  : static_cast<uint16_t>(rng() % 0x7800);
      }
    }
  }
  return ScoreMatrix{storage->data(), dtype, layers, tokens, stride};
}

// The definition read literally.
float PlainPool(const ScoreMatrix& m, const std::vector<int64_t>& positions, int64_t width,
                int64_t layer, int64_t i) {
  const int64_t half = (width - 1) / 2;
  float best = -1.0f;
  for (int64_t j = 0; j < m.tokens; ++j) {
    if (std::llabs(positions[static_cast<size_t>(j)] - positions[static_cast<size_t>(i)]) <= half) {
      best = std::max(best, ScoreAt(m, layer, j));
    }
  }
  return best;
}

using Case = std::tuple<ScoreDtype, int64_t /*tokens*/, int64_t /*width*/>;
class SpanMaxPoolTest : public ::testing::TestWithParam<Case> {};

TEST_P(SpanMaxPoolTest, EqualsThePlainDefinitionOverPositionsWithGaps) {
  const auto [dtype, tokens, width] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(tokens * 1000 + width) + static_cast<uint64_t>(dtype));
  for (int64_t max_gap : {int64_t{1}, int64_t{3}, width}) {
    constexpr int64_t kLayers = 3;
    const int64_t stride = tokens + 5;  // strided rows
    std::vector<uint32_t> storage;
    const ScoreMatrix m = RandomMatrix(rng, dtype, kLayers, tokens, stride, &storage);
    const std::vector<int64_t> positions = RandomPositions(rng, tokens, max_gap);
    std::vector<float> out(static_cast<size_t>(kLayers * tokens) + 1, -7.0f);
    cpu::SpanMaxPool(m, positions.data(), width, out.data(), nullptr);
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      for (int64_t i = 0; i < tokens; ++i) {
        ASSERT_EQ(out[static_cast<size_t>(layer * tokens + i)],
                  PlainPool(m, positions, width, layer, i))
            << "layer " << layer << " index " << i << " gap " << max_gap;
      }
    }
    EXPECT_EQ(out.back(), -7.0f) << "wrote past [layers, tokens]";
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesSizesWidths, SpanMaxPoolTest,
                         ::testing::Combine(::testing::Values(ScoreDtype::kFloat32,
                                                              ScoreDtype::kFloat16,
                                                              ScoreDtype::kBFloat16),
                                            ::testing::Values(0, 1, 2, 7, 111, 2000),
                                            ::testing::Values(3, 5, 15, 255)));

TEST(SpanMaxPoolEdgeTest, AGapWiderThanTheHalfWindowSeparatesNeighbours) {
  const std::vector<float> row = {1.0f, 0.0f, 0.0f, 5.0f, 0.0f};
  const std::vector<int64_t> positions = {0, 1, 2, 10, 11};
  std::vector<float> out(row.size());
  cpu::SpanMaxPool(ScoreMatrix::Dense(row.data(), ScoreDtype::kFloat32, 1, 5), positions.data(), 3,
                   out.data(), nullptr);
  // Index 2 and index 3 are neighbours by index, 8 positions apart: not by position.
  EXPECT_EQ(out, (std::vector<float>{1.0f, 1.0f, 0.0f, 5.0f, 5.0f}));
}

TEST(SpanMaxPoolEdgeTest, AnInvalidScorePoolsToNaNAtItsOwnEntry) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {-1.0f, inf, std::numeric_limits<float>::quiet_NaN()}) {
    const std::vector<float> row = {0.5f, bad, 0.25f, 0.0f};
    const std::vector<int64_t> positions = {0, 1, 2, 3};
    std::vector<float> out(row.size());
    cpu::SpanMaxPool(ScoreMatrix::Dense(row.data(), ScoreDtype::kFloat32, 1, 4), positions.data(),
                     3, out.data(), nullptr);
    EXPECT_TRUE(std::isnan(out[1])) << bad;
    int64_t invalid = 0;
    cpu::CountInvalidScores(ScoreMatrix::Dense(out.data(), ScoreDtype::kFloat32, 1, 4), &invalid,
                            nullptr);
    EXPECT_GE(invalid, 1) << bad;
  }
}

TEST(SpanMaxPoolEdgeTest, IsInTheBackendTable) {
  EXPECT_EQ(CpuBackend().span_max_pool, &cpu::SpanMaxPool);
  EXPECT_EQ(EmulatedDeviceBackend().span_max_pool, &cpu::SpanMaxPool);
}

}  // namespace
}  // namespace kvcm::kernels

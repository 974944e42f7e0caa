#include "kernels/momentum_update.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/hot_loops.h"
#include "kernels/half_float.h"
#include "kernels/score_validation.h"

namespace kvcm::kernels {
namespace {

// Scores stored in one dtype, with a stride wider than the token count.
struct StoredScores {
  std::vector<uint16_t> half;
  std::vector<float> full;
  ScoreMatrix matrix;
  std::vector<float> decoded;  // [layers, tokens] what the kernel must read

  StoredScores(ScoreDtype dtype, int64_t layers, int64_t tokens, int64_t pad, uint64_t seed) {
    const int64_t stride = tokens + pad;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    decoded.resize(static_cast<size_t>(layers * tokens));
    if (dtype == ScoreDtype::kFloat32) {
      full.assign(static_cast<size_t>(layers * stride), -1.0f);  // padding is poison
    } else {
      half.assign(static_cast<size_t>(layers * stride), 0xbc00);  // negative in both formats
    }
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t i = 0; i < tokens; ++i) {
        const float v = uniform(rng);
        const size_t at = static_cast<size_t>(l * stride + i);
        float stored = v;
        if (dtype == ScoreDtype::kFloat32) {
          full[at] = v;
        } else if (dtype == ScoreDtype::kFloat16) {
          half[at] = FloatToFloat16(v);
          stored = Float16ToFloat(half[at]);
        } else {
          half[at] = FloatToBFloat16(v);
          stored = BFloat16ToFloat(half[at]);
        }
        decoded[static_cast<size_t>(l * tokens + i)] = stored;
      }
    }
    const void* data = dtype == ScoreDtype::kFloat32 ? static_cast<const void*>(full.data())
                                                     : static_cast<const void*>(half.data());
    matrix = ScoreMatrix{data, dtype, layers, tokens, stride};
  }
};

// The update written plainly: SPEC.md step 3 (folded: m <- float(decay) * m + s_0), in
// float32.
std::vector<float> ReferenceUpdate(std::vector<float> m, const std::vector<float>& s,
                                   int64_t layers, const MomentumUpdateOptions& options) {
  const size_t n = m.size();
  const ScoreAggregation aggregation = options.aggregation;
  const float keep = static_cast<float>(
      aggregation == ScoreAggregation::kFolded ? options.decay : options.alpha);
  const float take = static_cast<float>(1.0 - options.alpha);
  if (aggregation == ScoreAggregation::kSingleStep) {
    std::vector<float> sum(n, 0.0f);
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t i = 0; i < n; ++i) sum[i] = sum[i] + s[l * n + i];
    }
    for (size_t i = 0; i < n; ++i) m[i] = sum[i] / static_cast<float>(layers);
    return m;
  }
  for (int64_t l = 0; l < layers; ++l) {
    for (size_t i = 0; i < n; ++i) {
      const float x = s[l * n + i];
      m[i] = aggregation == ScoreAggregation::kEma      ? keep * m[i] + take * x
             : aggregation == ScoreAggregation::kFolded ? keep * m[i] + x
                                                        : m[i] + x;
    }
  }
  return m;
}

struct UpdateCase {
  ScoreDtype dtype;
  ScoreAggregation aggregation;
  int64_t tokens;
  double decay = 0.0;  // kFolded only

  MomentumUpdateOptions Options() const { return {aggregation, 0.8, decay}; }
  // A folded update takes one row.
  int64_t Layers(int64_t per_layer) const {
    return aggregation == ScoreAggregation::kFolded ? 1 : per_layer;
  }
};

// Every instruction-set table this CPU runs (the public kernel uses only the selected one).
std::vector<const cpu::HotLoops*> RunnableTables() {
  std::vector<const cpu::HotLoops*> tables = {&cpu::BaselineHotLoops()};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    tables.push_back(&cpu::Avx2HotLoops());
  }
#endif
  return tables;
}

class UpdateMomentumTest : public ::testing::TestWithParam<UpdateCase> {};

TEST_P(UpdateMomentumTest, MatchesThePlainReferenceBitForBit) {
  const UpdateCase c = GetParam();
  const int64_t layers = c.Layers(5);
  StoredScores scores(c.dtype, layers, c.tokens, /*pad=*/3, /*seed=*/c.tokens);
  std::vector<float> momentum(static_cast<size_t>(c.tokens));
  for (size_t i = 0; i < momentum.size(); ++i) momentum[i] = 0.001f * static_cast<float>(i % 97);
  const std::vector<float> want = ReferenceUpdate(momentum, scores.decoded, layers, c.Options());
  std::vector<float> got(momentum.size(), -7.0f);
  int64_t invalid = -1;
  cpu::UpdateMomentum(momentum.data(), got.data(), c.tokens, scores.matrix, c.Options(),
                      &invalid, nullptr);
  EXPECT_EQ(invalid, 0);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << "token " << i;
  if (c.aggregation != ScoreAggregation::kFolded) return;  // hot_loops_test covers the rest
  for (const cpu::HotLoops* table : RunnableTables()) {
    std::vector<float> out(momentum.size(), -7.0f);
    const uint32_t screen = table->update_momentum(momentum.data(), out.data(), c.tokens,
                                                   scores.matrix, c.aggregation, c.decay);
    EXPECT_LE(screen, cpu::kLargestFiniteBits) << table->isa;
    EXPECT_EQ(out, want) << table->isa;
  }
}

TEST_P(UpdateMomentumTest, WorksInPlace) {
  const UpdateCase c = GetParam();
  const int64_t layers = c.Layers(3);
  StoredScores scores(c.dtype, layers, c.tokens, 0, 99);
  std::vector<float> momentum(static_cast<size_t>(c.tokens), 0.25f);
  const std::vector<float> want = ReferenceUpdate(momentum, scores.decoded, layers, c.Options());
  int64_t invalid = -1;
  cpu::UpdateMomentum(momentum.data(), momentum.data(), c.tokens, scores.matrix, c.Options(),
                      &invalid, nullptr);
  EXPECT_EQ(invalid, 0);
  EXPECT_EQ(momentum, want);
}

std::vector<UpdateCase> AllCases() {
  std::vector<UpdateCase> cases;
  for (ScoreDtype d : {ScoreDtype::kFloat32, ScoreDtype::kFloat16, ScoreDtype::kBFloat16}) {
    // Around the kernel's 1024-token block boundary, and odd sizes.
    for (int64_t n : {1, 7, 111, 1023, 1024, 1025, 4096, 5000}) {
      for (ScoreAggregation a : {ScoreAggregation::kEma, ScoreAggregation::kCumulative,
                                 ScoreAggregation::kSingleStep}) {
        cases.push_back({d, a, n});
      }
      // Folded decays: ema alpha 0.8 over 32 layers, cumulative, single_step, arbitrary.
      for (double decay : {0.00079228162514264, 1.0, 0.0, 0.37}) {
        cases.push_back({d, ScoreAggregation::kFolded, n, decay});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllDtypesAndAggregations, UpdateMomentumTest,
                         ::testing::ValuesIn(AllCases()));

TEST(FoldedUpdateTest, DecayOneIsACumulativeStepAndDecayZeroTakesTheRow) {
  std::vector<float> s = {0.1f, 0.9f, 0.3f};
  const ScoreMatrix row = ScoreMatrix::Dense(s.data(), ScoreDtype::kFloat32, 1, 3);
  std::vector<float> m = {5.0f, 0.25f, 1e-3f}, folded(3), cumulative(3);
  int64_t invalid = 0;
  cpu::UpdateMomentum(m.data(), folded.data(), 3, row, {ScoreAggregation::kFolded, 0.8, 1.0},
                      &invalid, nullptr);
  cpu::UpdateMomentum(m.data(), cumulative.data(), 3, row, {ScoreAggregation::kCumulative, 0.8},
                      &invalid, nullptr);
  EXPECT_EQ(folded, cumulative);
  cpu::UpdateMomentum(m.data(), folded.data(), 3, row, {ScoreAggregation::kFolded, 0.8, 0.0},
                      &invalid, nullptr);
  EXPECT_EQ(folded, s);
}

TEST(FoldedUpdateTest, CountsInvalidScoresOfTheRow) {
  std::vector<float> s = {0.5f, -0.25f, std::numeric_limits<float>::quiet_NaN(), 0.0f, -0.0f,
                          std::numeric_limits<float>::infinity()};
  const int64_t n = static_cast<int64_t>(s.size());
  std::vector<float> m(s.size(), 1.0f), out(s.size());
  int64_t invalid = 0;
  cpu::UpdateMomentum(m.data(), out.data(), n, ScoreMatrix::Dense(s.data(), ScoreDtype::kFloat32, 1, n),
                      {ScoreAggregation::kFolded, 0.8, 0.5}, &invalid, nullptr);
  EXPECT_EQ(invalid, 3);  // -0.25, NaN, +inf; -0.0 is accepted
}

TEST(UpdateMomentumValidationTest, CountsNegativeNanAndInfinite) {
  std::vector<float> scores = {0.5f, -0.25f, std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity(), 0.0f, -0.0f,
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::infinity()};
  const int64_t n = static_cast<int64_t>(scores.size());
  std::vector<float> m(scores.size(), 0.0f), out(scores.size());
  int64_t invalid = 0;
  cpu::UpdateMomentum(m.data(), out.data(), n, ScoreMatrix::Dense(scores.data(), ScoreDtype::kFloat32, 1, n),
                      {ScoreAggregation::kEma, 0.8}, &invalid, nullptr);
  // -0.25, NaN, +inf, -inf; -0.0 compares equal to 0 and is accepted, as is FLT_MAX.
  EXPECT_EQ(invalid, 4);
  int64_t counted = 0;
  cpu::CountInvalidScores(ScoreMatrix::Dense(scores.data(), ScoreDtype::kFloat32, 1, n), &counted,
                          nullptr);
  EXPECT_EQ(counted, 4);
  const InvalidScore first =
      FindFirstInvalidScore(ScoreMatrix::Dense(scores.data(), ScoreDtype::kFloat32, 1, n));
  EXPECT_EQ(first.layer, 0);
  EXPECT_EQ(first.index, 1);
  EXPECT_EQ(first.value, -0.25f);
}

TEST(UpdateMomentumValidationTest, FindsBadFloat16InLaterLayer) {
  std::vector<uint16_t> h(2 * 5, FloatToFloat16(0.5f));
  h[5 + 3] = 0x7e00;  // NaN in layer 1, token 3
  const ScoreMatrix m = ScoreMatrix::Dense(h.data(), ScoreDtype::kFloat16, 2, 5);
  int64_t counted = 0;
  cpu::CountInvalidScores(m, &counted, nullptr);
  EXPECT_EQ(counted, 1);
  const InvalidScore first = FindFirstInvalidScore(m);
  EXPECT_EQ(first.layer, 1);
  EXPECT_EQ(first.index, 3);
}

TEST(UpdateMomentumTest, AlphaZeroKeepsOnlyTheLastLayer) {
  std::vector<float> s = {0.1f, 0.9f, 0.3f, 0.7f, 0.2f, 0.4f};  // 2 layers x 3
  std::vector<float> m = {5.0f, 5.0f, 5.0f};
  int64_t invalid = 0;
  cpu::UpdateMomentum(m.data(), m.data(), 3, ScoreMatrix::Dense(s.data(), ScoreDtype::kFloat32, 2, 3),
                      {ScoreAggregation::kEma, 0.0}, &invalid, nullptr);
  EXPECT_EQ(m, (std::vector<float>{0.7f, 0.2f, 0.4f}));
}

TEST(UpdateMomentumTest, EmaWeightsLaterLayersMore) {
  // Two layers, alpha 0.5: m = 0.25 * m0 + 0.25 * s0 + 0.5 * s1.
  std::vector<float> s = {1.0f, 0.0f, 0.0f, 1.0f};  // layer 0 favours token 0, layer 1 token 1
  std::vector<float> m = {0.0f, 0.0f};
  int64_t invalid = 0;
  cpu::UpdateMomentum(m.data(), m.data(), 2, ScoreMatrix::Dense(s.data(), ScoreDtype::kFloat32, 2, 2),
                      {ScoreAggregation::kEma, 0.5}, &invalid, nullptr);
  EXPECT_EQ(m[0], 0.25f);
  EXPECT_EQ(m[1], 0.5f);
}

TEST(MeanMomentumTest, IsTheMeanInDoubleAndZeroWhenEmpty) {
  double mean = -1;
  cpu::MeanMomentum(nullptr, 0, &mean, nullptr);
  EXPECT_EQ(mean, 0.0);
  std::vector<float> m = {1.0f, 2.0f, 4.0f, 8.0f, 16.0f, 0.5f, 0.25f};
  cpu::MeanMomentum(m.data(), static_cast<int64_t>(m.size()), &mean, nullptr);
  EXPECT_DOUBLE_EQ(mean, 31.75 / 7.0);
  // Accumulating in float would lose the small terms next to a large one.
  std::vector<float> wide(1001, 1.0f);
  wide[0] = 16777216.0f;  // 2^24: adding 1.0f to it in float does nothing
  cpu::MeanMomentum(wide.data(), 1001, &mean, nullptr);
  EXPECT_DOUBLE_EQ(mean, (16777216.0 + 1000.0) / 1001.0);
}

TEST(ConvertToFloat32Test, DecodesEveryDtype) {
  const std::vector<float> values = {0.0f, 1.0f, 0.5f, 3.0f, 1e-3f};
  std::vector<uint16_t> h, b;
  for (float v : values) {
    h.push_back(FloatToFloat16(v));
    b.push_back(FloatToBFloat16(v));
  }
  std::vector<float> out(values.size());
  cpu::ConvertToFloat32(values.data(), ScoreDtype::kFloat32, 5, out.data(), nullptr);
  EXPECT_EQ(out, values);
  cpu::ConvertToFloat32(h.data(), ScoreDtype::kFloat16, 5, out.data(), nullptr);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(out[i], Float16ToFloat(h[i]));
  cpu::ConvertToFloat32(b.data(), ScoreDtype::kBFloat16, 5, out.data(), nullptr);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(out[i], BFloat16ToFloat(b[i]));
}

TEST(JoinRankPartialsTest, SumsRanksAndDividesByTotalHeads) {
  // 2 layers x 3 tokens; rank 0 has 1 head, rank 1 has 3 heads.
  std::vector<float> r0 = {0.1f, 0.2f, 0.7f, 0.5f, 0.5f, 0.0f};
  std::vector<uint16_t> r1;
  for (float v : {0.3f, 1.2f, 1.5f, 1.5f, 0.75f, 0.75f}) r1.push_back(FloatToFloat16(v));
  const ScoreMatrix partials[2] = {ScoreMatrix::Dense(r0.data(), ScoreDtype::kFloat32, 2, 3),
                                   ScoreMatrix::Dense(r1.data(), ScoreDtype::kFloat16, 2, 3)};
  std::vector<float> out(6);
  cpu::JoinRankPartials(partials, 2, 4, out.data(), nullptr);
  for (size_t i = 0; i < 6; ++i) {
    const double want =
        (static_cast<double>(r0[i]) + static_cast<double>(Float16ToFloat(r1[i]))) / 4.0;
    EXPECT_EQ(out[i], static_cast<float>(want)) << i;
  }
}

TEST(JoinRankPartialsTest, DoesNotDependOnWhichRankHoldsWhat) {
  // Rank order is the summation order; permuting the contents of ranks whose sums are
  // exact in double gives bit-identical output.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<std::vector<float>> ranks(4, std::vector<float>(777));
  for (auto& r : ranks) for (float& v : r) v = u(rng);
  std::vector<ScoreMatrix> a, b;
  for (int i = 0; i < 4; ++i) a.push_back(ScoreMatrix::Dense(ranks[i].data(), ScoreDtype::kFloat32, 1, 777));
  for (int i = 3; i >= 0; --i) b.push_back(ScoreMatrix::Dense(ranks[i].data(), ScoreDtype::kFloat32, 1, 777));
  std::vector<float> out_a(777), out_b(777);
  cpu::JoinRankPartials(a.data(), 4, 8, out_a.data(), nullptr);
  cpu::JoinRankPartials(b.data(), 4, 8, out_b.data(), nullptr);
  EXPECT_EQ(out_a, out_b);
}

}  // namespace
}  // namespace kvcm::kernels

// MeanMomentum's exact, order-independent sum (kernels/exact_sum.h): the same bits for
// every order of the same values, the exact sum where it is representable, and the
// edge cases (zeros, subnormals next to large values, non-finite values). The CUDA kernel
// computes the same function; tests/gpu pins the two against each other.
#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/hot_loops.h"
#include "kernels/exact_sum.h"
#include "kernels/momentum_update.h"

namespace kvcm::kernels {
namespace {

double Mean(const std::vector<float>& v) {
  double mean = -1.0;
  cpu::MeanMomentum(v.data(), static_cast<int64_t>(v.size()), &mean, nullptr);
  return mean;
}

uint64_t Bits(double d) { return std::bit_cast<uint64_t>(d); }

// The exact sum of non-negative floats as a fixed-point big integer in units of 2^-149,
// rounded once to double (round to nearest even): the reference for ranges where a long
// double accumulator would not be exact.
double ExactReferenceSum(const std::vector<float>& values) {
  std::vector<uint32_t> limbs(12, 0);  // 384 bits: 2^-149 .. 2^235
  for (float v : values) {
    int exponent = 0;
    const double mantissa = std::frexp(static_cast<double>(v), &exponent);
    if (mantissa == 0.0) continue;
    // v = integer * 2^(exponent - 24), integer < 2^24.
    uint64_t integer = static_cast<uint64_t>(std::ldexp(mantissa, 24));
    int shift = exponent - 24 + 149;
    while (shift < 0) {  // subnormal: integer has trailing zeros
      integer >>= 1;
      ++shift;
    }
    const int limb = shift / 32;
    const int bit = shift % 32;
    unsigned __int128 carry = static_cast<unsigned __int128>(integer) << bit;
    for (size_t i = static_cast<size_t>(limb); carry != 0 && i < limbs.size(); ++i) {
      carry += limbs[i];
      limbs[i] = static_cast<uint32_t>(carry);
      carry >>= 32;
    }
  }
  // Round to double: take the top 64 bits below the leading one, with a sticky bit.
  int top = static_cast<int>(limbs.size()) * 32 - 1;
  auto bit_at = [&](int b) { return (limbs[static_cast<size_t>(b / 32)] >> (b % 32)) & 1u; };
  while (top >= 0 && bit_at(top) == 0) --top;
  if (top < 0) return 0.0;
  uint64_t mant = 0;
  int b = top;
  for (int i = 0; i < 53 && b >= 0; ++i, --b) mant = (mant << 1) | bit_at(b);
  int low_bit = b + 1;  // weight of mant's last bit
  if (b >= 0) {
    const bool half = bit_at(b) != 0;
    bool sticky = false;
    for (int r = b - 1; r >= 0 && !sticky; --r) sticky = bit_at(r) != 0;
    if (half && (sticky || (mant & 1u))) ++mant;
  }
  return std::ldexp(static_cast<double>(mant), low_bit - 149);
}

TEST(ExactSumTest, EveryOrderOfTheSameValuesGivesTheSameBits) {
  std::mt19937_64 rng(12);
  for (int round = 0; round < 60; ++round) {
    const size_t n = 1 + rng() % 9000;
    std::vector<float> v(n);
    // Attention-like momentum: many tiny values, a few large, some zeros, some subnormal.
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (float& x : v) {
      const float y = u(rng);
      x = y * y * y * y * 1e-3f;
      if (rng() % 97 == 0) x = 0.0f;
      if (rng() % 211 == 0) x = std::ldexp(1.0f, -140) * static_cast<float>(rng() % 512);
      if (rng() % 503 == 0) x = 1e6f * y;
    }
    const double mean = Mean(v);
    for (int shuffle = 0; shuffle < 4; ++shuffle) {
      std::shuffle(v.begin(), v.end(), rng);
      ASSERT_EQ(Bits(Mean(v)), Bits(mean)) << "round " << round << " n " << n;
    }
    std::sort(v.begin(), v.end());
    ASSERT_EQ(Bits(Mean(v)), Bits(mean));
    std::reverse(v.begin(), v.end());
    ASSERT_EQ(Bits(Mean(v)), Bits(mean));
  }
}

TEST(ExactSumTest, TheSumIsWithinOneRoundingOfTheExactSum) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 200; ++round) {
    const size_t n = 1 + rng() % 3000;
    std::vector<float> v(n);
    for (float& x : v) {
      // Magnitudes over the whole float range, subnormals included.
      const int exponent = static_cast<int>(rng() % 270) - 149;
      x = std::ldexp(static_cast<float>(1 + rng() % 0xffffff), exponent - 24);
      if (!std::isfinite(x)) x = FLT_MAX;
    }
    const double exact = ExactReferenceSum(v);
    const double got = cpu::SelectedHotLoops().exact_sum(v.data(), static_cast<int64_t>(n));
    // The levels add up exactly; only the last additions round.
    EXPECT_LE(std::fabs(got - exact), 2.0 * std::ldexp(DBL_EPSILON, std::ilogb(exact)))
        << "round " << round;
  }
}

TEST(ExactSumTest, RepresentableSumsAreExact) {
  // 2^24 + 1000 ones: a float accumulator loses every one of them.
  std::vector<float> wide(1001, 1.0f);
  wide[0] = 16777216.0f;
  EXPECT_EQ(Mean(wide), (16777216.0 + 1000.0) / 1001.0);
  // A large value and tiny ones 2^-100 below it: the double sum of the tiny ones is exact
  // only because the levels keep them apart from the large one.
  std::vector<float> apart = {1.0f, std::ldexp(1.0f, -100), std::ldexp(1.0f, -100)};
  const double sum = cpu::SelectedHotLoops().exact_sum(apart.data(), 3);
  EXPECT_EQ(sum, 1.0 + std::ldexp(1.0, -99));  // representable in double
  std::vector<float> m = {1.0f, 2.0f, 4.0f, 8.0f, 16.0f, 0.5f, 0.25f};
  EXPECT_EQ(Mean(m), 31.75 / 7.0);
  EXPECT_EQ(Mean(std::vector<float>(6401, 0.1f)),
            static_cast<double>(0.1f) * 6401.0 / 6401.0);
}

TEST(ExactSumTest, ZerosSubnormalsAndTheEmptyCache) {
  double mean = -1.0;
  cpu::MeanMomentum(nullptr, 0, &mean, nullptr);
  EXPECT_EQ(Bits(mean), Bits(0.0));
  EXPECT_EQ(Bits(Mean({0.0f, -0.0f, 0.0f})), Bits(0.0));
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(Mean({tiny, tiny, 0.0f, tiny}),
            3.0 * static_cast<double>(tiny) / 4.0);
  EXPECT_EQ(Mean({FLT_MAX, FLT_MAX}), static_cast<double>(FLT_MAX));
}

TEST(ExactSumTest, NonFiniteValuesGiveNanOrTheInfinityOfTheirSign) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(Mean({1.0f, nan, 2.0f})));
  EXPECT_TRUE(std::isnan(Mean({inf, -inf})));
  EXPECT_EQ(Mean({1.0f, inf}), std::numeric_limits<double>::infinity());
  EXPECT_EQ(Mean({-inf, 3.0f}), -std::numeric_limits<double>::infinity());
}

TEST(ExactSumTest, ThePlanReachesTheSmallestValuesLastBit) {
  // One value: a single level suffices for any float.
  EXPECT_EQ(PlanExactSum(0x3f800000u, 0x3f800000u, 1).levels, 1);
  // Nothing but zeros: no levels.
  EXPECT_EQ(PlanExactSum(0, kNoNonZeroBits, 10).levels, 0);
  // The widest range at the largest count stays within the level budget.
  const ExactSumPlan widest = PlanExactSum(0x7f7fffffu, 1u, kMaxExactSumCount);
  EXPECT_GE(widest.levels, 2);
  EXPECT_LE(widest.levels, kMaxExactSumLevels);
}

}  // namespace
}  // namespace kvcm::kernels

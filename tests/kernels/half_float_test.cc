#include "kernels/half_float.h"

#include <bit>
#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace kvcm::kernels {
namespace {

// Reference decoding of binary16 from its definition, in double.
double Float16Reference(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  if (exponent == 31) return mantissa ? NAN : sign * INFINITY;
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

TEST(HalfFloatTest, EveryFloat16DecodesToItsExactValue) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float got = Float16ToFloat(static_cast<uint16_t>(h));
    const double want = Float16Reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(HalfFloatTest, Float16RoundTripsThroughFloat) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Float16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToFloat16(f), h) << std::hex << h;
  }
}

TEST(HalfFloatTest, FloatToFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToFloat16(1.0f), 0x3c00);
  // 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10): ties to even (1.0).
  EXPECT_EQ(FloatToFloat16(1.0f + 0x1p-11f), 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even).
  EXPECT_EQ(FloatToFloat16(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(FloatToFloat16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(FloatToFloat16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToFloat16(0x1p-26f), 0x0000);  // below half of it: zero
  EXPECT_EQ(FloatToFloat16(-2.0f), 0xc000);
}

TEST(HalfFloatTest, BFloat16IsTheHighHalfOfFloat) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(h));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), h << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToBFloat16(f), h);
    }
  }
  // Round to nearest even on the dropped half.
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
}

}  // namespace
}  // namespace kvcm::kernels

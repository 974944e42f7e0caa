// Scalar float16 / bfloat16 to float32 conversions, written with integer operations only so
// that loops over them vectorize on any x86-64 or ARM target (no F16C requirement).
// Both are exact: every float16 and bfloat16 value is representable in float32.
#ifndef KVCM_KERNELS_HALF_FLOAT_H_
#define KVCM_KERNELS_HALF_FLOAT_H_

#include <bit>
#include <cstdint>

namespace kvcm::kernels {

inline float BFloat16ToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// IEEE binary16 -> binary32. Normals and subnormals: shift the exponent+mantissa into the
// float32 field and rescale by 2^112 (the exponent bias difference), which is exact.
// Infinity and NaN: keep the all-ones exponent.
inline float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  const float scaled = std::bit_cast<float>(magnitude << 13) * 0x1p112f;
  // Select with a mask rather than ?: so that loops over this stay branch-free and
  // vectorize (the vectorizer gives up on the conditional form).
  const uint32_t special = 0u - static_cast<uint32_t>(magnitude >= 0x7c00u);
  const uint32_t bits = (std::bit_cast<uint32_t>(scaled) & ~special) |
                        ((0x7f800000u | (magnitude << 13)) & special);
  return std::bit_cast<float>(bits | sign);
}

// float32 -> binary16 with round-to-nearest-even (used by clients and tests to encode).
inline uint16_t FloatToFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero: value / 2^-24, rounded
    const float scaled = std::bit_cast<float>(abs) * 0x1p24f;
    // Float addition rounds to nearest even at integer granularity for values < 2^23.
    const float rounded = (scaled + 0x1p23f) - 0x1p23f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  const uint32_t mantissa_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xfffu + mantissa_odd;
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_HALF_FLOAT_H_

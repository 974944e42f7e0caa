// The exact, order-independent sum behind MeanMomentum, shared by the CPU reference and
// the CUDA kernel (this header compiles as host and as device code).
//
// The mean momentum decides where a token joins on a lazy or score-free step, so the CPU
// and the GPU must agree on it bit for bit. A double sum in any fixed order cannot give
// that: the GPU sums in a tree, the CPU in lanes. Instead both split every value, at
// power-of-two boundaries fixed by the data (its largest and smallest non-zero
// magnitude and its count), into pieces whose sums are exact in double in ANY order
// (Rump, Ogita and Oishi, "Accurate floating-point summation part I", SIAM J. Sci.
// Comput. 31(1), 2008, ExtractScalar, Lemma 3.2):
//
//   m     = ceil(log2 n)           (n <= 2^m values)
//   sigma_j = 2^(top - j*(53 - m))  level j = 0 .. levels-1
//   q_j   = (sigma_j + r) - sigma_j ;  r <- r - q_j      (r starts as the value, in double)
//
// Each q_j is a multiple of 2^(k_j - 53) no larger than 2^(k_j - m), so the level sums
// T_j = sum over values of q_j are exact whatever the order; after the last level every
// remainder is exactly 0 (the levels reach down to the smallest value's last bit), so
// the T_j add up to the exact sum. The result is then
//
//   sum = T_0 + (T_1 + (... + T_{levels-1}))      (in double, smallest level first)
//
// which depends only on the multiset of values: the exact sum rounded in a fixed,
// data-determined way (within one rounding of it). MeanMomentum is sum / n, in double.
// Non-finite values (which the engine never holds) give NaN, or an infinity of the only
// sign present. Stateless; plain functions.
#ifndef KVCM_KERNELS_EXACT_SUM_H_
#define KVCM_KERNELS_EXACT_SUM_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCM_HOST_DEVICE __host__ __device__
#else
#define KVCM_HOST_DEVICE
#endif

namespace kvcm::kernels {

// Enough levels for any float32 input of up to 2^40 values.
inline constexpr int kMaxExactSumLevels = 24;
inline constexpr int64_t kMaxExactSumCount = int64_t{1} << 40;

// Bits of |v|: for finite values they order like |v|; 0x7f800000 is infinity, above is NaN.
KVCM_HOST_DEVICE inline uint32_t MagnitudeBits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v) & 0x7fffffffu;
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffffu;
#endif
}

inline constexpr uint32_t kInfinityBits = 0x7f800000u;
// The "no non-zero value seen" start of the smallest-magnitude reduction.
inline constexpr uint32_t kNoNonZeroBits = 0xffffffffu;

// Flags of the non-finite values seen, OR-ed together (the rare path).
enum : uint32_t { kSawNan = 1, kSawPlusInfinity = 2, kSawMinusInfinity = 4 };

KVCM_HOST_DEVICE inline uint32_t NonFiniteFlags(float v) {
  const uint32_t magnitude = MagnitudeBits(v);
  if (magnitude < kInfinityBits) return 0;
  if (magnitude > kInfinityBits) return kSawNan;
  return v > 0.0f ? kSawPlusInfinity : kSawMinusInfinity;
}

// The sum when a value is not finite: NaN unless every non-finite value is an infinity of
// one sign.
KVCM_HOST_DEVICE inline double NonFiniteSum(uint32_t flags) {
  if ((flags & kSawNan) != 0 ||
      (flags & (kSawPlusInfinity | kSawMinusInfinity)) == (kSawPlusInfinity | kSawMinusInfinity)) {
    return NAN;
  }
  return (flags & kSawPlusInfinity) != 0 ? HUGE_VAL : -HUGE_VAL;
}

struct ExactSumPlan {
  int levels = 0;        // 0: every value is +-0 (the sum is 0)
  int top_exponent = 0;  // level j splits at 2^(top_exponent - j * step)
  int step = 0;          // 53 - ceil(log2 n)
};

// The plan for `n` finite values whose largest magnitude has bits `max_bits` and whose
// smallest non-zero magnitude has bits `min_nonzero_bits` (kNoNonZeroBits when none).
// REQUIRES: 1 <= n <= kMaxExactSumCount, max_bits < kInfinityBits.
KVCM_HOST_DEVICE inline ExactSumPlan PlanExactSum(uint32_t max_bits, uint32_t min_nonzero_bits,
                                                  int64_t n) {
  ExactSumPlan plan;
  if (max_bits == 0) return plan;
  int m = 0;
  while ((int64_t{1} << m) < n) ++m;
  const int e_max = static_cast<int>(max_bits >> 23);
  const int e_min = static_cast<int>(min_nonzero_bits >> 23);
  // A float of biased exponent e (1 for subnormals) is below 2^(e - 126) and a multiple
  // of 2^(e - 150).
  const int high = (e_max < 1 ? 1 : e_max) - 126;
  const int low = (e_min < 1 ? 1 : e_min) - 150;
  plan.top_exponent = high + m;
  plan.step = 53 - m;
  plan.levels = 1;
  // The last level's boundary k must satisfy k - 53 < low: its remainders are then 0.
  while (plan.top_exponent - (plan.levels - 1) * plan.step > low + 52) ++plan.levels;
  return plan;
}

KVCM_HOST_DEVICE inline double ExactSumBoundary(const ExactSumPlan& plan, int level) {
  return ldexp(1.0, plan.top_exponent - level * plan.step);
}

// One extraction: returns the piece of `*rest` on the grid of `boundary` and leaves the
// (exact) remainder in `*rest`.
KVCM_HOST_DEVICE inline double ExtractPiece(double boundary, double* rest) {
#if defined(__CUDA_ARCH__)
  const double piece = __dsub_rn(__dadd_rn(boundary, *rest), boundary);
  *rest = __dsub_rn(*rest, piece);
#else
  const double piece = (boundary + *rest) - boundary;
  *rest = *rest - piece;
#endif
  return piece;
}

// sum = T_0 + (T_1 + (... + T_{levels-1})).  level_sums: [levels].
KVCM_HOST_DEVICE inline double CombineLevelSums(const double* level_sums, int levels) {
  double sum = 0.0;
  for (int j = levels - 1; j >= 0; --j) {
#if defined(__CUDA_ARCH__)
    sum = __dadd_rn(level_sums[j], sum);
#else
    sum = level_sums[j] + sum;
#endif
  }
  return sum;
}

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_EXACT_SUM_H_

// Bodies of kernels/cpu/hot_loops.h. Included by exactly one .cc per instruction set,
// inside namespace KVCM_HOT_LOOPS_ISA; deliberately no include guard.
#include <algorithm>
#include <bit>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/cpu/hot_loops.h"
#include "kernels/exact_sum.h"
#include "kernels/half_float.h"

namespace kvcm::kernels::cpu {
namespace KVCM_HOT_LOOPS_ISA {
namespace {

inline uint32_t Bits(float v) { return std::bit_cast<uint32_t>(v); }

// Half-precision rows are widened to float32 a block at a time, then folded by the
// float32 loop. With F16C (the AVX2 build) float16 uses the hardware conversion, which
// GCC does not generate from scalar code; elsewhere the integer conversion of
// kernels/half_float.h, which vectorizes.
void WidenRow(const uint16_t* src, ScoreDtype dtype, int64_t n, float* dst) {
  int64_t i = 0;
  if (dtype == ScoreDtype::kBFloat16) {
    for (; i < n; ++i) dst[i] = BFloat16ToFloat(src[i]);
    return;
  }
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = Float16ToFloat(src[i]);
}

template <ScoreAggregation A>
inline float Combine(float m, float s, float keep, float take) {
  if constexpr (A == ScoreAggregation::kEma) {
    return keep * m + take * s;
  } else if constexpr (A == ScoreAggregation::kFolded) {
    return keep * m + s;  // keep = float(decay)
  } else {
    return m + s;  // cumulative, and the layer sum of single_step
  }
}

// Folds four float32 rows into acc[0, n): the momentum is loaded and stored once per four
// layers instead of once per layer, while each element still sees the layers one by one
// in order (the same arithmetic and rounding as one layer per pass). Returns the largest
// score bit pattern seen.
template <ScoreAggregation A>
uint32_t FoldFour(float* acc, int64_t n, const float* r0, const float* r1, const float* r2,
                  const float* r3, float keep, float take) {
  uint32_t screen = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float s0 = r0[i], s1 = r1[i], s2 = r2[i], s3 = r3[i];
    screen = std::max(screen, std::max(std::max(Bits(s0), Bits(s1)),
                                       std::max(Bits(s2), Bits(s3))));
    float m = acc[i];
    m = Combine<A>(m, s0, keep, take);
    m = Combine<A>(m, s1, keep, take);
    m = Combine<A>(m, s2, keep, take);
    m = Combine<A>(m, s3, keep, take);
    acc[i] = m;
  }
  return screen;
}

template <ScoreAggregation A>
uint32_t FoldOne(float* acc, int64_t n, const float* r, float keep, float take) {
  uint32_t screen = 0;
  for (int64_t i = 0; i < n; ++i) {
    screen = std::max(screen, Bits(r[i]));
    acc[i] = Combine<A>(acc[i], r[i], keep, take);
  }
  return screen;
}

constexpr int64_t kBlock = 1024;  // 4 KiB of float32 momentum: stays in L1 across layers

// `keep_factor`: alpha for kEma, decay for kFolded.
template <ScoreAggregation A>
uint32_t UpdateTyped(const float* momentum_in, float* momentum_out, int64_t tokens,
                     const ScoreMatrix& scores, double keep_factor) {
  const float keep = static_cast<float>(keep_factor);
  const float take = static_cast<float>(1.0 - keep_factor);  // kEma only
  const float layer_count = static_cast<float>(scores.layers);
  const bool widen = scores.dtype != ScoreDtype::kFloat32;
  uint32_t screen = 0;
  alignas(64) float acc[kBlock];
  alignas(64) float widened[4][kBlock];  // half-precision rows of the current pass
  // Row `layer` of this block as float32 (widened into slot `slot` when needed).
  auto row = [&](int64_t layer, int64_t base, int64_t n, int slot) -> const float* {
    if (!widen) return static_cast<const float*>(scores.Row(layer)) + base;
    WidenRow(static_cast<const uint16_t*>(scores.Row(layer)) + base, scores.dtype, n,
             widened[slot]);
    return widened[slot];
  };
  for (int64_t base = 0; base < tokens; base += kBlock) {
    const int64_t n = std::min(kBlock, tokens - base);
    if constexpr (A == ScoreAggregation::kSingleStep) {
      std::fill_n(acc, n, 0.0f);
    } else {
      std::memcpy(acc, momentum_in + base, static_cast<size_t>(n) * sizeof(float));
    }
    int64_t layer = 0;
    for (; layer + 4 <= scores.layers; layer += 4) {
      const float* r0 = row(layer, base, n, 0);
      const float* r1 = row(layer + 1, base, n, 1);
      const float* r2 = row(layer + 2, base, n, 2);
      const float* r3 = row(layer + 3, base, n, 3);
      screen = std::max(screen, FoldFour<A>(acc, n, r0, r1, r2, r3, keep, take));
    }
    for (; layer < scores.layers; ++layer) {
      screen = std::max(screen, FoldOne<A>(acc, n, row(layer, base, n, 0), keep, take));
    }
    if constexpr (A == ScoreAggregation::kSingleStep) {
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] / layer_count;
    }
    std::memcpy(momentum_out + base, acc, static_cast<size_t>(n) * sizeof(float));
  }
  return screen;
}

uint32_t UpdateMomentum(const float* in, float* out, int64_t tokens, const ScoreMatrix& scores,
                        ScoreAggregation aggregation, double keep) {
  switch (aggregation) {
    case ScoreAggregation::kEma:
      return UpdateTyped<ScoreAggregation::kEma>(in, out, tokens, scores, keep);
    case ScoreAggregation::kCumulative:
      return UpdateTyped<ScoreAggregation::kCumulative>(in, out, tokens, scores, keep);
    case ScoreAggregation::kSingleStep:
      return UpdateTyped<ScoreAggregation::kSingleStep>(in, out, tokens, scores, keep);
    case ScoreAggregation::kFolded:
      return UpdateTyped<ScoreAggregation::kFolded>(in, out, tokens, scores, keep);
  }
  return 0;
}

// Two passes, both vectorizable: the minimum bit pattern (for values >= 0 it orders like
// the value; the sign bit is masked so that -0.0 ties with +0.0), then its first
// occurrence.
inline int32_t OrderBits(float v) { return std::bit_cast<int32_t>(v) & 0x7fffffff; }

int64_t ArgMin(const float* values, int64_t begin, int64_t end) {
  int32_t lowest = OrderBits(values[begin]);
  for (int64_t i = begin + 1; i < end; ++i) lowest = std::min(lowest, OrderBits(values[i]));
  for (int64_t i = begin; i < end; ++i) {
    if (OrderBits(values[i]) == lowest) return i;
  }
  return begin;
}

// kernels/exact_sum.h: the largest and smallest non-zero magnitude (one vectorized
// pass; the smallest as the minimum of bits - 1, where a zero wraps to the top), then per
// block of 1024 values the level pieces, each level summed in eight lanes. Every level
// sum is exact, so the lanes (and the vectorizer's choice of them) cannot change the
// result. The last level's remainders are known to be 0 and are not formed.
inline double SumLanes(const double* lanes) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

double ExactSum(const float* values, int64_t n) {
  if (n <= 0) return 0.0;
  uint32_t max_bits = 0;
  uint32_t min_bits_less_one = 0xffffffffu;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = MagnitudeBits(values[i]);
    max_bits = std::max(max_bits, b);
    min_bits_less_one = std::min(min_bits_less_one, b - 1u);
  }
  if (max_bits >= kInfinityBits) {
    uint32_t flags = 0;
    for (int64_t i = 0; i < n; ++i) flags |= NonFiniteFlags(values[i]);
    return NonFiniteSum(flags);
  }
  const uint32_t min_bits =
      min_bits_less_one == 0xffffffffu ? kNoNonZeroBits : min_bits_less_one + 1u;
  const ExactSumPlan plan = PlanExactSum(max_bits, min_bits, n);
  if (plan.levels == 0) return 0.0;
  double level_sums[kMaxExactSumLevels] = {};
  const int last = plan.levels - 1;
  alignas(64) double rest[kBlock];
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t count = std::min(kBlock, n - base);
    const int64_t body = count - count % 8;
    const float* v = values + base;
    for (int level = 0; level <= last; ++level) {
      const double boundary = ExactSumBoundary(plan, level);
      double lanes[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      if (level == 0 && level == last) {
        for (int64_t i = 0; i < body; i += 8) {
          for (int l = 0; l < 8; ++l) {
            lanes[l] += (boundary + static_cast<double>(v[i + l])) - boundary;
          }
        }
        for (int64_t i = body; i < count; ++i) {
          lanes[0] += (boundary + static_cast<double>(v[i])) - boundary;
        }
      } else if (level == 0) {
        for (int64_t i = 0; i < body; i += 8) {
          for (int l = 0; l < 8; ++l) {
            rest[i + l] = static_cast<double>(v[i + l]);
            lanes[l] += ExtractPiece(boundary, &rest[i + l]);
          }
        }
        for (int64_t i = body; i < count; ++i) {
          rest[i] = static_cast<double>(v[i]);
          lanes[0] += ExtractPiece(boundary, &rest[i]);
        }
      } else if (level == last) {
        for (int64_t i = 0; i < body; i += 8) {
          for (int l = 0; l < 8; ++l) lanes[l] += (boundary + rest[i + l]) - boundary;
        }
        for (int64_t i = body; i < count; ++i) lanes[0] += (boundary + rest[i]) - boundary;
      } else {
        for (int64_t i = 0; i < body; i += 8) {
          for (int l = 0; l < 8; ++l) lanes[l] += ExtractPiece(boundary, &rest[i + l]);
        }
        for (int64_t i = body; i < count; ++i) lanes[0] += ExtractPiece(boundary, &rest[i]);
      }
      level_sums[level] += SumLanes(lanes);
    }
  }
  return CombineLevelSums(level_sums, plan.levels);
}

}  // namespace

const HotLoops& Table() {
  static const HotLoops table{KVCM_HOT_LOOPS_ISA_NAME, &UpdateMomentum, &ArgMin, &ExactSum};
  return table;
}

}  // namespace KVCM_HOT_LOOPS_ISA
}  // namespace kvcm::kernels::cpu

// The innermost loops of the CPU kernels, compiled once per instruction set.
//
// kernels/cpu/hot_loops_baseline.cc and hot_loops_avx2.cc each include hot_loops_impl.h
// with their own compiler flags; the public kernels (momentum_update_cpu.cc,
// selection_cpu.cc) pick one table at first use. Every loop computes element by element in
// the same order on every instruction set (no reassociation, no FMA contraction), so the
// choice changes speed, never results.
#ifndef KVCM_KERNELS_CPU_HOT_LOOPS_H_
#define KVCM_KERNELS_CPU_HOT_LOOPS_H_

#include <cstdint>

#include "kernels/momentum_update.h"
#include "kernels/score_matrix.h"

namespace kvcm::kernels::cpu {

// Any float whose bit pattern is above this is negative, infinite or NaN (or -0.0, which
// the exact check then lets through).
inline constexpr uint32_t kLargestFiniteBits = 0x7f7fffffu;

struct HotLoops {
  const char* isa;
  // momentum_out[i] = update of momentum_in[i] by every layer (see momentum_update.h).
  // `keep` is the factor on the old momentum: alpha for kEma, decay for kFolded (unused by
  // the others). Returns the largest bit pattern among the scores read: a one-instruction
  // screen for invalid scores (> kLargestFiniteBits means "check exactly").
  uint32_t (*update_momentum)(const float* momentum_in, float* momentum_out, int64_t tokens,
                              const ScoreMatrix& scores, ScoreAggregation aggregation,
                              double keep);
  // Index of the first minimum of values[begin, end) (values >= 0), end > begin.
  int64_t (*arg_min)(const float* values, int64_t begin, int64_t end);
  // The exact, order-independent sum of kernels/exact_sum.h (what MeanMomentum divides).
  double (*exact_sum)(const float* values, int64_t n);
};

const HotLoops& BaselineHotLoops();
#if defined(__x86_64__)
const HotLoops& Avx2HotLoops();
#endif
// The fastest table this CPU supports, chosen once.
const HotLoops& SelectedHotLoops();

}  // namespace kvcm::kernels::cpu

#endif  // KVCM_KERNELS_CPU_HOT_LOOPS_H_

// The momentum arithmetic of one scoring step: fold a step's per-layer scores into the
// running utility of every cached token, in the order the model ran its layers.
//
//   ema:         m <- alpha * m + (1 - alpha) * s_l      for l = 0 .. layers-1
//   cumulative:  m <- m + s_l                            for l = 0 .. layers-1
//   single_step: m <- (sum_l s_l) / layers               (the past is dropped)
//   folded:      m <- decay * m + s_0                    (layers == 1: a folded row)
//
// `folded` is the closed form of the three score rules over K layers, for one row that the
// caller has already folded with the weights of cache_manager/policy/fold.h (docs/SPEC.md,
// "Folded reports"): ema decay alpha^K, cumulative 1, single_step 0.
//
// The update is fused with validation: every score is checked (finite and >= 0) in the
// same pass that reads it, and the count of bad elements is returned, so a caller can
// reject the step without a second read. Stateless and thread-safe.
//
// The CPU reference (namespace cpu) and the CUDA kernels (namespace cuda) share these
// signatures (kernels/backend.h checks it at compile time); their parity is pinned by
// tests/gpu.
#ifndef KVCM_KERNELS_MOMENTUM_UPDATE_H_
#define KVCM_KERNELS_MOMENTUM_UPDATE_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels {

enum class ScoreAggregation : uint8_t { kEma, kCumulative, kSingleStep, kFolded };

struct MomentumUpdateOptions {
  ScoreAggregation aggregation = ScoreAggregation::kEma;
  double alpha = 0.8;  // ema only: m <- float(alpha) * m + float(1 - alpha) * s
  double decay = 0.0;  // folded only: m <- float(decay) * m + s
};

namespace cpu {

// momentum_in:  [tokens] f32, host.   momentum_out: [tokens] f32, host; may alias momentum_in.
// scores:       [layers, tokens] f32/f16/bf16, host; scores.tokens == tokens, layers >= 1
//               (kFolded: REQUIRES layers == 1).
// invalid_count:[1] i64, host: number of score elements that are negative, NaN or infinite.
//               When it is non-zero, momentum_out holds garbage and must be discarded; run
//               in place, that destroys the momentum, so a caller that must reject a step
//               unchanged updates out of place and swaps on success (MomentumState).
// stream:       nullptr.
void UpdateMomentum(const float* momentum_in, float* momentum_out, int64_t tokens,
                    ScoreMatrix scores, MomentumUpdateOptions options,
                    int64_t* invalid_count, StreamHandle stream);

// The mean of `n` momentum values in double (0 when n == 0); the initial momentum of a
// token that joins on a non-scoring step. The sum is exact and order-independent
// (kernels/exact_sum.h), so every backend returns the same double.
// REQUIRES: n <= kMaxExactSumCount (2^40).
// momentum: [n] f32, host.  mean: [1] f64, host.
void MeanMomentum(const float* momentum, int64_t n, double* mean, StreamHandle stream);

// Converts `n` scores of `dtype` to float32.  src: [n] host.  dst: [n] f32, host.
void ConvertToFloat32(const void* src, ScoreDtype dtype, int64_t n, float* dst,
                      StreamHandle stream);

// Tensor-parallel join: the layer score is the sum over ranks of each rank's partial head
// sum, divided by the total number of heads. Ranks are summed in index order, in double,
// so the result does not depend on the order in which the reports arrived.
// partials: [ranks] views of [layers, tokens] (same layers and tokens), host.
// out:      [layers, tokens] f32 dense, host.
void JoinRankPartials(const ScoreMatrix* partials, int64_t ranks, int64_t total_heads,
                      float* out, StreamHandle stream);

// The two halves of the tensor-parallel join around an all-reduce (the NCCL join of
// kernels/cuda/nccl_communicator.h): each rank widens its partial sums to double, the
// ranks sum them, and each rank scales the sum. With exact double sums (always, unless a
// layer's values span more than about 2^28 in magnitude) the result equals
// JoinRankPartials bit for bit.
// partial: [layers, tokens] f32/f16/bf16, host.   wide: [layers * tokens] f64 dense, host.
void WidenPartialSums(ScoreMatrix partial, double* wide, StreamHandle stream);
// sums: [n] f64, host.  out: [n] f32, host: float(sums / total_heads).
void ScaleJoinedSums(const double* sums, int64_t n, int64_t total_heads, float* out,
                     StreamHandle stream);

}  // namespace cpu
}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_MOMENTUM_UPDATE_H_

// CUDA kernels of kernels/momentum_update.h, with the CPU reference's signatures and
// results, bit for bit: UpdateMomentum, ConvertToFloat32, JoinRankPartials and the join
// halves use the same float32 / float64 operations in the same order, rounded to nearest,
// never contracted into FMA; MeanMomentum computes the exact, order-independent sum of
// kernels/exact_sum.h, as the CPU does.
//
// Every pointer is device memory unless stated; `stream` is a cudaStream_t (nullptr: the
// legacy default stream). Launchers only enqueue work: they never allocate or synchronize,
// and report launch failures through cudaGetLastError (kernels/cuda/cuda_adapter.h turns
// them into absl::Status). Thread-safe.
#ifndef KVCM_KERNELS_CUDA_MOMENTUM_UPDATE_CUDA_H_
#define KVCM_KERNELS_CUDA_MOMENTUM_UPDATE_CUDA_H_

#include <cstdint>

#include "kernels/momentum_update.h"
#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda {

// momentum_in:  [tokens] f32.   momentum_out: [tokens] f32; may alias momentum_in.
// scores:       [layers, tokens] f32/f16/bf16 (device data, strided rows, layers >= 1;
//               kFolded: REQUIRES layers == 1).
// invalid_count:[1] i64: negative, NaN or infinite scores (non-zero: discard momentum_out).
void UpdateMomentum(const float* momentum_in, float* momentum_out, int64_t tokens,
                    ScoreMatrix scores, MomentumUpdateOptions options,
                    int64_t* invalid_count, StreamHandle stream);

// momentum: [n] f32.  mean: [1] f64 (0 when n == 0).  REQUIRES: n <= kMaxExactSumCount.
void MeanMomentum(const float* momentum, int64_t n, double* mean, StreamHandle stream);

// src: [n] of `dtype`.  dst: [n] f32.
void ConvertToFloat32(const void* src, ScoreDtype dtype, int64_t n, float* dst,
                      StreamHandle stream);

// The most ranks one JoinRankPartials launch takes (the views travel as kernel arguments).
inline constexpr int64_t kMaxJoinRanks = 64;

// partials: [ranks] views in HOST memory whose data is [layers, tokens] in device memory.
// out:      [layers, tokens] f32 dense.
// REQUIRES: 1 <= ranks <= kMaxJoinRanks (aborts otherwise: a programming error).
void JoinRankPartials(const ScoreMatrix* partials, int64_t ranks, int64_t total_heads,
                      float* out, StreamHandle stream);

// The halves of the join around an all-reduce (see cpu::WidenPartialSums).
void WidenPartialSums(ScoreMatrix partial, double* wide, StreamHandle stream);
// sums: [n] f64.  out: [n] f32 = float(sums / total_heads).
void ScaleJoinedSums(const double* sums, int64_t n, int64_t total_heads, float* out,
                     StreamHandle stream);

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_MOMENTUM_UPDATE_CUDA_H_

// CUDA kernels of kernels/cuda/momentum_update_cuda.h. Parity with the CPU reference is
// by construction: each token's momentum is folded by one thread, layer by layer in order,
// with the same float32 operations written as round-to-nearest intrinsics (__fmul_rn,
// __fadd_rn, __fdiv_rn), which nvcc never contracts into an FMA; MeanMomentum is the
// exact sum of kernels/exact_sum.h.
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/momentum_update_cuda.h"
#include "kernels/exact_sum.h"

namespace kvcm::kernels::cuda {
namespace {

using detail::AsStream;
using detail::BlocksFor;
using detail::kThreads;

template <ScoreDtype D, ScoreAggregation A>
__global__ void __launch_bounds__(kThreads)
    UpdateMomentumKernel(const float* momentum_in, float* momentum_out, int64_t tokens,
                         ScoreMatrix scores, float keep, float take, int64_t* invalid_count) {
  const float layers = static_cast<float>(scores.layers);
  int64_t invalid = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < tokens;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float m = A == ScoreAggregation::kSingleStep ? 0.0f : momentum_in[i];
    for (int64_t layer = 0; layer < scores.layers; ++layer) {
      const float s = detail::LoadScore<D>(scores, layer, i);
      invalid += detail::IsInvalidScore(s) ? 1 : 0;
      if constexpr (A == ScoreAggregation::kEma) {
        m = __fadd_rn(__fmul_rn(keep, m), __fmul_rn(take, s));
      } else if constexpr (A == ScoreAggregation::kFolded) {
        m = __fadd_rn(__fmul_rn(keep, m), s);  // keep = float(decay)
      } else {
        m = __fadd_rn(m, s);
      }
    }
    if constexpr (A == ScoreAggregation::kSingleStep) m = __fdiv_rn(m, layers);
    momentum_out[i] = m;
  }
  detail::AddBlockCount(invalid, invalid_count);
}

template <ScoreDtype D>
struct LaunchUpdate {
  void operator()(const float* in, float* out, int64_t tokens, const ScoreMatrix& scores,
                  const MomentumUpdateOptions& options, int64_t* invalid_count,
                  cudaStream_t stream) const {
    // The factor on the old momentum: alpha for ema, decay for folded (as on the CPU).
    const double keep_factor =
        options.aggregation == ScoreAggregation::kFolded ? options.decay : options.alpha;
    const float keep = static_cast<float>(keep_factor);
    const float take = static_cast<float>(1.0 - keep_factor);
    const unsigned int blocks = BlocksFor(tokens);
    switch (options.aggregation) {
      case ScoreAggregation::kEma:
        UpdateMomentumKernel<D, ScoreAggregation::kEma><<<blocks, kThreads, 0, stream>>>(
            in, out, tokens, scores, keep, take, invalid_count);
        return;
      case ScoreAggregation::kCumulative:
        UpdateMomentumKernel<D, ScoreAggregation::kCumulative>
            <<<blocks, kThreads, 0, stream>>>(in, out, tokens, scores, keep, take,
                                              invalid_count);
        return;
      case ScoreAggregation::kSingleStep:
        UpdateMomentumKernel<D, ScoreAggregation::kSingleStep>
            <<<blocks, kThreads, 0, stream>>>(in, out, tokens, scores, keep, take,
                                              invalid_count);
        return;
      case ScoreAggregation::kFolded:
        UpdateMomentumKernel<D, ScoreAggregation::kFolded>
            <<<blocks, kThreads, 0, stream>>>(in, out, tokens, scores, keep, take,
                                              invalid_count);
        return;
    }
  }
};

// One block computes kernels/exact_sum.h, as the CPU does: the magnitude range (block
// reductions of the largest and smallest non-zero bits), then one pass per level in
// which every thread extracts its elements' pieces of that level (recomputing the
// earlier levels' remainders) and the block sums them. Every level sum is exact, so the
// block's reduction order does not matter: the result equals the CPU's bit for bit.
constexpr int kMeanThreads = 1024;

struct MaxBits {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};
struct MinBits {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; }
};
struct OrBits {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a | b; }
};

__global__ void __launch_bounds__(kMeanThreads)
    MeanMomentumKernel(const float* momentum, int64_t n, double* mean) {
  using BitsReduce = cub::BlockReduce<uint32_t, kMeanThreads>;
  using SumReduce = cub::BlockReduce<double, kMeanThreads>;
  __shared__ union {
    typename BitsReduce::TempStorage bits;
    typename SumReduce::TempStorage sum;
  } storage;
  __shared__ uint32_t shared_max;
  __shared__ uint32_t shared_min;
  __shared__ double level_sums[kMaxExactSumLevels];

  if (n <= 0) {
    if (threadIdx.x == 0) *mean = 0.0;
    return;
  }
  uint32_t max_bits = 0;
  uint32_t min_bits = kNoNonZeroBits;
  for (int64_t i = threadIdx.x; i < n; i += kMeanThreads) {
    const uint32_t b = MagnitudeBits(momentum[i]);
    max_bits = b > max_bits ? b : max_bits;
    min_bits = (b != 0 && b < min_bits) ? b : min_bits;
  }
  max_bits = BitsReduce(storage.bits).Reduce(max_bits, MaxBits{});
  if (threadIdx.x == 0) shared_max = max_bits;
  __syncthreads();
  min_bits = BitsReduce(storage.bits).Reduce(min_bits, MinBits{});
  if (threadIdx.x == 0) shared_min = min_bits;
  __syncthreads();
  max_bits = shared_max;
  min_bits = shared_min;

  if (max_bits >= kInfinityBits) {  // uniform across the block
    uint32_t flags = 0;
    for (int64_t i = threadIdx.x; i < n; i += kMeanThreads) flags |= NonFiniteFlags(momentum[i]);
    flags = BitsReduce(storage.bits).Reduce(flags, OrBits{});
    if (threadIdx.x == 0) *mean = __ddiv_rn(NonFiniteSum(flags), static_cast<double>(n));
    return;
  }
  const ExactSumPlan plan = PlanExactSum(max_bits, min_bits, n);
  for (int level = 0; level < plan.levels; ++level) {
    double piece_sum = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += kMeanThreads) {
      double rest = static_cast<double>(momentum[i]);
      double piece = 0.0;
      for (int j = 0; j <= level; ++j) piece = ExtractPiece(ExactSumBoundary(plan, j), &rest);
      piece_sum = __dadd_rn(piece_sum, piece);
    }
    const double total = SumReduce(storage.sum).Sum(piece_sum);
    if (threadIdx.x == 0) level_sums[level] = total;
    __syncthreads();  // the reduction storage is reused by the next level
  }
  if (threadIdx.x == 0) {
    const double sum = plan.levels == 0 ? 0.0 : CombineLevelSums(level_sums, plan.levels);
    *mean = __ddiv_rn(sum, static_cast<double>(n));
  }
}

template <ScoreDtype D>
__global__ void __launch_bounds__(kThreads)
    ConvertKernel(ScoreMatrix src, float* dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < src.tokens; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = detail::LoadScore<D>(src, 0, i);
  }
}

template <ScoreDtype D>
struct LaunchConvert {
  void operator()(const ScoreMatrix& src, float* dst, cudaStream_t stream) const {
    ConvertKernel<D><<<BlocksFor(src.tokens), kThreads, 0, stream>>>(src, dst);
  }
};

// The views of a join travel by value as the kernel's argument (2.5 KiB of the 4 KiB).
struct JoinViews {
  ScoreMatrix view[kMaxJoinRanks];
  int64_t ranks;
};

__global__ void __launch_bounds__(kThreads)
    JoinRankPartialsKernel(JoinViews views, double heads, float* out) {
  const int64_t tokens = views.view[0].tokens;
  const int64_t n = views.view[0].layers * tokens;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t layer = i / tokens;
    const int64_t token = i - layer * tokens;
    double acc = 0.0;
    for (int64_t r = 0; r < views.ranks; ++r) {
      acc = __dadd_rn(acc, static_cast<double>(detail::LoadScoreAny(views.view[r], layer, token)));
    }
    out[i] = __double2float_rn(__ddiv_rn(acc, heads));
  }
}

__global__ void __launch_bounds__(kThreads)
    WidenKernel(ScoreMatrix partial, double* wide) {
  const int64_t tokens = partial.tokens;
  const int64_t n = partial.layers * tokens;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t layer = i / tokens;
    wide[i] = static_cast<double>(detail::LoadScoreAny(partial, layer, i - layer * tokens));
  }
}

__global__ void __launch_bounds__(kThreads)
    ScaleKernel(const double* sums, int64_t n, double heads, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __double2float_rn(__ddiv_rn(sums[i], heads));
  }
}

}  // namespace

void UpdateMomentum(const float* momentum_in, float* momentum_out, int64_t tokens,
                    ScoreMatrix scores, MomentumUpdateOptions options,
                    int64_t* invalid_count, StreamHandle stream) {
  cudaMemsetAsync(invalid_count, 0, sizeof(int64_t), AsStream(stream));
  if (tokens <= 0) return;
  detail::DispatchDtype<LaunchUpdate>(scores.dtype, momentum_in, momentum_out, tokens, scores,
                                      options, invalid_count, AsStream(stream));
}

void MeanMomentum(const float* momentum, int64_t n, double* mean, StreamHandle stream) {
  MeanMomentumKernel<<<1, kMeanThreads, 0, AsStream(stream)>>>(momentum, n, mean);
}

void ConvertToFloat32(const void* src, ScoreDtype dtype, int64_t n, float* dst,
                      StreamHandle stream) {
  if (n <= 0) return;
  detail::DispatchDtype<LaunchConvert>(dtype, ScoreMatrix::Dense(src, dtype, 1, n), dst,
                                       AsStream(stream));
}

void JoinRankPartials(const ScoreMatrix* partials, int64_t ranks, int64_t total_heads,
                      float* out, StreamHandle stream) {
  if (ranks <= 0) return;
  if (ranks > kMaxJoinRanks) {
    std::fprintf(stderr, "kvcm::kernels::cuda::JoinRankPartials: %lld ranks, at most %lld\n",
                 static_cast<long long>(ranks), static_cast<long long>(kMaxJoinRanks));
    std::abort();
  }
  JoinViews views{};
  for (int64_t r = 0; r < ranks; ++r) views.view[r] = partials[r];
  views.ranks = ranks;
  const int64_t n = partials[0].layers * partials[0].tokens;
  if (n <= 0) return;
  JoinRankPartialsKernel<<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(
      views, static_cast<double>(total_heads), out);
}

void WidenPartialSums(ScoreMatrix partial, double* wide, StreamHandle stream) {
  const int64_t n = partial.layers * partial.tokens;
  if (n <= 0) return;
  WidenKernel<<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(partial, wide);
}

void ScaleJoinedSums(const double* sums, int64_t n, int64_t total_heads, float* out,
                     StreamHandle stream) {
  if (n <= 0) return;
  ScaleKernel<<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(
      sums, n, static_cast<double>(total_heads), out);
}

}  // namespace kvcm::kernels::cuda

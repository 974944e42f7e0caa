// CUDA kernel of kernels/cuda/span_pool_cuda.h.
#include <cmath>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/span_pool_cuda.h"

namespace kvcm::kernels::cuda {
namespace {

using detail::kThreads;

// The first index whose position is >= positions[i] - half (it is at most i).
__device__ inline int64_t WindowBegin(const int64_t* positions, int64_t i, int64_t half) {
  int64_t lo = 0;
  int64_t hi = i;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (positions[i] - positions[mid] > half) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <ScoreDtype D>
__global__ void __launch_bounds__(kThreads)
    SpanMaxPoolKernel(ScoreMatrix scores, const int64_t* positions, int64_t half, float* out) {
  const int64_t total = scores.layers * scores.tokens;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t layer = e / scores.tokens;
    const int64_t i = e % scores.tokens;
    const float own = detail::LoadScore<D>(scores, layer, i);
    if (detail::IsInvalidScore(own)) {
      out[e] = NAN;
      continue;
    }
    float best = own;
    for (int64_t j = WindowBegin(positions, i, half);
         j < scores.tokens && positions[j] - positions[i] <= half; ++j) {
      const float v = detail::LoadScore<D>(scores, layer, j);
      if (v > best) best = v;
    }
    out[e] = best;
  }
}

template <ScoreDtype D>
struct LaunchPool {
  void operator()(const ScoreMatrix& scores, const int64_t* positions, int64_t half, float* out,
                  cudaStream_t stream) const {
    SpanMaxPoolKernel<D><<<detail::BlocksFor(scores.layers * scores.tokens), kThreads, 0, stream>>>(
        scores, positions, half, out);
  }
};

}  // namespace

void SpanMaxPool(ScoreMatrix scores, const int64_t* positions, int64_t width, float* out,
                 StreamHandle stream) {
  if (scores.layers <= 0 || scores.tokens <= 0) return;
  detail::DispatchDtype<LaunchPool>(scores.dtype, scores, positions, (width - 1) / 2, out,
                                    detail::AsStream(stream));
}

}  // namespace kvcm::kernels::cuda

// CUDA kernel of kernels/cuda/score_validation_cuda.h.
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/score_validation_cuda.h"

namespace kvcm::kernels::cuda {
namespace {

using detail::kThreads;

template <ScoreDtype D>
__global__ void __launch_bounds__(kThreads)
    CountInvalidKernel(ScoreMatrix scores, int64_t* invalid_count) {
  int64_t invalid = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < scores.tokens; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    for (int64_t layer = 0; layer < scores.layers; ++layer) {
      invalid += detail::IsInvalidScore(detail::LoadScore<D>(scores, layer, i)) ? 1 : 0;
    }
  }
  detail::AddBlockCount(invalid, invalid_count);
}

template <ScoreDtype D>
struct LaunchCount {
  void operator()(const ScoreMatrix& scores, int64_t* invalid_count, cudaStream_t stream) const {
    CountInvalidKernel<D><<<detail::BlocksFor(scores.tokens), kThreads, 0, stream>>>(
        scores, invalid_count);
  }
};

}  // namespace

void CountInvalidScores(ScoreMatrix scores, int64_t* invalid_count, StreamHandle stream) {
  cudaMemsetAsync(invalid_count, 0, sizeof(int64_t), detail::AsStream(stream));
  if (scores.tokens <= 0 || scores.layers <= 0) return;
  detail::DispatchDtype<LaunchCount>(scores.dtype, scores, invalid_count,
                                     detail::AsStream(stream));
}

}  // namespace kvcm::kernels::cuda

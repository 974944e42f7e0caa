// CUDA kernels of kernels/cuda/token_arrays_cuda.h.
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/token_arrays_cuda.h"

namespace kvcm::kernels::cuda {
namespace {

__global__ void AppendEntryKernel(float* momentum, int64_t* positions, int64_t index,
                                  int64_t position, float value, const double* mean) {
  momentum[index] = mean != nullptr ? __double2float_rn(*mean) : value;
  positions[index] = position;
}

__global__ void __launch_bounds__(detail::kThreads)
    GatherPositionsKernel(const int64_t* positions, const int64_t* indices, int64_t k,
                          int64_t* out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[j] = positions[indices[j]];
  }
}

}  // namespace

void AppendEntry(float* momentum, int64_t* positions, int64_t index, int64_t position,
                 float value, const double* mean, StreamHandle stream) {
  AppendEntryKernel<<<1, 1, 0, detail::AsStream(stream)>>>(momentum, positions, index,
                                                             position, value, mean);
}

void GatherPositions(const int64_t* positions, const int64_t* indices, int64_t k,
                     int64_t* out, StreamHandle stream) {
  if (k <= 0) return;
  GatherPositionsKernel<<<detail::BlocksFor(k), detail::kThreads, 0, detail::AsStream(stream)>>>(
      positions, indices, k, out);
}

}  // namespace kvcm::kernels::cuda

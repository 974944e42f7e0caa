// CUDA kernels of kernels/token_arrays.h (same signatures and results as the CPU
// reference). Device memory, cudaStream_t; enqueues only, never allocates. Thread-safe.
#ifndef KVCM_KERNELS_CUDA_TOKEN_ARRAYS_CUDA_H_
#define KVCM_KERNELS_CUDA_TOKEN_ARRAYS_CUDA_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda {

// momentum: [index + 1] f32.  positions: [index + 1] i64.  mean: [1] f64 or nullptr.
void AppendEntry(float* momentum, int64_t* positions, int64_t index, int64_t position,
                 float value, const double* mean, StreamHandle stream);

// positions: [n] i64.  indices: [k] i64 (< n).  out: [k] i64.
void GatherPositions(const int64_t* positions, const int64_t* indices, int64_t k,
                     int64_t* out, StreamHandle stream);

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_TOKEN_ARRAYS_CUDA_H_

// CUDA kernel of kernels/score_validation.h (same signature and result as the CPU
// reference). Device memory, cudaStream_t; enqueues only. Thread-safe.
#ifndef KVCM_KERNELS_CUDA_SCORE_VALIDATION_CUDA_H_
#define KVCM_KERNELS_CUDA_SCORE_VALIDATION_CUDA_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda {

// scores: [layers, tokens] device.  invalid_count: [1] i64, device.
void CountInvalidScores(ScoreMatrix scores, int64_t* invalid_count, StreamHandle stream);

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_SCORE_VALIDATION_CUDA_H_

// CUDA kernel of kernels/span_pool.h (same signature and result as the CPU reference).
// Device memory, cudaStream_t; enqueues only. Thread-safe.
#ifndef KVCM_KERNELS_CUDA_SPAN_POOL_CUDA_H_
#define KVCM_KERNELS_CUDA_SPAN_POOL_CUDA_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda {

// scores: [layers, tokens] device.  positions: [tokens] i64 device.  out: [layers, tokens]
// f32 dense, device. One thread per element: a binary search for the window's first entry
// (positions are strictly ascending, so the window has at most `width` <= 255 entries).
void SpanMaxPool(ScoreMatrix scores, const int64_t* positions, int64_t width, float* out,
                 StreamHandle stream);

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_SPAN_POOL_CUDA_H_

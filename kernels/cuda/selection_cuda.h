// CUDA kernels of kernels/selection.h, with the CPU reference's signatures and exactly its
// results (the same total order on (momentum bits with -0 folded to +0, index)).
//
// Both run as a single thread block that walks the array in chunks: the selection is a
// radix select on the 32 value bits followed by an ordered compaction, the removal an
// in-place stable compaction. One block needs no global scratch and keeps the in-place
// removal race-free; the arrays of one sequence (at most a long prefill) fit it well.
// Device memory, cudaStream_t; enqueues only, never allocates. Thread-safe.
#ifndef KVCM_KERNELS_CUDA_SELECTION_CUDA_H_
#define KVCM_KERNELS_CUDA_SELECTION_CUDA_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda {

// REQUIRES: 0 <= begin <= end, end - begin < 2^31, 0 <= k <= end - begin, values >= 0.
// values: [end] f32.  selected: [k] i64, ascending.  scratch: unused (may be nullptr).
void SelectLowest(const float* values, int64_t begin, int64_t end, int64_t k,
                  int64_t* selected, uint64_t* scratch, StreamHandle stream);

// momentum: [n] f32.  positions: [n] i64.  indices: [k] i64 (ascending, distinct, < n).
void RemoveEntries(float* momentum, int64_t* positions, int64_t n, const int64_t* indices,
                   int64_t k, StreamHandle stream);

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_SELECTION_CUDA_H_

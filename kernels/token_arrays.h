// The two small steps on the engine's per-token arrays (momentum and positions, in cache
// order) that the device-resident engine needs as kernels, so that neither costs a round
// trip to the host: writing the entry of the token a step adds, and reading the positions
// of the entries a selection chose. Stateless and thread-safe.
//
// The CPU reference (namespace cpu) and the CUDA kernels (kernels/cuda/token_arrays_cuda.h)
// share these signatures (kernels/backend.h).
#ifndef KVCM_KERNELS_TOKEN_ARRAYS_H_
#define KVCM_KERNELS_TOKEN_ARRAYS_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels {
namespace cpu {

// Writes entry `index`: momentum[index] = (mean != nullptr ? float(*mean) : value) and
// positions[index] = position. `mean` is where MeanMomentum left its result (a token
// that joins on a non-scoring step), read in stream order.
// momentum: [index + 1] f32, host.  positions: [index + 1] i64, host.
// mean:     [1] f64, host, or nullptr.
void AppendEntry(float* momentum, int64_t* positions, int64_t index, int64_t position,
                 float value, const double* mean, StreamHandle stream);

// out[j] = positions[indices[j]] for j < k.
// positions: [n] i64, host.  indices: [k] i64 (< n), host.  out: [k] i64, host.
void GatherPositions(const int64_t* positions, const int64_t* indices, int64_t k,
                     int64_t* out, StreamHandle stream);

}  // namespace cpu
}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_TOKEN_ARRAYS_H_

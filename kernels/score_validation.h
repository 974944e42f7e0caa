// Validation of attention scores: SPEC.md requires every score to be finite and >= 0.
// UpdateMomentum validates in its own pass; these serve paths that read scores without
// updating momentum (tensor-parallel partial sums) and the error path that names the
// first bad element. Stateless and thread-safe.
#ifndef KVCM_KERNELS_SCORE_VALIDATION_H_
#define KVCM_KERNELS_SCORE_VALIDATION_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels {

// One element of a host score matrix, as float32.
float ScoreAt(const ScoreMatrix& scores, int64_t layer, int64_t index);

struct InvalidScore {
  int64_t layer = -1;
  int64_t index = -1;
  float value = 0.0f;
};

// The first invalid element in layer-major order, or layer == -1 when all are valid.
// scores: host. A slow scalar scan for error messages only.
InvalidScore FindFirstInvalidScore(const ScoreMatrix& scores);

namespace cpu {

// Counts the elements that are negative, NaN or infinite.
// scores: [layers, tokens] host.  invalid_count: [1] i64, host.  stream: nullptr.
void CountInvalidScores(ScoreMatrix scores, int64_t* invalid_count, StreamHandle stream);

}  // namespace cpu
}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_SCORE_VALIDATION_H_

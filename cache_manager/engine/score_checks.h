// The checks a receiver of scores applies and the messages it answers with, written once for
// a step's scores (Sequence) and a rank's partial sums (TensorParallelJoin): the row length
// against the cache, the matrix's shape, and the first invalid element. Each message opens
// with where it happened (ScoresAt: "sequence 'a' step 3: ", with " rank 1" for partial
// sums); `noun` names what was sent ("scores", "partial sums"). Free functions; thread-safe.
#ifndef KVCM_CACHE_MANAGER_ENGINE_SCORE_CHECKS_H_
#define KVCM_CACHE_MANAGER_ENGINE_SCORE_CHECKS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/score_matrix.h"

namespace kvcm {

// Where scores were sent: a sequence's step, and the rank for partial sums (-1: none).
struct ScoresAt {
  absl::string_view sequence_id;
  int64_t step = 0;
  int32_t rank = -1;
};
// "sequence 'a' step 3: " or "sequence 'a' step 3 rank 1: ".
std::string DescribeScoresAt(const ScoresAt& at);

// INVALID_ARGUMENT when `scores` does not cover `cached` + 1 tokens per layer (the cache and
// the new token) or is malformed (a stride shorter than a row, or no data); OK otherwise.
// Allocates nothing when OK (a step calls it every time).
absl::Status CheckScoreShape(const ScoresAt& at, absl::string_view noun,
                             const kernels::ScoreMatrix& scores, int64_t cached);

// INVALID_ARGUMENT naming the first invalid element: "<where><row> <element> <index>
// (position P) is V; <noun> must be finite and >= 0". `row` names its row ("layer 2",
// "folded row"); `element` is the singular noun ("score", "partial sum"); `position` is
// omitted when negative.
absl::Status InvalidScoreError(const ScoresAt& at, absl::string_view row,
                               absl::string_view element, int64_t index, int64_t position,
                               float value, absl::string_view noun);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_SCORE_CHECKS_H_

// Folded reports (docs/SPEC.md, "Folded reports"): the per-layer momentum update of a
// scoring step is linear in the layer rows, so a worker may send ONE row per step,
//
//   row = sum_l layer_weights[l] * s_l          (l = 0 .. K-1, in the order the model ran)
//
// and the engine applies m <- decay * m + row. This file is the one place that derives the
// weights from a policy (FoldWeightsFor) and folds rows with them (FoldRows: the replay
// tool, the tests, and what a worker does before it sends).
//
// Stateless functions over plain values; thread-safe.
#ifndef KVCM_CACHE_MANAGER_POLICY_FOLD_H_
#define KVCM_CACHE_MANAGER_POLICY_FOLD_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/policy/policy.h"
#include "kernels/score_matrix.h"

namespace kvcm {

// How a sequence's reports carry the scores of a scoring step: one row per layer
// ([layers, tokens], SPEC.md "A step") or one folded row ([1, tokens]).
enum class ScoreLayout : uint8_t { kPerLayer, kFolded };

// "per_layer" / "folded".
absl::string_view ScoreLayoutName(ScoreLayout layout);
// The inverse of ScoreLayoutName; INVALID_ARGUMENT for any other name.
absl::StatusOr<ScoreLayout> ParseScoreLayout(absl::string_view name);

// The most decoder layers a folded sequence may fold.
inline constexpr int64_t kMaxFoldLayers = 4096;

struct FoldWeights {
  std::vector<double> layer_weights;  // [K], layer 0 (the first the model ran) first
  double decay = 0;                   // the factor on the previous step's momentum
};

// The weights of a folded step over `layers` = K layer rows, in double:
//   ema          layer_weights[l] = (1 - alpha) * alpha^(K-1-l)   decay = alpha^K
//   cumulative   layer_weights[l] = 1                             decay = 1
//   single_step  layer_weights[l] = 1 / K                         decay = 0
// (alpha^j is std::pow(alpha, j); 0^0 = 1, so ema with alpha 0 keeps the last layer.)
// recency and random do not read scores: empty layer_weights and decay 1 (the momentum is
// not changed by scores; such a sequence ignores any it is sent).
// Errors: INVALID_ARGUMENT unless 1 <= layers <= kMaxFoldLayers.
absl::StatusOr<FoldWeights> FoldWeightsFor(const Policy& policy, int64_t layers);

// Folds K rows into one: out[i] = sum over l, in order, of layer_weights[l] * s_l[i],
// accumulated in double.
// rows: [K, tokens] f32/f16/bf16 (strided), host; REQUIRES rows.layers ==
//       weights.layer_weights.size() >= 1.
// out:  [tokens] f64, host.
void FoldRows(const kernels::ScoreMatrix& rows, const FoldWeights& weights, double* out);
// The same fold rounded once to float32: what a folded report carries.
// out:  [tokens] f32, host.
void FoldRows(const kernels::ScoreMatrix& rows, const FoldWeights& weights, float* out);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_POLICY_FOLD_H_

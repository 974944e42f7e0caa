// Eviction-quality diagnostics (issue 12, item 1): for a sampled sequence, on sampled
// scoring steps, the rank-trace figures of the paper's Appendix I (raw top-k churn, EMA
// top-k churn, raw/EMA Jaccard, raw top-k tokens evicted), computed live. Names and the
// reading of each figure: docs/METRICS.md, "Eviction-quality diagnostics".
//
// Definitions, for a scoring step t of a sequence with budget B. Its candidates are the
// cache before eviction plus the new token (n tokens, ascending positions); K_t is the
// cache after the step's eviction.
// - raw score r(i): what single_step would keep, (sum over the step's layer rows of
//   s_l(i)) / layers, in float32, layers in order (the engine's single_step kernel); for
//   a folded sequence the one folded row, i.e. the layer weighting of its fold weights.
//   The rows as received, before span pooling (SPEC.md, "Span pooling"): R_t is what the
//   query attended, so the figures measure a pooled policy against the attention itself.
// - k = DiagnosticsTopK(B) = ceil(B / 10): the top decile of the budget. The paper ranks
//   over the whole context, where its top-B is a tenth of the tokens at 90% compression;
//   the engine sees scores only for its cache (B + 1 candidates in the steady state), where
//   a top-B would be every candidate but one, so the figures rank the top tenth instead.
// - raw top-k R_t: the min(k, n) candidates with the highest raw score.
// - momentum top-k M_t: the min(k, |K_t|) tokens of K_t with the highest momentum (the EMA
//   for ema policies; the running sum for cumulative): what the policy values most.
// - "highest" by the engine's tie rule (kernels/selection.h, SelectHighest: the complement
//   of the lowest, which take the lower position first), so of equal values the higher
//   position is in the set. Protection is ignored: these are rankings, not decisions.
// - Sets are of positions; J(a, b) = |a ∩ b| / |a ∪ b| (1 for two empty sets).
// A *measured* step is a scoring step t whose previous scoring step t' (the previous
// decode step for every_step policies, r steps back for lazy ones) was examined too; only
// measured steps produce figures (StepDiagnostics::measured):
// - raw_topk_churn        = 1 - J(R_t, R_t')
// - momentum_topk_churn   = 1 - J(M_t, M_t')
// - raw_momentum_jaccard  = J(R_t, M_t)
// - small_change: at most one token entered M (|M_t \ M_t'| <= 1: at most one swap at the
//   boundary of the momentum's top set), the analogue of the paper's "decode steps that
//   change at most one token of the eviction set". The cache K itself is not a useful set
//   here: eviction is irreversible, so a steady step changes it by exactly one token in and
//   one out, whatever the policy.
// - evicted: tokens the step evicted; evicted_relevant: of those, the ones in R_t (evicted
//   while the current query ranks them in its top k: the paper's lag error).
//
// Sampling: a sequence is sampled when SampledForDiagnostics (a fixed hash of its id, so
// the choice is stable across restarts and daemons); a sampled sequence examines its k-th
// scoring step (k = 1, 2, ...) when k or k + 1 is a multiple of `every`, so one
// consecutive pair is measured per `every` scoring steps (every 1: every step from the
// second on). Unsampled sequences hold no SequenceDiagnostics at all.
//
// Memory: O(B) per sampled sequence (the previous R and M, and the scratch of a step of
// B + 1 candidates); a step whose candidates far exceed the budget (the first step of a
// long prefill) borrows O(n) scratch for that step only. Steady-state steps allocate
// nothing. Not thread-safe: its Sequence owns one and serializes access.
#ifndef KVCM_CACHE_MANAGER_ENGINE_DIAGNOSTICS_H_
#define KVCM_CACHE_MANAGER_ENGINE_DIAGNOSTICS_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kernels/score_matrix.h"

namespace kvcm {

struct DiagnosticsOptions {
  int64_t every = 0;  // scoring steps per measured pair; 0: off
  double sample = 0;  // fraction of sequences, 0 to 1
};

// Whether the sequence `id` is sampled under `options` (false when diagnostics are off):
// FNV-1a 64 of the id with MurmurHash3's 64-bit finalizer, its top 53 bits as a fraction
// in [0, 1), below `sample`.
bool SampledForDiagnostics(const DiagnosticsOptions& options, std::string_view id);

// The size of the top sets for a budget: ceil(budget / 10), at least 1.
int64_t DiagnosticsTopK(int64_t budget);

// The figures of one step; `measured` false on every step that produced none.
struct StepDiagnostics {
  bool measured = false;
  double raw_topk_churn = 0;
  double momentum_topk_churn = 0;
  double raw_momentum_jaccard = 0;
  bool small_change = false;
  int64_t evicted = 0;
  int64_t evicted_relevant = 0;
};

class SequenceDiagnostics {
 public:
  // REQUIRES: every >= 1, budget >= 1.
  SequenceDiagnostics(int64_t every, int64_t budget);

  SequenceDiagnostics(const SequenceDiagnostics&) = delete;
  SequenceDiagnostics& operator=(const SequenceDiagnostics&) = delete;

  int64_t top_k() const { return top_k_; }

  // Whether the sequence's `scoring_step`-th scoring step (1-based) is examined.
  bool Examines(int64_t scoring_step) const {
    return scoring_step % every_ == 0 || (scoring_step + 1) % every_ == 0;
  }

  // After a completed scoring step, the `scoring_step`-th: does nothing unless Examines;
  // otherwise records R and M and, on a measured step, writes the figures to `out`
  // (`out` is left alone otherwise).
  // scores:           the step's validated scores, [layers, n] f32/f16/bf16, host.
  // retained:         [m] i64, host: the cache after eviction, ascending positions.
  // momentum:         [m] f32, host: their momentum (>= 0).
  // evicted_indices:  [e] i64, host: the evicted tokens' indices into the n = m + e
  //                   candidates, ascending.
  // evicted:          [e] i64, host: their positions, in the same order.
  void Observe(int64_t scoring_step, const kernels::ScoreMatrix& scores,
               std::span<const int64_t> retained, std::span<const float> momentum,
               std::span<const int64_t> evicted_indices, std::span<const int64_t> evicted,
               StepDiagnostics* out);

 private:
  // The indices of the top min(k, count) of values[0, count), ascending, into top_.
  void SelectTop(const float* values, int64_t count);

  const int64_t every_;
  const int64_t budget_;
  const int64_t top_k_;
  int64_t last_examined_ = 0;  // scoring step of prev_raw_ / prev_momentum_; 0: none
  std::vector<float> raw_;              // [n] raw scores of the step
  std::vector<uint64_t> keys_;          // [n] selection scratch
  std::vector<int64_t> top_;           // [k] indices of a top set, ascending
  std::vector<int64_t> raw_top_;        // R_t, positions ascending
  std::vector<int64_t> momentum_top_;   // M_t
  std::vector<int64_t> prev_raw_;       // R_t'
  std::vector<int64_t> prev_momentum_;  // M_t'
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_DIAGNOSTICS_H_

// Sequence: the eviction engine of one generation request. It holds the policy, budget,
// momentum state and step counter, and carries out SPEC.md's step procedure.
//
// A step either completes and returns a decision, or is rejected with a status naming
// the sequence, step and what was wrong, and changes nothing. Not thread-safe:
// SequenceTable serializes the steps of each sequence.
#ifndef KVCM_CACHE_MANAGER_ENGINE_SEQUENCE_H_
#define KVCM_CACHE_MANAGER_ENGINE_SEQUENCE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_manager/engine/diagnostics.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/engine/momentum_state.h"
#include "cache_manager/policy/fold.h"
#include "cache_manager/policy/policy.h"
#include "cache_manager/policy/token_budget.h"
#include "kernels/score_matrix.h"

namespace kvcm {

struct SequenceStats {
  int64_t steps = 0;
  int64_t scoring_steps = 0;
  int64_t skipped_scoring_steps = 0;  // steps a score-using policy did not need scores for
  int64_t ignored_score_reports = 0;  // scores sent on a non-scoring step
  int64_t tokens_evicted = 0;
};

// Where a sequence that is not new starts: a snapshot's record (the drain wrote it, every
// field as the engine held it) or a worker's resume after a crash (positions and last
// step only: SPEC.md, "Resuming a sequence").
struct SequenceProgress {
  int64_t last_step = 0;           // the last step decided; the next is last_step + 1
  std::vector<int64_t> positions;  // the cache, ascending
  // One per position; empty: the momentum of a fresh prefill (0, or the position for
  // recency).
  std::vector<float> momentum;
  SequenceStats stats;
  // random only: the generator's state (std::mt19937_64's text form); empty: seeded
  // from the policy's seed, as at open.
  std::string rng_state;
};

struct SequenceOptions {
  int64_t prefill_len = 0;
  BudgetSpec budget;
  // When non-empty, the policy is this preset (Policy::FromPreset) and only `policy.seed`
  // and `policy.span_pool` are taken from `policy`; otherwise `policy` is used as given.
  std::string preset;
  Policy policy;
  // kFolded: every scoring step carries one row, the step's `layers` layer rows folded
  // with fold_weights() (cache_manager/policy/fold.h); `layers` must be 1 to kMaxFoldLayers.
  // kPerLayer: rows as SPEC.md describes them; `layers` must be 0 (a non-zero count is
  // rejected, so that a worker that meant to fold but forgot the layout is told at open,
  // not silently given the one-layer rule).
  ScoreLayout score_layout = ScoreLayout::kPerLayer;
  int64_t layers = 0;
  // How its decisions are encoded for the workers; remembered and reported, not used here.
  DecisionEncoding decision_encoding = DecisionEncoding::kPositions;
  // The kernel backend the engine state lives on and runs with (kernels/backend.h):
  // nullptr is the CPU reference; a device backend keeps it on GPU `device`.
  const kernels::KernelBackend* backend = nullptr;
  int device = 0;
  // Set: the sequence continues from there instead of its prefill (validated by Create).
  std::optional<SequenceProgress> resume;
};

class Sequence {
 public:
  // Validates the options (SPEC.md, "Registration fails ...", and the layout above) and
  // builds the prefill cache, or the cache of `options.resume` (positions strictly
  // increasing, each before the next step's token, at most the budget of them once a step
  // was taken and exactly the prefill before; momentum finite, one per position; a
  // random policy's generator state that parses). Errors: INVALID_ARGUMENT.
  static absl::StatusOr<std::unique_ptr<Sequence>> Create(std::string id,
                                                          const SequenceOptions& options);

  // The policy a sequence opened with `options` runs (the preset expanded), validated
  // against its budget: what Create uses, for tools that need it before they open one.
  // Errors: INVALID_ARGUMENT, as Create's for the budget and policy.
  static absl::StatusOr<Policy> ResolvePolicy(const SequenceOptions& options);

  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  // Decode step `step` (the previous step + 1; the first is 1). `scores` are the step's
  // layer scores, [layers, cache_size() + 1] in host memory (a folded sequence: exactly
  // one folded row on a scoring step), or nullptr / layers == 0 for none. On success
  // `decision` is overwritten (its vector's capacity is reused).
  // `space`: where the scores live (MomentumState::ScoreSpace; kBackend: in the memory of
  // the sequence's backend, read in place, e.g. a daemon-created CUDA score region).
  // Errors: FAILED_PRECONDITION for a step out of order, INVALID_ARGUMENT for missing or
  // malformed scores on a scoring step (folded: any row count but 1).
  absl::Status Step(int64_t step, const kernels::ScoreMatrix* scores,
                    EvictionDecision* decision,
                    MomentumState::ScoreSpace space = MomentumState::ScoreSpace::kHost);

  // Turns on the eviction-quality diagnostics (cache_manager/engine/diagnostics.h), measuring
  // one pair of consecutive scoring steps per `every`: from then on, measured steps carry
  // their figures in EvictionDecision::diagnostics. No-op for policies that never score.
  // REQUIRES: every >= 1.
  void EnableDiagnostics(int64_t every);

  const std::string& id() const { return id_; }
  int64_t prefill_len() const { return prefill_len_; }
  int64_t budget() const { return budget_; }
  const Policy& policy() const { return policy_; }
  int64_t last_step() const { return last_step_; }
  int64_t cache_size() const { return state_.size(); }
  // The number of scores per layer the next step must carry (cache plus the new token).
  int64_t next_score_length() const { return state_.size() + 1; }
  bool next_needs_scores() const { return policy_.IsScoringStep(last_step_ + 1); }
  const SequenceStats& stats() const { return stats_; }
  const MomentumState& state() const { return state_; }
  // The state a snapshot needs to rebuild this sequence exactly (SequenceOptions::resume).
  SequenceProgress Progress() const;
  ScoreLayout score_layout() const { return score_layout_; }
  // K, the layers a folded sequence's rows fold; 0 for per-layer.
  int64_t layers() const { return layers_; }
  // Folded: the weights its workers fold with (FoldWeightsFor); per-layer: empty weights,
  // decay 0.
  const FoldWeights& fold_weights() const { return fold_weights_; }
  DecisionEncoding decision_encoding() const { return decision_encoding_; }

 private:
  Sequence(std::string id, int64_t prefill_len, int64_t budget, Policy policy,
           ScoreLayout score_layout, int64_t layers, FoldWeights fold_weights,
           DecisionEncoding decision_encoding, const kernels::KernelBackend& backend,
           int device, const SequenceProgress* resume);

  absl::Status CheckScores(int64_t step, const kernels::ScoreMatrix& scores) const;
  absl::Status DescribeInvalidScore(int64_t step, const kernels::ScoreMatrix& scores,
                                    MomentumState::ScoreSpace space) const;
  void EvictRandom(int64_t begin, int64_t end, int64_t k, EvictionDecision* decision);
  uint64_t UniformBelow(uint64_t bound);

  const std::string id_;
  const int64_t prefill_len_;
  const int64_t budget_;
  const Policy policy_;
  const ScoreLayout score_layout_;
  const int64_t layers_;
  const FoldWeights fold_weights_;
  const DecisionEncoding decision_encoding_;
  // The kernel's options for a scoring step: the policy's rule, or kFolded with the decay.
  const kernels::MomentumUpdateOptions update_options_;
  MomentumState state_;
  int64_t last_step_ = 0;
  SequenceStats stats_;
  std::mt19937_64 rng_;  // random only; the engine of the standard is fully specified
  std::vector<int64_t> random_choice_;  // random only: indices picked this step
  std::unique_ptr<SequenceDiagnostics> diagnostics_;  // null unless sampled
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_SEQUENCE_H_

#include "cache_manager/engine/sequence.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/engine/score_checks.h"
#include "kernels/score_validation.h"

namespace kvcm {
namespace {

kernels::ScoreAggregation KernelAggregation(Aggregation aggregation) {
  switch (aggregation) {
    case Aggregation::kCumulative:
      return kernels::ScoreAggregation::kCumulative;
    case Aggregation::kSingleStep:
      return kernels::ScoreAggregation::kSingleStep;
    default:
      return kernels::ScoreAggregation::kEma;
  }
}

struct ResolvedOptions {
  int64_t budget = 0;
  Policy policy;
};

// The budget and the policy (preset expanded) of `options`, validated.
absl::StatusOr<ResolvedOptions> Resolve(const SequenceOptions& options) {
  ResolvedOptions r;
  ASSIGN_OR_RETURN(r.budget, ResolveBudget(options.prefill_len, options.budget));
  r.policy = options.policy;
  if (!options.preset.empty()) {
    ASSIGN_OR_RETURN(r.policy, Policy::FromPreset(options.preset, r.budget));
    r.policy.seed = options.policy.seed;
    r.policy.span_pool = options.policy.span_pool;
  }
  RETURN_IF_ERROR(r.policy.Validate(r.budget));
  return r;
}

// The weights of the layout (empty for per-layer), or why the layout's `layers` is wrong.
absl::StatusOr<FoldWeights> LayoutWeights(const SequenceOptions& options, const Policy& policy) {
  if (options.score_layout == ScoreLayout::kFolded) {
    return FoldWeightsFor(policy, options.layers);
  }
  if (options.layers != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers is ", options.layers,
        " but the score layout is per_layer; layers is for the folded layout only (0 here)"));
  }
  return FoldWeights{};
}

kernels::MomentumUpdateOptions UpdateOptions(const Policy& policy, ScoreLayout layout,
                                             const FoldWeights& fold) {
  if (layout == ScoreLayout::kFolded) {
    return {kernels::ScoreAggregation::kFolded, policy.alpha, fold.decay};
  }
  return {KernelAggregation(policy.aggregation), policy.alpha};
}

// Why `resume` cannot continue a sequence of this prefill, budget and policy, or OK.
absl::Status CheckProgress(const SequenceProgress& resume, int64_t prefill_len, int64_t budget,
                           const Policy& policy) {
  const int64_t last_step = resume.last_step;
  if (last_step < 0 || last_step > std::numeric_limits<int64_t>::max() - prefill_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume: last_step is ", last_step, "; it must be >= 0 and prefill_len + last_step "
        "must fit in 64 bits"));
  }
  const auto count = static_cast<int64_t>(resume.positions.size());
  if (last_step == 0) {
    // Before the first step the cache is the whole prefill.
    bool prefill = count == prefill_len;
    for (int64_t i = 0; prefill && i < count; ++i) {
      prefill = resume.positions[static_cast<size_t>(i)] == i;
    }
    if (!prefill) {
      return absl::InvalidArgumentError(absl::StrCat(
          "resume: at last_step 0 the cache must be the prefill 0 .. ", prefill_len - 1,
          " (got ", count, " positions)"));
    }
  } else if (count < 1 || count > budget) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume: ", count, " cached positions after step ", last_step,
        "; there must be 1 to the budget of ", budget));
  }
  // The newest token so far is at prefill_len + last_step - 1.
  const int64_t end = prefill_len + last_step;
  for (size_t i = 0; i < resume.positions.size(); ++i) {
    const int64_t p = resume.positions[i];
    if (p < 0 || p >= end || (i > 0 && p <= resume.positions[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "resume: position ", p, " (entry ", i, ") must be 0 to ", end - 1,
          " (prefill plus ", last_step, " steps) and strictly above the one before"));
    }
  }
  if (!resume.momentum.empty()) {
    if (resume.momentum.size() != resume.positions.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "resume: ", resume.momentum.size(), " momentum values for ",
          resume.positions.size(), " positions"));
    }
    for (size_t i = 0; i < resume.momentum.size(); ++i) {
      if (!std::isfinite(resume.momentum[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("resume: momentum of entry ", i, " is not finite"));
      }
    }
  }
  if (!resume.rng_state.empty()) {
    if (policy.aggregation != Aggregation::kRandom) {
      return absl::InvalidArgumentError("resume: a generator state for a policy that is not random");
    }
    std::mt19937_64 rng;
    std::istringstream in(resume.rng_state);
    in >> rng;
    if (in.fail()) {
      return absl::InvalidArgumentError("resume: the random policy's generator state does not parse");
    }
  }
  return absl::OkStatus();
}

// The engine state a sequence starts with: the prefill, or what `resume` holds.
MomentumState StartingState(int64_t prefill_len, int64_t budget, const Policy& policy,
                            const kernels::KernelBackend& backend, int device,
                            const SequenceProgress* resume) {
  const bool momentum_is_position = policy.aggregation == Aggregation::kRecency;
  if (resume == nullptr) {
    return MomentumState(prefill_len, budget, momentum_is_position, backend, device);
  }
  if (!resume->momentum.empty()) {
    return MomentumState(resume->positions, resume->momentum, budget, backend, device);
  }
  // A fresh prefill's momentum over the resumed positions.
  std::vector<float> momentum(resume->positions.size(), 0.0f);
  if (momentum_is_position) {
    for (size_t i = 0; i < momentum.size(); ++i) {
      momentum[i] = static_cast<float>(resume->positions[i]);
    }
  }
  return MomentumState(resume->positions, momentum, budget, backend, device);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sequence>> Sequence::Create(std::string id,
                                                            const SequenceOptions& options) {
  auto context = [&id](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("sequence '", id, "': ", s.message()));
  };
  absl::StatusOr<ResolvedOptions> resolved = Resolve(options);
  if (!resolved.ok()) return context(resolved.status());
  absl::StatusOr<FoldWeights> fold = LayoutWeights(options, resolved->policy);
  if (!fold.ok()) return context(fold.status());
  const int64_t layers = options.score_layout == ScoreLayout::kFolded ? options.layers : 0;
  if (options.resume.has_value()) {
    absl::Status progress =
        CheckProgress(*options.resume, options.prefill_len, resolved->budget, resolved->policy);
    if (!progress.ok()) return context(progress);
  }
  const kernels::KernelBackend& backend =
      options.backend != nullptr ? *options.backend : kernels::CpuBackend();
  std::unique_ptr<Sequence> sequence(new Sequence(
      std::move(id), options.prefill_len, resolved->budget, std::move(resolved->policy),
      options.score_layout, layers, *std::move(fold), options.decision_encoding, backend,
      options.device, options.resume.has_value() ? &*options.resume : nullptr));
  // A device backend can fail to hold the prefill (allocation, a missing device).
  if (!sequence->state_.status().ok()) return context(sequence->state_.status());
  return sequence;
}

absl::StatusOr<Policy> Sequence::ResolvePolicy(const SequenceOptions& options) {
  ASSIGN_OR_RETURN(ResolvedOptions resolved, Resolve(options));
  return std::move(resolved.policy);
}

Sequence::Sequence(std::string id, int64_t prefill_len, int64_t budget, Policy policy,
                   ScoreLayout score_layout, int64_t layers, FoldWeights fold_weights,
                   DecisionEncoding decision_encoding, const kernels::KernelBackend& backend,
                   int device, const SequenceProgress* resume)
    : id_(std::move(id)),
      prefill_len_(prefill_len),
      budget_(budget),
      policy_(std::move(policy)),
      score_layout_(score_layout),
      layers_(layers),
      fold_weights_(std::move(fold_weights)),
      decision_encoding_(decision_encoding),
      update_options_(UpdateOptions(policy_, score_layout_, fold_weights_)),
      state_(StartingState(prefill_len, budget, policy_, backend, device, resume)),
      rng_(policy_.seed) {
  if (resume == nullptr) return;
  last_step_ = resume->last_step;
  stats_ = resume->stats;
  if (!resume->rng_state.empty()) {
    std::istringstream in(resume->rng_state);
    in >> rng_;  // CheckProgress parsed it
  }
}

SequenceProgress Sequence::Progress() const {
  SequenceProgress progress;
  progress.last_step = last_step_;
  const auto positions = state_.positions();
  const auto momentum = state_.momentum();
  progress.positions.assign(positions.begin(), positions.end());
  progress.momentum.assign(momentum.begin(), momentum.end());
  progress.stats = stats_;
  if (policy_.aggregation == Aggregation::kRandom) {
    std::ostringstream out;
    out << rng_;
    progress.rng_state = out.str();
  }
  return progress;
}

absl::Status Sequence::CheckScores(int64_t step, const kernels::ScoreMatrix& scores) const {
  return CheckScoreShape(ScoresAt{id_, step}, "scores", scores, state_.size());
}

absl::Status Sequence::DescribeInvalidScore(int64_t step, const kernels::ScoreMatrix& scores,
                                            MomentumState::ScoreSpace space) const {
  // Slow path, only after the fused kernel counted a bad element: name the first one.
  const kernels::InvalidScore bad = state_.FindFirstInvalidScore(scores, space);
  const int64_t position = bad.index >= 0 && bad.index < state_.size()
                               ? state_.positions()[static_cast<size_t>(bad.index)]
                               : prefill_len_ + step - 1;
  const std::string row = score_layout_ == ScoreLayout::kFolded
                              ? std::string("folded row")
                              : absl::StrCat("layer ", bad.layer);
  return InvalidScoreError(ScoresAt{id_, step}, row, "score", bad.index, position, bad.value,
                           "scores");
}

absl::Status Sequence::Step(int64_t step, const kernels::ScoreMatrix* scores,
                            EvictionDecision* decision, MomentumState::ScoreSpace space) {
  RETURN_IF_ERROR(state_.status());  // a device backend that failed earlier
  if (step != last_step_ + 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence '", id_, "': step ", step, " is out of order; expected step ",
                     last_step_ + 1));
  }
  const bool scoring = policy_.IsScoringStep(step);
  const bool has_scores = scores != nullptr && scores->layers > 0;
  const int64_t new_position = prefill_len_ + step - 1;

  if (scoring) {
    if (score_layout_ == ScoreLayout::kFolded && (!has_scores || scores->layers != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", id_, "' step ", step,
          ": a folded sequence takes exactly 1 score row per scoring step (its ", layers_,
          " layers folded with its fold weights); this step has ",
          scores == nullptr ? 0 : scores->layers, " rows"));
    }
    if (!has_scores) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", id_, "' step ", step,
                       ": this is a scoring step and it carries no layer scores (need ",
                       state_.size() + 1, " scores per layer)"));
    }
    RETURN_IF_ERROR(CheckScores(step, *scores));
    state_.Append(new_position, 0.0f);
    const int64_t invalid =
        state_.ApplyScores(*scores, update_options_, space, policy_.span_pool);
    if (invalid != 0) {
      state_.PopBack();
      return DescribeInvalidScore(step, *scores, space);
    }
  } else if (policy_.aggregation == Aggregation::kRecency) {
    state_.Append(new_position, static_cast<float>(new_position));
  } else {
    state_.AppendAtMean(new_position);
  }

  // From here on nothing can fail but the device of a device backend (sticky: the
  // sequence is broken and reports it on every later step).
  decision->Reset();
  const int64_t excess = state_.size() - budget_;
  if (excess > 0) {
    const int64_t begin = state_.FirstUnprotectedSinkIndex(policy_.protect_sinks);
    const int64_t end = state_.size() - policy_.protect_recent;
    // Validate() guarantees protect_sinks + protect_recent <= budget, so at least `excess`
    // tokens are unprotected.
    if (policy_.aggregation == Aggregation::kRandom) {
      EvictRandom(begin, end, excess, decision);
    } else {
      state_.EvictLowest(begin, end, excess, &decision->evicted, &decision->evicted_indices);
    }
    if (step == 1) state_.ShrinkTo(budget_);
  }

  RETURN_IF_ERROR(state_.status());
  last_step_ = step;
  ++stats_.steps;
  stats_.tokens_evicted += static_cast<int64_t>(decision->evicted.size());
  if (scoring) {
    ++stats_.scoring_steps;
  } else if (policy_.UsesScores()) {
    ++stats_.skipped_scoring_steps;
  }
  if (!scoring && has_scores) ++stats_.ignored_score_reports;

  decision->step = step;
  decision->cache_size = state_.size();
  decision->next_needs_scores = policy_.IsScoringStep(step + 1);
  decision->scored = scoring;
  decision->scores_ignored = !scoring && has_scores;
  decision->preset = policy_.preset;
  decision->aggregation = policy_.aggregation;
  decision->encoding = decision_encoding_;
  // Sampled sequences only (one null test otherwise). On a device backend positions() and
  // momentum() download host copies, on the steps the diagnostics examine.
  if (diagnostics_ != nullptr && scoring && diagnostics_->Examines(stats_.scoring_steps)) {
    std::vector<std::byte> downloaded;  // device scores: the examined steps read a copy
    const kernels::ScoreMatrix on_host = state_.HostView(*scores, space, &downloaded);
    if (on_host.data != nullptr) {  // else the device failed: status() says so from now on
      diagnostics_->Observe(stats_.scoring_steps, on_host, state_.positions(), state_.momentum(),
                            decision->evicted_indices, decision->evicted, &decision->diagnostics);
    }
  }
  return absl::OkStatus();
}

void Sequence::EnableDiagnostics(int64_t every) {
  if (policy_.UsesScores()) diagnostics_ = std::make_unique<SequenceDiagnostics>(every, budget_);
}

uint64_t Sequence::UniformBelow(uint64_t bound) {
  // Lemire's multiply-shift with rejection: unbiased and independent of the standard
  // library's distribution implementations, so a seed gives the same choices everywhere.
  uint64_t x = rng_();
  unsigned __int128 m = static_cast<unsigned __int128>(x) * bound;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      x = rng_();
      m = static_cast<unsigned __int128>(x) * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

void Sequence::EvictRandom(int64_t begin, int64_t end, int64_t k, EvictionDecision* decision) {
  const int64_t count = end - begin;
  random_choice_.clear();
  if (k == 1) {
    random_choice_.push_back(begin + static_cast<int64_t>(UniformBelow(static_cast<uint64_t>(count))));
  } else {
    // A partial Fisher-Yates shuffle of the unprotected indices picks k distinct ones.
    std::vector<uint64_t>& pool = state_.index_scratch();
    for (int64_t i = 0; i < count; ++i) pool[static_cast<size_t>(i)] = static_cast<uint64_t>(begin + i);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t j = i + static_cast<int64_t>(UniformBelow(static_cast<uint64_t>(count - i)));
      std::swap(pool[static_cast<size_t>(i)], pool[static_cast<size_t>(j)]);
    }
    random_choice_.assign(pool.begin(), pool.begin() + k);
    std::sort(random_choice_.begin(), random_choice_.end());
  }
  state_.EvictIndices(random_choice_, &decision->evicted, &decision->evicted_indices);
}

}  // namespace kvcm

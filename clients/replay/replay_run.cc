#include "clients/replay/replay_run.h"

#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/policy/fold.h"
#include "clients/replay/decision_json.h"
#include "clients/replay/trace.h"
#include "kernels/score_validation.h"

namespace kvcm::replay {
namespace {

constexpr size_t kFlushBytes = 1 << 16;

absl::Status AtLine(const std::string& path, int64_t line, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ":", line, ": ", status.message()));
}

// Folds each step's K layer rows into the one row a folded sequence takes.
class StepFolder {
 public:
  StepFolder(FoldWeights weights, int64_t layers)
      : weights_(std::move(weights)), layers_(layers) {}

  // `folded` = `step` with its rows folded; without rows when the step has none or the
  // policy reads no scores (empty weights). INVALID_ARGUMENT when the step has rows but
  // not K of them, or an invalid score.
  absl::Status Fold(const TraceStep& step, TraceStep* folded) const {
    folded->line = step.line;
    folded->step = step.step;
    folded->tokens = step.tokens;
    folded->layers = 0;
    if (step.layers == 0 || weights_.layer_weights.empty()) return absl::OkStatus();
    if (step.layers != layers_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step.step, ": ", step.layers, " layer rows, but this folded replay folds ",
          layers_, " (the first step's count; a trace's layer count must not change)"));
    }
    // The engine sees only the folded row, in which a negative layer score may vanish:
    // check the trace's rows as the per-layer replay would.
    int64_t invalid = 0;
    kernels::cpu::CountInvalidScores(step.Matrix(), &invalid, nullptr);
    if (invalid != 0) {
      const kernels::InvalidScore bad = kernels::FindFirstInvalidScore(step.Matrix());
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step.step, ": layer ", bad.layer, " score ", bad.index, " is ", bad.value,
          " (before folding); scores must be finite and >= 0"));
    }
    folded->layers = 1;
    folded->scores.resize(static_cast<size_t>(step.tokens));
    FoldRows(step.Matrix(), weights_, folded->scores.data());
    return absl::OkStatus();
  }

 private:
  const FoldWeights weights_;
  const int64_t layers_;
};

absl::Status HeaderError(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ":1: header: ", status.message()));
}

}  // namespace

absl::StatusOr<ReplaySummary> RunReplay(const ReplayOptions& options, ReplayBackend& backend) {
  ASSIGN_OR_RETURN(std::unique_ptr<TraceReader> reader, TraceReader::Open(options.trace_path));
  const std::string id = options.sequence_id.empty()
                             ? std::filesystem::path(options.trace_path).filename().string()
                             : options.sequence_id;
  SequenceOptions sequence_options = reader->header().ToSequenceOptions();
  sequence_options.backend = options.engine_backend;
  sequence_options.device = options.device;
  if (options.preset.has_value()) {
    sequence_options.preset = *options.preset;
    sequence_options.policy = Policy{};
  }
  TraceStep step;
  bool step_read = false;  // folded: the first step, read ahead for its layer count
  std::optional<StepFolder> folder;
  if (options.folded) {
    // The header's errors first, as an unfolded replay reports them when it opens.
    absl::StatusOr<Policy> policy = Sequence::ResolvePolicy(sequence_options);
    if (!policy.ok()) return HeaderError(options.trace_path, policy.status());
    ASSIGN_OR_RETURN(step_read, reader->Next(&step));
    const int64_t layers = step_read && step.layers > 0 ? step.layers : 1;
    absl::StatusOr<FoldWeights> weights = FoldWeightsFor(*policy, layers);
    if (!weights.ok()) {
      return AtLine(options.trace_path, step.line,
                    absl::Status(weights.status().code(),
                                 absl::StrCat("step ", step.step, ": ", weights.status().message())));
    }
    sequence_options.score_layout = ScoreLayout::kFolded;
    sequence_options.layers = layers;
    folder.emplace(*std::move(weights), layers);
  }
  if (absl::Status opened = backend.Open(id, sequence_options, options.tp_ranks); !opened.ok()) {
    return HeaderError(options.trace_path, opened);
  }

  const absl::Time start = absl::Now();
  std::string out;
  TraceStep folded_step;
  EvictionDecision decision;
  absl::Status failure;
  while (true) {
    if (!step_read) {
      absl::StatusOr<bool> more = reader->Next(&step);
      if (!more.ok()) {
        failure = more.status();
        break;
      }
      if (!*more) break;
    }
    step_read = false;
    const TraceStep* send = &step;
    if (folder.has_value()) {
      if (absl::Status s = folder->Fold(step, &folded_step); !s.ok()) {
        failure = AtLine(options.trace_path, step.line, s);
        break;
      }
      send = &folded_step;
    }
    if (absl::Status s = backend.Step(id, *send, &decision); !s.ok()) {
      failure = AtLine(options.trace_path, step.line, s);
      break;
    }
    if (options.decisions != nullptr) {
      if (options.with_momentum) {
        ASSIGN_OR_RETURN(SequenceInfo info, backend.Inspect(id));
        AppendDecisionJson(decision, true, info.positions, info.momentum, &out);
      } else {
        AppendDecisionJson(decision, false, {}, {}, &out);
      }
      if (out.size() >= kFlushBytes) {
        options.decisions->write(out.data(), static_cast<std::streamsize>(out.size()));
        out.clear();
      }
    }
  }
  const absl::Duration elapsed = absl::Now() - start;
  if (options.decisions != nullptr) {
    options.decisions->write(out.data(), static_cast<std::streamsize>(out.size()));
    options.decisions->flush();
  }

  ReplaySummary summary;
  absl::StatusOr<SequenceInfo> info = backend.Inspect(id);
  absl::Status closed = backend.Close(id);
  if (!failure.ok()) return failure;
  RETURN_IF_ERROR(info.status());
  RETURN_IF_ERROR(closed);
  summary.trace = std::filesystem::path(options.trace_path).filename().string();
  summary.policy = info->policy.Label();
  summary.prefill_len = info->prefill_len;
  summary.budget = info->budget;
  summary.final_cache_size = info->cache_size;
  summary.stats = info->stats;
  summary.elapsed = elapsed;
  return summary;
}

int ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 0;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
      return 2;
    default:
      return 1;
  }
}

std::string FormatSummaryTable(const std::vector<ReplaySummary>& rows) {
  std::string out = absl::StrFormat("%-16s %7s %7s %7s %9s %9s %9s %9s %10s\n", "policy",
                                    "steps", "budget", "cached", "evicted", "scored",
                                    "skipped", "ignored", "us/step");
  for (const ReplaySummary& r : rows) {
    const double us_per_step =
        r.stats.steps > 0 ? absl::ToDoubleMicroseconds(r.elapsed) / r.stats.steps : 0.0;
    absl::StrAppendFormat(&out, "%-16s %7d %7d %7d %9d %9d %9d %9d %10.1f\n", r.policy,
                          r.stats.steps, r.budget, r.final_cache_size, r.stats.tokens_evicted,
                          r.stats.scoring_steps, r.stats.skipped_scoring_steps,
                          r.stats.ignored_score_reports, us_per_step);
  }
  return out;
}

}  // namespace kvcm::replay

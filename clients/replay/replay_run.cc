#include "clients/replay/replay_run.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cache_manager/status_macros.h"
#include "clients/replay/decision_json.h"
#include "clients/replay/trace.h"

namespace kvcm::replay {
namespace {

constexpr size_t kFlushBytes = 1 << 16;

absl::Status AtLine(const std::string& path, int64_t line, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ":", line, ": ", status.message()));
}

}  // namespace

absl::StatusOr<ReplaySummary> RunReplay(const ReplayOptions& options, ReplayBackend& backend) {
  ASSIGN_OR_RETURN(std::unique_ptr<TraceReader> reader, TraceReader::Open(options.trace_path));
  const std::string id = options.sequence_id.empty()
                             ? std::filesystem::path(options.trace_path).filename().string()
                             : options.sequence_id;
  SequenceOptions sequence_options = reader->header().ToSequenceOptions();
  if (options.preset.has_value()) {
    sequence_options.preset = *options.preset;
    sequence_options.policy = Policy{};
  }
  if (absl::Status opened = backend.Open(id, sequence_options, options.tp_ranks); !opened.ok()) {
    return absl::Status(opened.code(),
                        absl::StrCat(options.trace_path, ":1: header: ", opened.message()));
  }

  const absl::Time start = absl::Now();
  std::string out;
  TraceStep step;
  EvictionDecision decision;
  absl::Status failure;
  while (true) {
    absl::StatusOr<bool> more = reader->Next(&step);
    if (!more.ok()) {
      failure = more.status();
      break;
    }
    if (!*more) break;
    if (absl::Status s = backend.Step(id, step, &decision); !s.ok()) {
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

// One replay of a trace through a backend: open, step every line, write the decisions,
// close. Used by kvcache-replay and by the tests that pin its behaviour.
#ifndef KVCM_CLIENTS_REPLAY_REPLAY_RUN_H_
#define KVCM_CLIENTS_REPLAY_REPLAY_RUN_H_

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/policy/policy.h"
#include "clients/replay/replay_backend.h"
#include "kernels/backend.h"

namespace kvcm::replay {

struct ReplayOptions {
  std::string trace_path;
  std::string sequence_id;        // default: the trace's file name
  std::optional<std::string> preset;  // replaces the trace's policy (keeps its budget)
  int32_t tp_ranks = 1;
  // Open the sequence with the folded score layout (docs/SPEC.md, "Folded reports") and
  // send each step's layer rows folded into one row with its FoldWeightsFor. K is the row
  // count of the first step (1 when it has none: a policy that never scores); a later
  // step with another count fails as bad input. A policy that reads no scores is sent none.
  bool folded = false;
  bool with_momentum = false;
  std::ostream* decisions = nullptr;  // nullptr: decisions are not written
  // The kernel backend the embedded engine's sequence runs on (SequenceOptions::backend):
  // nullptr is the CPU; a device backend keeps the sequence on GPU `device`. Ignored by
  // backends that are not the embedded engine.
  const kernels::KernelBackend* engine_backend = nullptr;
  int device = 0;
};

struct ReplaySummary {
  std::string trace;
  std::string policy;  // label
  int64_t prefill_len = 0;
  int64_t budget = 0;
  int64_t final_cache_size = 0;
  SequenceStats stats;
  absl::Duration elapsed;
};

// Replays the whole trace. Errors name "file:line" and the step; decisions of the steps
// before a failing one are already written to options.decisions, nothing after it.
absl::StatusOr<ReplaySummary> RunReplay(const ReplayOptions& options, ReplayBackend& backend);

// Exit status for a failed replay: 2 for bad input (the trace, its policy, its steps),
// 1 for everything else (I/O, an unreachable daemon).
int ExitCodeFor(const absl::Status& status);

// A fixed-width table, one row per summary.
std::string FormatSummaryTable(const std::vector<ReplaySummary>& rows);

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_REPLAY_RUN_H_

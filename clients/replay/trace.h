// kvtrace/1 files (SPEC.md, "Trace files"): a JSON Lines header followed by one line per
// decode step. TraceReader streams them a line at a time, so traces of any length replay
// in bounded memory. Errors name the file, line and (when known) step. Not thread-safe.
#ifndef KVCM_CLIENTS_REPLAY_TRACE_H_
#define KVCM_CLIENTS_REPLAY_TRACE_H_

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/policy/policy.h"
#include "cache_manager/policy/token_budget.h"
#include "kernels/score_matrix.h"

namespace kvcm::replay {

struct TraceHeader {
  int64_t prefill_len = 0;
  BudgetSpec budget;
  std::string preset;  // "policy":{"preset":"..."} (a convenience beyond SPEC.md)
  Policy policy;

  SequenceOptions ToSequenceOptions() const;
};

struct TraceStep {
  int64_t line = 0;  // 1-based line in the file
  int64_t step = 0;
  int64_t layers = 0;  // 0 when the line carries no scores
  int64_t tokens = 0;  // scores per layer
  std::vector<float> scores;  // [layers, tokens], dense

  kernels::ScoreMatrix Matrix() const {
    return kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, layers,
                                       tokens);
  }
};

// Parses a header line (exposed for tests and for tools that build traces).
absl::StatusOr<TraceHeader> ParseTraceHeader(const std::string& line);
// Parses a step line into `step` (reusing its buffer).
absl::Status ParseTraceStep(const std::string& line, TraceStep* step);

class TraceReader {
 public:
  // Opens `path` and reads its header. Errors: NOT_FOUND (cannot open), INVALID_ARGUMENT
  // (malformed header), each naming "path:line".
  static absl::StatusOr<std::unique_ptr<TraceReader>> Open(const std::string& path);

  const TraceHeader& header() const { return header_; }
  const std::string& path() const { return path_; }

  // Reads the next step into `step`. Returns false at the end of the file.
  absl::StatusOr<bool> Next(TraceStep* step);

 private:
  TraceReader(std::string path, std::ifstream in) : path_(std::move(path)), in_(std::move(in)) {}

  std::string path_;
  std::ifstream in_;
  TraceHeader header_;
  int64_t line_ = 0;
  int64_t last_step_ = 0;  // the step number of the last line read
  std::string buffer_;
};

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_TRACE_H_

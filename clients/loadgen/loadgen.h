// kvcache-loadgen's core: many sequences stepped over several worker streams against a
// running kvcached, and the same work through the engine in-process for comparison.
#ifndef KVCM_CLIENTS_LOADGEN_LOADGEN_H_
#define KVCM_CLIENTS_LOADGEN_LOADGEN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "clients/cpp/kvcache_client.h"
#include "kernels/score_matrix.h"

namespace kvcm::loadgen {

struct LoadOptions {
  std::string server;  // empty: embedded engine only
  // TLS and bearer token for the daemon (its address is ignored: `server` above).
  client::ClientOptions connection;
  int32_t sequences = 64;
  int32_t streams = 4;  // worker threads, one step stream each
  int32_t layers = 32;
  int64_t context = 65536;
  std::optional<double> compression_ratio = 0.9;
  std::optional<int64_t> budget_tokens;
  kernels::ScoreDtype dtype = kernels::ScoreDtype::kFloat16;
  std::string policy = "inertia";
  absl::Duration duration = absl::Seconds(10);
  uint64_t seed = 1;
  // How scores reach the daemon: inline in the StepBatch ("grpc") or in a shared-memory
  // score region per stream that the reports reference ("shm"; the daemon needs
  // --allow_shm_scores). Regions are sized for the steady step; reports that do not fit
  // (the first step's prefill) go inline.
  std::string transport = "grpc";
  // Sequences opened with the FOLDED layout: one folded row per scoring step (the
  // synthetic layer rows folded with the policy's weights), in both runs.
  bool folded = false;
};

struct LoadResult {
  std::string policy;
  int64_t budget = 0;
  int64_t sequence_steps = 0;  // steady-state steps (after the first step)
  int64_t batches = 0;
  absl::Duration elapsed;
  double steps_per_second = 0;
  double batch_p50_ms = 0;
  double batch_p99_ms = 0;
  double bytes_per_step = 0;     // request bytes per sequence-step (scores and framing)
  double scored_fraction = 0;    // steps that carried scores
  double first_step_ms = 0;      // the prefill-scoring step of every sequence, per batch
  int64_t tokens_evicted = 0;
};

// Runs the load against options.server (UNAVAILABLE if it cannot be reached).
absl::StatusOr<LoadResult> RunAgainstDaemon(const LoadOptions& options);
// The same sequences, steps and scores through an in-process SequenceTable: what the
// daemon's work costs without gRPC.
absl::StatusOr<LoadResult> RunEmbedded(const LoadOptions& options);

// One row per result, with the embedded result's throughput and the ratio when given.
std::string FormatTable(const std::vector<LoadResult>& daemon,
                        const std::vector<LoadResult>& embedded);

}  // namespace kvcm::loadgen

#endif  // KVCM_CLIENTS_LOADGEN_LOADGEN_H_

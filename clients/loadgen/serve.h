// kvcache-loadgen --serve: how many requests a node serves at once with eviction (a fixed
// KV pool) against the full cache. Requests arrive as a Poisson process; each is admitted
// when kvcached leases the blocks of its prefill (OpenSequence) and waits in a FIFO queue
// while the pool refuses; the admitted ones decode one token per iteration over the worker
// streams until they have generated their tokens, and are closed. One run per
// configuration, one after another, against the same daemon(s). docs/BENCHMARKS.md,
// "Capacity".
//
// Not thread-safe: RunServe drives its own threads and returns when every run is done.
#ifndef KVCM_CLIENTS_LOADGEN_SERVE_H_
#define KVCM_CLIENTS_LOADGEN_SERVE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "clients/cpp/kvcache_client.h"
#include "kernels/score_matrix.h"

namespace kvcm::loadgen {

// One configuration: the full cache (streaming_llm with a budget of prompt + generate, so
// it never evicts and reads no scores), a preset at compression ratio rho, or the hand-off
// (open and step 1 on the prefill node, by a thread that works up to 16 requests ahead in
// arrival order; decode on the decode node after ImportSequence, admitted FIFO there).
struct ServeConfig {
  std::string name;  // as written: "full", "inertia@0.9", "handoff@0.9", "handoff:score_free@0.9"
  std::string preset;
  double rho = 0;  // 0 for full
  bool full = false;
  bool handoff = false;
};

// "all" (full; inertia, inertia_lazy4, score_free at 0.5, 0.8, 0.9; handoff@0.9) or a
// comma-separated list of names as above. INVALID_ARGUMENT naming the entry otherwise.
absl::StatusOr<std::vector<ServeConfig>> ParseServeConfigs(absl::string_view spec);

struct ServeOptions {
  std::string server;          // the (decode) node's kvcached
  std::string prefill_server;  // hand-off only: the prefill node's kvcached
  std::string prefill_peer;    // hand-off only: the prefill daemon as the decode daemon reaches it
  client::ClientOptions connection;  // TLS and token, for both daemons
  std::vector<ServeConfig> configs;
  // Arrivals: `requests` requests, or with a positive `duration` every arrival in that
  // time (admission stops at its end; the admitted ones finish, the queued are counted).
  int64_t requests = 200;
  absl::Duration duration = absl::ZeroDuration();
  double arrival_rate = 50;  // requests per second, Poisson
  int64_t prompt_min = 2048;
  int64_t prompt_max = 32768;
  bool prompt_log_uniform = false;  // else uniform
  int64_t generate = 128;           // decode steps per request, step 1 included
  int32_t streams = 4;              // worker streams, each one batch per iteration
  int32_t layers = 32;              // score rows folded into one per scoring step
  kernels::ScoreDtype dtype = kernels::ScoreDtype::kFloat16;
  // The model's time per iteration: memory-bound decode costs about the same for any
  // batch, so an iteration lasts max(model_step, the daemon's time).
  absl::Duration model_step = absl::Milliseconds(20);
  uint64_t seed = 1;
};

struct OccupancySample {
  double seconds = 0;  // since the run's start, at the end of the iteration
  int64_t used_blocks = 0;      // DescribeKvPools of the decoding node, all ranks
  int64_t reserved_blocks = 0;  // the admission ledger (below)
  int64_t cached_tokens = 0;    // the decoding sequences' caches, from their decisions
  int32_t decoding = 0;         // sequences stepped in the iteration
  int64_t queued = 0;           // arrived, not admitted
};

struct ServeResult {
  std::string config;
  int64_t capacity_blocks = 0;  // of the decoding node, all ranks
  int64_t tokens_per_block = 0;
  // Measured over the pool-bound window: from the first request's completion (the
  // ramp-up, one request's lifetime, is left out) to the last iteration whose queue head
  // could not be admitted (the drain is left out).
  bool pool_bound = false;  // false: the queue never waited; raise the arrival rate
  double window_seconds = 0;
  int64_t window_iterations = 0;
  double decoding_mean = 0;
  double decoding_p99 = 0;
  int64_t decoding_max = 0;  // whole run
  double tokens_per_second = 0;
  double iteration_p50_ms = 0;
  double iteration_p99_ms = 0;
  double occupancy_mean = 0;         // used / capacity blocks
  double blocks_per_token_mean = 0;  // used blocks * tokens_per_block / cached tokens
  double queue_wait_p50_ms = 0;      // every admitted request, arrival to admission
  double queue_wait_p99_ms = 0;
  int64_t requests_arrived = 0;
  int64_t requests_admitted = 0;
  int64_t requests_finished = 0;
  int64_t refused = 0;  // OpenSequence / ImportSequence answered RESOURCE_EXHAUSTED
  int64_t held = 0;     // iterations the head waited for the ledger (no RPC sent)
  int64_t max_used_blocks = 0;
  int64_t max_reserved_blocks = 0;
  int64_t max_used_over_reserved = 0;  // > 0: a sequence held more than the ledger allowed
  int64_t inline_reports = 0;          // scored reports that did not fit the region
  std::vector<int64_t> admission_order;  // request indices (arrival order) as admitted
  std::vector<OccupancySample> occupancy;
};

// Runs every configuration in order. Each starts and ends with the decoding node's pool
// (and the prefill node's) empty, checked with DescribeKvPools. A daemon needs KV pools
// and --allow_shm_scores (the scores go through a region it creates); any error but a
// pool's RESOURCE_EXHAUSTED at admission fails the run, a refused step included.
//
// Admission ledger: a request is tried only when the blocks its sequence may hold at its
// peak fit beside the peaks of the sequences already decoding (the full cache:
// ceil((prompt + generate) / tpb); with eviction: ceil((prompt + 1) / tpb) until step 1,
// then ceil((budget + 1) / tpb) + 1), so that no admitted sequence's step is ever refused
// for want of a block; the daemon's answer to OpenSequence is the final word.
absl::StatusOr<std::vector<ServeResult>> RunServe(const ServeOptions& options);

// One row per configuration.
std::string FormatServeTable(const std::vector<ServeResult>& results);
// Every number of every result, the occupancy series included, and the options.
std::string ServeJson(const ServeOptions& options, const std::vector<ServeResult>& results);

}  // namespace kvcm::loadgen

#endif  // KVCM_CLIENTS_LOADGEN_SERVE_H_

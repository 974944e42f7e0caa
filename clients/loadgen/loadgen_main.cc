// kvcache-loadgen: many concurrent sequences over several worker streams against a running
// kvcached, then the same work through the engine in-process, one row per policy.
//
//   kvcache-loadgen --server=127.0.0.1:50051 --sequences=64 --streams=4 --layers=32
//       --context=65536 --compression_ratio=0.9 --dtype=float16
//       --policy=inertia,inertia_lazy4,score_free --duration=10s
//
// With --serve, a capacity benchmark instead (clients/loadgen/serve.h, docs/BENCHMARKS.md,
// "Capacity"): Poisson arrivals admitted against the daemon's KV pool, per configuration.
//
//   kvcache-loadgen --serve --server=127.0.0.1:50051 --serve_configs=full,inertia@0.9
//       --arrival_rate=100 --serve_duration=20s --json=/tmp/capacity.json
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "cache_manager/policy/policy.h"
#include "clients/cpp/security_flags.h"
#include "clients/loadgen/loadgen.h"
#include "clients/loadgen/serve.h"

ABSL_FLAG(std::string, server, "", "kvcached address; empty: in-process engine only");
ABSL_FLAG(int32_t, sequences, 64, "concurrent sequences");
ABSL_FLAG(int32_t, streams, 4, "worker streams (threads), each stepping its share of sequences");
ABSL_FLAG(int32_t, layers, 32, "layers per scoring step");
ABSL_FLAG(int64_t, context, 65536, "prefill length of every sequence");
ABSL_FLAG(double, compression_ratio, 0.9, "compression ratio (ignored with --budget_tokens)");
ABSL_FLAG(int64_t, budget_tokens, 0, "budget in tokens (0: use --compression_ratio)");
ABSL_FLAG(std::string, dtype, "float16", "score dtype: float32, float16 or bfloat16");
ABSL_FLAG(std::string, policy, "inertia", "comma-separated presets, or 'all'");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10), "steady-state time per policy");
ABSL_FLAG(bool, embedded, true, "also run the same work in-process for the ratio");
ABSL_FLAG(uint64_t, seed, 1, "seed of the synthetic scores");
ABSL_FLAG(std::string, transport, "grpc",
          "how scores reach the daemon: grpc (inline bytes), shm (a shared-memory score "
          "region per stream; kvcached needs --allow_shm_scores) or created (the same in a "
          "region kvcached creates; not with --engine_backend=cuda)");
ABSL_FLAG(bool, folded, false,
          "open the sequences with the FOLDED layout: one folded row per scoring step");

// --serve: the capacity benchmark. --server, --streams, --layers, --dtype and --seed apply.
ABSL_FLAG(bool, serve, false,
          "capacity benchmark: Poisson arrivals admitted when kvcached's KV pool leases their "
          "prefill (FIFO while it refuses), decoded one token per iteration until --generate; "
          "one run per --serve_configs entry. kvcached needs KV pools and --allow_shm_scores");
ABSL_FLAG(std::string, serve_configs, "all",
          "--serve: comma-separated: full (no eviction), <preset>@<rho> (e.g. inertia@0.9), "
          "handoff@<rho> or handoff:<preset>@<rho> (prefill and step 1 on --prefill_server, "
          "ImportSequence into --server); all: full, inertia, inertia_lazy4 and score_free at "
          "0.5, 0.8, 0.9, and handoff@0.9");
ABSL_FLAG(int64_t, requests, 200, "--serve: requests per configuration (without --serve_duration)");
ABSL_FLAG(absl::Duration, serve_duration, absl::ZeroDuration(),
          "--serve: if > 0, admit arrivals for this long per configuration instead of "
          "--requests (the admitted ones then finish; the still-queued are counted)");
ABSL_FLAG(double, arrival_rate, 50, "--serve: requests per second (Poisson, seeded by --seed)");
ABSL_FLAG(int64_t, prompt_min, 2048, "--serve: shortest prompt, tokens");
ABSL_FLAG(int64_t, prompt_max, 32768, "--serve: longest prompt, tokens");
ABSL_FLAG(std::string, prompt_distribution, "uniform",
          "--serve: prompt lengths, uniform or log_uniform over [--prompt_min, --prompt_max]");
ABSL_FLAG(int64_t, generate, 128, "--serve: tokens each request generates (decode steps)");
ABSL_FLAG(absl::Duration, model_step, absl::Milliseconds(20),
          "--serve: the model's time per decode iteration. Memory-bound decode costs about the "
          "same for any batch size, so an iteration lasts max(model_step, the daemon's time)");
ABSL_FLAG(std::string, prefill_server, "", "--serve handoff: the prefill node's kvcached");
ABSL_FLAG(std::string, prefill_peer, "",
          "--serve handoff: the prefill kvcached as --server reaches it (its --peer_listen)");
ABSL_FLAG(std::string, json, "", "--serve: write every number and the occupancy series here");

namespace {

// --serve: the capacity benchmark.
int ServeMain(const kvcm::loadgen::LoadOptions& load) {
  kvcm::loadgen::ServeOptions o;
  o.server = load.server;
  o.connection = load.connection;
  o.streams = load.streams;
  o.layers = load.layers;
  o.dtype = load.dtype;
  o.seed = load.seed;
  o.prefill_server = absl::GetFlag(FLAGS_prefill_server);
  o.prefill_peer = absl::GetFlag(FLAGS_prefill_peer);
  o.requests = absl::GetFlag(FLAGS_requests);
  o.duration = absl::GetFlag(FLAGS_serve_duration);
  o.arrival_rate = absl::GetFlag(FLAGS_arrival_rate);
  o.prompt_min = absl::GetFlag(FLAGS_prompt_min);
  o.prompt_max = absl::GetFlag(FLAGS_prompt_max);
  o.generate = absl::GetFlag(FLAGS_generate);
  o.model_step = absl::GetFlag(FLAGS_model_step);
  const std::string distribution = absl::GetFlag(FLAGS_prompt_distribution);
  if (distribution != "uniform" && distribution != "log_uniform") {
    std::cerr << "kvcache-loadgen: --prompt_distribution must be uniform or log_uniform\n";
    return 2;
  }
  o.prompt_log_uniform = distribution == "log_uniform";
  absl::StatusOr<std::vector<kvcm::loadgen::ServeConfig>> configs =
      kvcm::loadgen::ParseServeConfigs(absl::GetFlag(FLAGS_serve_configs));
  if (!configs.ok()) {
    std::cerr << "kvcache-loadgen: " << configs.status().message() << "\n";
    return 2;
  }
  o.configs = *std::move(configs);
  std::cout << "kvcache-loadgen --serve: " << o.configs.size() << " configurations, "
            << (o.duration > absl::ZeroDuration() ? absl::FormatDuration(o.duration) + " of arrivals"
                                                  : std::to_string(o.requests) + " requests")
            << " at " << o.arrival_rate << "/s each, prompts " << o.prompt_min << ".."
            << o.prompt_max << " (" << distribution << "), " << o.generate << " tokens, model step "
            << absl::FormatDuration(o.model_step) << ", kvcached at " << o.server << "\n";
  absl::StatusOr<std::vector<kvcm::loadgen::ServeResult>> results = kvcm::loadgen::RunServe(o);
  if (!results.ok()) {
    std::cerr << "kvcache-loadgen: " << results.status().message() << "\n";
    return results.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::cout << kvcm::loadgen::FormatServeTable(*results);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream out(path);
    out << kvcm::loadgen::ServeJson(o, *results);
    if (!out.good()) {
      std::cerr << "kvcache-loadgen: --json: cannot write " << path << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("load generator for kvcached (see --help)");
  absl::ParseCommandLine(argc, argv);
  kvcm::loadgen::LoadOptions o;
  o.server = absl::GetFlag(FLAGS_server);
  if (absl::Status applied = kvcm::client::ApplySecurityFlagsFromCommandLine(&o.connection);
      !applied.ok()) {
    std::cerr << "kvcache-loadgen: " << applied.message() << "\n";
    return 2;
  }
  o.sequences = absl::GetFlag(FLAGS_sequences);
  o.streams = absl::GetFlag(FLAGS_streams);
  o.layers = absl::GetFlag(FLAGS_layers);
  o.context = absl::GetFlag(FLAGS_context);
  o.compression_ratio = absl::GetFlag(FLAGS_compression_ratio);
  if (absl::GetFlag(FLAGS_budget_tokens) > 0) o.budget_tokens = absl::GetFlag(FLAGS_budget_tokens);
  o.duration = absl::GetFlag(FLAGS_duration);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.folded = absl::GetFlag(FLAGS_folded);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (std::optional<kvcm::kernels::ScoreDtype> parsed = kvcm::kernels::ParseScoreDtype(dtype)) {
    o.dtype = *parsed;
  } else {
    std::cerr << "kvcache-loadgen: --dtype must be float32, float16 or bfloat16\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_serve)) return ServeMain(o);
  std::vector<std::string> policies;
  if (absl::GetFlag(FLAGS_policy) == "all") {
    for (auto name : kvcm::Policy::PresetNames()) policies.emplace_back(name);
  } else {
    policies = absl::StrSplit(absl::GetFlag(FLAGS_policy), ',', absl::SkipEmpty());
  }

  std::cout << "kvcache-loadgen: " << o.sequences << " sequences over " << o.streams
            << " streams, " << o.layers << " layers, context " << o.context << ", " << dtype
            << " scores" << (o.folded ? " (folded)" : "") << ", transport " << o.transport
            << ", " << absl::FormatDuration(o.duration) << " per policy"
            << (o.server.empty() ? " (in-process only)" : ", kvcached at " + o.server) << "\n";
  std::vector<kvcm::loadgen::LoadResult> daemon, embedded;
  for (const std::string& policy : policies) {
    o.policy = policy;
    if (!o.server.empty()) {
      absl::StatusOr<kvcm::loadgen::LoadResult> r = kvcm::loadgen::RunAgainstDaemon(o);
      if (!r.ok()) {
        std::cerr << "kvcache-loadgen: " << policy << ": " << r.status().message() << "\n";
        return r.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
      }
      daemon.push_back(*r);
    }
    if (absl::GetFlag(FLAGS_embedded) || o.server.empty()) {
      absl::StatusOr<kvcm::loadgen::LoadResult> r = kvcm::loadgen::RunEmbedded(o);
      if (!r.ok()) {
        std::cerr << "kvcache-loadgen: " << policy << " (in-process): " << r.status().message()
                  << "\n";
        return r.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
      }
      embedded.push_back(*r);
    }
  }
  std::cout << (o.server.empty() ? kvcm::loadgen::FormatTable(embedded, {})
                                 : kvcm::loadgen::FormatTable(daemon, embedded));
  return 0;
}

// kvcache-loadgen: many concurrent sequences over several worker streams against a running
// kvcached, then the same work through the engine in-process, one row per policy.
//
//   kvcache-loadgen --server=127.0.0.1:50051 --sequences=64 --streams=4 --layers=32
//       --context=65536 --compression_ratio=0.9 --dtype=float16
//       --policy=inertia,inertia_lazy4,score_free --duration=10s
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

// kvcache-replay: replays a kvtrace/1 file through the eviction engine and writes the
// decisions as JSON Lines (SPEC.md).
//
//   kvcache-replay --trace FILE [--out FILE] [--momentum] [--tp N] [--summary]
//   kvcache-replay --trace FILE --compare inertia,tova,...   (a per-policy table)
//   kvcache-replay --trace FILE --server 127.0.0.1:50051 [--tp N]  (through kvcached)
//   kvcache-replay --trace FILE --server ADDR --transport shm  (scores in shared memory)
//   kvcache-replay --trace FILE --folded [--server ADDR]  (one folded row per step)
//   kvcache-replay --trace FILE --device cuda  (the embedded engine's sequence on GPU 0)
//
// Exit status: 0 on success, 2 on bad input (one line on stderr naming the file line and
// step), 1 on other failures.
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "clients/replay/replay_backend.h"
#include "clients/replay/replay_run.h"
#include "clients/replay/score_transport.h"
#include "kernels/backend_by_name.h"
#ifdef KVCM_REPLAY_HAS_GRPC
#include "clients/cpp/security_flags.h"
#include "clients/replay/grpc_backend.h"
#endif

ABSL_FLAG(std::string, trace, "", "kvtrace/1 file to replay (required)");
ABSL_FLAG(std::string, out, "", "write decisions here instead of stdout");
ABSL_FLAG(bool, momentum, false, "add the cache's positions and momentum to every decision");
ABSL_FLAG(int32_t, tp, 1,
          "split each layer's scores into N tensor-parallel rank partial sums and decide "
          "through the tensor-parallel join (decisions do not change)");
ABSL_FLAG(bool, folded, false,
          "open the sequence with the folded score layout and send each step's layer rows "
          "folded into one row (docs/SPEC.md, \"Folded reports\"); decisions may differ "
          "from the per-layer ones by float32 rounding");
ABSL_FLAG(bool, summary, false, "print the trace's statistics after the decisions");
ABSL_FLAG(std::string, policy, "", "replace the trace's policy with this preset");
ABSL_FLAG(std::string, server, "",
          "replay through the kvcached at this address instead of the embedded engine "
          "(with --tp N: N concurrent rank streams)");
ABSL_FLAG(std::string, transport, "grpc",
          "with --server, how the scores travel: grpc (inline in each report), shm (in a "
          "shared-memory score region per rank stream that the reports reference; kvcached "
          "must run on this node with --allow_shm_scores), created (the same in a region "
          "kvcached creates, CreateScoreRegion; not with --engine_backend=cuda) or "
          "created_per_rank (each rank's region on that rank's device)");
ABSL_FLAG(std::string, device, "cpu",
          "where the embedded engine keeps and steps the sequence: cpu, cuda (momentum and "
          "positions on GPU --gpu, every step's kernels there; builds with CUDA only), "
          "emulated (the device-resident code path on the CPU, for tests), or auto (cuda "
          "when GPU --gpu is visible, else cpu)");
ABSL_FLAG(int32_t, gpu, 0, "with --device cuda, the CUDA device ordinal");
ABSL_FLAG(std::string, compare, "",
          "comma-separated presets (or 'all'): replay the trace under each and print a "
          "per-policy table instead of decisions");

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "kvcache-replay: " << status.message() << "\n";
  return kvcm::replay::ExitCodeFor(status);
}

// The embedded engine, or the daemon named by --server (scores sent over `transport`).
absl::StatusOr<std::unique_ptr<kvcm::replay::ReplayBackend>> MakeBackend(
    kvcm::replay::ScoreTransport transport) {
  const std::string server = absl::GetFlag(FLAGS_server);
  if (server.empty()) return kvcm::replay::NewEmbeddedBackend();
#ifdef KVCM_REPLAY_HAS_GRPC
  kvcm::replay::GrpcBackendOptions options;
  options.address = server;
  options.transport = transport;
  if (absl::Status applied = kvcm::client::ApplySecurityFlagsFromCommandLine(&options.connection);
      !applied.ok()) {
    return applied;
  }
  return kvcm::replay::NewGrpcBackend(options);
#else
  (void)transport;
  return absl::UnimplementedError("this kvcache-replay was built without gRPC (--server)");
#endif
}

// The embedded engine's kernel backend named by --device, on GPU --gpu.
absl::StatusOr<const kvcm::kernels::KernelBackend*> EngineBackend(const std::string& device) {
  absl::StatusOr<const kvcm::kernels::KernelBackend*> backend =
      kvcm::kernels::BackendByName(device, absl::GetFlag(FLAGS_gpu));
  if (backend.ok()) return backend;
  return absl::Status(backend.status().code(),
                      absl::StrCat("--device ", device, ": ", backend.status().message()));
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "replays a kvtrace/1 file through the eviction engine.\n"
      "  kvcache-replay --trace FILE [--out FILE] [--momentum] [--tp N] [--summary] [--folded]\n"
      "  kvcache-replay --trace FILE --server ADDR [--transport grpc|shm|created|created_per_rank] [--tp N] [--folded]\n"
      "  kvcache-replay --trace FILE --device cuda [--gpu N]\n"
      "  kvcache-replay --trace FILE --compare inertia,inertia_lazy4,score_free,tova");
  absl::ParseCommandLine(argc, argv);
  using kvcm::replay::ReplayOptions;
  using kvcm::replay::ReplaySummary;

  ReplayOptions options;
  options.trace_path = absl::GetFlag(FLAGS_trace);
  options.tp_ranks = absl::GetFlag(FLAGS_tp);
  options.with_momentum = absl::GetFlag(FLAGS_momentum);
  options.folded = absl::GetFlag(FLAGS_folded);
  if (options.trace_path.empty()) {
    return Fail(absl::InvalidArgumentError("--trace FILE is required (see --help)"));
  }
  if (options.tp_ranks < 1) {
    return Fail(absl::InvalidArgumentError("--tp must be >= 1"));
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  absl::StatusOr<const kvcm::kernels::KernelBackend*> engine = EngineBackend(device);
  if (!engine.ok()) return Fail(engine.status());
  if (device != "cpu" && !absl::GetFlag(FLAGS_server).empty()) {
    return Fail(absl::InvalidArgumentError(
        "--device " + device + " is for the embedded engine; with --server the daemon decides "
        "where its sequences live"));
  }
  options.engine_backend = *engine;
  options.device = absl::GetFlag(FLAGS_gpu);
  const std::string transport_name = absl::GetFlag(FLAGS_transport);
  const std::optional<kvcm::replay::ScoreTransport> transport =
      kvcm::replay::ParseScoreTransport(transport_name);
  if (!transport) {
    return Fail(absl::InvalidArgumentError(
        "--transport is '" + transport_name + "'; it must be grpc or shm"));
  }
  if (*transport != kvcm::replay::ScoreTransport::kGrpc && absl::GetFlag(FLAGS_server).empty()) {
    return Fail(absl::InvalidArgumentError(
        "--transport " + transport_name + " needs --server (the embedded engine reads the "
        "trace's scores directly)"));
  }

  const std::string compare = absl::GetFlag(FLAGS_compare);
  if (!compare.empty()) {
    std::vector<std::string> presets;
    if (compare == "all") {
      for (auto name : kvcm::Policy::PresetNames()) presets.emplace_back(name);
    } else {
      presets = absl::StrSplit(compare, ',', absl::SkipEmpty());
    }
    std::vector<ReplaySummary> rows;
    for (const std::string& preset : presets) {
      options.preset = preset;
      absl::StatusOr<std::unique_ptr<kvcm::replay::ReplayBackend>> backend =
          MakeBackend(*transport);
      if (!backend.ok()) return Fail(backend.status());
      absl::StatusOr<ReplaySummary> summary = kvcm::replay::RunReplay(options, **backend);
      if (!summary.ok()) return Fail(summary.status());
      rows.push_back(*summary);
    }
    std::cout << kvcm::replay::FormatSummaryTable(rows);
    return 0;
  }

  if (const std::string preset = absl::GetFlag(FLAGS_policy); !preset.empty()) {
    options.preset = preset;
  }
  const std::string out_path = absl::GetFlag(FLAGS_out);
  std::ofstream out_file;
  if (!out_path.empty()) {
    out_file.open(out_path, std::ios::out | std::ios::trunc);
    if (!out_file) return Fail(absl::UnavailableError("cannot write " + out_path));
    options.decisions = &out_file;
  } else {
    options.decisions = &std::cout;
  }
  absl::StatusOr<std::unique_ptr<kvcm::replay::ReplayBackend>> backend = MakeBackend(*transport);
  if (!backend.ok()) return Fail(backend.status());
  absl::StatusOr<ReplaySummary> summary = kvcm::replay::RunReplay(options, **backend);
  if (!summary.ok()) return Fail(summary.status());
  if (absl::GetFlag(FLAGS_summary)) {
    // Keep stdout a clean stream of decisions when it carries them.
    std::ostream& where = out_path.empty() ? std::cerr : std::cout;
    where << kvcm::replay::FormatSummaryTable({*summary});
  }
  return 0;
}

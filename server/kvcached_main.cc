// kvcached: the KV-cache eviction daemon. One per GPU node; workers stream their decode
// steps to it and receive the tokens to evict (see proto/kvcache/v1/kvcache.proto).
//
// SIGTERM or SIGINT: health goes NOT_SERVING, in-flight steps finish, the process exits 0
// within --drain_deadline. Every exit but SIGKILL removes the KV pools' shared memory
// (docs/RELIABILITY.md); the next start removes what a SIGKILLed instance left. With
// --state_dir the drain instead writes a snapshot that keeps them for the next start.
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/kv/kv_storage.h"
#include "server/daemon.h"
#include "server/ucx_sidecar.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address: host:port (port 0: any free port) or unix:/path/to.sock");
ABSL_FLAG(std::string, health_listen, "",
          "also serve grpc.health.v1, alone and in plaintext, on this host:port (port 0: any), "
          "for probes that cannot speak TLS (the kubelet's gRPC probes); \"\": only on --listen");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address (port 0: any free port; empty: no metrics)");
ABSL_FLAG(std::string, port_file, "",
          "once serving, write {\"grpc\":ADDR,\"metrics\":ADDR} here (for tests and scripts)");
ABSL_FLAG(int64_t, max_sequences, 65536, "most sequences open at once");
ABSL_FLAG(int32_t, max_tp_world_size, 64, "most tensor-parallel ranks per sequence");
ABSL_FLAG(int64_t, max_message_bytes, 256 << 20, "largest request accepted, in bytes");
ABSL_FLAG(int32_t, max_streams, 1024, "most step streams open at once");
ABSL_FLAG(absl::Duration, idle_timeout, absl::Minutes(10),
          "close sequences nobody stepped, opened or inspected for this long (0: never)");
ABSL_FLAG(absl::Duration, tp_join_timeout, absl::Seconds(30),
          "abandon a tensor-parallel step still missing ranks this long after its first "
          "report, so the ranks that reported get an answer (0: wait forever)");
ABSL_FLAG(absl::Duration, drain_deadline, absl::Seconds(30),
          "on SIGTERM, how long in-flight calls may take before they are cancelled");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(30), "gRPC keepalive ping interval");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(10), "gRPC keepalive ping timeout");
ABSL_FLAG(std::string, backend, "host",
          "where the KV pools live: host (POSIX shared memory) or cuda (GPU r for rank r)");
ABSL_FLAG(int64_t, pool_memory_bytes, 0,
          "KV pool size per tensor-parallel rank, in bytes (0: no pools, decisions only)");
ABSL_FLAG(int32_t, tp_ranks, 1, "tensor-parallel ranks, one KV pool each");
ABSL_FLAG(int64_t, kv_layers, 32, "KV geometry: decoder layers");
ABSL_FLAG(int64_t, kv_heads, 8, "KV geometry: KV heads per rank");
ABSL_FLAG(int64_t, kv_head_dim, 128, "KV geometry: head dimension");
ABSL_FLAG(int64_t, kv_tokens_per_block, 16, "KV geometry: token slots per block");
ABSL_FLAG(std::string, kv_dtype, "float16", "KV geometry: float16, bfloat16 or float32");
ABSL_FLAG(int32_t, engine_threads, 0,
          "engine threads; each sequence is pinned to one (0: one per core)");
ABSL_FLAG(int32_t, max_inflight_batches, 8,
          "unanswered batches per step stream; past it the stream is not read (back-pressure)");
ABSL_FLAG(int64_t, max_pending_join_bytes, int64_t{1} << 30,
          "partial sums held for tensor-parallel steps waiting for ranks, all sequences "
          "together; a report past it is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(bool, allow_shm_scores, false,
          "score regions for workers on this node: accept shared-memory ones "
          "(RegisterScoreRegion) and create them (CreateScoreRegion; device memory with "
          "--engine_backend=cuda)");
ABSL_FLAG(int64_t, max_score_regions, 256, "most score regions mapped at once");
ABSL_FLAG(int64_t, max_created_score_region_bytes, int64_t{1} << 30,
          "bytes of the score regions kvcached creates, all together (host ones also count "
          "against --memory_limit_bytes)");
ABSL_FLAG(int64_t, kv_events_ring, 65536,
          "KV events (WatchKvEvents) kept for subscribers that resume; also how far behind a "
          "subscriber may fall before it is dropped (0: no KV events)");
ABSL_FLAG(int32_t, kv_events_max_subscribers, 64, "most WatchKvEvents subscribers at once");
ABSL_FLAG(int64_t, diagnostics_every, 0,
          "eviction-quality diagnostics: measure one pair of consecutive scoring steps per "
          "this many scoring steps of each sampled sequence (0: off; docs/METRICS.md)");
ABSL_FLAG(double, diagnostics_sample, 0.1,
          "eviction-quality diagnostics: the fraction of sequences sampled, 0 to 1 (chosen "
          "by a hash of the sequence id, so stable)");
ABSL_FLAG(bool, kv_shared_memory, true,
          "host pools in POSIX shared memory (/kvcached-<pid>-rank<r>) for workers to map");
ABSL_FLAG(std::string, engine_backend, "auto",
          "where the sequences' momentum and positions live and their kernels run: cpu, "
          "cuda (GPU --engine_device), emulated (the device code path on the CPU, for "
          "tests), or auto (cuda with --backend=cuda, else cpu)");
ABSL_FLAG(int32_t, engine_device, 0, "the GPU of the sequences' state with the cuda engine");
ABSL_FLAG(int64_t, max_sequence_tokens, int64_t{1} << 22,
          "most tokens one sequence holds over its life, prefill plus decode; a longer "
          "prefill, or a step past it, is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, memory_limit_bytes, int64_t{8} << 30,
          "bytes the daemon holds for requests, all together: every sequence's engine "
          "state, pending tensor-parallel partial sums and reply buffers; an open or step "
          "past it is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(absl::Duration, stream_idle_timeout, absl::Minutes(10),
          "end a step stream that received no batch for this long while every batch it "
          "sent was answered (UNAVAILABLE; its sequences stay open), so that it gives back "
          "its --max_streams slot (0: never)");
ABSL_FLAG(int64_t, max_connections, 0,
          "most gRPC connections open at once on a TCP --listen; past it a new connection is "
          "closed as soon as accepted (0: the file-descriptor limit less 256, or half of it "
          "below 512)");
ABSL_FLAG(absl::Duration, listener_probe_interval, absl::Seconds(10),
          "how often kvcached probes its own listener over a fresh connection; health says "
          "NOT_SERVING while the probe fails, so a liveness probe restarts a wedged daemon "
          "(0: no probe)");
ABSL_FLAG(std::string, state_dir, "",
          "restart without loss: on SIGTERM/SIGINT write every open sequence and the KV "
          "pools' state to DIR/kvcached.snapshot, and at start restore it (re-attaching the "
          "shared-memory pools) and remove it; an unusable one is moved to "
          "kvcached.snapshot.corrupt (empty: off)");
ABSL_FLAG(absl::Duration, listener_probe_timeout, absl::Seconds(5),
          "how long one self-probe of the listener may take");
ABSL_FLAG(std::string, tls_cert_file, "",
          "TLS on the gRPC port (TCP and unix): the server's PEM certificate chain (with "
          "--tls_key_file; both or neither)");
ABSL_FLAG(std::string, tls_key_file, "", "TLS: the server's PEM private key");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "mTLS: PEM CA certificate(s); every client must present a certificate they "
          "signed (needs --tls_cert_file)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "bearer tokens: one 'token tenant' pair a line ('#' comments); every kvcache.v1 "
          "call then needs 'authorization: Bearer <token>' and runs as its tenant. Read "
          "again on SIGHUP (grpc.health.v1 stays open)");
ABSL_FLAG(int64_t, tenant_max_sequences, 0,
          "most sequences one tenant holds open (0: only --max_sequences)");
ABSL_FLAG(double, tenant_memory_share, 1.0,
          "fraction of --memory_limit_bytes one tenant's sequences may hold, in (0, 1]");
ABSL_FLAG(std::string, listen_group, "",
          "a unix: --listen socket (mode 0660) is given to this group");
ABSL_FLAG(std::string, kv_transfer, "ucx",
          "how ImportSequence moves K/V blocks from the source kvcached: ucx (one-sided "
          "reads; gRPC when the source offers no UCX) or grpc");
ABSL_FLAG(int64_t, max_import_bytes_in_flight, int64_t{8} << 30,
          "K/V bytes of imports in progress, all together; past it an import is refused");
ABSL_FLAG(int32_t, import_threads, 2, "threads that run imports (each waits on the network)");
ABSL_FLAG(int64_t, max_queued_imports, 64,
          "imports waiting for an import thread; past it ImportSequence is refused");
ABSL_FLAG(absl::Duration, import_timeout, absl::Seconds(60),
          "one import's deadline, from the export to the commit");
ABSL_FLAG(int64_t, max_exports, 256, "hand-offs of this daemon's sequences in progress at once");
ABSL_FLAG(absl::Duration, export_lease, absl::Seconds(30),
          "a hand-off the target has not finished by then is aborted: the sequence is "
          "served here again");
ABSL_FLAG(std::string, peer_listen, "",
          "a second listen address with the same services, for the other kvcached "
          "(host:port or unix:/path)");
ABSL_FLAG(std::string, peer_token_file, "",
          "a file holding the bearer token this daemon presents to a source it imports from "
          "(a 'token tenant peer' line of the source's --auth_tokens_file)");
ABSL_FLAG(std::string, peer_ca_file, "",
          "PEM CA of the peers: a client certificate it issued may call KvPeer, and "
          "imports go over TLS checked against it (needs --tls_cert_file, presented to "
          "sources)");

#ifndef KVCM_VERSION
#define KVCM_VERSION "0.0.0"
#endif

namespace {

// Descriptors kept out of --max_connections's default: pools, score regions, the metrics
// server's connections, gRPC's own (half of a limit below 512).
constexpr int64_t kReservedFds = 256;

// Raises the soft RLIMIT_NOFILE to the hard one (every connection costs a descriptor) and
// returns the soft limit in force.
int64_t RaiseFdLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  const rlim_t soft = limit.rlim_cur;
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) limit.rlim_cur = soft;
  }
  std::fprintf(stderr, "kvcached: file descriptors: soft limit %llu (was %llu), hard limit %llu\n",
               static_cast<unsigned long long>(limit.rlim_cur),
               static_cast<unsigned long long>(soft),
               static_cast<unsigned long long>(limit.rlim_max));
  return limit.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(limit.rlim_cur);
}

// A crash (a failed CHECK aborts, a bad pointer faults) must not leave the KV pools in
// /dev/shm: remove their names, then die of the same signal as before.
void UnlinkPoolsAndDie(int signal_number) {
  kvcm::UnlinkSharedMemoryAfterCrash();
  raise(signal_number);  // SA_RESETHAND restored the default action
}

void InstallCrashCleanup() {
  struct sigaction action{};
  action.sa_handler = UnlinkPoolsAndDie;
  action.sa_flags = SA_RESETHAND | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  for (const int signal_number : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL, SIGQUIT}) {
    sigaction(signal_number, &action, nullptr);
  }
}

bool WritePortFile(const std::string& path, const kvcm::server::Daemon& daemon) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "{\"grpc\": \"" << daemon.grpc_address() << "\", \"metrics\": \""
        << daemon.metrics_address() << "\"";
    if (!daemon.health_address().empty()) {
      out << ", \"health\": \"" << daemon.health_address() << "\"";
    }
    if (!daemon.peer_address().empty()) {
      out << ", \"peer\": \"" << daemon.peer_address() << "\"";
    }
    out << "}\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

// The flags of the network, the limits and the timeouts.
void ServiceFlags(kvcm::server::ServerOptions* options) {
  options->listen = absl::GetFlag(FLAGS_listen);
  options->metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options->health_listen = absl::GetFlag(FLAGS_health_listen);
  options->max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options->max_tp_world_size = absl::GetFlag(FLAGS_max_tp_world_size);
  options->max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options->max_streams = absl::GetFlag(FLAGS_max_streams);
  options->idle_timeout = absl::GetFlag(FLAGS_idle_timeout);
  options->drain_deadline = absl::GetFlag(FLAGS_drain_deadline);
  options->tp_join_timeout = absl::GetFlag(FLAGS_tp_join_timeout);
  options->keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  options->keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  options->max_sequence_tokens = absl::GetFlag(FLAGS_max_sequence_tokens);
  options->memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit_bytes);
  options->stream_idle_timeout = absl::GetFlag(FLAGS_stream_idle_timeout);
  options->max_connections = absl::GetFlag(FLAGS_max_connections);
  options->listener_probe_interval = absl::GetFlag(FLAGS_listener_probe_interval);
  options->listener_probe_timeout = absl::GetFlag(FLAGS_listener_probe_timeout);
  options->tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options->tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options->tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options->auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options->listen_group = absl::GetFlag(FLAGS_listen_group);
  options->tenant_max_sequences = absl::GetFlag(FLAGS_tenant_max_sequences);
  options->tenant_memory_share = absl::GetFlag(FLAGS_tenant_memory_share);
}

// The hand-off's flags (ImportSequence, KvPeer).
void HandoffFlags(kvcm::server::ServerOptions* options) {
  options->kv_transfer = absl::GetFlag(FLAGS_kv_transfer);
  options->max_import_bytes_in_flight = absl::GetFlag(FLAGS_max_import_bytes_in_flight);
  options->import_threads = absl::GetFlag(FLAGS_import_threads);
  options->max_queued_imports = absl::GetFlag(FLAGS_max_queued_imports);
  options->import_timeout = absl::GetFlag(FLAGS_import_timeout);
  options->max_exports = absl::GetFlag(FLAGS_max_exports);
  options->export_lease = absl::GetFlag(FLAGS_export_lease);
  options->peer_listen = absl::GetFlag(FLAGS_peer_listen);
  options->peer_token_file = absl::GetFlag(FLAGS_peer_token_file);
  options->peer_ca_file = absl::GetFlag(FLAGS_peer_ca_file);
}

// The flags of the step path: engine threads, score regions, KV events, diagnostics.
void StepPathFlags(kvcm::server::ServerOptions* options) {
  options->engine_threads = absl::GetFlag(FLAGS_engine_threads);
  options->max_inflight_batches = absl::GetFlag(FLAGS_max_inflight_batches);
  options->max_pending_join_bytes = absl::GetFlag(FLAGS_max_pending_join_bytes);
  options->allow_shm_scores = absl::GetFlag(FLAGS_allow_shm_scores);
  options->max_score_regions = absl::GetFlag(FLAGS_max_score_regions);
  options->max_created_score_region_bytes = absl::GetFlag(FLAGS_max_created_score_region_bytes);
  options->kv_events_ring = absl::GetFlag(FLAGS_kv_events_ring);
  options->kv_events_max_subscribers = absl::GetFlag(FLAGS_kv_events_max_subscribers);
  options->diagnostics_every = absl::GetFlag(FLAGS_diagnostics_every);
  options->diagnostics_sample = absl::GetFlag(FLAGS_diagnostics_sample);
  options->state_dir = absl::GetFlag(FLAGS_state_dir);
}

// The flags of the KV pools and of the engine's backend; the named ones must parse.
absl::Status PoolAndEngineFlags(kvcm::server::ServerOptions* options) {
  ASSIGN_OR_RETURN(options->backend, kvcm::server::KvBackendFromFlag(absl::GetFlag(FLAGS_backend)));
  ASSIGN_OR_RETURN(options->engine_backend,
                   kvcm::server::EngineBackendFromFlag(absl::GetFlag(FLAGS_engine_backend)));
  ASSIGN_OR_RETURN(options->kv_layout.dtype,
                   kvcm::server::KvDtypeFromFlag(absl::GetFlag(FLAGS_kv_dtype)));
  options->engine_device = absl::GetFlag(FLAGS_engine_device);
  options->pool_memory_bytes = absl::GetFlag(FLAGS_pool_memory_bytes);
  options->tp_ranks = absl::GetFlag(FLAGS_tp_ranks);
  options->kv_layout.layers = absl::GetFlag(FLAGS_kv_layers);
  options->kv_layout.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  options->kv_layout.head_dim = absl::GetFlag(FLAGS_kv_head_dim);
  options->kv_layout.tokens_per_block = absl::GetFlag(FLAGS_kv_tokens_per_block);
  options->kv_shared_memory = absl::GetFlag(FLAGS_kv_shared_memory);
  return absl::OkStatus();
}

// --max_connections 0 means what the file-descriptor limit leaves for connections (a
// fact of this process, hence here and not in the options' checks).
void ApplyFdLimit(kvcm::server::ServerOptions* options) {
  const int64_t fd_limit = RaiseFdLimit();
  const int64_t fd_budget = std::max<int64_t>(fd_limit / 2, fd_limit - kReservedFds);
  if (options->max_connections == 0) options->max_connections = fd_budget;
  if (options->max_connections > fd_budget) {
    std::fprintf(stderr,
                 "kvcached: warning: --max_connections=%lld exceeds the %lld descriptors the "
                 "fd limit leaves for connections; past them connections are refused anyway\n",
                 static_cast<long long>(options->max_connections),
                 static_cast<long long>(fd_budget));
  }
}

// Every flag into the options; Daemon::Start checks their values.
absl::StatusOr<kvcm::server::ServerOptions> OptionsFromFlags() {
  kvcm::server::ServerOptions options;
  ServiceFlags(&options);
  StepPathFlags(&options);
  HandoffFlags(&options);
  RETURN_IF_ERROR(PoolAndEngineFlags(&options));
  ApplyFdLimit(&options);
  return options;
}

// Step batches arrive as megabyte buffers many times a second. glibc's defaults would
// map each one fresh and hand it back, page-faulting it in again on every batch (a
// fifth of the daemon's CPU under load); keep such memory in the heap instead.
void TuneMalloc() {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  mallopt(M_TOP_PAD, 64 << 20);
  // With the heap kept, every malloc arena holds on to the megabyte buffers that passed
  // through it: a stream flooding 1 MiB batches peaked above 200 MB of RSS with glibc's
  // default of 8 arenas per core, and stays near 100 MB with two. One: the engine threads
  // build and free every sequence's state (Open and Close run there), and malloc_trim
  // (the reclaimer's) returns the top of the main arena only, so a closed sequence's
  // memory in another arena's top stayed resident. The step path itself allocates nothing
  // in steady state, so one arena costs it no contention.
  mallopt(M_ARENA_MAX, 1);
}

kvcm::server::BuildInfo ThisBuild() {
  kvcm::server::BuildInfo build;
  build.version = KVCM_VERSION;
#ifdef KVCM_HAS_CUDA
  build.cuda = true;
#endif
#ifdef KVCM_HAS_NCCL
  build.nccl = true;
#endif
  return build;
}

// Until SIGTERM or SIGINT (returned); SIGHUP reloads the tokens.
int WaitForStop(const sigset_t& stop_signals, kvcm::server::Daemon& daemon) {
  int signal_number = 0;
  while (sigwait(&stop_signals, &signal_number) == 0 && signal_number == SIGHUP) {
    if (absl::Status reloaded = daemon.ReloadAuthTokens(); !reloaded.ok()) {
      std::fprintf(stderr, "kvcached: SIGHUP: kept the tokens in force: %s\n",
                   std::string(reloaded.message()).c_str());
    }
  }
  return signal_number;
}

}  // namespace

int main(int argc, char** argv) {
  // The UCX sidecar (server/ucx_sidecar.h) is this binary started by a kvcached with the
  // control channel's fd and nothing else.
  if (argc == 2 && absl::StartsWith(argv[1], "--ucx_sidecar_fd=")) {
    int fd = -1;
    if (!absl::SimpleAtoi(absl::string_view(argv[1]).substr(17), &fd) || fd < 0) return 2;
    return kvcm::server::RunUcxSidecar(fd);
  }
  absl::SetProgramUsageMessage("the KV-cache eviction daemon: kvcached [--listen=ADDR] ...");
  absl::ParseCommandLine(argc, argv);
  TuneMalloc();

  // Block the stop signals (and SIGHUP, the tokens' reload) in every thread, gRPC's
  // included, and wait for them here.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  InstallCrashCleanup();

  absl::StatusOr<kvcm::server::ServerOptions> options = OptionsFromFlags();
  absl::StatusOr<std::unique_ptr<kvcm::server::Daemon>> daemon =
      options.ok() ? kvcm::server::Daemon::Start(*options, ThisBuild())
                   : absl::StatusOr<std::unique_ptr<kvcm::server::Daemon>>(options.status());
  if (!daemon.ok()) {
    std::fprintf(stderr, "kvcached: %s\n", std::string(daemon.status().message()).c_str());
    return daemon.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::fprintf(stderr,
               "kvcached %s: serving gRPC on %s, metrics on http://%s/metrics, engine %s\n",
               KVCM_VERSION, (*daemon)->grpc_address().c_str(),
               (*daemon)->metrics_address().c_str(), (*daemon)->engine_name().c_str());
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty() && !WritePortFile(port_file, **daemon)) {
    std::fprintf(stderr, "kvcached: cannot write %s\n", port_file.c_str());
    return 1;
  }

  const int signal_number = WaitForStop(stop_signals, **daemon);
  std::fprintf(stderr, "kvcached: %s: draining (deadline %s)\n",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT",
               absl::FormatDuration(options->drain_deadline).c_str());
  (*daemon)->Drain(options->drain_deadline);
  std::fprintf(stderr, "kvcached: stopped\n");
  std::fflush(nullptr);
  // Every call has ended and nothing is left to save. Skip the teardown: stopping the
  // metrics HTTP server alone takes one to two seconds (its poll loop checks for stop
  // once a second), which would only delay the pod's exit.
  std::_Exit(0);
}

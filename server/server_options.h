// ServerOptions: everything kvcached is configured with. Filled from flags in
// kvcached_main.cc (the only place flags live) and passed into the core, which checks
// them (Validate) before it uses them. Plain values; thread-compatible.
#ifndef KVCM_SERVER_SERVER_OPTIONS_H_
#define KVCM_SERVER_SERVER_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/kv_compaction.h"

namespace kvcm::server {

// Where the KV pools live.
enum class KvBackend : uint8_t { kHost, kCuda };
// "host" / "cuda", and back (nullopt for any other name).
absl::string_view KvBackendName(KvBackend backend);
std::optional<KvBackend> ParseKvBackend(absl::string_view name);

// Where the sequences' engine state (momentum, positions) lives and its kernels run. kAuto:
// on the GPU when the KV pools are (--backend=cuda), else the CPU. kEmulated: the device
// code path on the CPU (kernels::EmulatedDeviceBackend), for tests without a GPU.
enum class EngineBackend : uint8_t { kAuto, kCpu, kCuda, kEmulated };
// "auto" / "cpu" / "cuda" / "emulated", and back (nullopt for any other name).
absl::string_view EngineBackendName(EngineBackend backend);
std::optional<EngineBackend> ParseEngineBackend(absl::string_view name);

// A flag's value as the enum it names; INVALID_ARGUMENT naming the flag, the value and
// the names it accepts otherwise.
absl::StatusOr<KvBackend> KvBackendFromFlag(absl::string_view name);          // --backend
absl::StatusOr<EngineBackend> EngineBackendFromFlag(absl::string_view name);  // --engine_backend
absl::StatusOr<kernels::KvDtype> KvDtypeFromFlag(absl::string_view name);     // --kv_dtype

struct ServerOptions {
  // gRPC: host:port (port 0 picks a free port) or unix:/path (workers on the same node).
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen = "127.0.0.1:9464";   // Prometheus /metrics; "" disables
  // grpc.health.v1 alone, in plaintext, on its own port (host:port; "" : none), answering
  // what the health service on `listen` answers: for probes that cannot speak TLS.
  std::string health_listen;
  int64_t max_sequences = 65536;
  int32_t max_tp_world_size = 64;
  int64_t max_message_bytes = 256 << 20;  // largest StepBatch accepted
  int32_t max_streams = 1024;             // concurrent StepStream calls
  absl::Duration idle_timeout = absl::Minutes(10);     // 0: never reclaim
  absl::Duration reclaim_interval = absl::Seconds(1);
  // A tensor-parallel step still missing ranks this long after its first report is
  // abandoned (DEADLINE_EXCEEDED to the ranks that reported); 0: wait forever.
  absl::Duration tp_join_timeout = absl::Seconds(30);
  absl::Duration drain_deadline = absl::Seconds(30);
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  int32_t metrics_threads = 2;

  // The step path. Engine threads (0: one per core); each sequence is pinned to one.
  int32_t engine_threads = 0;
  // Unanswered batches per step stream: past it the daemon stops reading that stream.
  int32_t max_inflight_batches = 8;
  // Partial sums held by tensor-parallel steps waiting for their other ranks, in total.
  int64_t max_pending_join_bytes = int64_t{1} << 30;
  // Score regions (RegisterScoreRegion, CreateScoreRegion); off unless allowed.
  bool allow_shm_scores = false;
  int64_t max_score_regions = 256;
  // The bytes of the regions kvcached creates, all together (host regions also count
  // against memory_limit_bytes).
  int64_t max_created_score_region_bytes = int64_t{1} << 30;

  // KV events (WatchKvEvents, docs/EVENTS.md): the events kept for subscribers that
  // resume, which is also how far behind a subscriber may fall before it is dropped (0: no
  // events at all); and the most subscribers at once.
  int64_t kv_events_ring = 65536;
  int32_t kv_events_max_subscribers = 64;

  // Eviction-quality diagnostics (cache_manager/engine/diagnostics.h): one pair of consecutive
  // scoring steps measured per `diagnostics_every` scoring steps (0: off) of the sequences
  // a hash of their id samples at `diagnostics_sample` (0 to 1).
  int64_t diagnostics_every = 0;
  double diagnostics_sample = 0.1;

  // KV block pools, one per tensor-parallel rank: none when pool_memory_bytes is 0 (the
  // daemon then only decides). "host": host memory, in POSIX shared memory named
  // /kvcached-<pid>-rank<r> when kv_shared_memory; "cuda": device r's memory.
  KvBackend backend = KvBackend::kHost;
  int32_t tp_ranks = 1;
  int64_t pool_memory_bytes = 0;  // per rank
  kernels::KvBlockLayout kv_layout;
  bool kv_shared_memory = true;

  // The sequences' engine: see EngineBackend; `engine_device` is the GPU (CUDA ordinal of
  // this process) that holds every sequence's state when it runs on CUDA.
  EngineBackend engine_backend = EngineBackend::kAuto;
  int32_t engine_device = 0;
  // Request limits (docs/RELIABILITY.md): the most tokens one sequence holds over its
  // life (prefill plus decode), and the bytes the daemon holds for requests: every
  // sequence's engine state, pending tensor-parallel partial sums and reply buffers.
  int64_t max_sequence_tokens = int64_t{1} << 22;
  int64_t memory_limit_bytes = int64_t{8} << 30;
  // Exits (the drain, a fatal signal) unlink the pools' shared memory. A snapshot that
  // re-attaches the pools at the next start sets this on its SIGTERM drain so the names
  // outlive the process. Not a flag: only such a feature may set it (the drain keeps the
  // names on its own once it has written a snapshot, whatever this says).
  bool keep_kv_pools_on_exit = false;
  // Restart without loss (docs/RELIABILITY.md): when set, the drain writes every open
  // sequence and the pools' state to DIR/kvcached.snapshot, and the start restores it
  // (re-attaching the host shared-memory pools it names) and then removes it. "": off.
  std::string state_dir;

  // A StepStream that owes nothing and received no batch for this long is ended
  // (UNAVAILABLE), freeing its max_streams slot; 0: never.
  absl::Duration stream_idle_timeout = absl::Minutes(10);

  // TCP listen addresses: the most connections open at once; past it a new one is closed
  // as soon as accepted (0: no limit). Unix sockets have no limit (gRPC's own listener).
  int64_t max_connections = 0;
  // The self-probe of the listener over a fresh connection (health NOT_SERVING while it
  // fails): how often, and how long one may take. 0 interval: no probe.
  absl::Duration listener_probe_interval = absl::Seconds(10);
  absl::Duration listener_probe_timeout = absl::Seconds(5);

  // TLS on the gRPC port (TCP and unix): PEM certificate chain and key, both or neither;
  // with a client CA every client must present a certificate it signed (mTLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Bearer tokens ("token tenant" per line, server/auth.h): with a file, every kvcache.v1
  // call needs a known token and runs as its tenant; without, every caller is tenant "".
  // grpc.health.v1 stays open.
  std::string auth_tokens_file;
  // Per tenant: the most sequences open (0: only max_sequences), and the fraction of
  // memory_limit_bytes its sequences' engine state may hold, in (0, 1].
  int64_t tenant_max_sequences = 0;
  double tenant_memory_share = 1.0;
  // A unix: listen socket is made mode 0660; with a group name it is chowned to it.
  std::string listen_group;

  // Hand-off between daemons (ImportSequence, KvPeer; docs/DISAGGREGATION.md).
  // How an import moves K/V blocks: "ucx" (one-sided reads; gRPC when the source offers
  // no UCX or the pools are in device memory) or "grpc" (a stream from the source).
  std::string kv_transfer = "ucx";
  // The K/V bytes of imports in progress, all together; an import past it is refused
  // (RESOURCE_EXHAUSTED) before anything is leased.
  int64_t max_import_bytes_in_flight = int64_t{8} << 30;
  // Threads that run imports (each waits on the network), and the imports queued for
  // them (past it: RESOURCE_EXHAUSTED); one import's deadline, start to commit.
  int32_t import_threads = 2;
  int64_t max_queued_imports = 64;
  absl::Duration import_timeout = absl::Seconds(60);
  // Exports in progress at once, and how long a target has to finish one before the
  // source serves the sequence again.
  int64_t max_exports = 256;
  absl::Duration export_lease = absl::Seconds(30);
  // A second listen address with the same services, for the other daemons ("" : none).
  std::string peer_listen;
  // The bearer token this daemon presents to a source (a file holding it; "" : none).
  std::string peer_token_file;
  // PEM CA of the peers: a client certificate it issued is a peer credential (with TLS),
  // and a source's server certificate is checked against it (imports go over TLS).
  std::string peer_ca_file;

  // OK when every value is in range and the values agree with each other (and with this
  // build); else INVALID_ARGUMENT naming the flag and its value. Daemon::Start calls it
  // first.
  absl::Status Validate() const;
  // Where the sequences' engine runs: engine_backend with kAuto resolved (cuda with
  // --backend=cuda, else cpu). Never kAuto.
  EngineBackend ResolvedEngineBackend() const;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_SERVER_OPTIONS_H_

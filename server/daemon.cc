#include "server/daemon.h"

#include <malloc.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#ifdef KVCM_HAS_NCCL
#include "cache_manager/tp/nccl_cross_device_join.h"
#endif
#ifdef KVCM_HAS_CUDA
#include "cache_manager/kv/cuda_block_pool.h"
#include "kernels/cuda/cuda_adapter.h"
#endif
#include "cache_manager/base/status_macros.h"
#include "cache_manager/persist/restart.h"
#include "cache_manager/persist/snapshot.h"
#include "kernels/backend_by_name.h"
#include "kernels/stream_lanes.h"
#include "server/auth.h"
#include "server/health_service.h"
#include "server/importer.h"
#include "server/kvcache_service.h"
#include "server/tcp_listener.h"
#include "server/tls.h"
#include "server/translate.h"

namespace kvcm::server {
namespace {

// "127.0.0.1:0" with port 50123 bound -> "127.0.0.1:50123"; Unix socket addresses
// ("unix:/run/kvcached.sock") stay as they are.
std::string WithPort(const std::string& address, int port) {
  if (absl::StartsWith(address, "unix:")) return address;
  const size_t colon = address.rfind(':');
  return absl::StrCat(colon == std::string::npos ? address : address.substr(0, colon), ":", port);
}

int Millis(absl::Duration d) { return static_cast<int>(absl::ToInt64Milliseconds(d)); }

// The shared-memory name of rank r's pool: /kvcached-<pid>-rank<r>. The pid keeps
// instances on one node apart, and tells the start-up sweep whether the owner is alive.
std::string PoolShmName(int32_t rank) { return absl::StrCat("/kvcached-", getpid(), "-rank", rank); }

// Whether `name` (a /dev/shm entry, without the slash) is "kvcached-<pid>-rank<r>" of a
// process that no longer exists. RemoveStaleSharedMemory also requires that no process
// holds the object's lock: the pid test alone would misjudge an owner in another pid
// namespace, the lock test alone a kvcached older than the lock.
bool IsDeadInstancesPool(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "kvcached-")) return false;
  // A pool "-rank<r>", or a score region it created "-scores<n>".
  size_t dash = name.find("-rank");
  size_t suffix = 5;
  if (dash == absl::string_view::npos) {
    dash = name.find("-scores");
    suffix = 7;
  }
  if (dash == absl::string_view::npos) return false;
  int64_t pid = 0, rank = 0;
  if (!absl::SimpleAtoi(name.substr(0, dash), &pid) ||
      !absl::SimpleAtoi(name.substr(dash + suffix), &rank) || pid <= 0 || pid > INT32_MAX ||
      rank < 0) {
    return false;
  }
  return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// The join of tensor-parallel partial sums that sit one per rank on distinct devices
// (score regions created with a rank): NCCL for a CUDA engine (built with NCCL), the CPU
// twins for the emulated device, none otherwise (the CPU engine's regions are host
// memory; a CUDA build without NCCL gathers such steps onto the engine's GPU).
std::unique_ptr<CrossDeviceJoiner> CrossDeviceJoinerFor(EngineBackend engine) {
  if (engine == EngineBackend::kEmulated) return std::make_unique<CpuCrossDeviceJoiner>();
#ifdef KVCM_HAS_NCCL
  if (engine == EngineBackend::kCuda) return std::make_unique<NcclCrossDeviceJoiner>();
#endif
  return nullptr;
}

// The memory of the score regions kvcached creates: on the engine's GPU for a CUDA
// engine (exported by IPC handle), else a POSIX shared-memory object (the emulated
// device's "device memory" is host memory too).
ScoreRegionAllocator ScoreRegionAllocatorFor(EngineBackend engine, int device) {
#ifdef KVCM_HAS_CUDA
  if (engine == EngineBackend::kCuda) {
    return [device](int64_t bytes, const std::string& /*shm_name*/, int on_device) {
      return NewCudaKvStorage(bytes, on_device >= 0 ? on_device : device);
    };
  }
#endif
  (void)engine;
  (void)device;
  return [](int64_t bytes, const std::string& shm_name, int /*on_device*/) {
    HostStorageOptions host;
    host.shm_name = shm_name;
    return NewHostKvStorage(bytes, host);
  };
}

// A SIGKILLed instance could not unlink its pools and created score regions; without
// this they would hold node memory until reboot.
// Set when this start set its --state_dir snapshot aside: the pools that snapshot kept
// (marked, MarkSharedMemoryKept) will never be re-attached, and the sweep takes them.
std::atomic<bool> snapshot_set_aside{false};

void RemoveDeadInstancesSharedMemory() {
  for (const std::string& name :
       RemoveStaleSharedMemory(IsDeadInstancesPool, snapshot_set_aside.load())) {
    std::fprintf(stderr, "kvcached: removed %s, shared memory its dead kvcached left behind\n",
                 name.c_str());
  }
}

// The pool of each rank: host memory (shared, so that workers can map it, unless turned
// off) or device memory of the GPU with the rank's number. With `snapshot`, each rank's
// shared memory is the one it names, re-attached with its bytes as they are.
KvPools::PoolFactory PoolFactory(const ServerOptions& options,
                                 const EngineSnapshot* snapshot = nullptr) {
  return [options, snapshot](const BlockPoolOptions& pool)
             -> absl::StatusOr<std::unique_ptr<BlockPool>> {
#ifdef KVCM_HAS_CUDA
    if (options.backend == KvBackend::kCuda) return CreateCudaBlockPool(pool, pool.rank);
#endif
    HostStorageOptions host;
    if (snapshot != nullptr) {
      host.shm_name = snapshot->pools[static_cast<size_t>(pool.rank)].shm_name;
      host.attach = true;
    } else if (options.kv_shared_memory) {
      host.shm_name = PoolShmName(pool.rank);
    }
    return BlockPool::CreateHost(pool, host);
  };
}

std::string SnapshotPath(const ServerOptions& options) {
  return absl::StrCat(options.state_dir, "/", kSnapshotFileName);
}

// A snapshot that cannot be restored is moved to PATH.corrupt (replacing an older one, so
// the directory does not fill up) and kvcached starts empty: its workers re-open their
// sequences with `resume` as after a crash. Refusing to start would instead keep the
// whole node from serving until someone deletes the file.
void SetSnapshotAside(const std::string& path, const absl::Status& why) {
  snapshot_set_aside.store(true);
  const std::string aside = path + ".corrupt";
  const std::string where =
      std::rename(path.c_str(), aside.c_str()) == 0
          ? absl::StrCat("It was moved to ", aside)
          : absl::StrCat("It could not be moved aside (", std::strerror(errno), "); remove it");
  std::fprintf(stderr,
               "kvcached: ERROR: the snapshot %s cannot be restored: %s. %s; starting with no "
               "sequences (workers must re-open theirs, with resume)\n",
               path.c_str(), std::string(why.message()).c_str(), where.c_str());
}

// The snapshot of --state_dir when there is one this configuration can restore; nullopt
// when there is none, or it was set aside. An error (the directory cannot be read) stops
// the start: the drain could not write there either.
absl::StatusOr<std::optional<EngineSnapshot>> LoadSnapshot(const ServerOptions& options) {
  const std::string path = SnapshotPath(options);
  absl::StatusOr<EngineSnapshot> snapshot = ReadSnapshotFile(path);
  if (absl::IsNotFound(snapshot.status())) return std::nullopt;
  if (absl::IsDataLoss(snapshot.status())) {
    SetSnapshotAside(path, snapshot.status());
    return std::nullopt;
  }
  if (!snapshot.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir: ", snapshot.status().message()));
  }
  const int32_t ranks = options.pool_memory_bytes > 0 ? options.tp_ranks : 0;
  if (absl::Status match =
          CheckPoolsMatch(*snapshot, ranks, options.kv_layout, options.pool_memory_bytes);
      !match.ok()) {
    SetSnapshotAside(path, match);
    return std::nullopt;
  }
  return std::optional<EngineSnapshot>(*std::move(snapshot));
}

// The kernel backend of the sequences' engine state, or why this daemon cannot run it.
absl::StatusOr<const kernels::KernelBackend*> EngineKernels(const ServerOptions& options) {
  const EngineBackend engine = options.ResolvedEngineBackend();
  absl::StatusOr<const kernels::KernelBackend*> found =
      kernels::BackendByName(EngineBackendName(engine), options.engine_device);
  if (found.ok()) return found;
  return absl::Status(
      found.status().code(),
      absl::StrCat("--engine_backend=", EngineBackendName(engine), " --engine_device=",
                   options.engine_device, ": ", found.status().message(),
                   " (use --engine_backend=cpu to decide on the CPU)"));
}

// The id of group `name` (--listen_group); INVALID_ARGUMENT when there is none.
absl::StatusOr<gid_t> GroupId(const std::string& name) {
  group entry{};
  group* found = nullptr;
  std::vector<char> buffer(16384);
  const int e = getgrnam_r(name.c_str(), &entry, buffer.data(), buffer.size(), &found);
  if (e != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen_group ", name, ": no such group on this machine"));
  }
  return found->gr_gid;
}

// Mode 0660 on the unix socket at `path`, and group `gid` unless it is -1.
absl::Status SecureSocketFile(const std::string& path, gid_t gid) {
  if (gid != static_cast<gid_t>(-1) && chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--listen_group: cannot give ", path, " to group ", gid, ": ", std::strerror(errno)));
  }
  if (chmod(path.c_str(), 0660) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot make ", path, " mode 0660: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

Daemon::Daemon(const ServerOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const ServerOptions& options,
                                                      const BuildInfo& build) {
  RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<Daemon> d(new Daemon(options));
  d->metrics_ = std::make_unique<ServerMetrics>(build);
  std::optional<EngineSnapshot> snapshot;
  if (!options.state_dir.empty()) {
    ASSIGN_OR_RETURN(snapshot, LoadSnapshot(options));
  }
  RETURN_IF_ERROR(d->CreatePools(&snapshot));
  RETURN_IF_ERROR(d->CreateEngine());
  // The engine threads first: each restored sequence takes the device stream of the
  // thread that will step it.
  d->CreateExecutor();
  if (snapshot.has_value()) d->RestoreSequences(*snapshot);
  RETURN_IF_ERROR(d->CreateHandoff());
  if (options.allow_shm_scores) d->CreateScoreRegions();
  RETURN_IF_ERROR(d->ServeMetrics());
  RETURN_IF_ERROR(d->ServeGrpc());
  // Before the restored snapshot goes: a start that fails here keeps it for the next.
  RETURN_IF_ERROR(d->StartHealthServer());
  d->StartServing();
  return d;
}

absl::Status Daemon::CreatePools(std::optional<EngineSnapshot>* snapshot) {
  if (options_.pool_memory_bytes > 0) {
    if (snapshot->has_value()) {
      // Re-attached (and so locked) before the sweep below, which would remove them.
      absl::StatusOr<std::unique_ptr<KvPools>> attached =
          KvPools::Create(options_.tp_ranks, options_.kv_layout, options_.pool_memory_bytes,
                          PoolFactory(options_, &**snapshot));
      if (attached.ok()) {
        pools_ = *std::move(attached);
      } else {
        SetSnapshotAside(SnapshotPath(options_), attached.status());
        snapshot->reset();
      }
    }
    if (options_.backend == KvBackend::kHost && options_.kv_shared_memory) {
      // The pools re-attached above are locked by now: the sweep skips objects a live
      // process holds, this one included.
      RemoveDeadInstancesSharedMemory();
    }
    if (pools_ == nullptr) {
      ASSIGN_OR_RETURN(pools_, KvPools::Create(options_.tp_ranks, options_.kv_layout,
                                               options_.pool_memory_bytes,
                                               PoolFactory(options_)));
    }
  }
  if (options_.allow_shm_scores &&
      !(options_.pool_memory_bytes > 0 && options_.backend == KvBackend::kHost &&
        options_.kv_shared_memory)) {
    RemoveDeadInstancesSharedMemory();  // created score regions only
  }
  pool_gauges_ =
      std::make_shared<PoolGauges>(pools_.get(), std::string(KvBackendName(options_.backend)));
  return absl::OkStatus();
}

absl::Status Daemon::CreateEngine() {
  SequenceTableOptions table_options;
  table_options.max_sequences = options_.max_sequences;
  table_options.tenant_max_sequences = options_.tenant_max_sequences;
  if (options_.tenant_memory_share < 1.0) {
    table_options.tenant_memory_limit_bytes = static_cast<int64_t>(
        static_cast<double>(options_.memory_limit_bytes) * options_.tenant_memory_share);
  }
  table_options.max_tp_world_size = options_.max_tp_world_size;
  table_options.kv_pools = pools_.get();
  table_options.max_pending_join_bytes = options_.max_pending_join_bytes;
  table_options.max_sequence_tokens = options_.max_sequence_tokens;
  table_options.memory_limit_bytes = options_.memory_limit_bytes;
  if (options_.kv_events_ring > 0) {
    KvEventLogOptions events;
    events.ring_capacity = options_.kv_events_ring;
    events.max_subscribers = options_.kv_events_max_subscribers;
    kv_events_ = std::make_unique<KvEventLog>(events);
  }
  kv_event_gauges_ = std::make_shared<KvEventGauges>(kv_events_.get());
  table_options.kv_events = kv_events_.get();
  table_options.diagnostics = {options_.diagnostics_every, options_.diagnostics_sample};
  ASSIGN_OR_RETURN(table_options.engine_backend, EngineKernels(options_));
  table_options.engine_device = options_.engine_device;
  cross_device_joiner_ = CrossDeviceJoinerFor(options_.ResolvedEngineBackend());
  table_options.cross_device_joiner = cross_device_joiner_.get();
  engine_name_ = table_options.engine_backend->name;
  engine_memory_ = table_options.engine_backend->memory;
  table_ = std::make_unique<SequenceTable>(table_options);
  table_gauges_ = std::make_shared<TableGauges>(table_.get());
  limit_gauges_ = std::make_shared<LimitGauges>(table_->memory_budget());
  return absl::OkStatus();
}

void Daemon::RestoreSequences(const EngineSnapshot& snapshot) {
  const StepExecutor* executor = executor_.get();
  const RestoreReport report =
      RestoreEngine(snapshot, table_.get(), pools_.get(), [executor](absl::string_view id) {
        return kernels::EngineThreadStreamLane(executor->ShardOf(id));
      });
  for (const std::string& failure : report.failures) {
    std::fprintf(stderr, "kvcached: ERROR: a sequence of the snapshot was not restored: %s\n",
                 EscapeText(failure).c_str());
  }
  std::fprintf(stderr,
               "kvcached: restored %lld of %zu sequence(s) and %zu KV pool(s) from %s (written "
               "by pid %lld)\n",
               static_cast<long long>(report.restored), snapshot.sequences.size(),
               snapshot.pools.size(), SnapshotPath(options_).c_str(),
               static_cast<long long>(snapshot.pid));
  restored_snapshot_path_ = SnapshotPath(options_);
}

absl::Status Daemon::CreateHandoff() {
  ExportOptions exports;
  exports.max_exports = options_.max_exports;
  exports.lease = options_.export_lease;
  exports_ = std::make_unique<ExportTable>(table_.get(), pools_.get(), exports);
  if (options_.kv_transfer == "ucx" && pools_ != nullptr &&
      pools_->pool(0).storage().space() == MemorySpace::kHost) {
    StartUcx();
  }
  ASSIGN_OR_RETURN(PeerCredentials credentials, ReadPeerCredentials(options_));
  peer_ca_pem_ = credentials.ca_pem;  // KvPeer's trust, from the same read
  importer_ = std::make_unique<Importer>(options_, std::move(credentials), table_.get(),
                                         pools_.get(), executor_.get(), ucx_.get(),
                                         metrics_.get());
  return absl::OkStatus();
}

void Daemon::StartUcx() {
  absl::StatusOr<std::unique_ptr<UcxSidecar>> ucx = UcxSidecar::Start(*pools_, "/proc/self/exe");
  if (!ucx.ok()) {
    std::fprintf(stderr, "kvcached: UCX is not available (%s): hand-offs move K/V over gRPC\n",
                 std::string(ucx.status().message()).c_str());
    return;
  }
  std::fprintf(stderr, "kvcached: hand-offs move K/V over UCX (sidecar pid %d)\n",
               static_cast<int>((*ucx)->pid()));
  ucx_ = *std::move(ucx);
}

void Daemon::CreateExecutor() {
  const int32_t engine_threads =
      options_.engine_threads > 0
          ? options_.engine_threads
          : std::max<int32_t>(1, static_cast<int32_t>(std::thread::hardware_concurrency()));
  // Every in-flight batch posts at most one task per engine thread; unary Step calls, and
  // every Open, Close, Inspect, List and KV-events subscription (one task each), add what
  // gRPC lets through concurrently: the headroom. Past it they are RESOURCE_EXHAUSTED.
  const int64_t queue_capacity =
      int64_t{options_.max_streams} * options_.max_inflight_batches + 4096;
  executor_ = std::make_unique<StepExecutor>(engine_threads, queue_capacity);
}

void Daemon::CreateScoreRegions() {
  const EngineBackend engine = options_.ResolvedEngineBackend();
  created_region_budget_ = std::make_unique<ByteBudget>(
      options_.max_created_score_region_bytes, "--max_created_score_region_bytes",
      // Host regions are the daemon's memory like any other; device ones are not.
      engine == EngineBackend::kCuda ? nullptr : table_->memory_budget(),
      "the daemon's created score regions");
  ScoreRegionsOptions regions;
  regions.max_regions = options_.max_score_regions;
  regions.created_budget = created_region_budget_.get();
  regions.created_in_backend = engine_memory_ != kernels::MemorySpace::kHost;
  regions.created_name_prefix = absl::StrCat("/kvcached-", getpid(), "-scores");
  regions.allocate = ScoreRegionAllocatorFor(engine, options_.engine_device);
  regions.max_rank = options_.max_tp_world_size;
  regions_ = std::make_unique<ScoreRegions>(regions);
}

absl::Status Daemon::ServeMetrics() {
  if (options_.metrics_listen.empty()) return absl::OkStatus();
  // prometheus-cpp reports bind failures by throwing; keep that inside this module.
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(
        options_.metrics_listen, static_cast<size_t>(options_.metrics_threads));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", options_.metrics_listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(metrics_->registry());
  exposer_->RegisterCollectable(table_gauges_);
  exposer_->RegisterCollectable(pool_gauges_);
  exposer_->RegisterCollectable(kv_event_gauges_);
  exposer_->RegisterCollectable(limit_gauges_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  metrics_address_ =
      ports.empty() ? options_.metrics_listen : WithPort(options_.metrics_listen, ports[0]);
  return absl::OkStatus();
}

absl::Status Daemon::ServeGrpc() {
  if (!options_.auth_tokens_file.empty()) {
    ASSIGN_OR_RETURN(TokenSet tokens, ReadTokensFile(options_.auth_tokens_file));
    std::fprintf(stderr, "kvcached: %zu bearer token(s) from --auth_tokens_file\n",
                 tokens.size());
    tokens_ = std::make_unique<BearerTokens>(std::move(tokens));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   ServerCredentialsFor(options_));
  const bool unix_socket = absl::StartsWith(options_.listen, "unix:");
  gid_t listen_gid = static_cast<gid_t>(-1);
  if (!options_.listen_group.empty()) {
    ASSIGN_OR_RETURN(listen_gid, GroupId(options_.listen_group));
  }
  service_ = std::make_unique<KvCacheService>(options_, table_.get(), pools_.get(),
                                              executor_.get(), regions_.get(), metrics_.get(),
                                              tokens_.get());
  health_ = std::make_unique<HealthService>();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
  if (unix_socket) {
    builder.AddListeningPort(options_.listen, credentials, &port);
  } else {
    // Our own accept loop (server/tcp_listener.h): a connection limit, and no wedge after
    // an EMFILE. The TLS handshake, if any, is gRPC's, on the fds it is handed.
    ASSIGN_OR_RETURN(tcp_listener_, TcpListener::Bind(options_.listen, options_.max_connections));
    limit_gauges_->SetListener(tcp_listener_.get());
    acceptor = builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  }
  service_->set_importer(importer_.get());
  const PeerTrust trust{tokens_.get(), peer_ca_pem_};
  peer_service_ = std::make_unique<KvPeerService>(exports_.get(), pools_.get(), ucx_.get(),
                                                  executor_.get(), metrics_.get(), trust);
  int peer_port = 0;
  if (!options_.peer_listen.empty()) {
    builder.AddListeningPort(options_.peer_listen, credentials, &peer_port);
  }
  builder.RegisterService(service_.get());
  builder.RegisterService(peer_service_.get());
  builder.RegisterService(health_.get());
  ConfigureGrpcServer(&builder);
  {
    // gRPC makes the socket file with the process's umask: make it 0660 from its first
    // moment (not world-writable), then give it to --listen_group.
    const mode_t umask_before = unix_socket ? umask(0117) : 0;
    server_ = builder.BuildAndStart();
    if (unix_socket) umask(umask_before);
  }
  if (unix_socket && server_ != nullptr) {
    RETURN_IF_ERROR(SecureSocketFile(options_.listen.substr(5), listen_gid));
  }
  if (tcp_listener_ != nullptr && server_ != nullptr) {
    port = tcp_listener_->port();
    tcp_listener_->Start(std::move(acceptor));
  }
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options_.listen));
  }
  grpc_address_ = WithPort(options_.listen, port);
  if (!options_.peer_listen.empty()) {
    if (peer_port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on --peer_listen=",
                                                 options_.peer_listen));
    }
    peer_address_ = absl::StartsWith(options_.peer_listen, "unix:")
                        ? options_.peer_listen
                        : WithPort(options_.peer_listen, peer_port);
  }
  return absl::OkStatus();
}

void Daemon::ConfigureGrpcServer(grpc::ServerBuilder* builder) const {
  // The reflection service of gRPC 1.51 is synchronous: its pollers notice a shutdown only
  // when their completion-queue wait times out (10 s by default), which held every drain.
  builder->SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 100);
  builder->SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  builder->SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Millis(options_.keepalive_time));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Millis(options_.keepalive_timeout));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Accept client pings as often as our own keepalive interval.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              Millis(options_.keepalive_time));
  // Step batches are megabytes of scores: large HTTP/2 frames and socket reads cut the
  // per-frame and per-syscall work of receiving them.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  builder->AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
  builder->AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 8 << 20);
}

void Daemon::StartServing() {
  if (!restored_snapshot_path_.empty()) {
    // Restored and serving: a later crash must not bring this state back.
    if (std::remove(restored_snapshot_path_.c_str()) != 0) {
      std::fprintf(stderr, "kvcached: ERROR: cannot remove the restored snapshot %s: %s\n",
                   restored_snapshot_path_.c_str(), std::strerror(errno));
    }
  }
  serving_ = true;
  ForEachHealth([](HealthService& health) { health.SetServing(true); });
  metrics_->SetServing(true);
  reclaimer_ = std::thread([this] { ReclaimLoop(); });
  if (options_.listener_probe_interval > absl::ZeroDuration()) {
    prober_ = std::thread([this] { ProbeLoop(); });
  }
}

absl::Status Daemon::StartHealthServer() {
  // A unix: address was refused by ServerOptions::Validate.
  if (options_.health_listen.empty()) return absl::OkStatus();
  // Its own server, so that nothing but health is ever served without the credentials of
  // --listen; its own HealthService instance, because gRPC registers a service on one
  // server only. ForEachHealth keeps the two saying the same.
  plain_health_ = std::make_unique<HealthService>();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options_.health_listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(plain_health_.get());
  builder.SetMaxReceiveMessageSize(4096);  // a HealthCheckRequest names a service
  health_server_ = builder.BuildAndStart();
  if (health_server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve health on --health_listen=", options_.health_listen));
  }
  health_address_ = WithPort(options_.health_listen, port);
  return absl::OkStatus();
}

void Daemon::ForEachHealth(absl::FunctionRef<void(HealthService&)> tell) {
  tell(*health_);
  if (plain_health_ != nullptr) tell(*plain_health_);
}

void Daemon::ProbeLoop() {
  bool accepting = true;
  while (!stop_prober_.WaitForNotificationWithTimeout(options_.listener_probe_interval)) {
    const absl::Status probed =
        ProbeListener(
            grpc_address_, options_.listener_probe_timeout,
            [this](int local_port) {
              if (tcp_listener_ != nullptr) tcp_listener_->ExpectProbe(local_port);
            },
            /*tls=*/!options_.tls_cert_file.empty());
    metrics_->ListenerProbe(probed.ok());
    if (probed.ok() == accepting) continue;
    accepting = probed.ok();
    if (accepting) {
      std::fprintf(stderr, "kvcached: the listener accepts connections again: SERVING\n");
    } else {
      std::fprintf(stderr, "kvcached: the listener does not accept connections (%s): "
                           "NOT_SERVING until it does\n", std::string(probed.message()).c_str());
    }
    ForEachHealth([accepting](HealthService& health) { health.SetListenerAccepting(accepting); });
  }
}

absl::Status Daemon::ReloadAuthTokens() {
  if (tokens_ == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(TokenSet tokens, ReadTokensFile(options_.auth_tokens_file));
  const size_t count = tokens.size();
  tokens_->Replace(std::move(tokens));
  std::fprintf(stderr, "kvcached: SIGHUP: %zu bearer token(s) from --auth_tokens_file\n", count);
  return absl::OkStatus();
}

void Daemon::ReclaimLoop() {
  // What the table had freed when memory was last handed back to the system.
  int64_t freed_at_trim = 0;
#ifdef KVCM_HAS_CUDA
  bool cuda_unusable = false;
#endif
  while (!stop_reclaimer_.WaitForNotificationWithTimeout(options_.reclaim_interval)) {
#ifdef KVCM_HAS_CUDA
    // A sticky CUDA error (an illegal address in a kernel, an uncorrectable ECC error)
    // fails every later step of every sequence on the GPU: NOT_SERVING, so that the
    // orchestrator restarts the daemon instead of sending it more work.
    if (const absl::Status sticky = kernels::cuda::StickyContextError();
        !cuda_unusable && !sticky.ok()) {
      cuda_unusable = true;
      std::fprintf(stderr, "kvcached: ERROR: %s: NOT_SERVING\n",
                   std::string(sticky.message()).c_str());
      ForEachHealth([](HealthService& health) { health.SetServing(false); });
      metrics_->SetServing(false);
    }
#endif
    // What closed sequences free stays in glibc's heap (kvcached_main keeps large buffers
    // there, and trims only its top): once a lot was freed, give it back.
    constexpr int64_t kTrimAfterBytes = int64_t{32} << 20;
    const int64_t freed = table_->memory_bytes_freed();
    if (freed - freed_at_trim >= kTrimAfterBytes) {
      malloc_trim(0);
      freed_at_trim = freed;
    }
    if (options_.tp_join_timeout > absl::ZeroDuration()) {
      table_->AbortStaleJoins(options_.tp_join_timeout);
    }
    metrics_->SetStepPathGauges(executor_->QueuedTasks(), regions_ ? regions_->count() : 0,
                                created_region_budget_ ? created_region_budget_->used() : 0,
                                table_->pending_join_bytes());
    if (options_.idle_timeout > absl::ZeroDuration()) ReclaimIdle();
    // A target that died mid-hand-off: the source serves the sequence again.
    metrics_->ExportsEnded(ExportResult::kExpired, exports_->AbortExpired());
    metrics_->HousekeepingPass();
  }
}

void Daemon::ReclaimIdle() {
  if (regions_ != nullptr) {
    const int64_t dropped = regions_->DropIdle(options_.idle_timeout, absl::Now());
    if (dropped > 0) {
      std::fprintf(stderr, "kvcached: dropped %lld score region(s) unused for %s\n",
                   static_cast<long long>(dropped),
                   absl::FormatDuration(options_.idle_timeout).c_str());
    }
  }
  for (const SequenceInfo& info : table_->ReclaimIdle(options_.idle_timeout)) {
    metrics_->SequenceClosed(info.policy.preset, CloseReason::kIdleTimeout);
    std::fprintf(stderr, "kvcached: reclaimed sequence '%s' after %s idle (step %lld)\n",
                 EscapeText(info.id).c_str(), absl::FormatDuration(options_.idle_timeout).c_str(),
                 static_cast<long long>(info.last_step));
  }
}

void Daemon::Drain(absl::Duration deadline) {
  {
    MutexLock lock(&drain_mu_);
    if (drained_) return;
    drained_ = true;
  }
  stop_prober_.Notify();
  if (prober_.joinable()) prober_.join();
  if (server_ != nullptr) {  // null when Start failed before serving
    // NOT_SERVING, and watchers' calls end.
    ForEachHealth([](HealthService& health) { health.Shutdown(); });
    // New connections are refused from now on, as gRPC's own listener would refuse them
    // on Shutdown; stopped first so that it adds nothing between the steps below.
    if (tcp_listener_ != nullptr) tcp_listener_->Stop();
    metrics_->SetServing(false);
    importer_->Stop();  // queued imports are answered; running ones finish
    service_->StartDraining();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_->Wait();
  }
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    health_server_->Wait();
  }
  stop_reclaimer_.Notify();
  if (reclaimer_.joinable()) reclaimer_.join();
  StopEngine();
  const bool snapshot_written = WriteSnapshot();
  // kvcached's main exits without destructors after the drain, so the pools' names go
  // here; the memory stays mapped until the process is gone. A snapshot names them for
  // the next start to re-attach.
  if (pools_ != nullptr && !options_.keep_kv_pools_on_exit && !snapshot_written) {
    pools_->UnlinkSharedMemory();
  }
  if (pools_ != nullptr && snapshot_written) {
    // Until the next start re-attaches them nobody holds them: marked, another kvcached
    // starting on the node meanwhile does not take them for a dead instance's.
    for (int32_t r = 0; r < pools_->ranks(); ++r) {
      const MemoryExport& memory = pools_->pool(r).memory_export();
      if (memory.kind != MemoryExport::Kind::kPosixShm) continue;
      if (absl::Status marked = MarkSharedMemoryKept(memory.shm_name); !marked.ok()) {
        std::fprintf(stderr, "kvcached: ERROR: %s\n", std::string(marked.message()).c_str());
      }
    }
  }
}

bool Daemon::WriteSnapshot() {
  if (options_.state_dir.empty() || !serving_ || table_ == nullptr) return false;
  const std::string path = SnapshotPath(options_);
  const EngineSnapshot snapshot = CaptureEngine(*table_, pools_.get(), getpid());
  if (absl::Status written = WriteSnapshotFile(path, snapshot); !written.ok()) {
    std::fprintf(stderr,
                 "kvcached: ERROR: no snapshot written (%s); the %zu open sequence(s) are lost "
                 "and their workers must re-open them with resume\n",
                 std::string(written.message()).c_str(), snapshot.sequences.size());
    return false;
  }
  std::fprintf(stderr, "kvcached: wrote %zu sequence(s) and %zu KV pool(s) to %s\n",
               snapshot.sequences.size(), snapshot.pools.size(), path.c_str());
  return true;
}

void Daemon::StopEngine() {
  if (executor_ == nullptr) return;
  executor_.reset();  // runs every task already posted, then joins
  if (table_ == nullptr) return;
  // Abandoned, not snapshotted: the step changed nothing, and its ranks send it again to
  // the restarted daemon.
  table_->AbandonPendingSteps(absl::AbortedError(
      "kvcached stopped while this tensor-parallel step waited for its other ranks; send "
      "the step again"));
}

Daemon::~Daemon() {
  Drain(absl::ZeroDuration());
  exposer_.reset();  // before the registry and table it reads
}

}  // namespace kvcm::server

#include "server/daemon.h"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <exception>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#ifdef KVCM_HAS_CUDA
#include "cache_manager/cuda_block_pool.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/cuda_backend.h"
#endif
#include "cache_manager/status_macros.h"
#include "server/health_service.h"
#include "server/kvcache_service.h"
#include "server/tcp_listener.h"
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
  const size_t dash = name.find("-rank");
  if (dash == absl::string_view::npos) return false;
  int64_t pid = 0, rank = 0;
  if (!absl::SimpleAtoi(name.substr(0, dash), &pid) ||
      !absl::SimpleAtoi(name.substr(dash + 5), &rank) || pid <= 0 || pid > INT32_MAX ||
      rank < 0) {
    return false;
  }
  return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// The pool of each rank: host memory (shared, so that workers can map it, unless turned
// off) or device memory of the GPU with the rank's number.
KvPools::PoolFactory PoolFactory(const ServerOptions& options) {
  return [options](const BlockPoolOptions& pool) -> absl::StatusOr<std::unique_ptr<BlockPool>> {
#ifdef KVCM_HAS_CUDA
    if (options.backend == KvBackend::kCuda) return CreateCudaBlockPool(pool, pool.rank);
#endif
    HostStorageOptions host;
    if (options.kv_shared_memory) {
      host.shm_name = PoolShmName(pool.rank);
    }
    return BlockPool::CreateHost(pool, host);
  };
}

// The kernel backend of the sequences' engine state (nullptr: the CPU reference), or why
// this daemon cannot run it.
absl::StatusOr<const kernels::KernelBackend*> EngineKernels(const ServerOptions& options) {
  EngineBackend engine = options.engine_backend;
  if (engine == EngineBackend::kAuto) {
    engine = options.backend == KvBackend::kCuda ? EngineBackend::kCuda : EngineBackend::kCpu;
  }
  switch (engine) {
    case EngineBackend::kCpu:
    case EngineBackend::kAuto:
      return nullptr;
    case EngineBackend::kEmulated:
      return &kernels::EmulatedDeviceBackend();
    case EngineBackend::kCuda:
      break;
  }
#ifdef KVCM_HAS_CUDA
  ASSIGN_OR_RETURN(const int devices, kernels::cuda::VisibleDeviceCount());
  if (options.engine_device < 0 || options.engine_device >= devices) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--engine_backend=cuda: --engine_device is ", options.engine_device, " but ",
        devices, " CUDA device(s) are visible (use --engine_backend=cpu to decide on the "
        "CPU)"));
  }
  return &kernels::cuda::CudaBackend();
#else
  return absl::FailedPreconditionError(
      "--engine_backend=cuda: this kvcached was built without CUDA");
#endif
}

}  // namespace

absl::string_view EngineBackendName(EngineBackend backend) {
  switch (backend) {
    case EngineBackend::kAuto: return "auto";
    case EngineBackend::kCpu: return "cpu";
    case EngineBackend::kCuda: return "cuda";
    case EngineBackend::kEmulated: return "emulated";
  }
  return "auto";
}

std::optional<EngineBackend> ParseEngineBackend(absl::string_view name) {
  for (EngineBackend b : {EngineBackend::kAuto, EngineBackend::kCpu, EngineBackend::kCuda,
                          EngineBackend::kEmulated}) {
    if (name == EngineBackendName(b)) return b;
  }
  return std::nullopt;
}

absl::string_view KvBackendName(KvBackend backend) {
  return backend == KvBackend::kCuda ? "cuda" : "host";
}

std::optional<KvBackend> ParseKvBackend(absl::string_view name) {
  if (name == "host") return KvBackend::kHost;
  if (name == "cuda") return KvBackend::kCuda;
  return std::nullopt;
}

Daemon::Daemon(const ServerOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const ServerOptions& options,
                                                      const BuildInfo& build) {
  std::unique_ptr<Daemon> d(new Daemon(options));
  d->metrics_ = std::make_unique<ServerMetrics>(build);
#ifndef KVCM_HAS_CUDA
  if (options.backend == KvBackend::kCuda) {
    return absl::InvalidArgumentError("--backend=cuda: this kvcached was built without CUDA");
  }
#endif
  if (options.pool_memory_bytes > 0) {
    if (options.backend == KvBackend::kHost && options.kv_shared_memory) {
      // A SIGKILLed instance could not unlink its pools; without this they would hold
      // node memory until reboot. A restore that re-attaches pools (ServerOptions::
      // keep_kv_pools_on_exit) must do so before this: the sweep skips objects a live
      // process holds, this one included.
      for (const std::string& name : RemoveStaleSharedMemory(IsDeadInstancesPool)) {
        std::fprintf(stderr, "kvcached: removed %s, a KV pool its dead kvcached left behind\n",
                     name.c_str());
      }
    }
    ASSIGN_OR_RETURN(d->pools_, KvPools::Create(options.tp_ranks, options.kv_layout,
                                                options.pool_memory_bytes,
                                                PoolFactory(options)));
  }
  d->pool_gauges_ = std::make_shared<PoolGauges>(d->pools_.get(),
                                                  std::string(KvBackendName(options.backend)));
  SequenceTableOptions table_options;
  table_options.max_sequences = options.max_sequences;
  table_options.max_tp_world_size = options.max_tp_world_size;
  table_options.kv_pools = d->pools_.get();
  table_options.max_pending_join_bytes = options.max_pending_join_bytes;
  table_options.max_sequence_tokens = options.max_sequence_tokens;
  table_options.memory_limit_bytes = options.memory_limit_bytes;
  if (options.kv_events_ring > 0) {
    KvEventLogOptions events;
    events.ring_capacity = options.kv_events_ring;
    events.max_subscribers = options.kv_events_max_subscribers;
    d->kv_events_ = std::make_unique<KvEventLog>(events);
  }
  d->kv_event_gauges_ = std::make_shared<KvEventGauges>(d->kv_events_.get());
  table_options.kv_events = d->kv_events_.get();
  table_options.diagnostics = {options.diagnostics_every, options.diagnostics_sample};
  ASSIGN_OR_RETURN(table_options.engine_backend, EngineKernels(options));
  table_options.engine_device = options.engine_device;
  if (table_options.engine_backend != nullptr) d->engine_name_ = table_options.engine_backend->name;
  d->table_ = std::make_unique<SequenceTable>(table_options);
  const int32_t engine_threads =
      options.engine_threads > 0
          ? options.engine_threads
          : std::max<int32_t>(1, static_cast<int32_t>(std::thread::hardware_concurrency()));
  // Every in-flight batch posts at most one task per engine thread; unary Step calls add
  // what gRPC lets through concurrently.
  const int64_t queue_capacity =
      int64_t{options.max_streams} * options.max_inflight_batches + 4096;
  d->executor_ = std::make_unique<StepExecutor>(engine_threads, queue_capacity);
  if (options.allow_shm_scores) {
    ScoreRegionsOptions regions;
    regions.max_regions = options.max_score_regions;
    d->regions_ = std::make_unique<ScoreRegions>(regions);
  }
  d->table_gauges_ = std::make_shared<TableGauges>(d->table_.get());
  d->limit_gauges_ = std::make_shared<LimitGauges>(d->table_->memory_budget());

  if (!options.metrics_listen.empty()) {
    // prometheus-cpp reports bind failures by throwing; keep that inside this module.
    try {
      d->exposer_ = std::make_unique<prometheus::Exposer>(
          options.metrics_listen, static_cast<size_t>(options.metrics_threads));
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on ",
                                                 options.metrics_listen, ": ", e.what()));
    }
    d->exposer_->RegisterCollectable(d->metrics_->registry());
    d->exposer_->RegisterCollectable(d->table_gauges_);
    d->exposer_->RegisterCollectable(d->pool_gauges_);
    d->exposer_->RegisterCollectable(d->kv_event_gauges_);
    d->exposer_->RegisterCollectable(d->limit_gauges_);
    const std::vector<int> ports = d->exposer_->GetListeningPorts();
    d->metrics_address_ =
        ports.empty() ? options.metrics_listen : WithPort(options.metrics_listen, ports[0]);
  }

  d->service_ = std::make_unique<KvCacheService>(options, d->table_.get(), d->pools_.get(),
                                                 d->executor_.get(), d->regions_.get(),
                                                 d->metrics_.get());
  d->health_ = std::make_unique<HealthService>();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
  if (absl::StartsWith(options.listen, "unix:")) {
    builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port);
  } else {
    // Our own accept loop (server/tcp_listener.h): a connection limit, and no wedge after
    // an EMFILE.
    ASSIGN_OR_RETURN(d->tcp_listener_, TcpListener::Bind(options.listen, options.max_connections));
    d->limit_gauges_->SetListener(d->tcp_listener_.get());
    acceptor = builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
        grpc::InsecureServerCredentials());
  }
  builder.RegisterService(d->service_.get());
  builder.RegisterService(d->health_.get());
  // The reflection service of gRPC 1.51 is synchronous: its pollers notice a shutdown only
  // when their completion-queue wait times out (10 s by default), which held every drain.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 100);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Millis(options.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Millis(options.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Accept client pings as often as our own keepalive interval.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             Millis(options.keepalive_time));
  // Step batches are megabytes of scores: large HTTP/2 frames and socket reads cut the
  // per-frame and per-syscall work of receiving them.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  builder.AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
  builder.AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 8 << 20);
  d->server_ = builder.BuildAndStart();
  if (d->tcp_listener_ != nullptr && d->server_ != nullptr) {
    port = d->tcp_listener_->port();
    d->tcp_listener_->Start(std::move(acceptor));
  }
  if (d->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options.listen));
  }
  d->grpc_address_ = WithPort(options.listen, port);
  d->health_->SetServing(true);
  d->metrics_->SetServing(true);
  d->reclaimer_ = std::thread([daemon = d.get()] { daemon->ReclaimLoop(); });
  if (options.listener_probe_interval > absl::ZeroDuration()) {
    d->prober_ = std::thread([daemon = d.get()] { daemon->ProbeLoop(); });
  }
  return d;
}

void Daemon::ProbeLoop() {
  bool accepting = true;
  while (!stop_prober_.WaitForNotificationWithTimeout(options_.listener_probe_interval)) {
    const absl::Status probed =
        ProbeListener(grpc_address_, options_.listener_probe_timeout, [this](int local_port) {
          if (tcp_listener_ != nullptr) tcp_listener_->ExpectProbe(local_port);
        });
    if (probed.ok() == accepting) continue;
    accepting = probed.ok();
    if (accepting) {
      std::fprintf(stderr, "kvcached: the listener accepts connections again: SERVING\n");
    } else {
      std::fprintf(stderr, "kvcached: the listener does not accept connections (%s): "
                           "NOT_SERVING until it does\n", std::string(probed.message()).c_str());
    }
    health_->SetListenerAccepting(accepting);
  }
}

void Daemon::ReclaimLoop() {
  // What the table had freed when memory was last handed back to the system.
  int64_t freed_at_trim = 0;
  while (!stop_reclaimer_.WaitForNotificationWithTimeout(options_.reclaim_interval)) {
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
                                table_->pending_join_bytes());
    if (options_.idle_timeout <= absl::ZeroDuration()) continue;
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
    health_->Shutdown();  // NOT_SERVING, and watchers' calls end
    // New connections are refused from now on, as gRPC's own listener would refuse them
    // on Shutdown; stopped first so that it adds nothing between the steps below.
    if (tcp_listener_ != nullptr) tcp_listener_->Stop();
    metrics_->SetServing(false);
    service_->StartDraining();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_->Wait();
  }
  stop_reclaimer_.Notify();
  if (reclaimer_.joinable()) reclaimer_.join();
  StopEngine();
  // kvcached's main exits without destructors after the drain, so the pools' names go
  // here; the memory stays mapped until the process is gone.
  if (pools_ != nullptr && !options_.keep_kv_pools_on_exit) pools_->UnlinkSharedMemory();
}

void Daemon::StopEngine() {
  if (executor_ == nullptr) return;
  executor_.reset();  // runs every task already posted, then joins
  if (table_ == nullptr) return;
  table_->AbandonPendingSteps(absl::AbortedError(
      "kvcached stopped while this tensor-parallel step waited for its other ranks"));
}

Daemon::~Daemon() {
  Drain(absl::ZeroDuration());
  exposer_.reset();  // before the registry and table it reads
}

}  // namespace kvcm::server

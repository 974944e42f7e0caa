#include "server/daemon.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <exception>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#ifdef KVCM_HAS_CUDA
#include "cache_manager/cuda_block_pool.h"
#endif
#include "cache_manager/status_macros.h"
#include "server/health_service.h"
#include "server/kvcache_service.h"

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

// The pool of each rank: host memory (shared, so that workers can map it, unless turned
// off) or device memory of the GPU with the rank's number.
KvPools::PoolFactory PoolFactory(const ServerOptions& options) {
  return [options](const BlockPoolOptions& pool) -> absl::StatusOr<std::unique_ptr<BlockPool>> {
#ifdef KVCM_HAS_CUDA
    if (options.backend == KvBackend::kCuda) return CreateCudaBlockPool(pool, pool.rank);
#endif
    HostStorageOptions host;
    if (options.kv_shared_memory) {
      host.shm_name = absl::StrCat("/kvcached-", getpid(), "-rank", pool.rank);
    }
    return BlockPool::CreateHost(pool, host);
  };
}

}  // namespace

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
  if (options.kv_events_ring > 0) {
    KvEventLogOptions events;
    events.ring_capacity = options.kv_events_ring;
    events.max_subscribers = options.kv_events_max_subscribers;
    d->kv_events_ = std::make_unique<KvEventLog>(events);
  }
  d->kv_event_gauges_ = std::make_shared<KvEventGauges>(d->kv_events_.get());
  table_options.kv_events = d->kv_events_.get();
  table_options.diagnostics = {options.diagnostics_every, options.diagnostics_sample};
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
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port);
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
  if (d->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options.listen));
  }
  d->grpc_address_ = WithPort(options.listen, port);
  d->health_->SetServing(true);
  d->metrics_->SetServing(true);
  d->reclaimer_ = std::thread([daemon = d.get()] { daemon->ReclaimLoop(); });
  return d;
}

void Daemon::ReclaimLoop() {
  while (!stop_reclaimer_.WaitForNotificationWithTimeout(options_.reclaim_interval)) {
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
                   info.id.c_str(), absl::FormatDuration(options_.idle_timeout).c_str(),
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
  if (server_ != nullptr) {  // null when Start failed before serving
    health_->Shutdown();  // NOT_SERVING, and watchers' calls end
    metrics_->SetServing(false);
    service_->StartDraining();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_->Wait();
  }
  stop_reclaimer_.Notify();
  if (reclaimer_.joinable()) reclaimer_.join();
  StopEngine();
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

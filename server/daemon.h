// Daemon: one running kvcached. Owns the sequence table, the metrics and their HTTP
// exposer, the gRPC server with its health and reflection services, and the idle
// reclaimer. Start() returns once both ports are bound and health says SERVING; Drain()
// is the SIGTERM path. Thread-safe.
#ifndef KVCM_SERVER_DAEMON_H_
#define KVCM_SERVER_DAEMON_H_

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/handoff/exports.h"
#include "cache_manager/kv/score_regions.h"
#include "cache_manager/persist/snapshot.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "kernels/backend.h"
#include "server/kv_peer_service.h"
#include "server/metrics.h"
#include "server/ucx_sidecar.h"
#include "server/server_options.h"

namespace grpc {
class Server;
class ServerBuilder;
}
namespace prometheus {
class Exposer;
}

namespace kvcm::server {

class BearerTokens;
class HealthService;
class Importer;
class KvCacheService;
class TcpListener;

class Daemon {
 public:
  // Checks `options` first (ServerOptions::Validate: INVALID_ARGUMENT naming the flag),
  // then restores --state_dir's snapshot, creates the pools, the engine and the score
  // regions, serves metrics and gRPC, and starts the housekeeping threads.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const ServerOptions& options,
                                                       const BuildInfo& build);
  ~Daemon();

  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // host:port actually bound (port 0 in the options resolves here).
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  // host:port of --health_listen, bound; "" without it.
  const std::string& health_address() const { return health_address_; }
  // host:port of --peer_listen, bound; "" without it.
  const std::string& peer_address() const { return peer_address_; }
  // The kernel backend the sequences' engine state runs on ("cpu", "cuda", ...).
  const std::string& engine_name() const { return engine_name_; }

  // Health goes NOT_SERVING and new calls are refused; calls already open (step streams
  // included) keep being served until their clients end them, and whatever still runs at
  // `deadline` is cancelled. Returns when the server has stopped. Idempotent.
  void Drain(absl::Duration deadline);

  // SIGHUP: reads --auth_tokens_file again. A file that does not parse keeps the tokens in
  // force and returns why; OK (and does nothing) without the flag.
  absl::Status ReloadAuthTokens();

  SequenceTable& table() { return *table_; }
  ServerMetrics& metrics() { return *metrics_; }

 private:
  explicit Daemon(const ServerOptions& options);
  // Start's phases, in order (after ServerOptions::Validate and reading --state_dir's
  // snapshot). The pools: re-attached from `snapshot` when it names them (reset when that
  // fails: the snapshot is set aside), else new; the sweep of dead instances' memory.
  absl::Status CreatePools(std::optional<EngineSnapshot>* snapshot);
  // The sequence table on its kernel backend, with the KV event log and the gauges.
  absl::Status CreateEngine();
  // The snapshot's sequences into the table (failures are logged, not fatal).
  void RestoreSequences(const EngineSnapshot& snapshot);
  void CreateExecutor();
  // Hand-offs: the exports (source side), UCX over the pools (--kv_transfer=ucx; a
  // failure to start it is logged and K/V then moves over gRPC), the importer.
  absl::Status CreateHandoff();
  // The UCX sidecar over the pools (server/ucx_sidecar.h); none (logged) when it cannot
  // start: hand-offs then move K/V over gRPC.
  void StartUcx();
  // With --allow_shm_scores.
  void CreateScoreRegions();
  // The Prometheus exposer, with --metrics_listen.
  absl::Status ServeMetrics();
  // Tokens, credentials, the service and its listener; the server started.
  absl::Status ServeGrpc();
  void ConfigureGrpcServer(grpc::ServerBuilder* builder) const;
  // Health SERVING, and the reclaimer and prober threads.
  void StartServing();
  void ReclaimLoop();
  // Drops the score regions and reclaims the sequences idle for --idle_timeout.
  void ReclaimIdle();
  // Probes the listener every listener_probe_interval and tells health what it found.
  void ProbeLoop();
  // Runs what the engine threads still hold and answers every batch left waiting for
  // tensor-parallel ranks, so that no stream outlives the service. After the server
  // has stopped.
  void StopEngine();
  // Serves a second HealthService, alone and in plaintext, on options_.health_listen.
  absl::Status StartHealthServer();
  // Tells every health service (the one on --listen and the one on --health_listen).
  void ForEachHealth(absl::FunctionRef<void(HealthService&)> tell);
  // The drain's last act with --state_dir: writes the snapshot; true when it did.
  bool WriteSnapshot();

  const ServerOptions options_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<KvPools> pools_;  // before table_: leases return blocks to it
  std::shared_ptr<PoolGauges> pool_gauges_;
  std::unique_ptr<KvEventLog> kv_events_;  // before table_: its slots append to it
  std::shared_ptr<KvEventGauges> kv_event_gauges_;
  std::unique_ptr<CrossDeviceJoiner> cross_device_joiner_;  // before table_: its slots use it
  std::unique_ptr<SequenceTable> table_;
  std::unique_ptr<StepExecutor> executor_;
  // Hand-offs. exports_ after table_ (its destruction unfreezes sequences); importer_
  // after executor_ and ucx_.
  std::unique_ptr<UcxSidecar> ucx_;
  std::unique_ptr<ExportTable> exports_;
  std::unique_ptr<Importer> importer_;
  std::unique_ptr<KvPeerService> peer_service_;
  std::string peer_ca_pem_;  // --peer_ca_file's certificates ("": none)
  // The bytes of created score regions (a child of the table's memory budget for host
  // ones); before regions_, which gives its bytes back.
  std::unique_ptr<ByteBudget> created_region_budget_;
  std::unique_ptr<ScoreRegions> regions_;  // with --allow_shm_scores
  std::shared_ptr<TableGauges> table_gauges_;
  std::shared_ptr<LimitGauges> limit_gauges_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<BearerTokens> tokens_;  // with --auth_tokens_file; before service_
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<TcpListener> tcp_listener_;  // TCP listen addresses; before server_
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HealthService> plain_health_;  // with --health_listen
  std::unique_ptr<grpc::Server> health_server_;
  std::string health_address_;
  std::string peer_address_;
  std::string grpc_address_;
  std::string metrics_address_;
  std::string engine_name_ = "cpu";
  kernels::MemorySpace engine_memory_ = kernels::MemorySpace::kHost;
  absl::Notification stop_reclaimer_;
  std::thread reclaimer_;
  absl::Notification stop_prober_;
  std::thread prober_;
  // With --state_dir, the snapshot restored at start, removed once serving.
  std::string restored_snapshot_path_;
  bool serving_ = false;  // Start completed: only then may the drain write a snapshot
  Mutex drain_mu_;
  bool drained_ ABSL_GUARDED_BY(drain_mu_) = false;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_DAEMON_H_

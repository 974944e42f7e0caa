// ServerMetrics: the Prometheus metrics of docs/METRICS.md. One object, created by the
// daemon and passed to whoever records; every series with a bounded label set exists from
// the start. The per-policy gauges are computed from the sequence table at scrape time
// (TableGauges). Thread-safe: prometheus-cpp metrics are atomic, and the label lookups
// here go through fixed arrays built at construction.
#ifndef KVCM_SERVER_METRICS_H_
#define KVCM_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/events/kv_events.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"
#include "kernels/score_matrix.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcm::server {

// The `rpc` label values.
enum class Rpc : uint8_t {
  kOpenSequence,
  kCloseSequence,
  kInspectSequence,
  kListSequences,
  kStep,
  kStepStream,
  kDescribeKvPools,
  kRegisterScoreRegion,
  kUnregisterScoreRegion,
  kWatchKvEvents,
  kCreateScoreRegion,
  kImportSequence,
  kExportSequence,  // KvPeer
  kReadExportedKv,
  kFinishExport,
};
inline constexpr int kRpcCount = 15;
absl::string_view RpcName(Rpc rpc);

// "INVALID_ARGUMENT", ... for the `code` label.
absl::string_view StatusCodeName(absl::StatusCode code);

// The `policy` label: the preset name, or "custom".
absl::string_view PolicyLabel(absl::string_view preset);

struct BuildInfo {
  std::string version;
  bool cuda = false;
  bool nccl = false;
};

enum class CloseReason : uint8_t { kClient, kIdleTimeout, kHandedOff };
// How an export (a hand-off's source side) ended.
enum class ExportResult : uint8_t { kCommitted, kAborted, kExpired };

class ServerMetrics {
 public:
  explicit ServerMetrics(const BuildInfo& build);

  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  void SequenceOpened(absl::string_view preset);
  void SequenceClosed(absl::string_view preset, CloseReason reason);
  // One decided step (counted once per step, not once per rank) and its engine time; its
  // eviction-quality figures too when it was a measured step (decision.diagnostics).
  void StepDecided(const EvictionDecision& decision, double seconds);
  void BatchDone(Rpc rpc, int64_t sequences, double seconds);
  void Request(Rpc rpc, int64_t payload_bytes);
  // Score bytes of one report, inline or read from a score region.
  void ScoreBytes(kernels::ScoreDtype dtype, int64_t bytes, bool via_region);
  // Sampled by the daemon's housekeeping loop.
  void SetStepPathGauges(int64_t engine_queued, int64_t score_regions,
                         int64_t created_score_region_bytes, int64_t pending_join_bytes);
  void Error(Rpc rpc, absl::StatusCode code);
  void SetServing(bool serving);
  void StreamOpened();
  void StreamClosed();
  // One pass of the housekeeping loop done (memory trim, stale joins, gauges, idle reclaim).
  void HousekeepingPass();
  // One self-probe of the listener, and whether it was answered (server/health_service.h).
  void ListenerProbe(bool ok);
  // Hand-offs: an import finished here (ok or not) with the K/V bytes it moved over
  // `transport` ("ucx", "grpc"; nothing for "none"); exports that ended, `count` of them.
  void ImportDone(bool ok, absl::string_view transport, int64_t kv_bytes);
  void ExportsEnded(ExportResult result, int64_t count);

  // Test hook: the value of kvcache_errors_total{rpc, code}.
  double ErrorCount(Rpc rpc, absl::StatusCode code) const;

 private:
  struct PolicySeries {
    prometheus::Counter* opened;
    prometheus::Counter* closed_client;
    prometheus::Counter* closed_idle;
    prometheus::Counter* closed_handed_off;
    std::array<prometheus::Counter*, 5> steps;  // by aggregation
    prometheus::Counter* scoring;
    prometheus::Counter* skipped;
    prometheus::Counter* ignored;
    prometheus::Counter* evicted;
    prometheus::Histogram* decision_seconds;
    // Eviction-quality diagnostics (measured steps only).
    prometheus::Counter* diag_steps;
    prometheus::Counter* diag_small_change;
    prometheus::Counter* diag_evicted;
    prometheus::Counter* diag_evicted_relevant;
    prometheus::Histogram* diag_raw_churn;
    prometheus::Histogram* diag_momentum_churn;
    prometheus::Histogram* diag_raw_momentum_jaccard;
  };
  struct RpcSeries {
    prometheus::Histogram* batch_seconds;
    prometheus::Histogram* batch_sequences;
    prometheus::Counter* received_bytes;
    prometheus::Counter* requests;
    std::array<prometheus::Counter*, 17> errors;  // by status code
  };

  PolicySeries& Policy(absl::string_view preset);
  // The constructor's parts, one per family of series: build and serving state; per
  // policy (then its diagnostics, over the same policies_); per RPC; the step path's.
  void AddProcessSeries(const BuildInfo& build);
  void AddPolicySeries();
  void AddDiagnosticsSeries();
  void AddRpcSeries();
  void AddStepPathSeries();

  std::shared_ptr<prometheus::Registry> registry_;
  std::vector<PolicySeries> policies_;  // presets in Policy::PresetNames() order, then custom
  std::array<RpcSeries, kRpcCount> rpcs_;
  std::array<std::array<prometheus::Counter*, 3>, 2> score_bytes_;  // [grpc, shm][dtype]
  prometheus::Gauge* engine_queued_;
  prometheus::Gauge* score_regions_;
  prometheus::Gauge* created_score_region_bytes_;
  prometheus::Gauge* pending_join_bytes_;
  prometheus::Gauge* serving_;
  prometheus::Gauge* streams_open_;
  prometheus::Counter* housekeeping_passes_;
  std::array<prometheus::Counter*, 2> listener_probes_;  // [failed, ok]
  std::array<prometheus::Counter*, 2> imports_;           // [failed, ok]
  std::array<prometheus::Counter*, 2> import_kv_bytes_;   // [ucx, grpc]
  std::array<prometheus::Counter*, 3> exports_;           // by ExportResult
};

// kvcache_pool_capacity_blocks, kvcache_pool_used_blocks, kvcache_pool_block_bytes,
// kvcache_pool_block_tokens and kvcache_pool_cached_tokens by rank, and
// kvcache_pool_refused_total by RPC, read from the pools when Prometheus scrapes (rank 0
// and the counts at 0 when there are none): the step path pays one relaxed atomic add.
class PoolGauges : public prometheus::Collectable {
 public:
  PoolGauges(const KvPools* pools, std::string backend)
      : pools_(pools), backend_(std::move(backend)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const KvPools* pools_;  // may be null
  const std::string backend_;
};

// kvcache_sequences_open, kvcache_tokens_retained, kvcache_tokens_seen and
// kvcache_retention_ratio by policy, computed from the table when Prometheus scrapes.
class TableGauges : public prometheus::Collectable {
 public:
  explicit TableGauges(const SequenceTable* table) : table_(table) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const SequenceTable* table_;
};

// kvcache_kv_event_subscribers, kvcache_kv_events_published_total and
// kvcache_kv_event_subscribers_dropped_total, read from the KV event log when Prometheus
// scrapes (all 0 without one): the step path pays nothing for them.
class KvEventGauges : public prometheus::Collectable {
 public:
  explicit KvEventGauges(const KvEventLog* log) : log_(log) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const KvEventLog* log_;  // may be null
};

class TcpListener;

// The daemon's limits, read when Prometheus scrapes: kvcache_memory_bytes and
// kvcache_memory_limit_bytes (what --memory_limit_bytes counts, and the limit),
// kvcache_memory_refused_total (requests it refused), and the TCP listener's
// kvcache_connections_refused_total (at --max_connections) and
// kvcache_accept_errors_total (EMFILE and the like); those two stay 0 without a TCP
// listener (a unix: address) until SetListener.
class LimitGauges : public prometheus::Collectable {
 public:
  explicit LimitGauges(const ByteBudget* memory) : memory_(memory) {}
  // `listener` (may be null) must outlive every later Collect.
  void SetListener(const TcpListener* listener) { listener_.store(listener); }
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const ByteBudget* memory_;
  std::atomic<const TcpListener*> listener_{nullptr};
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_METRICS_H_

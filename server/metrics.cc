#include "server/metrics.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/policy/policy.h"
#include "server/tcp_listener.h"

namespace kvcm::server {
namespace {

constexpr absl::string_view kRpcNames[kRpcCount] = {
    "OpenSequence", "CloseSequence", "InspectSequence", "ListSequences",
    "Step",         "StepStream",    "DescribeKvPools", "RegisterScoreRegion",
    "UnregisterScoreRegion", "WatchKvEvents", "CreateScoreRegion", "ImportSequence",
    "ExportSequence", "ReadExportedKv", "FinishExport"};

constexpr absl::string_view kCodeNames[17] = {
    "OK",       "CANCELLED",         "UNKNOWN",           "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",   "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL",        "UNAVAILABLE",       "DATA_LOSS",
    "UNAUTHENTICATED"};



const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
      5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1.0};
  return *buckets;
}

const prometheus::Histogram::BucketBoundaries& BatchSizeBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  return *buckets;
}

// For the eviction-quality ratios (churn, Jaccard), which lie in [0, 1].
const prometheus::Histogram::BucketBoundaries& FractionBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4,
      0.5,   0.6,    0.7,   0.8,  0.9,   0.95, 0.975, 0.99, 0.999};
  return *buckets;
}

// A registered family of `r`; the series are added by the callers.
prometheus::Family<prometheus::Counter>& RegisterCounters(prometheus::Registry& r,
                                                       const char* name, const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Gauge>& RegisterGauges(prometheus::Registry& r, const char* name,
                                                   const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Histogram>& RegisterHistograms(prometheus::Registry& r,
                                                           const char* name, const char* help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

std::vector<std::string> PolicyLabels() {
  std::vector<std::string> labels;
  for (absl::string_view preset : Policy::PresetNames()) labels.emplace_back(preset);
  labels.emplace_back("custom");
  return labels;
}

}  // namespace

absl::string_view RpcName(Rpc rpc) { return kRpcNames[static_cast<int>(rpc)]; }

absl::string_view StatusCodeName(absl::StatusCode code) {
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kCodeNames[c] : "UNKNOWN";
}

absl::string_view PolicyLabel(absl::string_view preset) {
  for (absl::string_view name : Policy::PresetNames()) {
    if (name == preset) return name;
  }
  return "custom";
}

ServerMetrics::ServerMetrics(const BuildInfo& build)
    : registry_(std::make_shared<prometheus::Registry>()) {
  AddProcessSeries(build);
  AddPolicySeries();
  AddDiagnosticsSeries();
  AddRpcSeries();
  AddStepPathSeries();
}

void ServerMetrics::AddProcessSeries(const BuildInfo& build) {
  prometheus::Registry& r = *registry_;
  RegisterGauges(r, "kvcache_build_info",
              "Always 1; the build's version and whether CUDA and NCCL are compiled in")
      .Add({{"version", build.version},
            {"cuda", build.cuda ? "true" : "false"},
            {"nccl", build.nccl ? "true" : "false"}})
      .Set(1);
  serving_ = &RegisterGauges(r, "kvcache_serving",
                          "1 while health is SERVING, 0 while draining or not ready")
                  .Add({});
  streams_open_ = &RegisterGauges(r, "kvcache_streams_open", "Step streams currently open").Add({});
  housekeeping_passes_ =
      &RegisterCounters(r, "kvcache_housekeeping_passes_total",
                        "Passes of the housekeeping loop: memory trim, stale joins, gauges, "
                        "idle reclaim (about once a second)")
           .Add({});
  auto& probes = RegisterCounters(r, "kvcache_listener_probes_total",
                                  "Self-probes of the gRPC listener, by whether it answered");
  listener_probes_ = {&probes.Add({{"result", "failed"}}), &probes.Add({{"result", "ok"}})};
  auto& imports = RegisterCounters(r, "kvcache_imports_total",
                                   "Sequences imported from another kvcached (ImportSequence), "
                                   "by result");
  imports_ = {&imports.Add({{"result", "failed"}}), &imports.Add({{"result", "ok"}})};
  auto& import_bytes = RegisterCounters(r, "kvcache_import_kv_bytes_total",
                                        "K/V bytes imported from other kvcached, by transport");
  import_kv_bytes_ = {&import_bytes.Add({{"transport", "ucx"}}),
                      &import_bytes.Add({{"transport", "grpc"}})};
  auto& exports = RegisterCounters(r, "kvcache_exports_total",
                                   "Hand-offs of sequences to another kvcached, by how they ended");
  exports_ = {&exports.Add({{"result", "committed"}}), &exports.Add({{"result", "aborted"}}),
              &exports.Add({{"result", "expired"}})};
}

void ServerMetrics::AddPolicySeries() {
  prometheus::Registry& r = *registry_;
  auto& opened = RegisterCounters(r, "kvcache_sequences_opened_total", "Sequences opened");
  auto& closed = RegisterCounters(r, "kvcache_sequences_closed_total",
                               "Sequences closed, by the client or after the idle timeout");
  auto& steps = RegisterCounters(r, "kvcache_steps_total", "Decode steps decided");
  auto& scoring = RegisterCounters(r, "kvcache_scoring_steps_total", "Steps that took scores");
  auto& skipped = RegisterCounters(r, "kvcache_skipped_scoring_steps_total",
                                "Steps of a score-using policy that needed no scores");
  auto& ignored = RegisterCounters(r, "kvcache_ignored_score_reports_total",
                                "Steps that carried scores nobody needed");
  auto& evicted = RegisterCounters(r, "kvcache_tokens_evicted_total", "Tokens evicted");
  auto& decision = RegisterHistograms(r, "kvcache_step_decision_seconds",
                                   "Engine time to decide one sequence's step");
  for (const std::string& label : PolicyLabels()) {
    PolicySeries s{};
    s.opened = &opened.Add({{"policy", label}});
    s.closed_client = &closed.Add({{"policy", label}, {"reason", "client"}});
    s.closed_idle = &closed.Add({{"policy", label}, {"reason", "idle_timeout"}});
    s.closed_handed_off = &closed.Add({{"policy", label}, {"reason", "handed_off"}});
    for (int a = 0; a < 5; ++a) {
      s.steps[static_cast<size_t>(a)] =
          &steps.Add({{"policy", label}, {"aggregation", std::string(AggregationName(static_cast<Aggregation>(a)))}});
    }
    s.scoring = &scoring.Add({{"policy", label}});
    s.skipped = &skipped.Add({{"policy", label}});
    s.ignored = &ignored.Add({{"policy", label}});
    s.evicted = &evicted.Add({{"policy", label}});
    s.decision_seconds = &decision.Add({{"policy", label}}, LatencyBuckets());
    policies_.push_back(s);
  }
}

void ServerMetrics::AddDiagnosticsSeries() {
  prometheus::Registry& r = *registry_;
  auto& diag_steps = RegisterCounters(r, "kvcache_diag_steps_total",
                                   "Scoring steps measured by the eviction-quality diagnostics");
  auto& diag_small =
      RegisterCounters(r, "kvcache_diag_small_change_steps_total",
                    "Measured steps where at most one token entered the momentum top-k");
  auto& diag_evicted =
      RegisterCounters(r, "kvcache_diag_evicted_total", "Tokens evicted on measured steps");
  auto& diag_relevant =
      RegisterCounters(r, "kvcache_diag_evicted_relevant_total",
                    "Tokens evicted on measured steps while in the step's raw top-k");
  auto& diag_raw_churn =
      RegisterHistograms(r, "kvcache_diag_raw_topk_churn",
                      "1 - Jaccard of the raw top-k of consecutive scoring steps");
  auto& diag_momentum_churn =
      RegisterHistograms(r, "kvcache_diag_momentum_topk_churn",
                      "1 - Jaccard of the momentum top-k of consecutive scoring steps");
  auto& diag_jaccard =
      RegisterHistograms(r, "kvcache_diag_raw_momentum_jaccard",
                      "Jaccard of a step's raw top-k with its momentum top-k");
  // policies_ is in PolicyLabels() order (AddPolicySeries).
  const std::vector<std::string> labels = PolicyLabels();
  for (size_t i = 0; i < labels.size(); ++i) {
    const std::string& label = labels[i];
    PolicySeries& s = policies_[i];
    s.diag_steps = &diag_steps.Add({{"policy", label}});
    s.diag_small_change = &diag_small.Add({{"policy", label}});
    s.diag_evicted = &diag_evicted.Add({{"policy", label}});
    s.diag_evicted_relevant = &diag_relevant.Add({{"policy", label}});
    s.diag_raw_churn = &diag_raw_churn.Add({{"policy", label}}, FractionBuckets());
    s.diag_momentum_churn = &diag_momentum_churn.Add({{"policy", label}}, FractionBuckets());
    s.diag_raw_momentum_jaccard = &diag_jaccard.Add({{"policy", label}}, FractionBuckets());
  }
}

void ServerMetrics::AddRpcSeries() {
  prometheus::Registry& r = *registry_;
  auto& batch_seconds = RegisterHistograms(r, "kvcache_batch_duration_seconds",
                                        "Server time for one batch of steps");
  auto& batch_sequences =
      RegisterHistograms(r, "kvcache_batch_sequences", "Sequence steps per batch");
  auto& received =
      RegisterCounters(r, "kvcache_received_bytes_total", "Request payload bytes received");
  auto& requests = RegisterCounters(r, "kvcache_requests_total",
                                 "Requests (each stream message counts once)");
  auto& errors = RegisterCounters(r, "kvcache_errors_total",
                               "Failed requests and per-sequence step failures, by status code");
  for (int i = 0; i < kRpcCount; ++i) {
    const std::string rpc(kRpcNames[i]);
    RpcSeries& s = rpcs_[static_cast<size_t>(i)];
    s.batch_seconds = &batch_seconds.Add({{"rpc", rpc}}, LatencyBuckets());
    s.batch_sequences = &batch_sequences.Add({{"rpc", rpc}}, BatchSizeBuckets());
    s.received_bytes = &received.Add({{"rpc", rpc}});
    s.requests = &requests.Add({{"rpc", rpc}});
    for (int c = 1; c < 17; ++c) {
      s.errors[static_cast<size_t>(c)] =
          &errors.Add({{"rpc", rpc}, {"code", std::string(kCodeNames[c])}});
    }
    s.errors[0] = nullptr;
  }
}

void ServerMetrics::AddStepPathSeries() {
  prometheus::Registry& r = *registry_;
  auto& score_bytes = RegisterCounters(r, "kvcache_score_bytes_total",
                                    "Packed score bytes received, by dtype and transport");
  for (auto dtype : {kernels::ScoreDtype::kFloat32, kernels::ScoreDtype::kFloat16,
                     kernels::ScoreDtype::kBFloat16}) {
    for (int shm = 0; shm < 2; ++shm) {
      score_bytes_[static_cast<size_t>(shm)][static_cast<size_t>(dtype)] = &score_bytes.Add(
          {{"dtype", kernels::ScoreDtypeName(dtype)}, {"transport", shm ? "shm" : "grpc"}});
    }
  }
  engine_queued_ = &RegisterGauges(r, "kvcache_engine_queued_tasks",
                                "Batch shares waiting for an engine thread")
                        .Add({});
  score_regions_ = &RegisterGauges(r, "kvcache_score_regions",
                                "Score regions held (registered by workers or created)")
                        .Add({});
  created_score_region_bytes_ =
      &RegisterGauges(r, "kvcache_score_region_created_bytes",
                   "Bytes of the score regions kvcached created (CreateScoreRegion)")
           .Add({});
  pending_join_bytes_ =
      &RegisterGauges(r, "kvcache_pending_join_bytes",
                   "Partial sums held by tensor-parallel steps waiting for ranks")
           .Add({});
}

ServerMetrics::PolicySeries& ServerMetrics::Policy(absl::string_view preset) {
  const auto& names = kvcm::Policy::PresetNames();
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == preset) return policies_[i];
  }
  return policies_.back();  // custom
}

void ServerMetrics::SequenceOpened(absl::string_view preset) { Policy(preset).opened->Increment(); }

void ServerMetrics::SequenceClosed(absl::string_view preset, CloseReason reason) {
  PolicySeries& s = Policy(preset);
  switch (reason) {
    case CloseReason::kClient:
      s.closed_client->Increment();
      break;
    case CloseReason::kIdleTimeout:
      s.closed_idle->Increment();
      break;
    case CloseReason::kHandedOff:
      s.closed_handed_off->Increment();
      break;
  }
}

void ServerMetrics::StepDecided(const EvictionDecision& d, double seconds) {
  PolicySeries& s = Policy(d.preset);
  s.steps[static_cast<size_t>(d.aggregation)]->Increment();
  if (d.scored) {
    s.scoring->Increment();
  } else if (d.aggregation == Aggregation::kEma || d.aggregation == Aggregation::kCumulative ||
             d.aggregation == Aggregation::kSingleStep) {
    s.skipped->Increment();
  }
  if (d.scores_ignored) s.ignored->Increment();
  if (!d.evicted.empty()) s.evicted->Increment(static_cast<double>(d.evicted.size()));
  s.decision_seconds->Observe(seconds);
  const StepDiagnostics& q = d.diagnostics;
  if (!q.measured) return;
  s.diag_steps->Increment();
  if (q.small_change) s.diag_small_change->Increment();
  if (q.evicted > 0) s.diag_evicted->Increment(static_cast<double>(q.evicted));
  if (q.evicted_relevant > 0) {
    s.diag_evicted_relevant->Increment(static_cast<double>(q.evicted_relevant));
  }
  s.diag_raw_churn->Observe(q.raw_topk_churn);
  s.diag_momentum_churn->Observe(q.momentum_topk_churn);
  s.diag_raw_momentum_jaccard->Observe(q.raw_momentum_jaccard);
}

void ServerMetrics::BatchDone(Rpc rpc, int64_t sequences, double seconds) {
  RpcSeries& s = rpcs_[static_cast<size_t>(rpc)];
  s.batch_seconds->Observe(seconds);
  s.batch_sequences->Observe(static_cast<double>(sequences));
}

void ServerMetrics::Request(Rpc rpc, int64_t payload_bytes) {
  RpcSeries& s = rpcs_[static_cast<size_t>(rpc)];
  s.requests->Increment();
  if (payload_bytes > 0) s.received_bytes->Increment(static_cast<double>(payload_bytes));
}

void ServerMetrics::ScoreBytes(kernels::ScoreDtype dtype, int64_t bytes, bool via_region) {
  if (bytes > 0) {
    score_bytes_[via_region ? 1 : 0][static_cast<size_t>(dtype)]->Increment(
        static_cast<double>(bytes));
  }
}

void ServerMetrics::SetStepPathGauges(int64_t engine_queued, int64_t score_regions,
                                      int64_t created_score_region_bytes,
                                      int64_t pending_join_bytes) {
  engine_queued_->Set(static_cast<double>(engine_queued));
  score_regions_->Set(static_cast<double>(score_regions));
  created_score_region_bytes_->Set(static_cast<double>(created_score_region_bytes));
  pending_join_bytes_->Set(static_cast<double>(pending_join_bytes));
}

void ServerMetrics::Error(Rpc rpc, absl::StatusCode code) {
  const int c = static_cast<int>(code);
  if (c <= 0 || c >= 17) return;
  rpcs_[static_cast<size_t>(rpc)].errors[static_cast<size_t>(c)]->Increment();
}

double ServerMetrics::ErrorCount(Rpc rpc, absl::StatusCode code) const {
  const int c = static_cast<int>(code);
  if (c <= 0 || c >= 17) return 0;
  return rpcs_[static_cast<size_t>(rpc)].errors[static_cast<size_t>(c)]->Value();
}

void ServerMetrics::SetServing(bool serving) { serving_->Set(serving ? 1 : 0); }
void ServerMetrics::StreamOpened() { streams_open_->Increment(); }
void ServerMetrics::StreamClosed() { streams_open_->Decrement(); }
void ServerMetrics::HousekeepingPass() { housekeeping_passes_->Increment(); }

void ServerMetrics::ImportDone(bool ok, absl::string_view transport, int64_t kv_bytes) {
  imports_[ok ? 1 : 0]->Increment();
  if (kv_bytes <= 0) return;
  if (transport == "ucx") import_kv_bytes_[0]->Increment(static_cast<double>(kv_bytes));
  if (transport == "grpc") import_kv_bytes_[1]->Increment(static_cast<double>(kv_bytes));
}

void ServerMetrics::ExportsEnded(ExportResult result, int64_t count) {
  if (count > 0) exports_[static_cast<size_t>(result)]->Increment(static_cast<double>(count));
}
void ServerMetrics::ListenerProbe(bool ok) { listener_probes_[ok ? 1 : 0]->Increment(); }

namespace {

// One series of a gauge family: its labels and value.
struct GaugeSeries {
  std::vector<prometheus::ClientMetric::Label> labels;
  double value = 0;
};

prometheus::MetricFamily GaugeFamily(const char* name, const char* help,
                                     const std::vector<GaugeSeries>& series) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Gauge;
  for (const GaugeSeries& s : series) {
    prometheus::ClientMetric m;
    m.label = s.labels;
    m.gauge.value = s.value;
    f.metric.push_back(std::move(m));
  }
  return f;
}

// A family of one unlabelled counter, its value read from elsewhere.
prometheus::MetricFamily CounterFamily(const char* name, const char* help, double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Counter;
  prometheus::ClientMetric m;
  m.counter.value = value;
  f.metric.push_back(std::move(m));
  return f;
}

}  // namespace

std::vector<prometheus::MetricFamily> KvEventGauges::Collect() const {
  const KvEventStats stats = log_ != nullptr ? log_->Stats() : KvEventStats{};
  return {
      GaugeFamily("kvcache_kv_event_subscribers", "WatchKvEvents subscribers attached",
                  {{{}, static_cast<double>(stats.subscribers)}}),
      CounterFamily("kvcache_kv_events_published_total", "KV events published",
                    static_cast<double>(stats.published)),
      CounterFamily("kvcache_kv_event_subscribers_dropped_total",
                    "KV event subscribers dropped for falling too far behind",
                    static_cast<double>(stats.dropped)),
  };
}

namespace {

// kvcache_pool_refused_total by the RPC whose request the pools refused (Step stands for
// every decode step, sent by Step or StepStream: the engine cannot tell them apart).
prometheus::MetricFamily PoolRefusedFamily(const KvPools* pools) {
  static constexpr std::pair<KvPools::Asker, Rpc> kAskers[KvPools::kAskers] = {
      {KvPools::Asker::kOpen, Rpc::kOpenSequence},
      {KvPools::Asker::kImport, Rpc::kImportSequence},
      {KvPools::Asker::kStep, Rpc::kStep}};
  prometheus::MetricFamily f;
  f.name = "kvcache_pool_refused_total";
  f.help = "Requests refused RESOURCE_EXHAUSTED because a KV pool lacked the blocks";
  f.type = prometheus::MetricType::Counter;
  for (const auto& [asker, rpc] : kAskers) {
    prometheus::ClientMetric m;
    m.label = {{"rpc", std::string(RpcName(rpc))}};
    m.counter.value = pools != nullptr ? static_cast<double>(pools->refused(asker)) : 0.0;
    f.metric.push_back(std::move(m));
  }
  return f;
}

}  // namespace

std::vector<prometheus::MetricFamily> PoolGauges::Collect() const {
  std::vector<BlockPoolUsage> usage;
  if (pools_ != nullptr) usage = pools_->Usage();
  if (usage.empty()) usage.push_back(BlockPoolUsage{});  // no pools: rank 0 at zero
  std::vector<GaugeSeries> capacity, used, block_bytes, block_tokens, cached;
  for (const BlockPoolUsage& u : usage) {
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"backend", backend_}, {"rank", std::to_string(u.rank)}};
    capacity.push_back({labels, static_cast<double>(u.capacity_blocks)});
    used.push_back({labels, static_cast<double>(u.used_blocks)});
    block_bytes.push_back({labels, static_cast<double>(u.block_bytes)});
    block_tokens.push_back({labels, static_cast<double>(u.tokens_per_block)});
    cached.push_back({labels, static_cast<double>(u.cached_tokens)});
  }
  return {GaugeFamily("kvcache_pool_capacity_blocks", "KV blocks in the rank's pool", capacity),
          GaugeFamily("kvcache_pool_used_blocks", "KV blocks leased to sequences", used),
          GaugeFamily("kvcache_pool_block_bytes", "Bytes per KV block (all layers, K and V)",
                      block_bytes),
          GaugeFamily("kvcache_pool_block_tokens", "Token slots per KV block", block_tokens),
          GaugeFamily("kvcache_pool_cached_tokens",
                      "Slots of leased KV blocks that hold a cached token", cached),
          PoolRefusedFamily(pools_)};
}

std::vector<prometheus::MetricFamily> TableGauges::Collect() const {
  struct Totals {
    double open = 0, retained = 0, seen = 0;
  };
  const std::vector<std::string> labels = PolicyLabels();
  absl::flat_hash_map<std::string, Totals> by_policy;
  for (const std::string& label : labels) by_policy[label];
  for (const SequenceInfo& info : table_->ListEveryTenant()) {
    Totals& t = by_policy[PolicyLabel(info.policy.preset)];
    t.open += 1;
    t.retained += static_cast<double>(info.cache_size);
    t.seen += static_cast<double>(info.prefill_len + info.last_step);
  }
  std::vector<GaugeSeries> open, retained, seen, ratio;
  for (const std::string& label : labels) {
    const Totals& t = by_policy[label];
    const std::vector<prometheus::ClientMetric::Label> policy = {{"policy", label}};
    open.push_back({policy, t.open});
    retained.push_back({policy, t.retained});
    seen.push_back({policy, t.seen});
    ratio.push_back({policy, t.seen > 0 ? t.retained / t.seen : 0.0});
  }
  return {
      GaugeFamily("kvcache_sequences_open", "Sequences registered and not closed", open),
      GaugeFamily("kvcache_tokens_retained", "Tokens cached across open sequences", retained),
      GaugeFamily("kvcache_tokens_seen",
                  "Prefill and decoded tokens across open sequences (an uncompressed cache)",
                  seen),
      GaugeFamily("kvcache_retention_ratio", "kvcache_tokens_retained / kvcache_tokens_seen",
                  ratio),
  };
}

std::vector<prometheus::MetricFamily> LimitGauges::Collect() const {
  const TcpListener* listener = listener_.load();
  return {
      GaugeFamily("kvcache_memory_bytes",
                  "Bytes counted against --memory_limit_bytes (engine state, decision and "
                  "reply buffers, pending tensor-parallel partial sums)",
                  {{{}, static_cast<double>(memory_->used())}}),
      GaugeFamily("kvcache_memory_limit_bytes", "--memory_limit_bytes",
                  {{{}, static_cast<double>(memory_->limit())}}),
      CounterFamily("kvcache_memory_refused_total",
                    "Requests refused with RESOURCE_EXHAUSTED by --memory_limit_bytes",
                    static_cast<double>(memory_->refused())),
      CounterFamily("kvcache_connections_refused_total",
                    "TCP connections accepted and closed at once at --max_connections",
                    listener != nullptr ? static_cast<double>(listener->refused_at_limit()) : 0),
      CounterFamily("kvcache_accept_errors_total",
                    "accept4 failures on the TCP listener (EMFILE, ENFILE, ENOBUFS, ENOMEM, "
                    "other)",
                    listener != nullptr ? static_cast<double>(listener->accept_errors()) : 0),
  };
}

}  // namespace kvcm::server

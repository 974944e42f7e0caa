#include "clients/replay/grpc_backend.h"

#include <algorithm>
#include <limits>
#include <span>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "clients/cpp/kvcache_client.h"
#include "clients/cpp/score_region.h"

namespace kvcm::replay {
namespace {

namespace v1 = ::kvcache::v1;

// The proto enums are the engine's names, upper-cased and prefixed ("AGGREGATION_EMA"):
// map through the names so there is one table of them, the engine's.
std::string EngineName(const std::string& proto_name, absl::string_view prefix) {
  return absl::AsciiStrToLower(proto_name.substr(prefix.size()));
}

v1::OpenSequenceRequest ToRequest(const std::string& id, const SequenceOptions& options,
                                  int32_t tp_ranks) {
  v1::OpenSequenceRequest r;
  r.set_sequence_id(id);
  r.set_prefill_len(options.prefill_len);
  if (options.budget.budget_tokens) r.set_budget_tokens(*options.budget.budget_tokens);
  if (options.budget.compression_ratio) r.set_compression_ratio(*options.budget.compression_ratio);
  v1::Policy* p = r.mutable_policy();
  p->set_seed(options.policy.seed);
  // Out of int32's range is out of the valid range too: saturate so the daemon refuses it.
  p->set_span_pool(static_cast<int32_t>(std::clamp<int64_t>(
      options.policy.span_pool, std::numeric_limits<int32_t>::min(),
      std::numeric_limits<int32_t>::max())));
  if (!options.preset.empty()) {
    p->set_preset(options.preset);
  } else {
    v1::Aggregation aggregation = v1::AGGREGATION_UNSPECIFIED;
    v1::Refresh refresh = v1::REFRESH_UNSPECIFIED;
    v1::Aggregation_Parse(
        absl::StrCat("AGGREGATION_", absl::AsciiStrToUpper(AggregationName(options.policy.aggregation))),
        &aggregation);
    v1::Refresh_Parse(
        absl::StrCat("REFRESH_", absl::AsciiStrToUpper(RefreshName(options.policy.refresh))),
        &refresh);
    p->set_aggregation(aggregation);
    p->set_refresh(refresh);
    p->set_alpha(options.policy.alpha);
    p->set_refresh_interval(options.policy.refresh_interval);
    p->set_protect_sinks(options.policy.protect_sinks);
    p->set_protect_recent(options.policy.protect_recent);
  }
  r.set_tp_world_size(tp_ranks);
  r.set_score_dtype(v1::SCORE_DTYPE_FLOAT32);
  if (options.score_layout == ScoreLayout::kFolded) {
    // Each report then carries one row (layers = 1): RunReplay folds the trace's rows.
    r.set_score_layout(v1::SCORE_LAYOUT_FOLDED);
    r.set_layers(static_cast<int32_t>(options.layers));
  }
  return r;
}

SequenceInfo FromState(const v1::SequenceState& s) {
  SequenceInfo info;
  info.id = s.sequence_id();
  info.prefill_len = s.prefill_len();
  info.budget = s.budget();
  info.policy.preset = s.policy().preset();
  if (auto a = ParseAggregation(EngineName(v1::Aggregation_Name(s.policy().aggregation()),
                                           "AGGREGATION_"));
      a.ok()) {
    info.policy.aggregation = *a;
  }
  if (auto r = ParseRefresh(EngineName(v1::Refresh_Name(s.policy().refresh()), "REFRESH_"));
      r.ok()) {
    info.policy.refresh = *r;
  }
  info.policy.refresh_interval = s.policy().refresh_interval();
  info.tp_world_size = s.tp_world_size();
  info.last_step = s.last_step();
  info.cache_size = s.cache_size();
  info.next_needs_scores = s.next_needs_scores();
  info.stats.steps = s.stats().steps();
  info.stats.scoring_steps = s.stats().scoring_steps();
  info.stats.skipped_scoring_steps = s.stats().skipped_scoring_steps();
  info.stats.ignored_score_reports = s.stats().ignored_score_reports();
  info.stats.tokens_evicted = s.stats().tokens_evicted();
  info.positions.assign(s.positions().begin(), s.positions().end());
  info.momentum.assign(s.momentum().begin(), s.momentum().end());
  return info;
}

class GrpcBackend : public ReplayBackend {
 public:
  GrpcBackend(std::unique_ptr<client::KvCacheClient> client, ScoreTransport transport,
              bool adopt_open_sequences)
      : client_(std::move(client)),
        transport_(transport),
        adopt_open_sequences_(adopt_open_sequences) {}

  absl::Status Open(const std::string& id, const SequenceOptions& options,
                    int32_t tp_ranks) override {
    const absl::Status opened = client_->Open(ToRequest(id, options, tp_ranks)).status();
    if (!(adopt_open_sequences_ && absl::IsAlreadyExists(opened))) RETURN_IF_ERROR(opened);
    streams_.clear();
    for (int32_t r = 0; r < tp_ranks; ++r) {
      ASSIGN_OR_RETURN(std::unique_ptr<client::StepStream> stream, client_->OpenStepStream());
      streams_.push_back(std::move(stream));
    }
    // A rank keeps its region across sequences (a backend replays one at a time).
    regions_.resize(static_cast<size_t>(tp_ranks));
    return absl::OkStatus();
  }

  absl::Status Step(const std::string& id, const TraceStep& step,
                    EvictionDecision* decision) override {
    const auto ranks = static_cast<int32_t>(streams_.size());
    // Every rank sends before any waits: the step is decided when the last report lands,
    // and each rank's stream then carries the same decision.
    for (int32_t rank : RankArrivalOrder(step.step, ranks)) {
      v1::StepBatch batch;
      batch.set_rank(rank);
      batch.set_batch_id(static_cast<uint64_t>(step.step));
      v1::StepReport* report = client::AddReport(&batch, id, step.step);
      if (step.layers > 0) {
        if (ranks == 1) {
          RETURN_IF_ERROR(SetScores(rank, step.scores, static_cast<int32_t>(step.layers),
                                    /*head_count=*/0, report));
        } else {
          SplitIntoRankPartial(step, rank, &partial_);
          RETURN_IF_ERROR(SetScores(rank, partial_, static_cast<int32_t>(step.layers),
                                    static_cast<int32_t>(SimulatedHeadsOfRank(rank)), report));
        }
      }
      RETURN_IF_ERROR(streams_[static_cast<size_t>(rank)]->Send(batch));
    }
    std::vector<v1::Decision> received;
    for (int32_t rank = 0; rank < ranks; ++rank) {
      ASSIGN_OR_RETURN(v1::DecisionBatch reply, streams_[static_cast<size_t>(rank)]->Receive());
      if (reply.decisions_size() != 1) {
        return absl::InternalError(absl::StrCat("rank ", rank, " got ", reply.decisions_size(),
                                                " decisions for one report"));
      }
      received.push_back(reply.decisions(0));
    }
    // From here every rank's region may be written again (ScoreRef's ownership rule).
    for (const v1::Decision& d : received) RETURN_IF_ERROR(client::DecisionStatus(d));
    for (const v1::Decision& d : received) {
      if (d.evicted_size() != received[0].evicted_size() ||
          !std::equal(d.evicted().begin(), d.evicted().end(), received[0].evicted().begin()) ||
          d.cache_size() != received[0].cache_size()) {
        return absl::InternalError(absl::StrCat("step ", step.step, ": ranks received different decisions"));
      }
    }
    decision->Reset();
    decision->step = received[0].step();
    decision->evicted.assign(received[0].evicted().begin(), received[0].evicted().end());
    decision->cache_size = received[0].cache_size();
    decision->next_needs_scores = received[0].next_needs_scores();
    return absl::OkStatus();
  }

  absl::StatusOr<SequenceInfo> Inspect(const std::string& id) override {
    ASSIGN_OR_RETURN(v1::SequenceState state, client_->Inspect(id, /*include_cache=*/true));
    return FromState(state);
  }

  absl::Status Close(const std::string& id) override {
    for (auto& stream : streams_) RETURN_IF_ERROR(stream->Close());
    streams_.clear();
    return client_->Close(id).status();
  }

 private:
  // Puts `scores` ([layers, tokens] f32, host) into `report`: inline, or into `rank`'s
  // score region (created, or re-created larger, when they do not fit) and referenced.
  absl::Status SetScores(int32_t rank, std::span<const float> scores, int32_t layers,
                         int32_t head_count, v1::StepReport* report) {
    if (transport_ == ScoreTransport::kGrpc) {
      client::SetFloat32Scores(report, scores, layers, head_count);
      return absl::OkStatus();
    }
    const std::span<const std::byte> packed = std::as_bytes(scores);
    std::unique_ptr<client::ScoreRegion>& region = regions_[static_cast<size_t>(rank)];
    const auto need = static_cast<int64_t>(packed.size());
    if (region == nullptr || region->size() < need) {
      // The daemon no longer reads the old region: the last step's decisions are in.
      // Doubling keeps a trace whose cache grows from re-creating it at every step.
      const int64_t size =
          std::max(need, region == nullptr ? kMinRegionBytes : 2 * region->size());
      region.reset();
      // kCreatedPerRank: only tensor-parallel steps may sit on another device than the
      // sequence's.
      const int32_t placed = transport_ == ScoreTransport::kCreatedPerRank && streams_.size() > 1
                                 ? rank
                                 : -1;
      ASSIGN_OR_RETURN(region, transport_ == ScoreTransport::kShm
                                   ? client::ScoreRegion::Create(*client_, size)
                                   : client::ScoreRegion::CreateInDaemon(*client_, size, placed));
    }
    return region->Put(report, /*offset=*/0, packed, layers, kernels::ScoreDtype::kFloat32,
                       head_count);
  }

  static constexpr int64_t kMinRegionBytes = 1 << 20;

  std::unique_ptr<client::KvCacheClient> client_;
  const ScoreTransport transport_;
  const bool adopt_open_sequences_;
  std::vector<std::unique_ptr<client::StepStream>> streams_;
  std::vector<std::unique_ptr<client::ScoreRegion>> regions_;  // [ranks], transport shm
  std::vector<float> partial_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ReplayBackend>> NewGrpcBackend(const GrpcBackendOptions& options) {
  client::ClientOptions client_options = options.connection;
  client_options.address = options.address;
  ASSIGN_OR_RETURN(std::unique_ptr<client::KvCacheClient> client,
                   client::KvCacheClient::Connect(client_options));
  return std::unique_ptr<ReplayBackend>(
      new GrpcBackend(std::move(client), options.transport, options.adopt_open_sequences));
}

}  // namespace kvcm::replay

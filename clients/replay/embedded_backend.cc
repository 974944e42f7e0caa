#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "clients/replay/replay_backend.h"

namespace kvcm::replay {
namespace {

bool SameDecision(const EvictionDecision& a, const EvictionDecision& b) {
  return a.step == b.step && a.evicted == b.evicted && a.cache_size == b.cache_size &&
         a.next_needs_scores == b.next_needs_scores;
}

class EmbeddedBackend : public ReplayBackend {
 public:
  absl::Status Open(const std::string& id, const SequenceOptions& options,
                    int32_t tp_ranks) override {
    tp_ranks_ = tp_ranks;
    return table_.Open(id, options, tp_ranks).status();
  }

  absl::Status Step(const std::string& id, const TraceStep& step,
                    EvictionDecision* decision) override {
    const kernels::ScoreMatrix scores = step.Matrix();
    if (tp_ranks_ == 1) return table_.Step(id, step.step, &scores, decision);

    // Every rank's callback must see the same decision; the last report completes it.
    std::vector<absl::StatusOr<EvictionDecision>> received;
    for (int32_t rank : RankArrivalOrder(step.step, tp_ranks_)) {
      RankReport report;
      report.rank = rank;
      report.step = step.step;
      if (step.layers > 0) {
        SplitIntoRankPartial(step, rank, &partial_);
        report.partial_sums = kernels::ScoreMatrix::Dense(
            partial_.data(), kernels::ScoreDtype::kFloat32, step.layers, step.tokens);
        report.head_count = SimulatedHeadsOfRank(rank);
      }
      RETURN_IF_ERROR(table_.SubmitRankReport(
          id, report, [&received](const absl::StatusOr<EvictionDecision>& result) {
            received.push_back(result);
          }));
    }
    if (static_cast<int32_t>(received.size()) != tp_ranks_) {
      return absl::InternalError(absl::StrCat("step ", step.step, ": ", received.size(),
                                              " of ", tp_ranks_, " ranks got a decision"));
    }
    for (const auto& r : received) RETURN_IF_ERROR(r.status());
    for (const auto& r : received) {
      if (!SameDecision(*r, *received.front())) {
        return absl::InternalError(
            absl::StrCat("step ", step.step, ": ranks received different decisions"));
      }
    }
    *decision = *received.front();
    return absl::OkStatus();
  }

  absl::StatusOr<SequenceInfo> Inspect(const std::string& id) override {
    return table_.Inspect(id, /*with_cache=*/true);
  }

  absl::Status Close(const std::string& id) override { return table_.Close(id).status(); }

 private:
  SequenceTable table_;
  int32_t tp_ranks_ = 1;
  std::vector<float> partial_;
};

}  // namespace

std::unique_ptr<ReplayBackend> NewEmbeddedBackend() { return std::make_unique<EmbeddedBackend>(); }

int64_t SimulatedHeadsOfRank(int32_t rank) { return 1 + (rank % 2); }

void SplitIntoRankPartial(const TraceStep& step, int32_t rank, std::vector<float>* partial) {
  const float heads = static_cast<float>(SimulatedHeadsOfRank(rank));
  partial->resize(step.scores.size());
  for (size_t i = 0; i < step.scores.size(); ++i) (*partial)[i] = step.scores[i] * heads;
}

std::vector<int32_t> RankArrivalOrder(int64_t step, int32_t ranks) {
  std::vector<int32_t> order(static_cast<size_t>(ranks));
  for (int32_t i = 0; i < ranks; ++i) {
    order[static_cast<size_t>(i)] = static_cast<int32_t>((step + i) % ranks);
  }
  return order;
}

}  // namespace kvcm::replay

#include "cache_manager/tensor_parallel_join.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cache_manager/check.h"
#include "kernels/score_validation.h"

namespace kvcm {

TensorParallelJoin::TensorParallelJoin(int32_t world_size,
                                       const kernels::KernelBackend& backend)
    : world_size_(world_size), backend_(&backend), slots_(static_cast<size_t>(world_size)) {
  KVCM_CHECK(world_size >= 1);
  KVCM_CHECK(backend.memory == kernels::MemorySpace::kHost);
}

std::vector<int32_t> TensorParallelJoin::MissingRanks() const {
  std::vector<int32_t> missing;
  for (int32_t r = 0; r < world_size_; ++r) {
    if (!slots_[static_cast<size_t>(r)].arrived) missing.push_back(r);
  }
  return missing;
}

absl::Status TensorParallelJoin::Add(const RankReport& report, const JoinExpectation& expect) {
  const auto where = [&]() {
    return absl::StrCat("sequence '", expect.sequence_id, "' step ", report.step, " rank ",
                        report.rank, ": ");
  };
  if (report.rank < 0 || report.rank >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "rank is outside the tensor-parallel world of ", world_size_, " ranks"));
  }
  if (report.step != expect.step) {
    return absl::FailedPreconditionError(
        absl::StrCat(where(), "step is out of order; expected step ", expect.step));
  }
  Slot& slot = slots_[static_cast<size_t>(report.rank)];
  if (slot.arrived) {
    return absl::FailedPreconditionError(
        absl::StrCat(where(), "this rank already reported this step"));
  }
  const kernels::ScoreMatrix& p = report.partial_sums;
  const bool has_scores = p.layers > 0;
  if (!has_scores) {
    if (expect.scoring_step) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "this is a scoring step and the report carries no partial sums (need ",
          expect.tokens, " per layer)"));
    }
  } else if (expect.scoring_step) {
    if (report.head_count < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "head_count is ", report.head_count, "; it must be >= 1"));
    }
    if (p.tokens != expect.tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "partial sums cover ", p.tokens, " tokens per layer, the cache holds ",
          expect.tokens, " (cached + the new token)"));
    }
    if (layers_ != 0 && p.layers != layers_) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "report has ", p.layers, " layers, earlier ranks reported ", layers_));
    }
    if (p.data == nullptr || p.layer_stride < p.tokens) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "malformed partial sums"));
    }
    int64_t invalid = 0;
    backend_->count_invalid_scores(p, &invalid, nullptr);
    if (invalid != 0) {
      const kernels::InvalidScore bad = kernels::FindFirstInvalidScore(p);
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "layer ", bad.layer, " partial sum ", bad.index, " is ", bad.value,
          "; partial sums must be finite and >= 0"));
    }
    // Accepted: copy it densely.
    const size_t row_bytes = static_cast<size_t>(p.tokens) * kernels::ScoreDtypeSize(p.dtype);
    slot.bytes.resize(row_bytes * static_cast<size_t>(p.layers));
    for (int64_t layer = 0; layer < p.layers; ++layer) {
      std::memcpy(slot.bytes.data() + static_cast<size_t>(layer) * row_bytes, p.Row(layer),
                  row_bytes);
    }
    slot.view = kernels::ScoreMatrix::Dense(slot.bytes.data(), p.dtype, p.layers, p.tokens);
    slot.head_count = report.head_count;
    layers_ = p.layers;
  }
  if (has_scores && !expect.scoring_step) scores_ignored_ = true;
  slot.arrived = true;
  ++arrived_;
  return absl::OkStatus();
}

kernels::ScoreMatrix TensorParallelJoin::Join() {
  KVCM_CHECK(complete());
  if (layers_ == 0) return kernels::ScoreMatrix{};
  views_.clear();
  int64_t total_heads = 0;
  for (const Slot& slot : slots_) {
    views_.push_back(slot.view);
    total_heads += slot.head_count;
  }
  const kernels::ScoreMatrix& first = views_.front();
  joined_.resize(static_cast<size_t>(first.layers * first.tokens));
  backend_->join_rank_partials(views_.data(), static_cast<int64_t>(views_.size()),
                               total_heads, joined_.data(), nullptr);
  return kernels::ScoreMatrix::Dense(joined_.data(), kernels::ScoreDtype::kFloat32,
                                     first.layers, first.tokens);
}

void TensorParallelJoin::Reset() {
  for (Slot& slot : slots_) {
    slot.arrived = false;
    slot.head_count = 0;
    slot.view = kernels::ScoreMatrix{};
    // The first step of a long prefill is far larger than the steady steps that follow.
    if (slot.bytes.capacity() > 2 * slot.bytes.size() + 4096) slot.bytes.shrink_to_fit();
  }
  if (joined_.capacity() > 2 * joined_.size() + 1024) joined_.shrink_to_fit();
  arrived_ = 0;
  layers_ = 0;
  scores_ignored_ = false;
}

}  // namespace kvcm

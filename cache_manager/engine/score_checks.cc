#include "cache_manager/engine/score_checks.h"

#include "absl/strings/str_cat.h"

namespace kvcm {

std::string DescribeScoresAt(const ScoresAt& at) {
  if (at.rank < 0) return absl::StrCat("sequence '", at.sequence_id, "' step ", at.step, ": ");
  return absl::StrCat("sequence '", at.sequence_id, "' step ", at.step, " rank ", at.rank, ": ");
}

absl::Status CheckScoreShape(const ScoresAt& at, absl::string_view noun,
                             const kernels::ScoreMatrix& scores, int64_t cached) {
  if (scores.tokens != cached + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        DescribeScoresAt(at), noun, " cover ", scores.tokens, " tokens per layer, the cache holds ", cached + 1,
        " (", cached, " cached + the new token)"));
  }
  if (scores.layer_stride < scores.tokens || scores.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        DescribeScoresAt(at), "malformed ", noun, " (stride ", scores.layer_stride, " < ", scores.tokens,
        " tokens, or no data)"));
  }
  return absl::OkStatus();
}

absl::Status InvalidScoreError(const ScoresAt& at, absl::string_view row,
                               absl::string_view element, int64_t index, int64_t position,
                               float value, absl::string_view noun) {
  const std::string of = position >= 0 ? absl::StrCat(" (position ", position, ")") : "";
  return absl::InvalidArgumentError(absl::StrCat(DescribeScoresAt(at), row, " ", element, " ",
                                                 index, of, " is ", value, "; ", noun,
                                                 " must be finite and >= 0"));
}

}  // namespace kvcm

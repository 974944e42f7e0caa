#include "cache_manager/policy/token_budget.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvcm {

absl::StatusOr<int64_t> ResolveBudget(int64_t prefill_len, const BudgetSpec& spec) {
  if (prefill_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_len is ", prefill_len, "; it must be >= 1"));
  }
  if (spec.budget_tokens.has_value() == spec.compression_ratio.has_value()) {
    return absl::InvalidArgumentError(
        "give exactly one of budget_tokens and compression_ratio");
  }
  if (spec.budget_tokens.has_value()) {
    if (*spec.budget_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("budget_tokens is ", *spec.budget_tokens, "; it must be >= 1"));
    }
    return *spec.budget_tokens;
  }
  const double ratio = *spec.compression_ratio;
  if (!(ratio >= 0.0 && ratio < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compression_ratio is ", ratio, "; it must satisfy 0 <= compression_ratio < 1"));
  }
  const double kept = std::floor((1.0 - ratio) * static_cast<double>(prefill_len) + 1e-9);
  // A prefill near INT64_MAX rounds up in double; converting that back would overflow.
  if (kept >= static_cast<double>(prefill_len)) return prefill_len;
  return std::max<int64_t>(1, static_cast<int64_t>(kept));
}

}  // namespace kvcm

// The token budget: the budget rule of SPEC.md (the most tokens a sequence's cache may hold
// after a step; the one place that computes it, everything else asks here).
#ifndef KVCM_CACHE_MANAGER_POLICY_TOKEN_BUDGET_H_
#define KVCM_CACHE_MANAGER_POLICY_TOKEN_BUDGET_H_

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm {

// Exactly one of the two must be set.
struct BudgetSpec {
  std::optional<int64_t> budget_tokens;     // >= 1
  std::optional<double> compression_ratio;  // 0 <= ratio < 1

  static BudgetSpec Tokens(int64_t tokens) { return BudgetSpec{tokens, std::nullopt}; }
  static BudgetSpec Ratio(double ratio) { return BudgetSpec{std::nullopt, ratio}; }
};

// B = budget_tokens, or max(1, floor((1 - ratio) * prefill_len + 1e-9)) computed in double.
// INVALID_ARGUMENT when prefill_len < 1 or the spec is not exactly one valid field.
absl::StatusOr<int64_t> ResolveBudget(int64_t prefill_len, const BudgetSpec& spec);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_POLICY_TOKEN_BUDGET_H_

#include "cache_manager/budget.h"

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

bool ByteBudget::TryTakeHere(int64_t bytes) {
  int64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit_ - used) {  // limit_ - used cannot overflow: used >= 0
      refused_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

bool ByteBudget::TryTake(int64_t bytes, const ByteBudget** refused_by) {
  if (!TryTakeHere(bytes)) {
    if (refused_by != nullptr) *refused_by = this;
    return false;
  }
  if (parent_ != nullptr && !parent_->TryTake(bytes, refused_by)) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);  // here only: the parent took nothing
    return false;
  }
  return true;
}

void ByteBudget::Take(int64_t bytes) {
  used_.fetch_add(bytes, std::memory_order_relaxed);
  if (parent_ != nullptr) parent_->Take(bytes);
}

void ByteBudget::Give(int64_t bytes) {
  used_.fetch_sub(bytes, std::memory_order_relaxed);
  if (parent_ != nullptr) parent_->Give(bytes);
}

void ByteBudget::Release(int64_t bytes) {
  used_.fetch_sub(bytes, std::memory_order_relaxed);
  freed_.fetch_add(bytes, std::memory_order_relaxed);
  if (parent_ != nullptr) parent_->Release(bytes);
}

int64_t ByteBudget::left() const { return std::max<int64_t>(0, limit_ - used()); }

std::string ByteBudget::Refusal(int64_t bytes) const {
  return absl::StrCat(bytes, " bytes asked, ", used(), " of ", holder_, "'s ", limit_,
                      " bytes in use, ", left(), " left (", flag_, ")");
}

}  // namespace kvcm

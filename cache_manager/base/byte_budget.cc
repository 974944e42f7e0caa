#include "cache_manager/base/byte_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvcm {

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

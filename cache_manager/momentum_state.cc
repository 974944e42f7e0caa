#include "cache_manager/momentum_state.h"

#include <algorithm>

#include "cache_manager/check.h"
#include "kernels/selection.h"

namespace kvcm {

MomentumState::MomentumState(int64_t prefill_len, int64_t budget, bool momentum_is_position) {
  Reserve(std::max(prefill_len, budget) + 1);
  positions_.resize(static_cast<size_t>(prefill_len));
  momentum_.resize(static_cast<size_t>(prefill_len));
  for (int64_t i = 0; i < prefill_len; ++i) {
    positions_[static_cast<size_t>(i)] = i;
    momentum_[static_cast<size_t>(i)] = momentum_is_position ? static_cast<float>(i) : 0.0f;
  }
}

void MomentumState::Reserve(int64_t capacity) {
  capacity_ = capacity;
  const auto n = static_cast<size_t>(capacity);
  positions_.reserve(n);
  momentum_.reserve(n);
  update_scratch_.resize(n);
  select_scratch_.resize(n);
  selected_scratch_.resize(n);
}

void MomentumState::ShrinkTo(int64_t budget) {
  const int64_t wanted = std::max(size(), budget) + 1;
  if (capacity_ <= wanted) return;
  positions_.shrink_to_fit();
  momentum_.shrink_to_fit();
  update_scratch_ = std::vector<float>();
  select_scratch_ = std::vector<uint64_t>();
  selected_scratch_ = std::vector<int64_t>();
  Reserve(wanted);
}

void MomentumState::Append(int64_t position, float momentum) {
  KVCM_CHECK(positions_.empty() || position > positions_.back());
  if (size() + 1 > capacity_) Reserve(std::max(size() + 1, 2 * capacity_));
  positions_.push_back(position);
  momentum_.push_back(momentum);
}

void MomentumState::PopBack() {
  positions_.pop_back();
  momentum_.pop_back();
}

int64_t MomentumState::ApplyScores(const kernels::ScoreMatrix& scores,
                                   const kernels::MomentumUpdateOptions& options) {
  KVCM_CHECK(scores.tokens == size());
  int64_t invalid = 0;
  kernels::cpu::UpdateMomentum(momentum_.data(), update_scratch_.data(), size(), scores,
                               options, &invalid, nullptr);
  if (invalid != 0) return invalid;
  // Commit: the scratch becomes the momentum, and the old momentum the next scratch. Both
  // were reserved to capacity_, so the resizes neither allocate nor, in the steady state
  // (size() == capacity_), touch any element.
  const size_t n = momentum_.size();
  momentum_.swap(update_scratch_);
  momentum_.resize(n);
  update_scratch_.resize(static_cast<size_t>(capacity_));
  return 0;
}

double MomentumState::MeanMomentum() const {
  double mean = 0.0;
  kernels::cpu::MeanMomentum(momentum_.data(), size(), &mean, nullptr);
  return mean;
}

int64_t MomentumState::FirstUnprotectedSinkIndex(int64_t protect_sinks) const {
  return std::lower_bound(positions_.begin(), positions_.end(), protect_sinks) -
         positions_.begin();
}

void MomentumState::EvictLowest(int64_t begin, int64_t end, int64_t k,
                                std::vector<int64_t>* evicted, std::vector<int64_t>* indices) {
  if (k <= 0) return;
  KVCM_CHECK(k <= end - begin);
  kernels::cpu::SelectLowest(momentum_.data(), begin, end, k, selected_scratch_.data(),
                             select_scratch_.data(), nullptr);
  EvictIndices(std::span<const int64_t>(selected_scratch_.data(), static_cast<size_t>(k)),
               evicted, indices);
}

void MomentumState::EvictIndices(std::span<const int64_t> indices,
                                 std::vector<int64_t>* evicted,
                                 std::vector<int64_t>* evicted_indices) {
  if (indices.empty()) return;
  for (int64_t index : indices) evicted->push_back(positions_[static_cast<size_t>(index)]);
  evicted_indices->insert(evicted_indices->end(), indices.begin(), indices.end());
  kernels::cpu::RemoveEntries(momentum_.data(), positions_.data(), size(), indices.data(),
                              static_cast<int64_t>(indices.size()), nullptr);
  const size_t remaining = positions_.size() - indices.size();
  positions_.resize(remaining);
  momentum_.resize(remaining);
}

}  // namespace kvcm

// A deliberately plain model of SPEC.md's step procedure, for property tests: one token at
// a time, a full scan per eviction, no scratch, no kernels. It shares no code with the
// engine beyond the Policy value type and the budget rule.
#ifndef KVCM_TESTS_CACHE_MANAGER_REFERENCE_ENGINE_H_
#define KVCM_TESTS_CACHE_MANAGER_REFERENCE_ENGINE_H_

#include <cstdint>
#include <vector>

#include "cache_manager/policy/policy.h"

namespace kvcm::testing {

struct ReferenceDecision {
  std::vector<int64_t> evicted;
  int64_t cache_size = 0;
  bool next_needs_scores = false;
};

class ReferenceEngine {
 public:
  ReferenceEngine(int64_t prefill_len, int64_t budget, Policy policy)
      : prefill_len_(prefill_len), budget_(budget), policy_(policy) {
    for (int64_t i = 0; i < prefill_len; ++i) {
      positions_.push_back(i);
      momentum_.push_back(policy.aggregation == Aggregation::kRecency ? static_cast<float>(i)
                                                                      : 0.0f);
    }
  }

  bool IsScoring(int64_t t) const {
    const bool uses = policy_.aggregation == Aggregation::kEma ||
                      policy_.aggregation == Aggregation::kCumulative ||
                      policy_.aggregation == Aggregation::kSingleStep;
    if (!uses) return false;
    if (policy_.refresh == Refresh::kEveryStep) return true;
    if (policy_.refresh == Refresh::kLazy) return (t - 1) % policy_.refresh_interval == 0;
    return t == 1;
  }

  // `layers` holds one vector of |C|+1 scores per layer (ignored on non-scoring steps).
  ReferenceDecision Step(int64_t t, const std::vector<std::vector<float>>& layers) {
    const int64_t position = prefill_len_ + t - 1;
    if (IsScoring(t)) {
      positions_.push_back(position);
      momentum_.push_back(0.0f);
      const float keep = static_cast<float>(policy_.alpha);
      const float take = static_cast<float>(1.0 - policy_.alpha);
      if (policy_.aggregation == Aggregation::kSingleStep) {
        for (size_t i = 0; i < momentum_.size(); ++i) {
          float sum = 0.0f;
          for (const auto& layer : layers) sum += layer[i];
          momentum_[i] = sum / static_cast<float>(layers.size());
        }
      } else {
        for (const auto& layer : layers) {
          for (size_t i = 0; i < momentum_.size(); ++i) {
            momentum_[i] = policy_.aggregation == Aggregation::kEma
                               ? keep * momentum_[i] + take * layer[i]
                               : momentum_[i] + layer[i];
          }
        }
      }
    } else if (policy_.aggregation == Aggregation::kRecency) {
      positions_.push_back(position);
      momentum_.push_back(static_cast<float>(position));
    } else {
      long double sum = 0;
      for (float m : momentum_) sum += m;
      const double mean = momentum_.empty() ? 0.0 : static_cast<double>(sum / momentum_.size());
      positions_.push_back(position);
      momentum_.push_back(static_cast<float>(mean));
    }

    ReferenceDecision d;
    while (static_cast<int64_t>(positions_.size()) > budget_) {
      const int64_t n = static_cast<int64_t>(positions_.size());
      int64_t victim = -1;
      for (int64_t i = 0; i < n; ++i) {
        const bool sink = positions_[i] < policy_.protect_sinks;
        const bool recent = i >= n - policy_.protect_recent;
        if (sink || recent) continue;
        if (victim < 0 || momentum_[i] < momentum_[victim]) victim = i;
      }
      d.evicted.push_back(positions_[victim]);
      positions_.erase(positions_.begin() + victim);
      momentum_.erase(momentum_.begin() + victim);
    }
    std::sort(d.evicted.begin(), d.evicted.end());
    d.cache_size = static_cast<int64_t>(positions_.size());
    d.next_needs_scores = IsScoring(t + 1);
    return d;
  }

  int64_t size() const { return static_cast<int64_t>(positions_.size()); }
  const std::vector<int64_t>& positions() const { return positions_; }
  const std::vector<float>& momentum() const { return momentum_; }

 private:
  int64_t prefill_len_;
  int64_t budget_;
  Policy policy_;
  std::vector<int64_t> positions_;
  std::vector<float> momentum_;
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_CACHE_MANAGER_REFERENCE_ENGINE_H_

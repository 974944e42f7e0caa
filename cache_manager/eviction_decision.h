// EvictionDecision: what the engine answers for one step of one sequence (SPEC.md, step 5).
#ifndef KVCM_CACHE_MANAGER_EVICTION_DECISION_H_
#define KVCM_CACHE_MANAGER_EVICTION_DECISION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cache_manager/policy.h"

namespace kvcm {

struct EvictionDecision {
  int64_t step = 0;
  std::vector<int64_t> evicted;  // positions, ascending
  int64_t cache_size = 0;        // tokens cached after eviction
  bool next_needs_scores = false;
  // Beyond the contract, for accounting: whether this step was a scoring step, and
  // whether scores were sent on a step that did not need them (ignored).
  bool scored = false;
  bool scores_ignored = false;
  // The policy that decided (for per-policy accounting): its preset name, empty for a
  // policy given field by field, and its aggregation.
  std::string preset;
  Aggregation aggregation = Aggregation::kEma;

  // Clears for reuse, keeping the capacity of `evicted`.
  void Reset() {
    step = 0;
    evicted.clear();
    cache_size = 0;
    next_needs_scores = scored = scores_ignored = false;
  }
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_EVICTION_DECISION_H_

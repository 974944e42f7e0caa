// EvictionDecision: what the engine answers for one step of one sequence (SPEC.md, step 5).
#ifndef KVCM_CACHE_MANAGER_ENGINE_EVICTION_DECISION_H_
#define KVCM_CACHE_MANAGER_ENGINE_EVICTION_DECISION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cache_manager/engine/diagnostics.h"
#include "cache_manager/kv/kv_slot_changes.h"
#include "cache_manager/policy/policy.h"

namespace kvcm {

// How a sequence's decisions travel to its workers (the proto's DecisionEncoding). The
// engine only remembers the sequence's choice and stamps it on each decision; server/
// encodes: positions, a bit mask over `evicted_indices`, or per decision the smaller.
enum class DecisionEncoding : uint8_t { kPositions, kMask, kAuto };

struct EvictionDecision {
  int64_t step = 0;
  std::vector<int64_t> evicted;  // positions, ascending
  // The same tokens as indices into the cache before eviction (the new token last):
  // what slot tables and KV leases are updated with.
  std::vector<int64_t> evicted_indices;
  int64_t cache_size = 0;        // tokens cached after eviction
  bool next_needs_scores = false;
  // Beyond the contract, for accounting: whether this step was a scoring step, and
  // whether scores were sent on a step that did not need them (ignored).
  bool scored = false;
  bool scores_ignored = false;
  // Engine time of the step (the join included), for the decision-time histogram.
  double decide_seconds = 0;
  // The policy that decided (for per-policy accounting): its preset name, empty for a
  // policy given field by field, and its aggregation.
  std::string preset;
  Aggregation aggregation = Aggregation::kEma;
  // The sequence's choice (set by every step, like `preset`).
  DecisionEncoding encoding = DecisionEncoding::kPositions;
  // Per rank, when the sequence holds KV leases; empty otherwise.
  std::vector<KvSlotChanges> kv;
  // Eviction-quality figures of a sampled step (cache_manager/engine/diagnostics.h); `measured`
  // is false on every other step.
  StepDiagnostics diagnostics = {};

  // Clears for reuse, keeping the capacity of `evicted`.
  void Reset() {
    step = 0;
    evicted.clear();
    evicted_indices.clear();
    kv.clear();
    cache_size = 0;
    next_needs_scores = scored = scores_ignored = false;
    decide_seconds = 0;
    diagnostics.measured = false;
  }
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_EVICTION_DECISION_H_

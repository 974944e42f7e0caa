// Decisions as JSON Lines (SPEC.md): {"step":1,"evicted":[4,5],"cache_size":25,
// "next_needs_scores":false} and, with momentum output, "momentum":{"positions":[...],
// "values":[...]}. Values are written in the shortest form that reads back to the same
// float32.
#ifndef KVCM_CLIENTS_REPLAY_DECISION_JSON_H_
#define KVCM_CLIENTS_REPLAY_DECISION_JSON_H_

#include <cstdint>
#include <span>
#include <string>

#include "cache_manager/engine/eviction_decision.h"

namespace kvcm::replay {

// Appends one decision line (with its trailing newline) to `out`. `positions`/`momentum`
// are written only when `with_momentum`.
void AppendDecisionJson(const EvictionDecision& decision, bool with_momentum,
                        std::span<const int64_t> positions, std::span<const float> momentum,
                        std::string* out);

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_DECISION_JSON_H_

// The rules the table applies to every sequence, each written once: what a NOT_FOUND says,
// and the --max_sequence_tokens limit on a sequence's life (prefill plus decode), which an
// Open, a resumed Open and each step check. Free functions; thread-safe.
#ifndef KVCM_CACHE_MANAGER_TABLE_SEQUENCE_RULES_H_
#define KVCM_CACHE_MANAGER_TABLE_SEQUENCE_RULES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcm {

// NOT_FOUND "sequence '<id>' is not open": an unknown id, a closed one and another
// tenant's all get exactly this.
absl::Status SequenceNotOpen(absl::string_view id);

// RESOURCE_EXHAUSTED when a sequence of `prefill_len` tokens would hold more than
// `max_tokens` over its life at step `step` (0: at its open; a resumed open passes its
// last step). The subtraction is ordered so that nothing wraps for any int64 inputs >= 0.
absl::Status CheckSequenceTokens(absl::string_view id, int64_t prefill_len, int64_t step,
                                 int64_t max_tokens);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TABLE_SEQUENCE_RULES_H_

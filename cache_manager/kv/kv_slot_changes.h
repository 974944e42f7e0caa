// KvSlotChanges: what one step did to one rank's KV slots: the KV layer's answer to a set of
// evicted tokens (SequenceKv::ApplyEvictions), which decisions carry to the workers.
#ifndef KVCM_CACHE_MANAGER_KV_KV_SLOT_CHANGES_H_
#define KVCM_CACHE_MANAGER_KV_KV_SLOT_CHANGES_H_

#include <cstdint>
#include <vector>

#include "kernels/kv_compaction.h"

namespace kvcm {

// What happened to one rank's KV slots in a step (when the daemon holds KV pools).
struct KvSlotChanges {
  int32_t rank = 0;
  // Where the step's token's K/V goes (after any compaction of this step); -1 when the
  // token was evicted in its own step.
  int64_t new_token_slot = -1;
  std::vector<kernels::KvMove> moves;        // compaction: K/V moved from src to dst slot
  std::vector<int32_t> released_blocks;      // blocks returned to the pool
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_KV_SLOT_CHANGES_H_

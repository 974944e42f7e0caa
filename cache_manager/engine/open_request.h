// The rules of an open request that are not the policy's (cache_manager/policy/
// policy_request.h) and that the wire leaves to the engine: what an unset tensor-parallel
// world means, and what a worker's resume after a crash must carry (SPEC.md, "Resuming a
// sequence"). Plain functions; thread-safe.
#ifndef KVCM_CACHE_MANAGER_ENGINE_OPEN_REQUEST_H_
#define KVCM_CACHE_MANAGER_ENGINE_OPEN_REQUEST_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "cache_manager/engine/sequence.h"

namespace kvcm {

// The ranks of a sequence whose request says `requested` (0: not given, one rank). Other
// values are returned as they are: the table checks them against its limit.
int32_t TpWorldSizeOrDefault(int32_t requested);

// A worker's resume: the last step it decided and the positions it holds. A worker's
// resume carries no momentum: the sequence starts from a fresh prefill's over these
// positions. INVALID_ARGUMENT when `last_step` < 1 (a sequence before its first step is
// opened without resume); the positions are checked at open (Sequence::Create).
absl::StatusOr<SequenceProgress> WorkerResume(int64_t last_step, std::vector<int64_t> positions);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_OPEN_REQUEST_H_

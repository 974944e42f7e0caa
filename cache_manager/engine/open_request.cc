#include "cache_manager/engine/open_request.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {

int32_t TpWorldSizeOrDefault(int32_t requested) { return requested == 0 ? 1 : requested; }

absl::StatusOr<SequenceProgress> WorkerResume(int64_t last_step,
                                              std::vector<int64_t> positions) {
  if (last_step < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume: last_step is ", last_step,
        "; it must be >= 1 (a sequence before its first step is opened without resume)"));
  }
  SequenceProgress progress;
  progress.last_step = last_step;
  progress.positions = std::move(positions);
  return progress;
}

}  // namespace kvcm

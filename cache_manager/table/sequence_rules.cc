#include "cache_manager/table/sequence_rules.h"

#include "absl/strings/str_cat.h"

namespace kvcm {

absl::Status SequenceNotOpen(absl::string_view id) {
  return absl::NotFoundError(absl::StrCat("sequence '", id, "' is not open"));
}

absl::Status CheckSequenceTokens(absl::string_view id, int64_t prefill_len, int64_t step,
                                 int64_t max_tokens) {
  if (prefill_len > max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", id, "': its prefill of ", prefill_len,
        " tokens is more than --max_sequence_tokens=", max_tokens, " (prefill plus decode)"));
  }
  if (step > max_tokens - prefill_len) {  // cannot wrap: prefill_len <= max_tokens
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", id, "' step ", step, ": it would hold ", prefill_len, " + ", step,
        " tokens (prefill plus decode), more than --max_sequence_tokens=", max_tokens,
        "; close it"));
  }
  return absl::OkStatus();
}

}  // namespace kvcm

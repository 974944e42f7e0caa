#include "cache_manager/policy/policy_request.h"

#include "absl/strings/str_cat.h"

namespace kvcm {

bool PolicyRequest::HasFields() const {
  return aggregation.has_value() || alpha.has_value() || refresh.has_value() ||
         refresh_interval.has_value() || protect_sinks != 0 || protect_recent != 0;
}

absl::StatusOr<RequestedPolicy> ResolvePolicyRequest(const PolicyRequest& request) {
  RequestedPolicy out;
  if (!request.preset.empty()) {
    if (request.HasFields()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy: preset '", request.preset,
          "' is given together with policy fields; give a preset (and seed) or the fields"));
    }
    out.preset = request.preset;
  } else if (!request.HasFields()) {
    // A seed or a span_pool alone changes nothing else.
    out.preset = std::string(kDefaultPreset);
  } else {
    if (request.aggregation) out.policy.aggregation = *request.aggregation;
    if (request.alpha) out.policy.alpha = *request.alpha;
    if (request.refresh) out.policy.refresh = *request.refresh;
    if (request.refresh_interval) out.policy.refresh_interval = *request.refresh_interval;
    out.policy.protect_sinks = request.protect_sinks;
    out.policy.protect_recent = request.protect_recent;
  }
  out.policy.seed = request.seed;
  out.policy.span_pool = request.span_pool;
  return out;
}

}  // namespace kvcm

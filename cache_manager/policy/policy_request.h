// PolicyRequest: a policy as a client asks for it at open: a preset's name, or fields that
// override the defaults of Policy, or nothing. The rules that turn it into the policy the
// sequence gets live here, not in the translation from the wire (server/translate.cc):
// nothing asked means the default preset; a preset excludes the fields (a seed and a
// span_pool may go with either). Plain values; thread-compatible.
#ifndef KVCM_CACHE_MANAGER_POLICY_POLICY_REQUEST_H_
#define KVCM_CACHE_MANAGER_POLICY_POLICY_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/policy/policy.h"

namespace kvcm {

// The preset of a sequence whose request names no policy at all.
inline constexpr absl::string_view kDefaultPreset = "inertia";

struct PolicyRequest {
  std::string preset;  // "": none named
  // Unset (or 0 for the protections): not given, Policy's default applies.
  std::optional<Aggregation> aggregation;
  std::optional<double> alpha;
  std::optional<Refresh> refresh;
  std::optional<int64_t> refresh_interval;
  int64_t protect_sinks = 0;
  int64_t protect_recent = 0;
  uint64_t seed = 0;  // with a preset or with the fields
  // With a preset or with the fields: span pooling is orthogonal to the aggregation it
  // feeds (SPEC.md, "Span pooling"), so `inertia` + span_pool 7 is a valid request.
  int64_t span_pool = 0;

  // Whether any policy field (not the preset, the seed or span_pool) was given.
  bool HasFields() const;
};

// What SequenceOptions takes: a preset to expand (Policy::FromPreset; only policy.seed and
// policy.span_pool are read then), or, with an empty preset, the policy as given.
struct RequestedPolicy {
  std::string preset;
  Policy policy;
};

// The request's policy: its preset, the default preset when it asks nothing, or Policy's
// defaults overridden by its fields. INVALID_ARGUMENT when it gives a preset together with
// fields. The values themselves are checked at open (Policy::Validate).
absl::StatusOr<RequestedPolicy> ResolvePolicyRequest(const PolicyRequest& request);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_POLICY_POLICY_REQUEST_H_

// Policy: how a sequence turns attention scores into evictions (SPEC.md, "Policy").
//
// A Policy is a plain value: the aggregation rule, the refresh schedule and the
// protections. It is the single place that decides which steps are scoring steps
// (IsScoringStep) and what the named presets expand to (FromPreset). Validation against a
// budget is separate because protections are bounded by it. Thread-compatible.
#ifndef KVCM_CACHE_MANAGER_POLICY_POLICY_H_
#define KVCM_CACHE_MANAGER_POLICY_POLICY_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

enum class Aggregation : uint8_t { kEma, kCumulative, kSingleStep, kRecency, kRandom };
enum class Refresh : uint8_t { kEveryStep, kLazy, kScoreFree };

absl::string_view AggregationName(Aggregation aggregation);
absl::string_view RefreshName(Refresh refresh);
absl::StatusOr<Aggregation> ParseAggregation(absl::string_view name);
absl::StatusOr<Refresh> ParseRefresh(absl::string_view name);

struct Policy {
  Aggregation aggregation = Aggregation::kEma;
  double alpha = 0.8;  // ema only, 0 <= alpha < 1
  Refresh refresh = Refresh::kEveryStep;
  int64_t refresh_interval = 4;  // lazy only, >= 1
  int64_t protect_sinks = 0;     // positions < protect_sinks are never evicted
  int64_t protect_recent = 0;    // the protect_recent newest cached tokens are never evicted
  uint64_t seed = 0;             // random only
  // Span pooling (SPEC.md, "Span pooling"): each score row is max-pooled over a window of
  // this many positions before it becomes momentum. 0 or 1: off; else odd, 3 to 255.
  int64_t span_pool = 0;
  // The preset this policy was expanded from, or empty for a policy given field by field.
  // Informational (metrics, introspection); it never changes behaviour.
  std::string preset;

  // The named presets of SPEC.md, one line each in cache_manager/policy/presets.txt (the
  // list the Python client reads too). h2o protects the budget/2 newest tokens, hence
  // `budget`. PresetNames is in the file's order.
  static absl::StatusOr<Policy> FromPreset(absl::string_view name, int64_t budget);
  static const std::vector<absl::string_view>& PresetNames();

  // OK when every field is in range and protect_sinks + protect_recent <= budget.
  absl::Status Validate(int64_t budget) const;

  // Whether the aggregation reads attention scores at all (recency and random do not).
  bool UsesScores() const;
  // Whether scoring steps max-pool their rows over positions (span_pool > 1).
  bool PoolsSpans() const { return span_pool > 1; }
  // Whether decode step t (t >= 1) is a scoring step: SPEC.md, "A step".
  bool IsScoringStep(int64_t step) const;

  // "ema alpha=0.8 lazy r=4 sinks=0 recent=0" (or the preset name followed by that).
  std::string DebugString() const;
  // The preset name when there is one, else a compact description for labels and tables.
  std::string Label() const;
};

bool operator==(const Policy& a, const Policy& b);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_POLICY_POLICY_H_

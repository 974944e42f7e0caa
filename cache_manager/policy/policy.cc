#include "cache_manager/policy/policy.h"

#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache_manager/base/status_macros.h"
#include "kernels/span_pool.h"

namespace kvcm {
namespace {

struct NamedAggregation {
  absl::string_view name;
  Aggregation value;
};
constexpr NamedAggregation kAggregations[] = {
    {"ema", Aggregation::kEma},         {"cumulative", Aggregation::kCumulative},
    {"single_step", Aggregation::kSingleStep}, {"recency", Aggregation::kRecency},
    {"random", Aggregation::kRandom}};

struct NamedRefresh {
  absl::string_view name;
  Refresh value;
};
constexpr NamedRefresh kRefreshes[] = {{"every_step", Refresh::kEveryStep},
                                       {"lazy", Refresh::kLazy},
                                       {"score_free", Refresh::kScoreFree}};

// One line of cache_manager/policy/presets.txt, the one list of presets (the Python client
// reads the same file). nullopt: the field keeps Policy's default.
struct PresetRow {
  absl::string_view name;
  absl::string_view aggregation;
  std::optional<double> alpha;
  std::optional<absl::string_view> refresh;
  std::optional<int64_t> refresh_interval;
  int64_t protect_recent;          // a count of tokens, when protect_recent_divisor is 0
  int64_t protect_recent_divisor;  // > 0: protect_recent is budget / this (integer division)
  int64_t protect_sinks;
};
constexpr PresetRow kPresetRows[] = {
#include "cache_manager/policy/presets.inc"
};

// The names in a row are checked here, not at build time: ParseAggregation and
// ParseRefresh stay the one place that knows them (policy_test resolves every row).
absl::StatusOr<Policy> ExpandPreset(const PresetRow& row, int64_t budget) {
  Policy p;
  ASSIGN_OR_RETURN(p.aggregation, ParseAggregation(row.aggregation));
  if (row.alpha.has_value()) p.alpha = *row.alpha;
  if (row.refresh.has_value()) {
    ASSIGN_OR_RETURN(p.refresh, ParseRefresh(*row.refresh));
  }
  if (row.refresh_interval.has_value()) p.refresh_interval = *row.refresh_interval;
  p.protect_recent = row.protect_recent_divisor > 0 ? budget / row.protect_recent_divisor
                                                    : row.protect_recent;
  p.protect_sinks = row.protect_sinks;
  p.preset = std::string(row.name);
  return p;
}

// SPEC.md, "Span pooling": 0 or 1 is off; otherwise an odd width in range, and only for
// an aggregation that reads scores (there is nothing else to pool).
absl::Status ValidateSpanPool(const Policy& policy) {
  const int64_t k = policy.span_pool;
  if (k == 0 || k == 1) return absl::OkStatus();
  if (k < kernels::kMinSpanPoolWidth || k > kernels::kMaxSpanPoolWidth || k % 2 == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.span_pool is ", k, "; it must be 0 or 1 (off) or odd, ",
        kernels::kMinSpanPoolWidth, " to ", kernels::kMaxSpanPoolWidth));
  }
  if (!policy.UsesScores()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.span_pool needs an aggregation that reads scores (ema, cumulative or "
        "single_step); ", AggregationName(policy.aggregation), " reads none"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view AggregationName(Aggregation aggregation) {
  for (const auto& a : kAggregations) {
    if (a.value == aggregation) return a.name;
  }
  return "unknown";
}

absl::string_view RefreshName(Refresh refresh) {
  for (const auto& r : kRefreshes) {
    if (r.value == refresh) return r.name;
  }
  return "unknown";
}

absl::StatusOr<Aggregation> ParseAggregation(absl::string_view name) {
  for (const auto& a : kAggregations) {
    if (a.name == name) return a.value;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown aggregation '", name, "' (expected ema, cumulative, single_step, recency or random)"));
}

absl::StatusOr<Refresh> ParseRefresh(absl::string_view name) {
  for (const auto& r : kRefreshes) {
    if (r.name == name) return r.value;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown refresh '", name, "' (expected every_step, lazy or score_free)"));
}

const std::vector<absl::string_view>& Policy::PresetNames() {
  static const auto* names = [] {
    auto* out = new std::vector<absl::string_view>;
    for (const PresetRow& row : kPresetRows) out->push_back(row.name);
    return out;
  }();
  return *names;
}

absl::StatusOr<Policy> Policy::FromPreset(absl::string_view name, int64_t budget) {
  for (const PresetRow& row : kPresetRows) {
    if (row.name == name) return ExpandPreset(row, budget);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown policy preset '", name, "' (expected one of ",
      absl::StrJoin(PresetNames(), ", "), ")"));
}

absl::Status Policy::Validate(int64_t budget) const {
  if (!(alpha >= 0.0 && alpha < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy alpha is ", alpha, "; it must satisfy 0 <= alpha < 1"));
  }
  if (refresh_interval < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy refresh_interval is ", refresh_interval, "; it must be >= 1"));
  }
  if (protect_sinks < 0 || protect_recent < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy protect_sinks (", protect_sinks, ") and protect_recent (", protect_recent,
        ") must be >= 0"));
  }
  if (AggregationName(aggregation) == "unknown" || RefreshName(refresh) == "unknown") {
    return absl::InvalidArgumentError("policy has an unknown aggregation or refresh value");
  }
  RETURN_IF_ERROR(ValidateSpanPool(*this));
  // Both are >= 0 here, so this is protect_sinks + protect_recent > budget without the
  // sum, which a client can make wrap around.
  if (protect_sinks > budget || protect_recent > budget - protect_sinks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy protects ", protect_sinks, " sink + ", protect_recent,
        " recent tokens, more than the budget of ", budget, " tokens"));
  }
  return absl::OkStatus();
}

bool Policy::UsesScores() const {
  return aggregation == Aggregation::kEma || aggregation == Aggregation::kCumulative ||
         aggregation == Aggregation::kSingleStep;
}

bool Policy::IsScoringStep(int64_t step) const {
  if (!UsesScores() || step < 1) return false;
  switch (refresh) {
    case Refresh::kEveryStep:
      return true;
    case Refresh::kLazy:
      return (step - 1) % refresh_interval == 0;
    case Refresh::kScoreFree:
      return step == 1;
  }
  return false;
}

std::string Policy::DebugString() const {
  std::string out = preset.empty() ? "" : absl::StrCat(preset, ": ");
  absl::StrAppend(&out, AggregationName(aggregation));
  if (aggregation == Aggregation::kEma) absl::StrAppend(&out, " alpha=", alpha);
  if (UsesScores()) {
    absl::StrAppend(&out, " ", RefreshName(refresh));
    if (refresh == Refresh::kLazy) absl::StrAppend(&out, " r=", refresh_interval);
  }
  if (protect_sinks > 0) absl::StrAppend(&out, " sinks=", protect_sinks);
  if (protect_recent > 0) absl::StrAppend(&out, " recent=", protect_recent);
  if (aggregation == Aggregation::kRandom) absl::StrAppend(&out, " seed=", seed);
  if (PoolsSpans()) absl::StrAppend(&out, " span_pool=", span_pool);
  return out;
}

std::string Policy::Label() const {
  if (!preset.empty()) return preset;
  std::string out(AggregationName(aggregation));
  if (UsesScores() && refresh != Refresh::kEveryStep) {
    absl::StrAppend(&out, "_", RefreshName(refresh));
    if (refresh == Refresh::kLazy) absl::StrAppend(&out, refresh_interval);
  }
  return out;
}

bool operator==(const Policy& a, const Policy& b) {
  return a.aggregation == b.aggregation && a.alpha == b.alpha && a.refresh == b.refresh &&
         a.refresh_interval == b.refresh_interval && a.protect_sinks == b.protect_sinks &&
         a.protect_recent == b.protect_recent && a.seed == b.seed &&
         a.span_pool == b.span_pool;
}

}  // namespace kvcm

#include "cache_manager/policy.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
  static const auto* names = new std::vector<absl::string_view>{
      "inertia", "inertia_lazy4", "score_free", "tova", "h2o", "streaming_llm", "random"};
  return *names;
}

absl::StatusOr<Policy> Policy::FromPreset(absl::string_view name, int64_t budget) {
  Policy p;
  if (name == "inertia") {
    p.aggregation = Aggregation::kEma;
    p.alpha = 0.8;
    p.refresh = Refresh::kEveryStep;
  } else if (name == "inertia_lazy4") {
    p.aggregation = Aggregation::kEma;
    p.alpha = 0.8;
    p.refresh = Refresh::kLazy;
    p.refresh_interval = 4;
  } else if (name == "score_free") {
    p.aggregation = Aggregation::kEma;
    p.alpha = 0.8;
    p.refresh = Refresh::kScoreFree;
  } else if (name == "tova") {
    p.aggregation = Aggregation::kSingleStep;
    p.refresh = Refresh::kEveryStep;
  } else if (name == "h2o") {
    p.aggregation = Aggregation::kCumulative;
    p.refresh = Refresh::kEveryStep;
    p.protect_recent = budget / 2;
  } else if (name == "streaming_llm") {
    p.aggregation = Aggregation::kRecency;
    p.protect_sinks = 4;
  } else if (name == "random") {
    p.aggregation = Aggregation::kRandom;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown policy preset '", name, "' (expected one of ",
        absl::StrJoin(PresetNames(), ", "), ")"));
  }
  p.preset = std::string(name);
  return p;
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
         a.protect_recent == b.protect_recent && a.seed == b.seed;
}

}  // namespace kvcm

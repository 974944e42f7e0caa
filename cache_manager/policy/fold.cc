#include "cache_manager/policy/fold.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "kernels/momentum_update.h"

namespace kvcm {
namespace {

struct NamedLayout {
  absl::string_view name;
  ScoreLayout value;
};
constexpr NamedLayout kLayouts[] = {{"per_layer", ScoreLayout::kPerLayer},
                                    {"folded", ScoreLayout::kFolded}};

constexpr int64_t kBlock = 1024;  // tokens folded at a time (8 KiB of double sums)

// acc[0, n) = the fold of tokens [base, base + n) of `rows`.
void FoldBlock(const kernels::ScoreMatrix& rows, const FoldWeights& weights, int64_t base,
               int64_t n, double* acc) {
  alignas(64) float widened[kBlock];
  std::fill_n(acc, n, 0.0);
  const size_t element = kernels::ScoreDtypeSize(rows.dtype);
  for (int64_t layer = 0; layer < rows.layers; ++layer) {
    const void* src =
        static_cast<const char*>(rows.Row(layer)) + static_cast<size_t>(base) * element;
    const float* row = static_cast<const float*>(src);
    if (rows.dtype != kernels::ScoreDtype::kFloat32) {
      kernels::cpu::ConvertToFloat32(src, rows.dtype, n, widened, nullptr);
      row = widened;
    }
    const double w = weights.layer_weights[static_cast<size_t>(layer)];
    for (int64_t i = 0; i < n; ++i) acc[i] += w * static_cast<double>(row[i]);
  }
}

}  // namespace

absl::string_view ScoreLayoutName(ScoreLayout layout) {
  for (const auto& l : kLayouts) {
    if (l.value == layout) return l.name;
  }
  return "unknown";
}

absl::StatusOr<ScoreLayout> ParseScoreLayout(absl::string_view name) {
  for (const auto& l : kLayouts) {
    if (l.name == name) return l.value;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown score layout '", name, "' (expected per_layer or folded)"));
}

absl::StatusOr<FoldWeights> FoldWeightsFor(const Policy& policy, int64_t layers) {
  if (layers < 1 || layers > kMaxFoldLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a folded sequence folds 1 to ", kMaxFoldLayers, " layers; layers is ", layers));
  }
  FoldWeights w;
  const auto k = static_cast<size_t>(layers);
  switch (policy.aggregation) {
    case Aggregation::kEma:
      w.layer_weights.resize(k);
      for (size_t l = 0; l < k; ++l) {
        w.layer_weights[l] =
            (1.0 - policy.alpha) * std::pow(policy.alpha, static_cast<double>(k - 1 - l));
      }
      w.decay = std::pow(policy.alpha, static_cast<double>(layers));
      break;
    case Aggregation::kCumulative:
      w.layer_weights.assign(k, 1.0);
      w.decay = 1.0;
      break;
    case Aggregation::kSingleStep:
      w.layer_weights.assign(k, 1.0 / static_cast<double>(layers));
      w.decay = 0.0;
      break;
    case Aggregation::kRecency:
    case Aggregation::kRandom:
      w.decay = 1.0;
      break;
  }
  return w;
}

void FoldRows(const kernels::ScoreMatrix& rows, const FoldWeights& weights, double* out) {
  KVCM_CHECK(rows.layers >= 1 &&
             static_cast<size_t>(rows.layers) == weights.layer_weights.size());
  for (int64_t base = 0; base < rows.tokens; base += kBlock) {
    FoldBlock(rows, weights, base, std::min(kBlock, rows.tokens - base), out + base);
  }
}

void FoldRows(const kernels::ScoreMatrix& rows, const FoldWeights& weights, float* out) {
  KVCM_CHECK(rows.layers >= 1 &&
             static_cast<size_t>(rows.layers) == weights.layer_weights.size());
  alignas(64) double acc[kBlock];
  for (int64_t base = 0; base < rows.tokens; base += kBlock) {
    const int64_t n = std::min(kBlock, rows.tokens - base);
    FoldBlock(rows, weights, base, n, acc);
    for (int64_t i = 0; i < n; ++i) out[base + i] = static_cast<float>(acc[i]);
  }
}

}  // namespace kvcm

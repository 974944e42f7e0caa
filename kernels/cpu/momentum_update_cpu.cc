// CPU reference of kernels/momentum_update.h. The loops are written to auto-vectorize:
// tokens are processed in L1-sized blocks, each block folding every layer before it is
// written back, so the running momentum stays in cache while the scores stream past once.
#include <algorithm>
#include <cfloat>
#include <cstring>

#include "kernels/half_float.h"
#include "kernels/momentum_update.h"

namespace kvcm::kernels::cpu {
namespace {

constexpr int64_t kBlock = 1024;  // 4 KiB of float32 momentum: stays in L1 across layers

template <ScoreDtype D>
struct Loader;
template <>
struct Loader<ScoreDtype::kFloat32> {
  using T = float;
  static float Load(T v) { return v; }
};
template <>
struct Loader<ScoreDtype::kFloat16> {
  using T = uint16_t;
  static float Load(T v) { return Float16ToFloat(v); }
};
template <>
struct Loader<ScoreDtype::kBFloat16> {
  using T = uint16_t;
  static float Load(T v) { return BFloat16ToFloat(v); }
};

// 1 when a score is negative, NaN or infinite; branch-free so the loop vectorizes.
inline int32_t IsInvalid(float v) {
  return static_cast<int32_t>(!((v >= 0.0f) & (v <= FLT_MAX)));
}

template <ScoreDtype D, ScoreAggregation A>
void UpdateTyped(const float* momentum_in, float* momentum_out, int64_t tokens,
                 const ScoreMatrix& scores, double alpha, int64_t* invalid_count) {
  using T = typename Loader<D>::T;
  const float keep = static_cast<float>(alpha);
  const float take = static_cast<float>(1.0 - alpha);
  const float layers = static_cast<float>(scores.layers);
  int64_t invalid = 0;
  alignas(64) float acc[kBlock];
  for (int64_t base = 0; base < tokens; base += kBlock) {
    const int64_t n = std::min(kBlock, tokens - base);
    if constexpr (A == ScoreAggregation::kSingleStep) {
      std::fill_n(acc, n, 0.0f);
    } else {
      std::memcpy(acc, momentum_in + base, static_cast<size_t>(n) * sizeof(float));
    }
    for (int64_t layer = 0; layer < scores.layers; ++layer) {
      const T* row = static_cast<const T*>(scores.Row(layer)) + base;
      int32_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float s = Loader<D>::Load(row[i]);
        bad += IsInvalid(s);
        if constexpr (A == ScoreAggregation::kEma) {
          acc[i] = keep * acc[i] + take * s;
        } else {
          acc[i] = acc[i] + s;
        }
      }
      invalid += bad;
    }
    if constexpr (A == ScoreAggregation::kSingleStep) {
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] / layers;
    }
    std::memcpy(momentum_out + base, acc, static_cast<size_t>(n) * sizeof(float));
  }
  *invalid_count = invalid;
}

template <ScoreDtype D>
void UpdateForDtype(const float* in, float* out, int64_t tokens, const ScoreMatrix& scores,
                    const MomentumUpdateOptions& options, int64_t* invalid_count) {
  switch (options.aggregation) {
    case ScoreAggregation::kEma:
      return UpdateTyped<D, ScoreAggregation::kEma>(in, out, tokens, scores, options.alpha,
                                                    invalid_count);
    case ScoreAggregation::kCumulative:
      return UpdateTyped<D, ScoreAggregation::kCumulative>(in, out, tokens, scores,
                                                           options.alpha, invalid_count);
    case ScoreAggregation::kSingleStep:
      return UpdateTyped<D, ScoreAggregation::kSingleStep>(in, out, tokens, scores,
                                                           options.alpha, invalid_count);
  }
}

template <ScoreDtype D>
void AccumulateRow(const void* row, int64_t n, double* acc) {
  const auto* typed = static_cast<const typename Loader<D>::T*>(row);
  for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<double>(Loader<D>::Load(typed[i]));
}

}  // namespace

void UpdateMomentum(const float* momentum_in, float* momentum_out, int64_t tokens,
                    ScoreMatrix scores, MomentumUpdateOptions options,
                    int64_t* invalid_count, StreamHandle /*stream*/) {
  switch (scores.dtype) {
    case ScoreDtype::kFloat32:
      return UpdateForDtype<ScoreDtype::kFloat32>(momentum_in, momentum_out, tokens, scores,
                                                  options, invalid_count);
    case ScoreDtype::kFloat16:
      return UpdateForDtype<ScoreDtype::kFloat16>(momentum_in, momentum_out, tokens, scores,
                                                  options, invalid_count);
    case ScoreDtype::kBFloat16:
      return UpdateForDtype<ScoreDtype::kBFloat16>(momentum_in, momentum_out, tokens, scores,
                                                   options, invalid_count);
  }
}

void MeanMomentum(const float* momentum, int64_t n, double* mean, StreamHandle /*stream*/) {
  if (n <= 0) {
    *mean = 0.0;
    return;
  }
  // Four independent accumulators: a fixed summation order (so results are reproducible)
  // without one long dependency chain through a single register.
  double lanes[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int lane = 0; lane < 4; ++lane) lanes[lane] += static_cast<double>(momentum[i + lane]);
  }
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) sum += static_cast<double>(momentum[i]);
  *mean = sum / static_cast<double>(n);
}

void ConvertToFloat32(const void* src, ScoreDtype dtype, int64_t n, float* dst,
                      StreamHandle /*stream*/) {
  switch (dtype) {
    case ScoreDtype::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case ScoreDtype::kFloat16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Float16ToFloat(h[i]);
      return;
    }
    case ScoreDtype::kBFloat16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(h[i]);
      return;
    }
  }
}

void JoinRankPartials(const ScoreMatrix* partials, int64_t ranks, int64_t total_heads,
                      float* out, StreamHandle /*stream*/) {
  if (ranks <= 0) return;
  const int64_t layers = partials[0].layers;
  const int64_t tokens = partials[0].tokens;
  const double heads = static_cast<double>(total_heads);
  alignas(64) double acc[kBlock];
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t base = 0; base < tokens; base += kBlock) {
      const int64_t n = std::min(kBlock, tokens - base);
      std::fill_n(acc, n, 0.0);
      for (int64_t r = 0; r < ranks; ++r) {
        const ScoreMatrix& p = partials[r];
        const char* row = static_cast<const char*>(p.Row(layer)) +
                          static_cast<size_t>(base) * ScoreDtypeSize(p.dtype);
        switch (p.dtype) {
          case ScoreDtype::kFloat32:
            AccumulateRow<ScoreDtype::kFloat32>(row, n, acc);
            break;
          case ScoreDtype::kFloat16:
            AccumulateRow<ScoreDtype::kFloat16>(row, n, acc);
            break;
          case ScoreDtype::kBFloat16:
            AccumulateRow<ScoreDtype::kBFloat16>(row, n, acc);
            break;
        }
      }
      float* dst = out + layer * tokens + base;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(acc[i] / heads);
    }
  }
}

}  // namespace kvcm::kernels::cpu

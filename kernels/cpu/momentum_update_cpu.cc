// CPU reference of kernels/momentum_update.h. The per-step loops live in
// kernels/cpu/hot_loops_impl.h (compiled per instruction set); the rest is here.
#include <algorithm>
#include <cfloat>
#include <cstring>

#include "kernels/cpu/hot_loops.h"
#include "kernels/cpu/score_loader.h"
#include "kernels/half_float.h"
#include "kernels/momentum_update.h"
#include "kernels/score_validation.h"

namespace kvcm::kernels::cpu {
namespace {

constexpr int64_t kBlock = 1024;  // 4 KiB of float32 momentum: stays in L1 across layers

template <ScoreDtype D>
using Loader = ScoreLoader<D>;

template <ScoreDtype D>
void AccumulateRow(const void* row, int64_t n, double* acc) {
  const auto* typed = static_cast<const typename Loader<D>::T*>(row);
  for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<double>(Loader<D>::Load(typed[i]));
}

}  // namespace

void UpdateMomentum(const float* momentum_in, float* momentum_out, int64_t tokens,
                    ScoreMatrix scores, MomentumUpdateOptions options,
                    int64_t* invalid_count, StreamHandle /*stream*/) {
  const double keep =
      options.aggregation == ScoreAggregation::kFolded ? options.decay : options.alpha;
  const uint32_t screen = SelectedHotLoops().update_momentum(
      momentum_in, momentum_out, tokens, scores, options.aggregation, keep);
  *invalid_count = 0;
  // The screen trips on negative, infinite and NaN scores, and on -0.0, which the exact
  // count accepts. Only then is the block read a second time.
  if (screen > kLargestFiniteBits) CountInvalidScores(scores, invalid_count, nullptr);
}

void MeanMomentum(const float* momentum, int64_t n, double* mean, StreamHandle /*stream*/) {
  // The exact, order-independent sum of kernels/exact_sum.h, which the CUDA kernel
  // computes too: the GPU's mean is this one bit for bit.
  *mean = n <= 0 ? 0.0 : SelectedHotLoops().exact_sum(momentum, n) / static_cast<double>(n);
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

void WidenPartialSums(ScoreMatrix partial, double* wide, StreamHandle /*stream*/) {
  for (int64_t layer = 0; layer < partial.layers; ++layer) {
    double* dst = wide + layer * partial.tokens;
    const void* row = partial.Row(layer);
    switch (partial.dtype) {
      case ScoreDtype::kFloat32: {
        const auto* f = static_cast<const float*>(row);
        for (int64_t i = 0; i < partial.tokens; ++i) dst[i] = static_cast<double>(f[i]);
        break;
      }
      case ScoreDtype::kFloat16: {
        const auto* h = static_cast<const uint16_t*>(row);
        for (int64_t i = 0; i < partial.tokens; ++i) dst[i] = static_cast<double>(Float16ToFloat(h[i]));
        break;
      }
      case ScoreDtype::kBFloat16: {
        const auto* h = static_cast<const uint16_t*>(row);
        for (int64_t i = 0; i < partial.tokens; ++i) dst[i] = static_cast<double>(BFloat16ToFloat(h[i]));
        break;
      }
    }
  }
}

void ScaleJoinedSums(const double* sums, int64_t n, int64_t total_heads, float* out,
                     StreamHandle /*stream*/) {
  const double heads = static_cast<double>(total_heads);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(sums[i] / heads);
}

}  // namespace kvcm::kernels::cpu

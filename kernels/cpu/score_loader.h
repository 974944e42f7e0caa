// ScoreLoader<D>: reads one score of dtype D as float32, for the CPU kernels that template
// their loops on the dtype (momentum update, span pooling).
#ifndef KVCM_KERNELS_CPU_SCORE_LOADER_H_
#define KVCM_KERNELS_CPU_SCORE_LOADER_H_

#include <cstdint>

#include "kernels/half_float.h"
#include "kernels/score_matrix.h"

namespace kvcm::kernels::cpu {

template <ScoreDtype D>
struct ScoreLoader;
template <>
struct ScoreLoader<ScoreDtype::kFloat32> {
  using T = float;
  static float Load(T v) { return v; }
};
template <>
struct ScoreLoader<ScoreDtype::kFloat16> {
  using T = uint16_t;
  static float Load(T v) { return Float16ToFloat(v); }
};
template <>
struct ScoreLoader<ScoreDtype::kBFloat16> {
  using T = uint16_t;
  static float Load(T v) { return BFloat16ToFloat(v); }
};

}  // namespace kvcm::kernels::cpu

#endif  // KVCM_KERNELS_CPU_SCORE_LOADER_H_

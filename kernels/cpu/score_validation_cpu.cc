#include <cfloat>

#include "kernels/half_float.h"
#include "kernels/score_validation.h"

namespace kvcm::kernels {
namespace {

inline bool Valid(float v) { return v >= 0.0f && v <= FLT_MAX; }

template <typename T, float (*Load)(T)>
int64_t CountRow(const T* row, int64_t n) {
  int32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Load(row[i]);
    bad += static_cast<int32_t>(!((v >= 0.0f) & (v <= FLT_MAX)));
  }
  return bad;
}

float Identity(float v) { return v; }

}  // namespace

float ScoreAt(const ScoreMatrix& scores, int64_t layer, int64_t index) {
  const void* row = scores.Row(layer);
  switch (scores.dtype) {
    case ScoreDtype::kFloat32:
      return static_cast<const float*>(row)[index];
    case ScoreDtype::kFloat16:
      return Float16ToFloat(static_cast<const uint16_t*>(row)[index]);
    case ScoreDtype::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(row)[index]);
  }
  return 0.0f;
}

InvalidScore FindFirstInvalidScore(const ScoreMatrix& scores) {
  for (int64_t layer = 0; layer < scores.layers; ++layer) {
    for (int64_t i = 0; i < scores.tokens; ++i) {
      const float v = ScoreAt(scores, layer, i);
      if (!Valid(v)) return InvalidScore{layer, i, v};
    }
  }
  return InvalidScore{};
}

namespace cpu {

void CountInvalidScores(ScoreMatrix scores, int64_t* invalid_count, StreamHandle /*stream*/) {
  int64_t bad = 0;
  for (int64_t layer = 0; layer < scores.layers; ++layer) {
    const void* row = scores.Row(layer);
    switch (scores.dtype) {
      case ScoreDtype::kFloat32:
        bad += CountRow<float, Identity>(static_cast<const float*>(row), scores.tokens);
        break;
      case ScoreDtype::kFloat16:
        bad += CountRow<uint16_t, Float16ToFloat>(static_cast<const uint16_t*>(row),
                                                  scores.tokens);
        break;
      case ScoreDtype::kBFloat16:
        bad += CountRow<uint16_t, BFloat16ToFloat>(static_cast<const uint16_t*>(row),
                                                   scores.tokens);
        break;
    }
  }
  *invalid_count = bad;
}

}  // namespace cpu
}  // namespace kvcm::kernels

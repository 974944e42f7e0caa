#include "kernels/score_matrix.h"

namespace kvcm::kernels {

const char* ScoreDtypeName(ScoreDtype dtype) {
  switch (dtype) {
    case ScoreDtype::kFloat32:
      return "float32";
    case ScoreDtype::kFloat16:
      return "float16";
    case ScoreDtype::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

std::optional<ScoreDtype> ParseScoreDtype(std::string_view name) {
  for (ScoreDtype dtype : {ScoreDtype::kFloat32, ScoreDtype::kFloat16, ScoreDtype::kBFloat16}) {
    if (name == ScoreDtypeName(dtype)) return dtype;
  }
  return std::nullopt;
}

}  // namespace kvcm::kernels

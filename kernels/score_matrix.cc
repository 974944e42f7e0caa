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

}  // namespace kvcm::kernels

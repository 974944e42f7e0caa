// The one mapping between the engine's score dtypes and the wire's (kvcache.v1.ScoreDtype),
// shared by the daemon's translation and the C++ client. Header-only. Its own folder
// because proto/ is the API and depends on nothing of ours (scripts/check_layers.py).
#ifndef KVCM_WIRE_WIRE_DTYPE_H_
#define KVCM_WIRE_WIRE_DTYPE_H_

#include <optional>

#include "kernels/score_matrix.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcm::wire {

inline ::kvcache::v1::ScoreDtype ToProto(kernels::ScoreDtype dtype) {
  switch (dtype) {
    case kernels::ScoreDtype::kFloat32:
      return ::kvcache::v1::SCORE_DTYPE_FLOAT32;
    case kernels::ScoreDtype::kFloat16:
      return ::kvcache::v1::SCORE_DTYPE_FLOAT16;
    case kernels::ScoreDtype::kBFloat16:
      return ::kvcache::v1::SCORE_DTYPE_BFLOAT16;
  }
  return ::kvcache::v1::SCORE_DTYPE_UNSPECIFIED;
}

// nullopt for UNSPECIFIED and for numbers this build does not know.
inline std::optional<kernels::ScoreDtype> FromProto(::kvcache::v1::ScoreDtype dtype) {
  switch (dtype) {
    case ::kvcache::v1::SCORE_DTYPE_FLOAT32:
      return kernels::ScoreDtype::kFloat32;
    case ::kvcache::v1::SCORE_DTYPE_FLOAT16:
      return kernels::ScoreDtype::kFloat16;
    case ::kvcache::v1::SCORE_DTYPE_BFLOAT16:
      return kernels::ScoreDtype::kBFloat16;
    default:
      return std::nullopt;
  }
}

}  // namespace kvcm::wire

#endif  // KVCM_WIRE_WIRE_DTYPE_H_

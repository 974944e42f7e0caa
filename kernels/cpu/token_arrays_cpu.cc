// CPU reference of kernels/token_arrays.h.
#include "kernels/token_arrays.h"

namespace kvcm::kernels::cpu {

void AppendEntry(float* momentum, int64_t* positions, int64_t index, int64_t position,
                 float value, const double* mean, StreamHandle /*stream*/) {
  momentum[index] = mean != nullptr ? static_cast<float>(*mean) : value;
  positions[index] = position;
}

void GatherPositions(const int64_t* positions, const int64_t* indices, int64_t k,
                     int64_t* out, StreamHandle /*stream*/) {
  for (int64_t j = 0; j < k; ++j) out[j] = positions[indices[j]];
}

}  // namespace kvcm::kernels::cpu

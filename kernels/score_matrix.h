// Score matrices: the layer-major blocks of attention scores the kernels read.
//
// A ScoreMatrix is a non-owning view of [layers, tokens] scores in one of the wire dtypes
// (float32, float16, bfloat16), rows `layer_stride` elements apart. It carries no memory
// space: each kernel states whether it expects host or device memory. Plain value type,
// safe to copy and share between threads (the pointed-to data must outlive its use).
#ifndef KVCM_KERNELS_SCORE_MATRIX_H_
#define KVCM_KERNELS_SCORE_MATRIX_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kvcm::kernels {

enum class ScoreDtype : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr size_t ScoreDtypeSize(ScoreDtype dtype) {
  return dtype == ScoreDtype::kFloat32 ? 4 : 2;
}

// "float32", "float16", "bfloat16", and back (nullopt for any other name).
const char* ScoreDtypeName(ScoreDtype dtype);
std::optional<ScoreDtype> ParseScoreDtype(std::string_view name);

// A cudaStream_t on the CUDA backend; the CPU reference takes it for signature parity
// and requires nullptr.
using StreamHandle = void*;

struct ScoreMatrix {
  const void* data = nullptr;  // [layers, layer_stride] of `dtype`
  ScoreDtype dtype = ScoreDtype::kFloat32;
  int64_t layers = 0;
  int64_t tokens = 0;        // scores per layer
  int64_t layer_stride = 0;  // elements between the starts of two layers, >= tokens

  static ScoreMatrix Dense(const void* data, ScoreDtype dtype, int64_t layers, int64_t tokens) {
    return ScoreMatrix{data, dtype, layers, tokens, tokens};
  }
  const void* Row(int64_t layer) const {
    return static_cast<const char*>(data) +
           static_cast<size_t>(layer * layer_stride) * ScoreDtypeSize(dtype);
  }
};

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_SCORE_MATRIX_H_

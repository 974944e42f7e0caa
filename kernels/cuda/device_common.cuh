// Device-side helpers shared by the CUDA kernels (included by .cu files only): reading one
// score of a ScoreMatrix as float32 (exact for every dtype, like kernels/half_float.h on
// the host), the validity rule of SPEC.md, counting into a device counter, and the launch
// geometry of element-wise kernels.
#ifndef KVCM_KERNELS_CUDA_DEVICE_COMMON_CUH_
#define KVCM_KERNELS_CUDA_DEVICE_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include <cfloat>
#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda::detail {

constexpr int kThreads = 256;  // block size of the element-wise kernels

// Blocks for `n` elements, one element per thread, at least 1. Kernels loop grid-stride, so
// capping the grid only trades occupancy for loop trips.
inline unsigned int BlocksFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > (1 << 20) ? (1 << 20) : blocks));
}

inline cudaStream_t AsStream(StreamHandle stream) { return static_cast<cudaStream_t>(stream); }

template <ScoreDtype D>
struct ScoreLoader;
template <>
struct ScoreLoader<ScoreDtype::kFloat32> {
  using T = float;
  __device__ static float Load(T v) { return v; }
};
template <>
struct ScoreLoader<ScoreDtype::kFloat16> {
  using T = uint16_t;
  __device__ static float Load(T v) { return __half2float(__ushort_as_half(v)); }
};
template <>
struct ScoreLoader<ScoreDtype::kBFloat16> {
  using T = uint16_t;
  __device__ static float Load(T v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
};

// Element `index` of row `layer`, as float32.
template <ScoreDtype D>
__device__ inline float LoadScore(const ScoreMatrix& m, int64_t layer, int64_t index) {
  using T = typename ScoreLoader<D>::T;
  return ScoreLoader<D>::Load(static_cast<const T*>(m.data)[layer * m.layer_stride + index]);
}

// SPEC.md: a score is valid when finite and >= 0 (NaN fails both comparisons).
__device__ inline bool IsInvalidScore(float v) { return !((v >= 0.0f) && (v <= FLT_MAX)); }

// Runtime-dtype version of LoadScore, for kernels whose inputs mix dtypes (the join).
__device__ inline float LoadScoreAny(const ScoreMatrix& m, int64_t layer, int64_t index) {
  switch (m.dtype) {
    case ScoreDtype::kFloat16:
      return LoadScore<ScoreDtype::kFloat16>(m, layer, index);
    case ScoreDtype::kBFloat16:
      return LoadScore<ScoreDtype::kBFloat16>(m, layer, index);
    default:
      return LoadScore<ScoreDtype::kFloat32>(m, layer, index);
  }
}

// Adds every thread's `count` to `*total` (zeroed by the launcher beforehand): one block
// reduction and at most one atomic per block. REQUIRES: blockDim.x == kThreads, called by
// every thread of the block.
__device__ inline void AddBlockCount(int64_t count, int64_t* total) {
  using Reduce = cub::BlockReduce<long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const long long sum = Reduce(storage).Sum(static_cast<long long>(count));
  if (threadIdx.x == 0 && sum != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(total), static_cast<unsigned long long>(sum));
  }
}

// Instantiates `Launch<D>` for the runtime dtype: Launch is a functor template.
template <template <ScoreDtype> class Launch, typename... Args>
void DispatchDtype(ScoreDtype dtype, Args&&... args) {
  switch (dtype) {
    case ScoreDtype::kFloat32:
      return Launch<ScoreDtype::kFloat32>{}(args...);
    case ScoreDtype::kFloat16:
      return Launch<ScoreDtype::kFloat16>{}(args...);
    case ScoreDtype::kBFloat16:
      return Launch<ScoreDtype::kBFloat16>{}(args...);
  }
}

}  // namespace kvcm::kernels::cuda::detail

#endif  // KVCM_KERNELS_CUDA_DEVICE_COMMON_CUH_

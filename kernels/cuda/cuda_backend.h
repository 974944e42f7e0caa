// The CUDA backend table (kernels/backend.h): the CUDA kernels of kernels/cuda/ with the
// CPU reference's signatures (checked at compile time in cuda_backend.cc), and the CUDA
// runtime behind the memory operations: stream-ordered allocation (cudaMallocAsync) from
// the current device's memory pool, pinned staging from a cache of blocks, cudaMemcpyAsync,
// and a non-blocking stream per device for each lane (kernels/stream_lanes.h), so each
// engine thread has its own. Thread-safe.
#ifndef KVCM_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVCM_KERNELS_CUDA_CUDA_BACKEND_H_

#include "kernels/backend.h"

namespace kvcm::kernels::cuda {

const KernelBackend& CudaBackend();

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_CUDA_BACKEND_H_

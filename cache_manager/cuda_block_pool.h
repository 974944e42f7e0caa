// The CUDA backend of BlockPool (built with the CUDA backend only, library
// kvcm::cache_manager_cuda): a rank's blocks live in one cudaMalloc allocation on its
// device, exported to the worker process by a CUDA IPC handle
// (pool->memory_export().cuda_ipc_handle: the 64 bytes of a cudaIpcMemHandle_t, to open
// with cudaIpcOpenMemHandle). Compaction runs kernels::cuda::CompactKv on a stream of the
// pool's own and waits for it. Thread-safe, like every KvStorage.
#ifndef KVCM_CACHE_MANAGER_CUDA_BLOCK_POOL_H_
#define KVCM_CACHE_MANAGER_CUDA_BLOCK_POOL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "cache_manager/block_pool.h"
#include "cache_manager/kv_storage.h"

namespace kvcm {

// `bytes` (> 0) of device memory on `device`, zero-filled. Errors: INVALID_ARGUMENT (size,
// a device that does not exist), INTERNAL (CUDA, with the runtime's message).
absl::StatusOr<std::unique_ptr<KvStorage>> NewCudaKvStorage(int64_t bytes, int device);

// A BlockPool in device memory on `device` (BlockPool::Create with NewCudaKvStorage).
absl::StatusOr<std::unique_ptr<BlockPool>> CreateCudaBlockPool(const BlockPoolOptions& options,
                                                               int device);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_CUDA_BLOCK_POOL_H_

// The CUDA backend of BlockPool (built with the CUDA backend only, library
// kvcm::cache_manager_cuda): a rank's blocks live in one cudaMalloc allocation on its
// device, zero-filled before the pool is handed out. Compaction runs
// kernels::cuda::CompactKv on a stream of the storage's own and waits for it; every
// operation of the storage (the fill included) runs on that stream, so they are ordered.
//
// Exporting the memory to a worker process is optional (CudaStorageOptions::export_ipc),
// and where the GPU cannot export (exclusive-process compute mode, no CUDA IPC on the
// platform) the storage is made without it, memory_export().unavailable saying why
// (ipc_availability.h):
// with it, pool->memory_export() is kCudaIpc with the 64 bytes of a cudaIpcMemHandle_t
// (to open with cudaIpcOpenMemHandle) and this process's device ordinal, and
// CudaIpcExportOf(pool->storage()) adds what a worker needs to find the same GPU in its
// own numbering: the device UUID and PCI bus id (ordinals differ between processes under
// CUDA_VISIBLE_DEVICES). Without it the export is kNone. Thread-safe, like every
// KvStorage.
#ifndef KVCM_CACHE_MANAGER_KV_CUDA_BLOCK_POOL_H_
#define KVCM_CACHE_MANAGER_KV_CUDA_BLOCK_POOL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cache_manager/kv/block_pool.h"
#include "cache_manager/kv/ipc_availability.h"
#include "cache_manager/kv/kv_storage.h"

namespace kvcm {

struct CudaStorageOptions {
  // Export the allocation by CUDA IPC handle. Off: only this process reaches it.
  bool export_ipc = true;
};

// Which GPU a device ordinal names, in terms that do not depend on the process.
struct CudaDeviceIdentity {
  std::string uuid;        // "GPU-8c1b2f1e-...": what nvidia-smi -L and CUDA_VISIBLE_DEVICES use
  std::string pci_bus_id;  // "0000:18:00.0" (cudaDeviceGetPCIBusId)
};

// Errors: INVALID_ARGUMENT (no such device), INTERNAL (CUDA).
absl::StatusOr<CudaDeviceIdentity> DescribeCudaDevice(int device);

// The device's compute mode (cudaDevAttrComputeMode). INTERNAL (CUDA).
absl::StatusOr<GpuComputeMode> ComputeModeOf(int device);

// Everything a worker needs to map an exported CUDA storage.
struct CudaIpcExport {
  std::string handle;  // the 64 bytes of a cudaIpcMemHandle_t
  int32_t device = -1;  // the ordinal in the exporting process
  CudaDeviceIdentity identity;
  int64_t bytes = 0;
};

// The IPC export of a storage made by NewCudaKvStorage. FAILED_PRECONDITION when it was
// made without export_ipc, INVALID_ARGUMENT when it is not CUDA storage.
absl::StatusOr<CudaIpcExport> CudaIpcExportOf(const KvStorage& storage);

// `bytes` (> 0) of device memory on `device`, zero-filled (the fill has completed when
// this returns). With export_ipc the allocation, bytes() and the export's size are
// `bytes` rounded up to whole IPC units (CudaIpcAllocationBytes, ipc_export_size.h): an
// exported allocation never shares the allocator's block with other memory. Errors:
// INVALID_ARGUMENT (size, a device that does not exist), INTERNAL (CUDA, with the
// runtime's message; also when the device count cannot be read).
absl::StatusOr<std::unique_ptr<KvStorage>> NewCudaKvStorage(int64_t bytes, int device,
                                                            const CudaStorageOptions& options = {});

// A BlockPool in device memory on `device` (BlockPool::Create with NewCudaKvStorage).
// Exported (the default), its blocks fit within the whole IPC units of
// options.memory_bytes (CudaIpcUsableCap), since the allocation is rounded up to them;
// INVALID_ARGUMENT when those hold no block.
absl::StatusOr<std::unique_ptr<BlockPool>> CreateCudaBlockPool(
    const BlockPoolOptions& options, int device, const CudaStorageOptions& storage = {});

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_CUDA_BLOCK_POOL_H_

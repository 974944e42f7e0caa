#include "cache_manager/kv/cuda_block_pool.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/kv/ipc_availability.h"
#include "cache_manager/kv/ipc_export_size.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/kv_compaction_cuda.h"

namespace kvcm {
namespace {

using kernels::cuda::CudaStatus;
using kernels::cuda::ScopedDevice;

// Frees what MakeCudaKvStorage's cudaMalloc made (it synchronizes the device: outside
// any NCCL group). nullptr is ignored.
void FreeExportable(void* data) {
  if (data == nullptr) return;
  std::lock_guard<std::mutex> no_group(kernels::cuda::SynchronizingCallMutex());
  cudaFree(data);
}

class CudaKvStorage final : public KvStorage {
 public:
  // Takes ownership of `data` and `stream`, both of `device`.
  CudaKvStorage(int device, void* data, int64_t bytes, cudaStream_t stream,
                MemoryExport exported, CudaDeviceIdentity identity)
      : device_(device), data_(data), bytes_(bytes), stream_(stream),
        export_(std::move(exported)), identity_(std::move(identity)) {}

  ~CudaKvStorage() override {
    ScopedDevice on_device(device_);
    cudaStreamDestroy(stream_);
    FreeExportable(data_);
  }

  MemorySpace space() const override { return MemorySpace::kDevice; }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  const MemoryExport& memory_export() const override { return export_; }
  const CudaDeviceIdentity& identity() const { return identity_; }

  absl::Status CopyOut(int64_t offset, void* dst, int64_t bytes) const override {
    ScopedDevice on_device(device_);
    RETURN_IF_ERROR(on_device.status());
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, static_cast<const char*>(data_) + offset,
                                               static_cast<size_t>(bytes),
                                               cudaMemcpyDeviceToHost, stream_),
                               "copying KV blocks out of the pool"));
    return kernels::cuda::SyncStatus(stream_, "KV copy out");
  }
  absl::Status CopyIn(int64_t offset, const void* src, int64_t bytes) override {
    ScopedDevice on_device(device_);
    RETURN_IF_ERROR(on_device.status());
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(static_cast<char*>(data_) + offset, src,
                                               static_cast<size_t>(bytes),
                                               cudaMemcpyHostToDevice, stream_),
                               "copying KV blocks into the pool"));
    return kernels::cuda::SyncStatus(stream_, "KV copy in");
  }

  absl::Status MoveTokens(const kernels::KvBlockLayout& layout,
                          std::span<const kernels::KvMove> moves) override {
    if (moves.empty()) return absl::OkStatus();
    ScopedDevice on_device(device_);
    RETURN_IF_ERROR(on_device.status());
    // The moves travel in a stream-ordered allocation: concurrent compactions need no
    // shared staging buffer, and the pageable source is consumed before the copy returns.
    const size_t move_bytes = moves.size() * sizeof(kernels::KvMove);
    void* device_moves = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&device_moves, move_bytes, stream_),
                               "cudaMallocAsync for compaction moves"));
    absl::Status status = CudaStatus(
        cudaMemcpyAsync(device_moves, moves.data(), move_bytes, cudaMemcpyHostToDevice, stream_),
        "copying compaction moves to the device");
    if (status.ok()) {
      kernels::cuda::CompactKv(data_, layout, static_cast<const kernels::KvMove*>(device_moves),
                               static_cast<int64_t>(moves.size()), stream_);
      status = kernels::cuda::LaunchStatus("CompactKv");
    }
    const absl::Status freed = CudaStatus(cudaFreeAsync(device_moves, stream_), "cudaFreeAsync");
    const absl::Status synced = kernels::cuda::SyncStatus(stream_, "KV compaction");
    if (!status.ok()) return status;
    return freed.ok() ? synced : freed;
  }

 private:
  const int device_;
  void* const data_;
  const int64_t bytes_;
  const cudaStream_t stream_;
  const MemoryExport export_;
  const CudaDeviceIdentity identity_;
};

absl::Status CheckDevice(int device) {
  ASSIGN_OR_RETURN(const int visible, kernels::cuda::VisibleDeviceCount());
  if (device < 0 || device >= visible) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " does not exist (",
                                                   visible, " visible)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GpuComputeMode> ComputeModeOf(int device) {
  int mode = cudaComputeModeDefault;
  RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device),
                             absl::StrCat("cudaDeviceGetAttribute(ComputeMode, ", device, ")")));
  switch (mode) {
    case cudaComputeModeExclusiveProcess:
      return GpuComputeMode::kExclusiveProcess;
    case cudaComputeModeProhibited:
      return GpuComputeMode::kProhibited;
    case cudaComputeModeDefault:
      return GpuComputeMode::kDefault;
    default:  // cudaComputeModeExclusive (per thread, retired) and any later mode
      return GpuComputeMode::kExclusiveThread;
  }
}

absl::StatusOr<CudaDeviceIdentity> DescribeCudaDevice(int device) {
  RETURN_IF_ERROR(CheckDevice(device));
  cudaDeviceProp properties{};
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&properties, device),
                             absl::StrCat("cudaGetDeviceProperties(", device, ")")));
  char bus_id[32] = {};
  RETURN_IF_ERROR(CudaStatus(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device),
                             absl::StrCat("cudaDeviceGetPCIBusId(", device, ")")));
  return CudaDeviceIdentity{kernels::cuda::FormatDeviceUuid(properties.uuid), bus_id};
}

absl::StatusOr<CudaIpcExport> CudaIpcExportOf(const KvStorage& storage) {
  const auto* cuda = dynamic_cast<const CudaKvStorage*>(&storage);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError("the KV storage is not CUDA device memory");
  }
  const MemoryExport& exported = cuda->memory_export();
  if (exported.kind != MemoryExport::Kind::kCudaIpc) {
    return absl::FailedPreconditionError(
        exported.unavailable.empty()
            ? "the CUDA KV storage was made without an IPC export (CudaStorageOptions::export_ipc)"
            : absl::StrCat("the CUDA KV storage has no IPC export: ", exported.unavailable));
  }
  return CudaIpcExport{exported.cuda_ipc_handle, exported.device, cuda->identity(),
                       exported.bytes};
}

absl::StatusOr<std::unique_ptr<KvStorage>> NewCudaKvStorage(int64_t bytes, int device,
                                                            const CudaStorageOptions& options) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device KV storage of ", bytes, " bytes; it must be > 0"));
  }
  // An exported allocation gets whole IPC units of its own (ipc_export_size.h): the
  // handle of a smaller one would expose its neighbours in the allocator's block.
  if (options.export_ipc) {
    const int64_t requested = bytes;
    bytes = CudaIpcAllocationBytes(requested);
    if (bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device KV storage of ", requested, " bytes is too large"));
    }
  }
  ASSIGN_OR_RETURN(CudaDeviceIdentity identity, DescribeCudaDevice(device));
  ScopedDevice on_device(device);
  RETURN_IF_ERROR(on_device.status());
  const std::string what = absl::StrCat("device ", device, ": ");
  cudaStream_t stream = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                             absl::StrCat(what, "cudaStreamCreate")));
  void* data = nullptr;
  absl::Status status;
  {
    // Exported memory cannot come from a stream-ordered pool: the synchronous allocator,
    // outside any NCCL group.
    std::lock_guard<std::mutex> no_group(kernels::cuda::SynchronizingCallMutex());
    status = CudaStatus(cudaMalloc(&data, static_cast<size_t>(bytes)),
                        absl::StrCat(what, "cudaMalloc of ", bytes, " bytes"));
  }
  // The fill runs on the storage's own stream (which does not wait for the legacy default
  // stream) and is complete before anyone, here or in a worker, can see the memory.
  if (status.ok()) {
    status = CudaStatus(cudaMemsetAsync(data, 0, static_cast<size_t>(bytes), stream),
                        absl::StrCat(what, "cudaMemsetAsync"));
  }
  if (status.ok()) status = kernels::cuda::SyncStatus(stream, absl::StrCat(what, "zero fill"));
  MemoryExport exported;
  if (status.ok() && options.export_ipc) {
    absl::StatusOr<GpuComputeMode> mode = ComputeModeOf(device);
    status = mode.status();
    std::string unavailable;
    cudaIpcMemHandle_t handle;
    if (status.ok()) unavailable = IpcExportUnavailableReason(device, *mode, true);
    if (status.ok() && unavailable.empty()) {
      const cudaError_t got = cudaIpcGetMemHandle(&handle, data);
      if (got == cudaErrorNotSupported) {
        cudaGetLastError();  // not sticky: leave no error for the next check
        unavailable = IpcExportUnavailableReason(device, *mode, false);
      } else {
        status = CudaStatus(got, absl::StrCat(what, "cudaIpcGetMemHandle"));
      }
    }
    if (status.ok() && !unavailable.empty()) {
      // The memory stays this process's alone; the pool works, workers cannot map it.
      exported.unavailable = std::move(unavailable);
    } else if (status.ok()) {
      exported.kind = MemoryExport::Kind::kCudaIpc;
      exported.cuda_ipc_handle.assign(handle.reserved, sizeof(handle.reserved));
      exported.device = device;
      exported.device_uuid = identity.uuid;
      exported.device_pci_bus_id = identity.pci_bus_id;
      exported.bytes = bytes;
    }
  }
  if (!status.ok()) {
    FreeExportable(data);
    cudaStreamDestroy(stream);
    return status;
  }
  return std::unique_ptr<KvStorage>(new CudaKvStorage(device, data, bytes, stream,
                                                      std::move(exported), std::move(identity)));
}

absl::StatusOr<std::unique_ptr<BlockPool>> CreateCudaBlockPool(const BlockPoolOptions& options,
                                                               int device,
                                                               const CudaStorageOptions& storage) {
  BlockPoolOptions capped = options;
  if (storage.export_ipc) {
    // The allocation is rounded up to whole IPC units; its blocks are counted within the
    // whole units of the cap, so that what the device gives stays within the cap.
    capped.memory_bytes = CudaIpcUsableCap(options.memory_bytes);
    if (capped.memory_bytes < options.layout.BlockBytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", options.rank, " KV pool: exported by CUDA IPC handle, its device memory "
          "comes in whole units of ", kCudaIpcGranularity, " bytes; the memory cap of ",
          options.memory_bytes, " bytes holds ", capped.memory_bytes,
          " bytes of them, below one block of ", options.layout.BlockBytes(), " bytes"));
    }
  }
  return BlockPool::Create(capped, [device, storage](int64_t bytes) {
    return NewCudaKvStorage(bytes, device, storage);
  });
}

}  // namespace kvcm

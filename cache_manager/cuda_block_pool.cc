#include "cache_manager/cuda_block_pool.h"

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/status_macros.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/kv_compaction_cuda.h"

namespace kvcm {
namespace {

using kernels::cuda::CudaStatus;
using kernels::cuda::ScopedDevice;

class CudaKvStorage final : public KvStorage {
 public:
  // Takes ownership of `data` and `stream`, both of `device`.
  CudaKvStorage(int device, void* data, int64_t bytes, cudaStream_t stream,
                MemoryExport exported)
      : device_(device), data_(data), bytes_(bytes), stream_(stream),
        export_(std::move(exported)) {}

  ~CudaKvStorage() override {
    ScopedDevice on_device(device_);
    cudaStreamDestroy(stream_);
    cudaFree(data_);
  }

  MemorySpace space() const override { return MemorySpace::kDevice; }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  const MemoryExport& memory_export() const override { return export_; }

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
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStorage>> NewCudaKvStorage(int64_t bytes, int device) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device KV storage of ", bytes, " bytes; it must be > 0"));
  }
  const int visible = kernels::cuda::VisibleDeviceCount();
  if (device < 0 || device >= visible) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " does not exist (",
                                                   visible, " visible)"));
  }
  ScopedDevice on_device(device);
  RETURN_IF_ERROR(on_device.status());
  const std::string what = absl::StrCat("device ", device, ": ");
  void* data = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, static_cast<size_t>(bytes)),
                             absl::StrCat(what, "cudaMalloc of ", bytes, " bytes")));
  cudaStream_t stream = nullptr;
  cudaIpcMemHandle_t handle;
  absl::Status status = CudaStatus(cudaMemset(data, 0, static_cast<size_t>(bytes)),
                                   absl::StrCat(what, "cudaMemset"));
  if (status.ok()) {
    status = CudaStatus(cudaIpcGetMemHandle(&handle, data),
                        absl::StrCat(what, "cudaIpcGetMemHandle"));
  }
  if (status.ok()) {
    status = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                        absl::StrCat(what, "cudaStreamCreate"));
  }
  if (!status.ok()) {
    cudaFree(data);
    return status;
  }
  MemoryExport exported;
  exported.kind = MemoryExport::Kind::kCudaIpc;
  exported.cuda_ipc_handle.assign(handle.reserved, sizeof(handle.reserved));
  exported.device = device;
  exported.bytes = bytes;
  return std::unique_ptr<KvStorage>(
      new CudaKvStorage(device, data, bytes, stream, std::move(exported)));
}

absl::StatusOr<std::unique_ptr<BlockPool>> CreateCudaBlockPool(const BlockPoolOptions& options,
                                                               int device) {
  return BlockPool::Create(options,
                           [device](int64_t bytes) { return NewCudaKvStorage(bytes, device); });
}

}  // namespace kvcm

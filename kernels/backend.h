// KernelBackend: the array kernels of one backend as one table of function pointers, so
// that the engine (cache_manager/) runs the same code on the CPU reference or on CUDA.
//
//   const kernels::KernelBackend& backend = kernels::CpuBackend();  // or cuda::CudaBackend()
//   backend.update_momentum(m, scratch, n, scores, options, &invalid, stream);
//
// Each entry has exactly the type of the CPU reference kernel of the same name
// (kernels/*.h: the member is declared as decltype(&cpu::Kernel)), and
// kernels/cuda/cuda_backend.cc checks at compile time that every CUDA kernel has that
// same signature, so a drifting twin does not build. Pointers given to an entry live in
// the backend's memory space (`memory`: host for the CPU, device memory of the current
// device for CUDA) unless the kernel's comment says otherwise; `stream` is nullptr on the
// CPU and a cudaStream_t on CUDA. CUDA entries only enqueue work; the memory operations
// (BackendMemory) turn failures into absl::Status.
//
// Tables are immutable and live as long as the program: thread-safe.
#ifndef KVCM_KERNELS_BACKEND_H_
#define KVCM_KERNELS_BACKEND_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kv_compaction.h"
#include "kernels/momentum_update.h"
#include "kernels/score_matrix.h"
#include "kernels/score_validation.h"
#include "kernels/selection.h"
#include "kernels/span_pool.h"
#include "kernels/token_arrays.h"

namespace kvcm::kernels {

// X(Kernel, entry): every kernel with a CPU reference and a CUDA twin, in one list that
// declares the table and drives the signature check.
#define KVCM_KERNEL_ENTRIES(X)                \
  X(UpdateMomentum, update_momentum)          \
  X(MeanMomentum, mean_momentum)              \
  X(ConvertToFloat32, convert_to_float32)     \
  X(JoinRankPartials, join_rank_partials)     \
  X(WidenPartialSums, widen_partial_sums)     \
  X(ScaleJoinedSums, scale_joined_sums)       \
  X(CountInvalidScores, count_invalid_scores) \
  X(SpanMaxPool, span_max_pool)               \
  X(SelectLowest, select_lowest)              \
  X(RemoveEntries, remove_entries)            \
  X(AppendEntry, append_entry)                \
  X(GatherPositions, gather_positions)        \
  X(CompactKv, compact_kv)

enum class MemorySpace : uint8_t { kHost, kDevice };

enum class CopyKind : uint8_t {
  kHostToBackend,  // src: host, dst: the backend's memory
  kBackendToHost,  // src: the backend's memory, dst: host
  kWithinBackend,  // both in the backend's memory
};

// How the engine holds arrays in a backend's memory. Host backends implement them with
// the C library; CUDA with the runtime, on the device made current by set_device.
//
// Nothing here may synchronize the device on the step path, where a sequence's arrays
// grow: device memory is stream-ordered (CUDA: cudaMallocAsync from the device's memory
// pool, which keeps freed memory for reuse, so growth neither reaches the driver nor
// waits for other threads' work or an NCCL group), and staging comes from a cache of
// pinned blocks (kernels/block_cache.h).
struct BackendMemory {
  // Makes `device` current on the calling thread (a no-op on the host).
  absl::Status (*set_device)(int device);
  // `bytes` of the backend's memory on the current device (at least 256-byte aligned),
  // ordered on `stream`: work enqueued on `stream` after the call may use it; work on
  // another stream only once `stream` was synchronized.
  absl::Status (*allocate)(size_t bytes, StreamHandle stream, void** ptr);
  // Frees memory of `allocate` once the work enqueued on `stream` before the call has run
  // (work on other streams that uses it must have been waited for). nullptr is ignored.
  void (*release)(void* ptr, StreamHandle stream);
  // Host memory that copies to and from the backend fastest (pinned on CUDA; a released
  // block is kept for the next request of its size class).
  absl::Status (*allocate_staging)(size_t bytes, void** ptr);
  void (*release_staging)(void* ptr);  // nullptr is ignored
  // Enqueues a copy on `stream`. A pageable host source may be reused once the call
  // returns; a staging source must stay as it is, and a host destination is not complete,
  // until `synchronize`.
  absl::Status (*copy)(void* dst, const void* src, size_t bytes, CopyKind kind,
                       StreamHandle stream);
  // The calling thread's stream of `device`: the one of its lane (kernels/stream_lanes.h),
  // made on first use and kept for the program. Work that must be ordered stays on the
  // stream it began on, whichever thread continues it. nullptr on the host.
  absl::Status (*device_stream)(int device, StreamHandle* stream);
  // Waits for everything enqueued on `stream`; reports launch and execution failures of
  // the kernels enqueued since the last call on this thread (`what` names the step).
  absl::Status (*synchronize)(StreamHandle stream, const char* what);
};

struct KernelBackend {
  const char* name;    // "cpu", "cuda", ...
  MemorySpace memory;  // where the arrays given to the entries live
#define KVCM_DECLARE_KERNEL_ENTRY(kernel, entry) decltype(&cpu::kernel) entry;
  KVCM_KERNEL_ENTRIES(KVCM_DECLARE_KERNEL_ENTRY)
#undef KVCM_DECLARE_KERNEL_ENTRY
  BackendMemory mem;
};

// Copies the rows of `scores` (strided, in `kind`'s source memory) densely to `dense`
// ([layers, tokens] of scores.dtype, in its destination memory), enqueued on `stream`.
inline absl::Status CopyScoreRowsDense(const BackendMemory& mem, const ScoreMatrix& scores,
                                       void* dense, CopyKind kind, StreamHandle stream) {
  if (scores.tokens <= 0) return absl::OkStatus();
  const size_t row_bytes = static_cast<size_t>(scores.tokens) * ScoreDtypeSize(scores.dtype);
  auto* out = static_cast<std::byte*>(dense);
  for (int64_t layer = 0; layer < scores.layers; ++layer) {
    absl::Status copied = mem.copy(out + static_cast<size_t>(layer) * row_bytes,
                                   scores.Row(layer), row_bytes, kind, stream);
    if (!copied.ok()) return copied;
  }
  return absl::OkStatus();
}

// `scores` in a device backend's memory, downloaded densely into `buffer` on `stream` of
// the current device, and waited for: the slow paths (error messages, sampled
// diagnostics) that read device scores on the host.
inline absl::StatusOr<ScoreMatrix> DownloadScores(const BackendMemory& mem, StreamHandle stream,
                                                  const ScoreMatrix& scores,
                                                  std::vector<std::byte>* buffer) {
  buffer->resize(static_cast<size_t>(std::max<int64_t>(scores.layers, 0)) *
                 static_cast<size_t>(std::max<int64_t>(scores.tokens, 0)) *
                 ScoreDtypeSize(scores.dtype));
  absl::Status copied =
      CopyScoreRowsDense(mem, scores, buffer->data(), CopyKind::kBackendToHost, stream);
  if (copied.ok()) copied = mem.synchronize(stream, "reading scores back");
  if (!copied.ok()) return copied;
  return ScoreMatrix::Dense(buffer->data(), scores.dtype, scores.layers, scores.tokens);
}

// The CPU reference kernels over host memory.
const KernelBackend& CpuBackend();

// The CPU reference kernels, but declared to hold their arrays in "device" memory
// (MemorySpace::kDevice, plain host allocations behind it): the engine then runs its
// device-resident path (explicit copies in and out, double buffers, staged decisions) on
// the CPU. For tests of that path on machines without a GPU; its results must equal
// CpuBackend()'s. Its streams are handles that nothing dereferences, one per lane
// (EmulatedStream), so that tests can see which stream work was given to.
const KernelBackend& EmulatedDeviceBackend();
// The emulated device's stream of `lane` (kernels/stream_lanes.h).
StreamHandle EmulatedStream(int lane);

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_BACKEND_H_

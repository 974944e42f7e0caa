// KvStorage: the memory behind one rank's KV block pool and the means to move tokens
// inside it. A BlockPool (cache_manager/kv/block_pool.h) decides which blocks and slots are
// used; the storage only holds the bytes, tells the worker how to map them, and runs the
// compaction kernel of its memory space. Two backends:
//   - host: plain memory, or a POSIX shared-memory object a worker process can map
//     (NewHostKvStorage, below);
//   - CUDA: one cudaMalloc allocation exported by IPC handle (cache_manager/
//     cuda_block_pool.h, built with the CUDA backend).
// Implementations are thread-safe: MoveTokens may run concurrently for disjoint slots.
#ifndef KVCM_CACHE_MANAGER_KV_KV_STORAGE_H_
#define KVCM_CACHE_MANAGER_KV_KV_STORAGE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/kv_compaction.h"

namespace kvcm {

enum class MemorySpace : uint8_t { kHost, kDevice };

// How another process reaches the storage's bytes.
struct MemoryExport {
  enum class Kind : uint8_t {
    kNone,      // private host memory: only this process sees it
    kPosixShm,  // shm_open(shm_name) and mmap `bytes` bytes, MAP_SHARED
    kCudaIpc,   // cudaIpcOpenMemHandle(cuda_ipc_handle) on `device`
  };
  Kind kind = Kind::kNone;
  std::string shm_name;         // kPosixShm: "/name"
  std::string cuda_ipc_handle;  // kCudaIpc: the 64 bytes of a cudaIpcMemHandle_t
  int32_t device = -1;          // kCudaIpc: the CUDA device ordinal in this process
  // kCudaIpc: the same GPU in terms that do not depend on the process (ordinals differ
  // under CUDA_VISIBLE_DEVICES): its UUID ("GPU-8c1b...") and PCI bus id ("0000:18:00.0").
  std::string device_uuid;
  std::string device_pci_bus_id;
  int64_t bytes = 0;            // the mapped size; block b starts at b * block bytes
  // kNone of storage that was asked to be exported but cannot be (device memory on a GPU
  // in exclusive-process mode, a platform without CUDA IPC): why, for the operator.
  std::string unavailable;
};

class KvStorage {
 public:
  virtual ~KvStorage() = default;

  virtual MemorySpace space() const = 0;
  // The first byte, aligned to at least 256 bytes; bytes() bytes in space().
  virtual void* data() const = 0;
  virtual int64_t bytes() const = 0;
  virtual const MemoryExport& memory_export() const = 0;

  // Copies `bytes` at `offset` of the storage out to host memory `dst`, or in from host
  // memory `src` (a hand-off's KV over gRPC), returning once complete. REQUIRES: the range
  // lies inside the storage. Errors: INTERNAL (the device failed).
  virtual absl::Status CopyOut(int64_t offset, void* dst, int64_t bytes) const = 0;
  virtual absl::Status CopyIn(int64_t offset, const void* src, int64_t bytes) = 0;

  // Copies every layer's K and V of each move's source slot to its destination slot (the
  // layout and move contract of kernels/kv_compaction.h) and returns once the copies are
  // complete. Errors: INTERNAL (the device failed), nothing moved or partially moved;
  // the sources are never written, so they still hold the tokens.
  // REQUIRES: every slot lies inside bytes() for `layout`.
  virtual absl::Status MoveTokens(const kernels::KvBlockLayout& layout,
                                  std::span<const kernels::KvMove> moves) = 0;
};

struct HostStorageOptions {
  // When set, the memory is a POSIX shared-memory object of this name ("/kvcm-rank0",
  // one slash then up to 254 characters without '/'), created exclusively and unlinked
  // when the storage is destroyed (or before: UnlinkSharedMemory). The storage holds a
  // shared flock on it while it lives. Empty: private anonymous memory.
  std::string shm_name;
  // With shm_name: the object already exists (the pool of an earlier kvcached, recorded
  // in its snapshot) and is mapped with its bytes as they are instead of created; its size
  // must be the storage's. From then on it is this storage's as if it had made it (locked,
  // exclusively, while it lives; unlinked on exit). NOT_FOUND when it is gone, FAILED_PRECONDITION for another size or
  // an object a live process holds.
  bool attach = false;
};

// Host memory of `bytes` bytes (> 0), zero-filled. Errors: INVALID_ARGUMENT (size, name),
// ALREADY_EXISTS (the shared-memory name is taken), RESOURCE_EXHAUSTED (no memory),
// INTERNAL (other system errors, with strerror's text).
absl::StatusOr<std::unique_ptr<KvStorage>> NewHostKvStorage(int64_t bytes,
                                                            const HostStorageOptions& options);

// Removes the name of a shared-memory object this process created ("/name"): workers can
// no longer open it, while every existing mapping (ours, theirs) stays valid. For exits
// that skip destructors. Idempotent.
void UnlinkSharedMemory(const std::string& shm_name);

// Removes the names of every shared-memory storage of this process still alive. Only
// async-signal-safe calls: for a fatal-signal handler, which then re-raises the signal.
void UnlinkSharedMemoryAfterCrash();

// Marks a shared-memory object as kept for a restart (a snapshot names it): mode 0700, the
// owner's execute bit being the mark, until a storage attaches it again (back to 0600).
// Between the drain that keeps it and the start that re-attaches it no process holds it,
// and RemoveStaleSharedMemory must not take it for a dead instance's (another kvcached
// starting on the node in that window would). INTERNAL with strerror's text on failure.
absl::Status MarkSharedMemoryKept(const std::string& shm_name);
// How long a mark protects an object: a snapshot not restored by then is abandoned.
inline constexpr int64_t kKeptSharedMemorySeconds = 600;

// Removes the shared-memory objects of /dev/shm whose name (without the slash) `ours`
// accepts, that belong to this user and that no live process holds (a NewHostKvStorage
// owner holds a flock until it dies, SIGKILL included), except those marked kept
// (MarkSharedMemoryKept) less than kKeptSharedMemorySeconds ago unless `include_kept` (a
// daemon whose own snapshot was set aside: the pools it kept are abandoned). Returns the
// names removed.
std::vector<std::string> RemoveStaleSharedMemory(
    absl::FunctionRef<bool(absl::string_view name)> ours, bool include_kept = false);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_KV_STORAGE_H_

// ScoreRegion: a score region of a worker on the daemon's node (kvcache.v1
// RegisterScoreRegion, CreateScoreRegion). The worker writes a report's packed scores into
// the region and the report names the range (a ScoreRef) instead of carrying the bytes;
// the daemon reads them in place, with no copy through gRPC.
//
//   auto region = ScoreRegion::Create(*client, 64 << 20);
//   v1::StepReport* r = AddReport(&batch, "req-1", step);
//   (*region)->Put(r, /*offset=*/0, packed_bytes, layers, dtype);   // copies into the region
//   auto decisions = stream->Step(batch);   // from here the range may be written again
//
// A region is host shared memory (Create; CreateInDaemon against a CPU or emulated engine)
// or, from CreateInDaemon against a CUDA engine (kvcached --engine_backend=cuda), device
// memory on the daemon's GPU, opened by its CUDA IPC handle (on_device()). Into device
// memory Put copies asynchronously on the stream it is given, so before the batch that
// names the ranges is sent the worker calls WaitForWrites(), which waits for an event
// recorded after the last write (that stream only, not the whole device):
//
//   auto region = ScoreRegion::CreateInDaemon(*client, 64 << 20);
//   (*region)->Put(r, 0, packed_bytes, layers, dtype, /*head_count=*/0, stream);
//   ...                                  // the batch's other reports
//   (*region)->WaitForWrites();          // REQUIRED on device memory before the Send
//   auto decisions = stream->Step(batch);
//
// Device regions need a client built with CUDA (KVCM_CUDA); one built without refuses
// them (FAILED_PRECONDITION saying so). On a host region WaitForWrites() returns at once,
// so a worker may call it unconditionally.
//
// Ownership (kvcache.proto, ScoreRef): a range belongs to the daemon from the Send of the
// batch that names it until that batch's DecisionBatch has been received. An object Create
// makes has a random name and mode 0600 and is unregistered, unmapped and unlinked when the
// ScoreRegion is destroyed; a device region's IPC mapping is closed before it is
// unregistered (the daemon then frees the memory). Not thread-safe (one per worker rank,
// like a StepStream).
#ifndef KVCM_CLIENTS_CPP_SCORE_REGION_H_
#define KVCM_CLIENTS_CPP_SCORE_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "clients/cpp/kvcache_client.h"

namespace kvcm::client {

class ScoreRegion {
 public:
  // Creates, sizes and maps a new object of `byte_size` bytes and registers it.
  // FAILED_PRECONDITION when the daemon does not allow score regions.
  static absl::StatusOr<std::unique_ptr<ScoreRegion>> Create(KvCacheClient& client,
                                                             int64_t byte_size);
  // Asks the daemon to create a region of `byte_size` bytes (CreateScoreRegion) and maps
  // it read-write. The daemon owns the memory: the destructor unmaps and unregisters it,
  // and the daemon frees it. Host shared memory is mapped with mmap; device memory (a CUDA
  // engine's region) is opened with cudaIpcOpenMemHandle on this process's ordinal of the
  // daemon's GPU, found by PCI bus id (by UUID when the daemon sends no bus id) and checked
  // by UUID, since ordinals differ between processes (CUDA_VISIBLE_DEVICES).
  // FAILED_PRECONDITION when the daemon does not allow score regions, when this client was
  // built without CUDA and the region is device memory, or when this process cannot reach
  // that GPU (not visible, or another GPU by UUID at that bus id); INTERNAL with the CUDA
  // runtime's words when opening the handle fails. A failed map unregisters the region.
  // `rank` >= 0: placed on that tensor-parallel rank's device (CreateScoreRegionRequest;
  // a host daemon ignores it).
  static absl::StatusOr<std::unique_ptr<ScoreRegion>> CreateInDaemon(KvCacheClient& client,
                                                                     int64_t byte_size,
                                                                     int32_t rank = -1);
  ~ScoreRegion();

  ScoreRegion(const ScoreRegion&) = delete;
  ScoreRegion& operator=(const ScoreRegion&) = delete;

  uint64_t id() const { return id_; }
  // The object's name for shared memory; "cuda-ipc:<id>@<GPU uuid>" for device memory.
  const std::string& name() const { return name_; }
  int64_t size() const { return static_cast<int64_t>(size_); }
  // The host mapping, for workers that write their scores straight into it. Empty for a
  // device region, whose memory the host cannot touch: use device_pointer().
  std::span<std::byte> bytes() {
    if (on_device()) return {};
    return {static_cast<std::byte*>(base_), size_};
  }

  // Whether the region is device memory (a CUDA engine's, opened by IPC handle).
  bool on_device() const { return device_ >= 0; }
  // This process's ordinal of the region's GPU (not the daemon's); -1 for host memory.
  int device() const { return device_; }
  // The region's size() bytes on device(), for workers whose own kernels write the scores
  // (then RecordWrites on their stream); null for host memory. Valid until destruction.
  void* device_pointer() const { return on_device() ? base_ : nullptr; }

  // Points `report` at [offset, offset + byte_size) of the region, which already holds
  // its [layers, tokens] packed scores of `dtype`. REQUIRES: the range fits.
  void Reference(v1::StepReport* report, int64_t offset, int64_t byte_size, int32_t layers,
                 kernels::ScoreDtype dtype, int32_t head_count = 0) const;
  // Copies `packed` (the bytes SetScores would put inline) to `offset` and references
  // them. INVALID_ARGUMENT when they do not fit. On a device region the copy is enqueued
  // on the legacy default stream of device(); see the overload below.
  absl::Status Put(v1::StepReport* report, int64_t offset, std::span<const std::byte> packed,
                   int32_t layers, kernels::ScoreDtype dtype, int32_t head_count = 0);
  // The same, on `stream` (a cudaStream_t of device(); nullptr: its legacy default stream)
  // for a device region: `packed`, in host or device memory (cudaMemcpyDefault), is copied
  // with cudaMemcpyAsync and an event is recorded after it; `packed` may be reused once
  // this returns when it is pageable host memory, and once the stream has passed the copy
  // otherwise. REQUIRES: WaitForWrites() before the batch naming the range is sent. INTERNAL
  // when CUDA fails. On a host region `stream` is unused and the copy is done on return.
  absl::Status Put(v1::StepReport* report, int64_t offset, std::span<const std::byte> packed,
                   int32_t layers, kernels::ScoreDtype dtype, int32_t head_count, void* stream);
  // Device region: the work enqueued so far on `stream` (a cudaStream_t of device();
  // nullptr: its legacy default stream) writes into the region, so WaitForWrites() waits
  // for it too. Put calls it; a worker writing through device_pointer() calls it after its
  // kernels. Writes on several streams are chained (each new stream first waits for the
  // previous one's writes), so one event covers them all. Nothing to do on a host region.
  absl::Status RecordWrites(void* stream);
  // Returns once the GPU has done every write recorded since the last call
  // (cudaEventSynchronize on one event: the writing streams only, not the whole device).
  // Call it after building a batch and before sending it; OK at once on a host region or
  // when nothing was written. INTERNAL with the CUDA error when a write failed.
  absl::Status WaitForWrites();

 private:
  ScoreRegion(KvCacheClient& client, std::string name, void* base, size_t size, bool ours)
      : client_(client), name_(std::move(name)), base_(base), size_(size), ours_(ours) {}

  // Device region: waits for its writes, then closes the event and the IPC mapping.
  void CloseDevice();

  KvCacheClient& client_;
  const std::string name_;
  void* const base_;  // the host mapping, or the device pointer on device_
  const size_t size_;
  const bool ours_;  // we made the object (Create) and unlink it; else the daemon's
  uint64_t id_ = 0;
  // Device memory only (device_ >= 0).
  int device_ = -1;
  void* event_ = nullptr;           // cudaEvent_t recorded after the last write
  [[maybe_unused]] void* last_stream_ = nullptr;  // cudaStream_t last recorded on (CUDA builds)
  bool unwaited_ = false;           // recorded since the last WaitForWrites
};

// The offset after `offset` + `bytes` at which the next report's range starts (64-byte
// aligned, so every dtype is aligned and ranges do not share cache lines).
inline int64_t NextScoreOffset(int64_t offset, int64_t bytes) {
  return (offset + bytes + 63) / 64 * 64;
}

}  // namespace kvcm::client

#endif  // KVCM_CLIENTS_CPP_SCORE_REGION_H_

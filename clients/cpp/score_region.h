// ScoreRegion: a shared-memory score region of a worker on the daemon's node
// (kvcache.v1 RegisterScoreRegion). The worker writes a report's packed scores into the
// region and the report names the range (a ScoreRef) instead of carrying the bytes; the
// daemon reads them in place, with no copy through gRPC.
//
//   auto region = ScoreRegion::Create(*client, 64 << 20);
//   v1::StepReport* r = AddReport(&batch, "req-1", step);
//   (*region)->Put(r, /*offset=*/0, packed_bytes, layers, dtype);   // copies into the region
//   auto decisions = stream->Step(batch);   // from here the range may be written again
//
// Ownership (kvcache.proto, ScoreRef): a range belongs to the daemon from the Send of the
// batch that names it until that batch's DecisionBatch has been received. The object is
// created with a random name and mode 0600, unregistered, unmapped and unlinked when the
// ScoreRegion is destroyed. Not thread-safe (one per worker rank, like a StepStream).
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
  // it read-write. The daemon owns the object: the destructor unregisters and unmaps it,
  // and the daemon frees it. FAILED_PRECONDITION when the daemon does not allow score
  // regions, or when it made the region in device memory (a CUDA engine), which a worker
  // maps with cudaIpcOpenMemHandle (CreateScoreRegionResponse), not with this class.
  // `rank` >= 0: placed on that tensor-parallel rank's device (CreateScoreRegionRequest;
  // a host daemon ignores it).
  static absl::StatusOr<std::unique_ptr<ScoreRegion>> CreateInDaemon(KvCacheClient& client,
                                                                     int64_t byte_size,
                                                                     int32_t rank = -1);
  ~ScoreRegion();

  ScoreRegion(const ScoreRegion&) = delete;
  ScoreRegion& operator=(const ScoreRegion&) = delete;

  uint64_t id() const { return id_; }
  const std::string& name() const { return name_; }
  int64_t size() const { return static_cast<int64_t>(size_); }
  // The mapping, for workers that write their scores straight into it.
  std::span<std::byte> bytes() { return {static_cast<std::byte*>(base_), size_}; }

  // Points `report` at [offset, offset + byte_size) of the region, which already holds
  // its [layers, tokens] packed scores of `dtype`. REQUIRES: the range fits.
  void Reference(v1::StepReport* report, int64_t offset, int64_t byte_size, int32_t layers,
                 kernels::ScoreDtype dtype, int32_t head_count = 0) const;
  // Copies `packed` (the bytes SetScores would put inline) to `offset` and references
  // them. INVALID_ARGUMENT when they do not fit.
  absl::Status Put(v1::StepReport* report, int64_t offset, std::span<const std::byte> packed,
                   int32_t layers, kernels::ScoreDtype dtype, int32_t head_count = 0);

 private:
  ScoreRegion(KvCacheClient& client, std::string name, void* base, size_t size, bool ours)
      : client_(client), name_(std::move(name)), base_(base), size_(size), ours_(ours) {}

  KvCacheClient& client_;
  const std::string name_;
  void* const base_;
  const size_t size_;
  const bool ours_;  // we made the object (Create) and unlink it; else the daemon's
  uint64_t id_ = 0;
};

// The offset after `offset` + `bytes` at which the next report's range starts (64-byte
// aligned, so every dtype is aligned and ranges do not share cache lines).
inline int64_t NextScoreOffset(int64_t offset, int64_t bytes) {
  return (offset + bytes + 63) / 64 * 64;
}

}  // namespace kvcm::client

#endif  // KVCM_CLIENTS_CPP_SCORE_REGION_H_

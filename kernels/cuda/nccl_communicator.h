// NcclCommunicator: one NCCL clique over GPUs of this process (rank r on devices[r], made
// by ncclCommInitAll), and the tensor-parallel join on those GPUs: when every rank's
// partial head sums already sit in its device memory, the ranks send them to one rank
// (the root) instead of shipping them to the host (SPEC.md, "Tensor-parallel ranks"):
//
//   layer score = (sum over ranks p, in rank order, of sum_p) / total_heads   (on the root)
//
// The root sums the gathered partials with kernels::cuda::JoinRankPartials, in rank order
// in double, so the result equals kernels::cpu::JoinRankPartials (the CPU joiner's) bit for
// bit for any values. An all-reduce would not: NCCL adds in ring or tree order, which with
// 3 or more ranks and partials of a wide range rounds differently.
//
// Thread-safe: collectives are issued under one mutex, so every rank sees them in the same
// order. Calls enqueue work on the given streams and return; Wait() waits for the results
// while polling for asynchronous NCCL errors under a timeout.
// NCCL failures are INTERNAL with ncclGetErrorString's text.
#ifndef KVCM_KERNELS_CUDA_NCCL_COMMUNICATOR_H_
#define KVCM_KERNELS_CUDA_NCCL_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/score_matrix.h"

namespace kvcm::kernels::cuda {

// One rank's part of JoinPartialSums, all on that rank's device.
struct RankJoinBuffers {
  ScoreMatrix partial_sums;  // [layers, tokens] f32/f16/bf16, device; this rank's head sums
  // [layers * tokens] of partial_sums' dtype, device: where a rank other than the root
  // packs strided partial sums before sending them (null when they are dense).
  void* staging = nullptr;
  StreamHandle stream = nullptr;  // cudaStream_t of the rank's device
  void* done = nullptr;           // cudaEvent_t of the rank's device, recorded after its work
};

// Where the join's result goes: the root rank's device.
struct JoinRoot {
  int32_t rank = 0;
  // [world_size, layers * tokens * 4] bytes, device: rank r's partial sums land at
  // r * layers * tokens * 4 (the root's own slot is unused).
  void* gathered = nullptr;
  float* joined = nullptr;  // [layers, tokens] f32 dense, device: the joined scores
};

class NcclCommunicator {
 public:
  // A clique with rank r on devices[r]. NCCL needs distinct devices. Errors:
  // INVALID_ARGUMENT (empty or repeated devices, a device that does not exist), INTERNAL.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(std::vector<int> devices);

  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int32_t world_size() const { return static_cast<int32_t>(devices_.size()); }
  int device(int32_t rank) const { return devices_[static_cast<size_t>(rank)]; }

  // The join: root.joined receives (sum over ranks, in rank order, of partial_sums) /
  // total_heads. Every rank but the root sends its partial sums to the root (ncclSend /
  // ncclRecv in one group), which joins them with JoinRankPartials; each rank's `done`
  // event is recorded after its part. INVALID_ARGUMENT unless there is one entry per rank
  // (at most kMaxJoinRanks), every rank's partial sums have the same layers and tokens,
  // the buffers named above are given, the root is a rank and total_heads >= 1.
  absl::Status JoinPartialSums(std::span<const RankJoinBuffers> ranks, int64_t total_heads,
                               const JoinRoot& root);

  // Waits until every rank's event (done[r], a cudaEvent_t on device(r)) has completed,
  // polling each rank's ncclCommGetAsyncError meanwhile, so that a failed or hung
  // collective is an error instead of a hang: INTERNAL with NCCL's text (or the event's
  // CUDA error), DEADLINE_EXCEEDED after `timeout`. Either error aborts the communicators
  // (ncclCommAbort); every later call then fails with FAILED_PRECONDITION. Only the work
  // before each event counts: other work on the same streams or devices cannot hold it up.
  absl::Status Wait(std::span<void* const> done, absl::Duration timeout);

 private:
  struct Comms;
  NcclCommunicator(std::vector<int> devices, std::unique_ptr<Comms> comms);

  // Aborts every communicator after a failure (REQUIRES: mu_ held).
  void AbortLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<int> devices_;
  absl::Mutex mu_;
  const std::unique_ptr<Comms> comms_ ABSL_PT_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_NCCL_COMMUNICATOR_H_

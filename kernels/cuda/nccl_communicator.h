// NcclCommunicator: one NCCL clique over GPUs of this process (rank r on devices[r], made
// by ncclCommInitAll), and the tensor-parallel join on those GPUs: when every rank's
// partial head sums already sit in its device memory, the ranks sum them with an
// all-reduce instead of shipping them to the host (SPEC.md, "Tensor-parallel ranks").
//
//   layer score = (sum over ranks p of sum_p) / total_heads      (on every rank)
//
// The join widens each rank's partials to double, all-reduces the doubles and divides, so
// it equals kernels::cpu::JoinRankPartials bit for bit whenever the double sums are exact
// (see kernels/cuda/momentum_update_cuda.h).
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

// One rank's buffers for JoinPartialSums, all on that rank's device.
struct RankJoinBuffers {
  ScoreMatrix partial_sums;  // [layers, tokens] f32/f16/bf16, device; this rank's head sums
  double* workspace = nullptr;  // [layers * tokens] f64, device
  float* joined = nullptr;      // [layers, tokens] f32 dense, device: the joined scores
  StreamHandle stream = nullptr;  // cudaStream_t of the rank's device
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

  // In place, element-wise: afterwards every rank's buffer holds the sum over ranks.
  // buffers[r]: [count] f64 on device(r).  streams[r]: cudaStream_t on device(r).
  absl::Status AllReduceSum(std::span<double* const> buffers, int64_t count,
                            std::span<const StreamHandle> streams);

  // The join: every rank's `joined` receives (sum of all partial_sums) / total_heads.
  // INVALID_ARGUMENT unless there is one entry per rank, every rank's partial sums have
  // the same layers and tokens, and total_heads >= 1.
  absl::Status JoinPartialSums(std::span<const RankJoinBuffers> ranks, int64_t total_heads);

  // Waits until every rank's stream (streams[r] on device(r)) has finished what was
  // enqueued on it, polling each rank's ncclCommGetAsyncError meanwhile, so that a failed
  // or hung collective is an error instead of a hang: INTERNAL with NCCL's text (or the
  // stream's CUDA error), DEADLINE_EXCEEDED after `timeout`. Either error aborts the
  // communicators (ncclCommAbort); every later call then fails with FAILED_PRECONDITION.
  absl::Status Wait(std::span<const StreamHandle> streams, absl::Duration timeout);

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

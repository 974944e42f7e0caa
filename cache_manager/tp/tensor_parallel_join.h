// TensorParallelJoin: gathers the per-rank reports of one decode step of one sequence and
// joins them into the step's layer scores (SPEC.md, "Tensor-parallel ranks"):
//
//   layer score = (sum over ranks p of sum_p) / (sum over ranks p of h_p)
//
// where sum_p is rank p's sum of its heads' attention rows and h_p its head count. Each
// report is validated when it arrives; a rejected report changes nothing and the others
// keep waiting. Reports are joined in rank order, so the result does not depend on
// arrival order. Two memories:
//   - host reports are copied (the caller's buffers need not outlive Add), validated and
//     joined by the host kernel backend the join was made with (the CPU reference by
//     default);
//   - reports already in a device's memory (RankReport::in_backend: daemon-created score
//     regions of a device engine) are referenced in place, kept alive by their pin, and
//     validated and joined by the device backend on its stream, so that the joined scores
//     stay on the device (JoinOnDevice) and no partial sum crosses to the host. Host
//     reports of such a step are uploaded first. When the ranks' partial sums sit on
//     different devices, one per rank (regions placed on each rank's GPU), the join is
//     the CrossDeviceJoiner's all-reduce (NCCL on GPUs); other mixes are gathered onto
//     the sequence's device by peer copies first.
// Not thread-safe: SequenceTable guards it with the sequence's mutex.
#ifndef KVCM_CACHE_MANAGER_TP_TENSOR_PARALLEL_JOIN_H_
#define KVCM_CACHE_MANAGER_TP_TENSOR_PARALLEL_JOIN_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/score_matrix.h"

namespace kvcm {

// One rank's report for one step.
struct RankReport {
  int32_t rank = 0;
  int64_t step = 0;
  // [layers, tokens] partial head sums in host memory; layers == 0 when the rank sends no
  // scores (non-scoring steps).
  kernels::ScoreMatrix partial_sums;
  // Query heads summed into partial_sums (>= 1 whenever scores are sent).
  int64_t head_count = 0;
  // partial_sums lie in the memory of the sequence's kernel backend (a daemon-created
  // score region on the sequence's device) instead of host memory: a single-rank
  // sequence reads them in place; a tensor-parallel one joins a host copy.
  bool in_backend = false;
  // With in_backend: keeps the memory behind partial_sums alive while the step waits for
  // its other ranks (a score region's mapping; may be null when the caller guarantees it).
  std::shared_ptr<const void> pin;
  // With in_backend: the device the partial sums are on (-1: the sequence's own).
  int device = -1;
};

// Joins partial sums that sit on several devices, one per rank: the tensor-parallel
// all-reduce (cache_manager/tp/nccl_cross_device_join.h on GPUs; CpuCrossDeviceJoiner for
// the emulated device). Thread-safe.
class CrossDeviceJoiner {
 public:
  virtual ~CrossDeviceJoiner() = default;
  // out = (sum over ranks r, in rank order, of partials[r] widened to double) /
  // total_heads, as float32 [layers, tokens] dense on `out_device`: bit for bit
  // kernels::cpu::JoinRankPartials. partials[r] lies in device memory on devices[r]; they
  // were written, and `out` is no longer read by queued work, before the call (the
  // caller synchronized its streams when it validated them). Returns once `out` is
  // complete. REQUIRES: devices distinct and out_device among them, every partial of the
  // same layers and tokens, total_heads >= 1. Errors: INTERNAL, DEADLINE_EXCEEDED.
  virtual absl::Status Join(std::span<const kernels::ScoreMatrix> partials,
                            std::span<const int> devices, int64_t total_heads, int out_device,
                            float* out) = 0;
};

// The emulated devices' joiner: their memory is the host's, so the CPU twin of the NCCL
// join's sum on its root (kernels::cpu::JoinRankPartials, in rank order) runs there.
class CpuCrossDeviceJoiner final : public CrossDeviceJoiner {
 public:
  absl::Status Join(std::span<const kernels::ScoreMatrix> partials, std::span<const int> devices,
                    int64_t total_heads, int out_device, float* out) override;
};

// What the step being joined expects of every report.
struct JoinExpectation {
  absl::string_view sequence_id;
  int64_t step = 0;           // the only step accepted
  int64_t tokens = 0;         // scores per layer: cache + the new token
  bool scoring_step = false;  // whether scores are required (otherwise they are ignored)
};

class TensorParallelJoin {
 public:
  // REQUIRES: world_size >= 1, backend.memory == kHost. `device_backend` (may be null):
  // the device backend (memory kDevice) of the sequence, on `device`, whose memory
  // in_backend reports are in; without it in_backend reports are host memory.
  // `cross_device` (may be null: such steps are gathered onto `device` first) joins
  // partial sums on one device per rank. `stream`: the sequence's stream of `device`
  // (MomentumState::stream()), where the join's work on `device` goes so that the step
  // that reads its result follows it in order, whichever thread runs either; nullptr: the
  // device backend's stream of the thread that first joins.
  explicit TensorParallelJoin(int32_t world_size,
                              const kernels::KernelBackend& backend = kernels::CpuBackend(),
                              const kernels::KernelBackend* device_backend = nullptr,
                              int device = 0, CrossDeviceJoiner* cross_device = nullptr,
                              kernels::StreamHandle stream = nullptr);
  ~TensorParallelJoin();
  TensorParallelJoin(const TensorParallelJoin&) = delete;
  TensorParallelJoin& operator=(const TensorParallelJoin&) = delete;

  int32_t world_size() const { return world_size_; }
  int32_t arrived() const { return arrived_; }
  bool complete() const { return arrived_ == world_size_; }
  bool any_scores_ignored() const { return scores_ignored_; }
  // Ranks that have not reported yet (for error messages).
  std::vector<int32_t> MissingRanks() const;

  // Validates and stores `report`. Errors: INVALID_ARGUMENT (rank outside the world, bad
  // head count, shape or values, layers differing from an earlier rank, scores missing
  // on a scoring step); FAILED_PRECONDITION (wrong step, rank already reported).
  absl::Status Add(const RankReport& report, const JoinExpectation& expect);

  // Whether a report of this step is in device memory: then JoinOnDevice, not Join.
  bool any_on_device() const { return any_on_device_; }

  // The joined [layers, tokens] float32 scores, or a matrix with layers == 0 when the step
  // carries none. Valid until the next Add/Reset. REQUIRES: complete(), !any_on_device().
  kernels::ScoreMatrix Join();
  // The same, in the device backend's memory, enqueued on the join's stream (where its
  // buffers are allocated too), whose next work, the sequence's step, reads the result in
  // stream order. INTERNAL when the device fails. REQUIRES: complete(), any_on_device().
  absl::StatusOr<kernels::ScoreMatrix> JoinOnDevice();

  // Forgets the reports of the current step, keeping buffers for the next. After a
  // JoinOnDevice it first waits for the device stream, so that no queued read of a
  // report's region outlives the region's pin.
  void Reset();

 private:
  struct Slot {
    bool arrived = false;
    kernels::ScoreMatrix view;  // into `bytes` (dense), or the report's device memory
    int64_t head_count = 0;
    std::vector<std::byte> bytes;
    bool on_device = false;             // view is the report's own device memory
    int device = 0;                     // ... on this device
    std::shared_ptr<const void> pin;    // ... kept alive by this
    void* device_copy = nullptr;        // on device_: a host report uploaded, or another
    size_t device_copy_bytes = 0;       // device's rows gathered, for JoinOnDevice
  };

  // The count of invalid elements of `p` (memory of `device`); INTERNAL on failure.
  absl::StatusOr<int64_t> CountInvalidOnDevice(const kernels::ScoreMatrix& p, int device);
  // The first invalid element of `p` (memory of `device`), for the message.
  kernels::InvalidScore FindInvalidOnDevice(const kernels::ScoreMatrix& p, int device);
  // stream_, from the device backend when none was given.
  absl::Status EnsureStream();
  // Allocates on the current device, ordered on stream_.
  absl::Status EnsureDeviceBuffer(size_t bytes, void** buffer, size_t* capacity);
  // Whether the step's partial sums sit one per rank on distinct devices, device_ among
  // them: the cross-device joiner's case.
  bool OnePerRankDevice() const;

  const int32_t world_size_;
  const kernels::KernelBackend* const backend_;
  const kernels::KernelBackend* const device_backend_;
  const int device_;
  CrossDeviceJoiner* const cross_device_;
  bool any_on_device_ = false;
  std::vector<int> devices_;  // reused by JoinOnDevice
  // Where the device work on device_ is enqueued: the sequence's (see the constructor).
  kernels::StreamHandle stream_ = nullptr;
  bool device_work_queued_ = false;         // JoinOnDevice ran since the last Reset
  std::vector<int64_t*> device_invalid_;   // [1] on each device, by device number
  int64_t* staged_invalid_ = nullptr;       // [1] host staging
  float* device_joined_ = nullptr;
  size_t device_joined_bytes_ = 0;
  std::vector<Slot> slots_;
  int32_t arrived_ = 0;
  int64_t layers_ = 0;  // of the first scored report of this step, 0 before it
  bool scores_ignored_ = false;
  std::vector<kernels::ScoreMatrix> views_;  // reused by Join
  std::vector<float> joined_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TP_TENSOR_PARALLEL_JOIN_H_

// TensorParallelJoin: gathers the per-rank reports of one decode step of one sequence and
// joins them into the step's layer scores (SPEC.md, "Tensor-parallel ranks"):
//
//   layer score = (sum over ranks p of sum_p) / (sum over ranks p of h_p)
//
// where sum_p is rank p's sum of its heads' attention rows and h_p its head count. Each
// report is validated when it arrives; a rejected report changes nothing and the others
// keep waiting. Reports are copied (the caller's buffers need not outlive Add) and joined
// in rank order, so the result does not depend on arrival order. Validation and the join
// run on the kernel backend the join was made with (kernels/backend.h; the CPU reference
// by default), over host memory: reports arrive in host memory. Partial sums that sit on
// the GPUs are joined by kernels/cuda/nccl_communicator.h instead.
// Not thread-safe: SequenceTable guards it with the sequence's mutex.
#ifndef KVCM_CACHE_MANAGER_TENSOR_PARALLEL_JOIN_H_
#define KVCM_CACHE_MANAGER_TENSOR_PARALLEL_JOIN_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
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
  // REQUIRES: world_size >= 1, backend.memory == kHost.
  explicit TensorParallelJoin(int32_t world_size,
                              const kernels::KernelBackend& backend = kernels::CpuBackend());

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

  // The joined [layers, tokens] float32 scores, or a matrix with layers == 0 when the step
  // carries none. Valid until the next Add/Reset. REQUIRES: complete().
  kernels::ScoreMatrix Join();

  // Forgets the reports of the current step, keeping buffers for the next.
  void Reset();

 private:
  struct Slot {
    bool arrived = false;
    kernels::ScoreMatrix view;  // into `bytes`, dense
    int64_t head_count = 0;
    std::vector<std::byte> bytes;
  };

  const int32_t world_size_;
  const kernels::KernelBackend* const backend_;
  std::vector<Slot> slots_;
  int32_t arrived_ = 0;
  int64_t layers_ = 0;  // of the first scored report of this step, 0 before it
  bool scores_ignored_ = false;
  std::vector<kernels::ScoreMatrix> views_;  // reused by Join
  std::vector<float> joined_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TENSOR_PARALLEL_JOIN_H_

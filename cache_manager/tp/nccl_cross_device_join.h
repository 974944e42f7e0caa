// NcclCrossDeviceJoiner: the tensor-parallel join of partial sums that sit one per rank
// on distinct GPUs of this process (daemon-created score regions placed on each rank's
// GPU): NcclCommunicator::JoinPartialSums (every rank sends its partials to the output's
// rank, which sums them in rank order: CpuCrossDeviceJoiner's result, bit for bit), then
// NcclCommunicator::Wait on the join's completion events, which polls
// ncclCommGetAsyncError under the timeout, so that a failed or hung collective is an error
// instead of a hang. The join runs on streams of its own, one per device, made with the
// clique: work other engine threads queued on their streams cannot make a finished join
// time out. Built with NCCL only (library kvcm::cache_manager_nccl).
//
// One clique per list of devices, made on first use and kept; one that failed (an NCCL
// error, the timeout: NcclCommunicator aborts it) is dropped, and the next join makes a
// new one. Joins run one at a time (the clique's buffers are shared). Thread-safe.
#ifndef KVCM_CACHE_MANAGER_TP_NCCL_CROSS_DEVICE_JOIN_H_
#define KVCM_CACHE_MANAGER_TP_NCCL_CROSS_DEVICE_JOIN_H_

#include <map>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_manager/tp/tensor_parallel_join.h"

namespace kvcm {
namespace kernels::cuda {
class NcclCommunicator;
}

class NcclCrossDeviceJoiner final : public CrossDeviceJoiner {
 public:
  explicit NcclCrossDeviceJoiner(absl::Duration timeout = absl::Seconds(10));
  ~NcclCrossDeviceJoiner() override;

  absl::Status Join(std::span<const kernels::ScoreMatrix> partials, std::span<const int> devices,
                    int64_t total_heads, int out_device, float* out) override;

 private:
  struct Clique;

  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::map<std::vector<int>, std::unique_ptr<Clique>> cliques_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TP_NCCL_CROSS_DEVICE_JOIN_H_

#include "cache_manager/tp/nccl_cross_device_join.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/nccl_communicator.h"

namespace kvcm {

// A clique and, per rank, the device buffers of its join: the double workspace, and the
// joined scores of the ranks whose result nobody reads (the caller's `out` is its own).
struct NcclCrossDeviceJoiner::Clique {
  std::unique_ptr<kernels::cuda::NcclCommunicator> comm;
  std::vector<void*> workspace;
  std::vector<void*> joined;
  std::vector<size_t> elements;  // what each rank's buffers hold

  ~Clique() {
    const kernels::BackendMemory& mem = kernels::cuda::CudaBackend().mem;
    for (size_t r = 0; r < workspace.size(); ++r) {
      if (!mem.set_device(comm->device(static_cast<int32_t>(r))).ok()) continue;
      mem.release(workspace[r]);
      mem.release(joined[r]);
    }
  }
};

NcclCrossDeviceJoiner::NcclCrossDeviceJoiner(absl::Duration timeout) : timeout_(timeout) {}

NcclCrossDeviceJoiner::~NcclCrossDeviceJoiner() = default;

absl::Status NcclCrossDeviceJoiner::Join(std::span<const kernels::ScoreMatrix> partials,
                                         std::span<const int> devices, int64_t total_heads,
                                         int out_device, float* out) {
  KVCM_CHECK(!partials.empty() && partials.size() == devices.size());
  const auto out_rank = static_cast<size_t>(
      std::find(devices.begin(), devices.end(), out_device) - devices.begin());
  KVCM_CHECK(out_rank < devices.size());
  const size_t n = static_cast<size_t>(partials[0].layers * partials[0].tokens);
  const kernels::BackendMemory& mem = kernels::cuda::CudaBackend().mem;

  absl::MutexLock lock(&mu_);
  std::vector<int> key(devices.begin(), devices.end());
  std::unique_ptr<Clique>& clique = cliques_[key];
  if (clique == nullptr) {
    absl::StatusOr<std::unique_ptr<kernels::cuda::NcclCommunicator>> comm =
        kernels::cuda::NcclCommunicator::Create(key);
    if (!comm.ok()) {
      cliques_.erase(key);
      return comm.status();
    }
    clique = std::make_unique<Clique>();
    clique->comm = *std::move(comm);
    clique->workspace.assign(key.size(), nullptr);
    clique->joined.assign(key.size(), nullptr);
    clique->elements.assign(key.size(), 0);
  }
  std::vector<kernels::cuda::RankJoinBuffers> buffers(key.size());
  std::vector<kernels::StreamHandle> streams(key.size());
  for (size_t r = 0; r < key.size(); ++r) {
    RETURN_IF_ERROR(mem.set_device(key[r]));
    if (clique->elements[r] < n) {
      mem.release(clique->workspace[r]);
      mem.release(clique->joined[r]);
      clique->workspace[r] = clique->joined[r] = nullptr;
      clique->elements[r] = 0;
      RETURN_IF_ERROR(mem.allocate(n * sizeof(double), &clique->workspace[r]));
      RETURN_IF_ERROR(mem.allocate(n * sizeof(float), &clique->joined[r]));
      clique->elements[r] = n;
    }
    RETURN_IF_ERROR(mem.device_stream(key[r], &streams[r]));
    buffers[r].partial_sums = partials[r];
    buffers[r].workspace = static_cast<double*>(clique->workspace[r]);
    buffers[r].joined = r == out_rank ? out : static_cast<float*>(clique->joined[r]);
    buffers[r].stream = streams[r];
  }
  absl::Status joined = clique->comm->JoinPartialSums(buffers, total_heads);
  if (joined.ok()) joined = clique->comm->Wait(streams, timeout_);
  if (!joined.ok()) {
    cliques_.erase(key);  // aborted or unusable: the next join makes a new clique
    return absl::Status(joined.code(),
                        absl::StrCat("the tensor-parallel join across GPUs: ", joined.message()));
  }
  return absl::OkStatus();
}

}  // namespace kvcm

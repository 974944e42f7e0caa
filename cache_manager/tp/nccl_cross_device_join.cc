#include "cache_manager/tp/nccl_cross_device_join.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/status_macros.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/nccl_communicator.h"

namespace kvcm {

// A clique and, per rank, what its joins use on the rank's device: a stream and an event of
// the join's own, made with the clique (the engine's streams may be busy with other
// sequences' steps, which must not count against the join's timeout), the staging of
// strided partial sums it sends, and, where it is the root, the gathered partial sums.
struct NcclCrossDeviceJoiner::Clique {
  std::unique_ptr<kernels::cuda::NcclCommunicator> comm;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> done;
  std::vector<void*> staging;
  std::vector<size_t> staging_bytes;
  std::vector<void*> gathered;
  std::vector<size_t> gathered_bytes;

  ~Clique() {
    const kernels::BackendMemory& mem = kernels::cuda::CudaBackend().mem;
    for (size_t r = 0; r < streams.size(); ++r) {
      if (!mem.set_device(comm->device(static_cast<int32_t>(r))).ok()) continue;
      mem.release(staging[r], streams[r]);  // after the joins queued there
      mem.release(gathered[r], streams[r]);
      if (done[r] != nullptr) cudaEventDestroy(done[r]);
      if (streams[r] != nullptr) cudaStreamDestroy(streams[r]);
    }
  }

  // The streams and events, on each rank's device.
  absl::Status MakeStreams() {
    const size_t world = static_cast<size_t>(comm->world_size());
    streams.assign(world, nullptr);
    done.assign(world, nullptr);
    staging.assign(world, nullptr);
    staging_bytes.assign(world, 0);
    gathered.assign(world, nullptr);
    gathered_bytes.assign(world, 0);
    for (size_t r = 0; r < world; ++r) {
      const int device = comm->device(static_cast<int32_t>(r));
      RETURN_IF_ERROR(kernels::cuda::CudaBackend().mem.set_device(device));
      const std::string what = absl::StrCat("the NCCL join on device ", device, ": ");
      RETURN_IF_ERROR(kernels::cuda::CudaStatus(
          cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking),
          absl::StrCat(what, "cudaStreamCreate")));
      RETURN_IF_ERROR(kernels::cuda::CudaStatus(
          cudaEventCreateWithFlags(&done[r], cudaEventDisableTiming),
          absl::StrCat(what, "cudaEventCreate")));
    }
    return absl::OkStatus();
  }

  // `*buffer` of at least `bytes` on the current device, ordered on `stream` (the rank's,
  // which uses it).
  static absl::Status Ensure(size_t bytes, cudaStream_t stream, void** buffer,
                             size_t* capacity) {
    if (bytes <= *capacity) return absl::OkStatus();
    const kernels::BackendMemory& mem = kernels::cuda::CudaBackend().mem;
    mem.release(*buffer, stream);
    *buffer = nullptr;
    *capacity = 0;
    RETURN_IF_ERROR(mem.allocate(bytes, stream, buffer));
    *capacity = bytes;
    return absl::OkStatus();
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
    absl::Status made = comm.status();
    if (made.ok()) {
      clique = std::make_unique<Clique>();
      clique->comm = *std::move(comm);
      made = clique->MakeStreams();
    }
    if (!made.ok()) {
      cliques_.erase(key);
      return made;
    }
  }
  std::vector<kernels::cuda::RankJoinBuffers> buffers(key.size());
  std::vector<void*> done(key.size());
  kernels::cuda::JoinRoot root;
  root.rank = static_cast<int32_t>(out_rank);
  root.joined = out;
  for (size_t r = 0; r < key.size(); ++r) {
    const kernels::ScoreMatrix& p = partials[r];
    buffers[r].partial_sums = p;
    buffers[r].stream = clique->streams[r];
    buffers[r].done = done[r] = clique->done[r];
    const bool packs = r != out_rank && p.layer_stride != p.tokens;
    if (!packs && r != out_rank) continue;
    RETURN_IF_ERROR(mem.set_device(key[r]));
    if (packs) {
      RETURN_IF_ERROR(Clique::Ensure(n * kernels::ScoreDtypeSize(p.dtype), clique->streams[r],
                                     &clique->staging[r], &clique->staging_bytes[r]));
      buffers[r].staging = clique->staging[r];
    }
    if (r == out_rank && key.size() > 1) {
      RETURN_IF_ERROR(Clique::Ensure(key.size() * n * sizeof(float), clique->streams[r],
                                     &clique->gathered[r], &clique->gathered_bytes[r]));
      root.gathered = clique->gathered[r];
    }
  }
  absl::Status joined = clique->comm->JoinPartialSums(buffers, total_heads, root);
  if (joined.ok()) joined = clique->comm->Wait(done, timeout_);
  if (!joined.ok()) {
    cliques_.erase(key);  // aborted or unusable: the next join makes a new clique
    return absl::Status(joined.code(),
                        absl::StrCat("the tensor-parallel join across GPUs: ", joined.message()));
  }
  return absl::OkStatus();
}

}  // namespace kvcm

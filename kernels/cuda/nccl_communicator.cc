#include "kernels/cuda/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/momentum_update_cuda.h"

namespace kvcm::kernels::cuda {
namespace {

absl::Status NcclStatus(ncclResult_t result, absl::string_view what) {
  if (result == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": NCCL error ", static_cast<int>(result), ": ",
                                          ncclGetErrorString(result)));
}

}  // namespace

struct NcclCommunicator::Comms {
  std::vector<ncclComm_t> comm;  // null once aborted
  ~Comms() {
    // Destroying frees device memory; aborting (AbortLocked) must never wait, so only
    // this takes the mutex.
    std::lock_guard<std::mutex> no_synchronizing_calls(SynchronizingCallMutex());
    for (ncclComm_t c : comm) {
      if (c != nullptr) ncclCommDestroy(c);
    }
  }
};

void NcclCommunicator::AbortLocked() {
  for (ncclComm_t& c : comms_->comm) {
    if (c != nullptr) ncclCommAbort(c);
    c = nullptr;
  }
  aborted_ = true;
}

absl::Status NcclCommunicator::Wait(std::span<void* const> done, absl::Duration timeout) {
  if (static_cast<int32_t>(done.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("Wait: ", done.size(),
                                                   " events for a world of ", world_size()));
  }
  absl::MutexLock lock(&mu_);
  if (aborted_) return absl::FailedPreconditionError("Wait: the communicator was aborted");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    bool finished = true;
    for (int32_t r = 0; r < world_size(); ++r) {
      ScopedDevice device(devices_[static_cast<size_t>(r)]);
      if (!device.status().ok()) return device.status();
      const cudaError_t query = cudaEventQuery(static_cast<cudaEvent_t>(done[r]));
      if (query == cudaErrorNotReady) {
        finished = false;
      } else if (query != cudaSuccess) {
        AbortLocked();
        return CudaStatus(query, absl::StrCat("the join on rank ", r));
      }
      ncclResult_t async = ncclSuccess;
      const ncclResult_t asked = ncclCommGetAsyncError(comms_->comm[static_cast<size_t>(r)], &async);
      const ncclResult_t failure = asked != ncclSuccess ? asked : async;
      if (failure != ncclSuccess && failure != ncclInProgress) {
        AbortLocked();
        return NcclStatus(failure, absl::StrCat("the join on rank ", r));
      }
    }
    if (finished) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      AbortLocked();
      return absl::DeadlineExceededError(absl::StrCat(
          "the NCCL join did not finish within ", absl::FormatDuration(timeout),
          "; the communicators were aborted"));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    std::vector<int> devices) {
  if (devices.empty()) {
    return absl::InvalidArgumentError("NcclCommunicator: no devices given");
  }
  std::vector<int> sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return absl::InvalidArgumentError(
        "NcclCommunicator: a device is listed twice; NCCL runs one rank per device");
  }
  const absl::StatusOr<int> devices_visible = VisibleDeviceCount();
  if (!devices_visible.ok()) return devices_visible.status();
  const int visible = *devices_visible;
  if (sorted.front() < 0 || sorted.back() >= visible) {
    return absl::InvalidArgumentError(absl::StrCat("NcclCommunicator: devices must be 0 to ",
                                                   visible - 1, " (", visible, " visible)"));
  }
  auto comms = std::make_unique<Comms>();
  comms->comm.assign(devices.size(), nullptr);
  // ncclCommInitAll allocates on every device and enqueues its own setup: not beside a
  // group or a synchronizing allocation of another thread.
  std::unique_lock<std::mutex> no_synchronizing_calls(SynchronizingCallMutex());
  absl::Status init = NcclStatus(
      ncclCommInitAll(comms->comm.data(), static_cast<int>(devices.size()), devices.data()),
      absl::StrCat("ncclCommInitAll over ", devices.size(), " devices"));
  no_synchronizing_calls.unlock();
  if (!init.ok()) return init;
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(devices), std::move(comms)));
}

NcclCommunicator::NcclCommunicator(std::vector<int> devices, std::unique_ptr<Comms> comms)
    : devices_(std::move(devices)), comms_(std::move(comms)) {}

NcclCommunicator::~NcclCommunicator() = default;

absl::Status NcclCommunicator::JoinPartialSums(std::span<const RankJoinBuffers> ranks,
                                               int64_t total_heads, const JoinRoot& root) {
  if (static_cast<int32_t>(ranks.size()) != world_size() || world_size() > kMaxJoinRanks) {
    return absl::InvalidArgumentError(absl::StrCat("JoinPartialSums: ", ranks.size(),
                                                   " ranks given, the world has ", world_size(),
                                                   " (at most ", kMaxJoinRanks, ")"));
  }
  if (total_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("JoinPartialSums: total_heads is ", total_heads, "; it must be >= 1"));
  }
  if (root.rank < 0 || root.rank >= world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("JoinPartialSums: root rank ", root.rank,
                                                   " in a world of ", world_size()));
  }
  const auto root_rank = static_cast<size_t>(root.rank);
  const ScoreMatrix& first = ranks[0].partial_sums;
  const bool any = first.layers * first.tokens > 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const ScoreMatrix& p = ranks[r].partial_sums;
    const bool needs_staging = r != root_rank && p.layer_stride != p.tokens;
    if (p.layers != first.layers || p.tokens != first.tokens || p.layer_stride < p.tokens ||
        ranks[r].stream == nullptr || ranks[r].done == nullptr ||
        (any && (p.data == nullptr || (needs_staging && ranks[r].staging == nullptr)))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "JoinPartialSums: rank ", r, " has [", p.layers, ", ", p.tokens,
          "] partial sums (stride ", p.layer_stride, "), rank 0 has [", first.layers, ", ",
          first.tokens, "]; every rank needs the same shape, a stream, an event and its buffers"));
    }
  }
  if (any && (root.joined == nullptr || (world_size() > 1 && root.gathered == nullptr))) {
    return absl::InvalidArgumentError("JoinPartialSums: the root's buffers are missing");
  }
  absl::MutexLock lock(&mu_);
  if (aborted_) {
    return absl::FailedPreconditionError("JoinPartialSums: the communicator was aborted");
  }
  const int64_t n = first.layers * first.tokens;
  const size_t slot_bytes = static_cast<size_t>(n) * sizeof(float);
  const auto stream_of = [&](size_t r) { return static_cast<cudaStream_t>(ranks[r].stream); };
  // What the root joins: its own partial sums in place, every other rank's in its slot.
  std::vector<ScoreMatrix> views(ranks.size());
  std::vector<const void*> sent(ranks.size());
  absl::Status status;
  for (size_t r = 0; r < ranks.size() && status.ok() && n > 0; ++r) {
    const ScoreMatrix& p = ranks[r].partial_sums;
    if (r == root_rank) {
      views[r] = p;
      continue;
    }
    views[r] = ScoreMatrix::Dense(static_cast<char*>(root.gathered) + r * slot_bytes, p.dtype,
                                  p.layers, p.tokens);
    sent[r] = p.data;
    if (p.layer_stride == p.tokens) continue;
    // Strided rows travel packed: NCCL sends one contiguous range.
    ScopedDevice device(devices_[r]);
    status = device.status();
    if (!status.ok()) break;
    const size_t row = static_cast<size_t>(p.tokens) * ScoreDtypeSize(p.dtype);
    status = CudaStatus(cudaMemcpy2DAsync(ranks[r].staging, row, p.data,
                                          static_cast<size_t>(p.layer_stride) * ScoreDtypeSize(p.dtype),
                                          row, static_cast<size_t>(p.layers),
                                          cudaMemcpyDeviceToDevice, stream_of(r)),
                        absl::StrCat("packing the partial sums of rank ", r));
    sent[r] = ranks[r].staging;
  }
  if (status.ok() && n > 0 && world_size() > 1) {
    // Every rank's part is enqueued before any call that may wait for a device runs.
    std::lock_guard<std::mutex> no_synchronizing_calls(SynchronizingCallMutex());
    status = NcclStatus(ncclGroupStart(), "ncclGroupStart");
    if (!status.ok()) return status;
    for (size_t r = 0; r < ranks.size() && status.ok(); ++r) {
      if (r == root_rank) continue;
      const size_t bytes = static_cast<size_t>(n) * ScoreDtypeSize(ranks[r].partial_sums.dtype);
      status = NcclStatus(ncclSend(sent[r], bytes, ncclUint8, root.rank, comms_->comm[r],
                                   stream_of(r)),
                          absl::StrCat("ncclSend from rank ", r));
      if (!status.ok()) break;
      status = NcclStatus(ncclRecv(const_cast<void*>(views[r].data), bytes, ncclUint8,
                                   static_cast<int>(r), comms_->comm[root_rank],
                                   stream_of(root_rank)),
                          absl::StrCat("ncclRecv on rank ", root.rank, " from rank ", r));
    }
    // The group must be closed even when an enqueue failed.
    const absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    if (status.ok()) status = end;
  }
  if (status.ok() && n > 0) {
    ScopedDevice device(devices_[root_rank]);
    status = device.status();
    if (status.ok()) {
      JoinRankPartials(views.data(), world_size(), total_heads, root.joined,
                       ranks[root_rank].stream);
      status = LaunchStatus(absl::StrCat("JoinRankPartials on rank ", root.rank));
    }
  }
  for (size_t r = 0; r < ranks.size() && status.ok(); ++r) {
    ScopedDevice device(devices_[r]);
    status = device.status();
    if (!status.ok()) break;
    status = CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(ranks[r].done), stream_of(r)),
                        absl::StrCat("recording the end of the join on rank ", r));
  }
  if (!status.ok()) AbortLocked();  // a half-enqueued group leaves the clique unusable
  return status;
}

}  // namespace kvcm::kernels::cuda

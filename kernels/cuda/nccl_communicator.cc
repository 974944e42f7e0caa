#include "kernels/cuda/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
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

absl::Status NcclCommunicator::Wait(std::span<const StreamHandle> streams, absl::Duration timeout) {
  if (static_cast<int32_t>(streams.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("Wait: ", streams.size(),
                                                   " streams for a world of ", world_size()));
  }
  absl::MutexLock lock(&mu_);
  if (aborted_) return absl::FailedPreconditionError("Wait: the communicator was aborted");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    bool done = true;
    for (int32_t r = 0; r < world_size(); ++r) {
      ScopedDevice device(devices_[static_cast<size_t>(r)]);
      if (!device.status().ok()) return device.status();
      const cudaError_t query = cudaStreamQuery(static_cast<cudaStream_t>(streams[r]));
      if (query == cudaErrorNotReady) {
        done = false;
      } else if (query != cudaSuccess) {
        AbortLocked();
        return CudaStatus(query, absl::StrCat("the join's stream on rank ", r));
      }
      ncclResult_t async = ncclSuccess;
      const ncclResult_t asked = ncclCommGetAsyncError(comms_->comm[static_cast<size_t>(r)], &async);
      const ncclResult_t failure = asked != ncclSuccess ? asked : async;
      if (failure != ncclSuccess && failure != ncclInProgress) {
        AbortLocked();
        return NcclStatus(failure, absl::StrCat("the join on rank ", r));
      }
    }
    if (done) return absl::OkStatus();
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
  absl::Status init = NcclStatus(
      ncclCommInitAll(comms->comm.data(), static_cast<int>(devices.size()), devices.data()),
      absl::StrCat("ncclCommInitAll over ", devices.size(), " devices"));
  if (!init.ok()) return init;
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(devices), std::move(comms)));
}

NcclCommunicator::NcclCommunicator(std::vector<int> devices, std::unique_ptr<Comms> comms)
    : devices_(std::move(devices)), comms_(std::move(comms)) {}

NcclCommunicator::~NcclCommunicator() = default;

absl::Status NcclCommunicator::AllReduceSum(std::span<double* const> buffers, int64_t count,
                                            std::span<const StreamHandle> streams) {
  if (static_cast<int32_t>(buffers.size()) != world_size() ||
      static_cast<int32_t>(streams.size()) != world_size() || count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AllReduceSum: ", buffers.size(), " buffers and ", streams.size(), " streams of ",
        count, " elements for a world of ", world_size(), " ranks"));
  }
  if (count == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (aborted_) {
    return absl::FailedPreconditionError("AllReduceSum: the communicator was aborted");
  }
  absl::Status status = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  if (!status.ok()) return status;
  for (int32_t r = 0; r < world_size() && status.ok(); ++r) {
    status = NcclStatus(
        ncclAllReduce(buffers[r], buffers[r], static_cast<size_t>(count), ncclFloat64, ncclSum,
                      comms_->comm[static_cast<size_t>(r)], static_cast<cudaStream_t>(streams[r])),
        absl::StrCat("ncclAllReduce on rank ", r));
  }
  // The group must be closed even when an enqueue failed.
  const absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  return status.ok() ? end : status;
}

absl::Status NcclCommunicator::JoinPartialSums(std::span<const RankJoinBuffers> ranks,
                                               int64_t total_heads) {
  if (static_cast<int32_t>(ranks.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("JoinPartialSums: ", ranks.size(),
                                                   " ranks given, the world has ",
                                                   world_size()));
  }
  if (total_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("JoinPartialSums: total_heads is ", total_heads, "; it must be >= 1"));
  }
  const ScoreMatrix& first = ranks[0].partial_sums;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const ScoreMatrix& p = ranks[r].partial_sums;
    if (p.layers != first.layers || p.tokens != first.tokens || p.layer_stride < p.tokens ||
        (p.layers > 0 && (p.data == nullptr || ranks[r].workspace == nullptr ||
                          ranks[r].joined == nullptr))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "JoinPartialSums: rank ", r, " has [", p.layers, ", ", p.tokens,
          "] partial sums (stride ", p.layer_stride, "), rank 0 has [", first.layers, ", ",
          first.tokens, "]; every rank needs the same shape and its buffers"));
    }
  }
  const int64_t n = first.layers * first.tokens;
  if (n == 0) return absl::OkStatus();
  std::vector<double*> wide(ranks.size());
  std::vector<StreamHandle> streams(ranks.size());
  // Widen, all-reduce, scale: three passes in stream order on every rank. The kernels are
  // enqueued outside the NCCL group (a group defers only the collectives).
  absl::Status status;
  for (size_t r = 0; r < ranks.size() && status.ok(); ++r) {
    ScopedDevice device(devices_[r]);
    status = device.status();
    if (!status.ok()) break;
    WidenPartialSums(ranks[r].partial_sums, ranks[r].workspace, ranks[r].stream);
    status = LaunchStatus(absl::StrCat("WidenPartialSums on rank ", r));
    wide[r] = ranks[r].workspace;
    streams[r] = ranks[r].stream;
  }
  if (status.ok()) status = AllReduceSum(wide, n, streams);
  for (size_t r = 0; r < ranks.size() && status.ok(); ++r) {
    ScopedDevice device(devices_[r]);
    status = device.status();
    if (!status.ok()) break;
    ScaleJoinedSums(ranks[r].workspace, n, total_heads, ranks[r].joined, ranks[r].stream);
    status = LaunchStatus(absl::StrCat("ScaleJoinedSums on rank ", r));
  }
  return status;
}

}  // namespace kvcm::kernels::cuda

#include "cache_manager/tp/tensor_parallel_join.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/engine/score_checks.h"
#include "kernels/momentum_update.h"
#include "kernels/score_validation.h"

namespace kvcm {

TensorParallelJoin::TensorParallelJoin(int32_t world_size,
                                       const kernels::KernelBackend& backend,
                                       const kernels::KernelBackend* device_backend, int device,
                                       CrossDeviceJoiner* cross_device,
                                       kernels::StreamHandle stream)
    : world_size_(world_size),
      backend_(&backend),
      device_backend_(device_backend != nullptr &&
                              device_backend->memory != kernels::MemorySpace::kHost
                          ? device_backend
                          : nullptr),
      device_(device),
      cross_device_(cross_device),
      stream_(stream),
      slots_(static_cast<size_t>(world_size)) {
  KVCM_CHECK(world_size >= 1);
  KVCM_CHECK(backend.memory == kernels::MemorySpace::kHost);
}

TensorParallelJoin::~TensorParallelJoin() {
  if (device_backend_ == nullptr) return;
  const kernels::BackendMemory& mem = device_backend_->mem;
  if (!mem.set_device(device_).ok()) return;  // the device is gone; so is its memory
  // Queued reads of the buffers and the pinned regions end before either goes.
  if (device_work_queued_) (void)mem.synchronize(stream_, "destroying a tensor-parallel join");
  for (Slot& slot : slots_) mem.release(slot.device_copy, stream_);
  mem.release(device_joined_, stream_);
  mem.release_staging(staged_invalid_);
  // Each counter's last use was waited for; it goes on the stream it was made on (the
  // sequence's for its own device, this thread's elsewhere: any stream there would do).
  for (size_t d = 0; d < device_invalid_.size(); ++d) {
    const int device = static_cast<int>(d);
    kernels::StreamHandle stream = device == device_ ? stream_ : nullptr;
    if (device_invalid_[d] != nullptr && mem.set_device(device).ok() &&
        (stream != nullptr || mem.device_stream(device, &stream).ok())) {
      mem.release(device_invalid_[d], stream);
    }
  }
}

absl::Status TensorParallelJoin::EnsureStream() {
  if (stream_ != nullptr) return absl::OkStatus();
  return device_backend_->mem.device_stream(device_, &stream_);
}

absl::Status TensorParallelJoin::EnsureDeviceBuffer(size_t bytes, void** buffer,
                                                    size_t* capacity) {
  if (bytes <= *capacity) return absl::OkStatus();
  const kernels::BackendMemory& mem = device_backend_->mem;
  mem.release(*buffer, stream_);  // after the earlier joins queued there
  *buffer = nullptr;
  *capacity = 0;
  RETURN_IF_ERROR(mem.allocate(bytes, stream_, buffer));
  *capacity = bytes;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> TensorParallelJoin::CountInvalidOnDevice(const kernels::ScoreMatrix& p,
                                                                 int device) {
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("device ", device));
  const kernels::BackendMemory& mem = device_backend_->mem;
  RETURN_IF_ERROR(mem.set_device(device));
  // The sequence's stream on its own device; another device's, this thread's there. The
  // counting is waited for below, whichever it is.
  kernels::StreamHandle stream = nullptr;
  if (device == device_) {
    RETURN_IF_ERROR(EnsureStream());
    stream = stream_;
  } else {
    RETURN_IF_ERROR(mem.device_stream(device, &stream));
  }
  // A counter in each device's own memory (no peer access needed).
  if (static_cast<size_t>(device) >= device_invalid_.size()) {
    device_invalid_.resize(static_cast<size_t>(device) + 1, nullptr);
  }
  int64_t*& counter = device_invalid_[static_cast<size_t>(device)];
  if (counter == nullptr) {
    void* d = nullptr;
    RETURN_IF_ERROR(mem.allocate(sizeof(int64_t), stream, &d));
    counter = static_cast<int64_t*>(d);
  }
  if (staged_invalid_ == nullptr) {
    void* h = nullptr;
    RETURN_IF_ERROR(mem.allocate_staging(sizeof(int64_t), &h));
    staged_invalid_ = static_cast<int64_t*>(h);
  }
  device_backend_->count_invalid_scores(p, counter, stream);
  RETURN_IF_ERROR(mem.copy(staged_invalid_, counter, sizeof(int64_t),
                           kernels::CopyKind::kBackendToHost, stream));
  RETURN_IF_ERROR(mem.synchronize(stream, "validating partial sums"));
  return *staged_invalid_;
}

kernels::InvalidScore TensorParallelJoin::FindInvalidOnDevice(const kernels::ScoreMatrix& p,
                                                              int device) {
  // The slow path of an error message: one download of the rows.
  const kernels::BackendMemory& mem = device_backend_->mem;
  kernels::StreamHandle stream = nullptr;
  if (!mem.set_device(device).ok() || !mem.device_stream(device, &stream).ok()) {
    return kernels::InvalidScore{};
  }
  std::vector<std::byte> host;
  absl::StatusOr<kernels::ScoreMatrix> on_host = kernels::DownloadScores(mem, stream, p, &host);
  return on_host.ok() ? kernels::FindFirstInvalidScore(*on_host) : kernels::InvalidScore{};
}

absl::Status CpuCrossDeviceJoiner::Join(std::span<const kernels::ScoreMatrix> partials,
                                        std::span<const int> devices, int64_t total_heads,
                                        int out_device, float* out) {
  KVCM_CHECK(!partials.empty() && partials.size() == devices.size() && total_heads >= 1);
  KVCM_CHECK(std::find(devices.begin(), devices.end(), out_device) != devices.end());
  // What the NCCL join's root does with the partials it gathered: the twin of its
  // kernels::cuda::JoinRankPartials, summing in rank order.
  kernels::cpu::JoinRankPartials(partials.data(), static_cast<int64_t>(partials.size()),
                                 total_heads, out, nullptr);
  return absl::OkStatus();
}

std::vector<int32_t> TensorParallelJoin::MissingRanks() const {
  std::vector<int32_t> missing;
  for (int32_t r = 0; r < world_size_; ++r) {
    if (!slots_[static_cast<size_t>(r)].arrived) missing.push_back(r);
  }
  return missing;
}

absl::Status TensorParallelJoin::Add(const RankReport& report, const JoinExpectation& expect) {
  const auto where = [&]() {
    return DescribeScoresAt(ScoresAt{expect.sequence_id, report.step, report.rank});
  };
  if (report.rank < 0 || report.rank >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "rank is outside the tensor-parallel world of ", world_size_, " ranks"));
  }
  if (report.step != expect.step) {
    return absl::FailedPreconditionError(
        absl::StrCat(where(), "step is out of order; expected step ", expect.step));
  }
  Slot& slot = slots_[static_cast<size_t>(report.rank)];
  if (slot.arrived) {
    return absl::FailedPreconditionError(
        absl::StrCat(where(), "this rank already reported this step"));
  }
  const kernels::ScoreMatrix& p = report.partial_sums;
  const bool has_scores = p.layers > 0;
  if (!has_scores) {
    if (expect.scoring_step) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "this is a scoring step and the report carries no partial sums (need ",
          expect.tokens, " per layer)"));
    }
  } else if (expect.scoring_step) {
    if (report.head_count < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "head_count is ", report.head_count, "; it must be >= 1"));
    }
    const ScoresAt at{expect.sequence_id, report.step, report.rank};
    RETURN_IF_ERROR(CheckScoreShape(at, "partial sums", p, expect.tokens - 1));
    if (layers_ != 0 && p.layers != layers_) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "report has ", p.layers, " layers, earlier ranks reported ", layers_));
    }
    const bool on_device = report.in_backend && device_backend_ != nullptr;
    const int device = report.device >= 0 ? report.device : device_;
    int64_t invalid = 0;
    if (on_device) {
      absl::StatusOr<int64_t> counted = CountInvalidOnDevice(p, device);
      if (!counted.ok()) {
        return absl::InternalError(absl::StrCat(where(), counted.status().message()));
      }
      invalid = *counted;
    } else {
      backend_->count_invalid_scores(p, &invalid, nullptr);
    }
    if (invalid != 0) {
      const kernels::InvalidScore bad =
          on_device ? FindInvalidOnDevice(p, device) : kernels::FindFirstInvalidScore(p);
      return InvalidScoreError(at, absl::StrCat("layer ", bad.layer), "partial sum", bad.index,
                               -1, bad.value, "partial sums");
    }
    slot.head_count = report.head_count;
    layers_ = p.layers;
    if (on_device) {
      // Accepted, in place: the rows stay where the worker wrote them until the join.
      slot.view = p;
      slot.pin = report.pin;
      slot.on_device = true;
      slot.device = device;
      any_on_device_ = true;
      slot.arrived = true;
      ++arrived_;
      return absl::OkStatus();
    }
    // Accepted: copy it densely (host to host: the CPU backend's memory is host memory).
    slot.bytes.resize(static_cast<size_t>(p.layers * p.tokens) * kernels::ScoreDtypeSize(p.dtype));
    RETURN_IF_ERROR(kernels::CopyScoreRowsDense(kernels::CpuBackend().mem, p, slot.bytes.data(),
                                                kernels::CopyKind::kWithinBackend, nullptr));
    slot.view = kernels::ScoreMatrix::Dense(slot.bytes.data(), p.dtype, p.layers, p.tokens);
  }
  if (has_scores && !expect.scoring_step) scores_ignored_ = true;
  slot.arrived = true;
  ++arrived_;
  return absl::OkStatus();
}

bool TensorParallelJoin::OnePerRankDevice() const {
  bool has_own = false;
  for (size_t r = 0; r < slots_.size(); ++r) {
    if (!slots_[r].on_device) return false;
    has_own = has_own || slots_[r].device == device_;
    for (size_t q = 0; q < r; ++q) {
      if (slots_[q].device == slots_[r].device) return false;
    }
  }
  return has_own && slots_.size() > 1;
}

absl::StatusOr<kernels::ScoreMatrix> TensorParallelJoin::JoinOnDevice() {
  KVCM_CHECK(complete() && any_on_device_ && device_backend_ != nullptr);
  const kernels::BackendMemory& mem = device_backend_->mem;
  RETURN_IF_ERROR(mem.set_device(device_));
  RETURN_IF_ERROR(EnsureStream());
  // From here work may be queued that reads the reports' regions: Reset waits for it.
  device_work_queued_ = true;
  views_.clear();
  devices_.clear();
  int64_t total_heads = 0;
  for (const Slot& slot : slots_) total_heads += slot.head_count;
  const Slot& any = *std::find_if(slots_.begin(), slots_.end(),
                                  [](const Slot& slot) { return slot.on_device; });
  const int64_t layers = any.view.layers, tokens = any.view.tokens;
  void* joined = device_joined_;
  const size_t had_bytes = device_joined_bytes_;
  RETURN_IF_ERROR(EnsureDeviceBuffer(static_cast<size_t>(layers * tokens) * sizeof(float),
                                     &joined, &device_joined_bytes_));
  // (Not the pointer: a new allocation may well reuse the freed one's address.)
  const bool newly_allocated = device_joined_bytes_ != had_bytes;
  device_joined_ = static_cast<float*>(joined);
  const kernels::ScoreMatrix result = kernels::ScoreMatrix::Dense(
      device_joined_, kernels::ScoreDtype::kFloat32, layers, tokens);

  if (cross_device_ != nullptr && OnePerRankDevice()) {
    // Each rank's partial sums on a device of its own: the all-reduce across them.
    for (const Slot& slot : slots_) {
      views_.push_back(slot.view);
      devices_.push_back(slot.device);
    }
    // The joiner writes the result on streams of its own, while memory just allocated is
    // ordered on stream_: usable elsewhere once stream_ ran dry. (The last step's reads
    // of an older buffer were waited for by that step.)
    if (newly_allocated) {
      RETURN_IF_ERROR(mem.synchronize(stream_, "allocating a joined step's scores"));
    }
    RETURN_IF_ERROR(cross_device_->Join(views_, devices_, total_heads, device_, device_joined_));
    return result;
  }
  for (Slot& slot : slots_) {
    if (slot.on_device && slot.device == device_) {
      views_.push_back(slot.view);
      continue;
    }
    // Onto device_ first: a host report uploaded (the copy is done with the host bytes
    // when it returns), another device's rows by peer copies; the join reads them on the
    // same stream.
    const size_t bytes = static_cast<size_t>(slot.view.layers * slot.view.tokens) *
                         kernels::ScoreDtypeSize(slot.view.dtype);
    RETURN_IF_ERROR(EnsureDeviceBuffer(bytes, &slot.device_copy, &slot.device_copy_bytes));
    RETURN_IF_ERROR(kernels::CopyScoreRowsDense(
        mem, slot.view, slot.device_copy,
        slot.on_device ? kernels::CopyKind::kWithinBackend : kernels::CopyKind::kHostToBackend,
        stream_));
    views_.push_back(kernels::ScoreMatrix::Dense(slot.device_copy, slot.view.dtype,
                                                 slot.view.layers, slot.view.tokens));
  }
  device_backend_->join_rank_partials(views_.data(), static_cast<int64_t>(views_.size()),
                                      total_heads, device_joined_, stream_);
  return result;
}

kernels::ScoreMatrix TensorParallelJoin::Join() {
  KVCM_CHECK(complete() && !any_on_device_);
  if (layers_ == 0) return kernels::ScoreMatrix{};
  views_.clear();
  int64_t total_heads = 0;
  for (const Slot& slot : slots_) {
    views_.push_back(slot.view);
    total_heads += slot.head_count;
  }
  const kernels::ScoreMatrix& first = views_.front();
  joined_.resize(static_cast<size_t>(first.layers * first.tokens));
  backend_->join_rank_partials(views_.data(), static_cast<int64_t>(views_.size()),
                               total_heads, joined_.data(), nullptr);
  return kernels::ScoreMatrix::Dense(joined_.data(), kernels::ScoreDtype::kFloat32,
                                     first.layers, first.tokens);
}

void TensorParallelJoin::Reset() {
  // The regions pinned below may be freed with their last pin (a created region
  // unregistered meanwhile): the join's queued reads of them must have run first. The
  // engine has normally waited for the stream already (its step reads the result), so this
  // returns at once; it matters when the step failed between the join and that wait.
  if (device_work_queued_) {
    (void)device_backend_->mem.synchronize(stream_, "releasing a joined step's score regions");
    device_work_queued_ = false;
  }
  for (Slot& slot : slots_) {
    slot.arrived = false;
    slot.head_count = 0;
    slot.view = kernels::ScoreMatrix{};
    slot.on_device = false;
    slot.pin.reset();
    // The first step of a long prefill is far larger than the steady steps that follow.
    if (slot.bytes.capacity() > 2 * slot.bytes.size() + 4096) slot.bytes.shrink_to_fit();
  }
  if (joined_.capacity() > 2 * joined_.size() + 1024) joined_.shrink_to_fit();
  arrived_ = 0;
  layers_ = 0;
  scores_ignored_ = false;
  any_on_device_ = false;
}

}  // namespace kvcm

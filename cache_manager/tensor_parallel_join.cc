#include "cache_manager/tensor_parallel_join.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cache_manager/check.h"
#include "cache_manager/status_macros.h"
#include "kernels/score_validation.h"

namespace kvcm {

TensorParallelJoin::TensorParallelJoin(int32_t world_size,
                                       const kernels::KernelBackend& backend,
                                       const kernels::KernelBackend* device_backend, int device)
    : world_size_(world_size),
      backend_(&backend),
      device_backend_(device_backend != nullptr &&
                              device_backend->memory != kernels::MemorySpace::kHost
                          ? device_backend
                          : nullptr),
      device_(device),
      slots_(static_cast<size_t>(world_size)) {
  KVCM_CHECK(world_size >= 1);
  KVCM_CHECK(backend.memory == kernels::MemorySpace::kHost);
}

TensorParallelJoin::~TensorParallelJoin() {
  if (device_backend_ == nullptr) return;
  const kernels::BackendMemory& mem = device_backend_->mem;
  if (!mem.set_device(device_).ok()) return;  // the device is gone; so is its memory
  for (Slot& slot : slots_) mem.release(slot.device_copy);
  mem.release(device_joined_);
  mem.release(device_invalid_);
  mem.release_staging(staged_invalid_);
}

absl::Status TensorParallelJoin::EnsureDeviceBuffer(size_t bytes, void** buffer,
                                                    size_t* capacity) {
  if (bytes <= *capacity) return absl::OkStatus();
  const kernels::BackendMemory& mem = device_backend_->mem;
  mem.release(*buffer);
  *buffer = nullptr;
  *capacity = 0;
  RETURN_IF_ERROR(mem.allocate(bytes, buffer));
  *capacity = bytes;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> TensorParallelJoin::CountInvalidOnDevice(const kernels::ScoreMatrix& p) {
  const kernels::BackendMemory& mem = device_backend_->mem;
  RETURN_IF_ERROR(mem.set_device(device_));
  if (stream_ == nullptr) RETURN_IF_ERROR(mem.device_stream(device_, &stream_));
  if (device_invalid_ == nullptr) {
    void* d = nullptr;
    RETURN_IF_ERROR(mem.allocate(sizeof(int64_t), &d));
    device_invalid_ = static_cast<int64_t*>(d);
  }
  if (staged_invalid_ == nullptr) {
    void* h = nullptr;
    RETURN_IF_ERROR(mem.allocate_staging(sizeof(int64_t), &h));
    staged_invalid_ = static_cast<int64_t*>(h);
  }
  device_backend_->count_invalid_scores(p, device_invalid_, stream_);
  RETURN_IF_ERROR(mem.copy(staged_invalid_, device_invalid_, sizeof(int64_t),
                           kernels::CopyKind::kBackendToHost, stream_));
  RETURN_IF_ERROR(mem.synchronize(stream_, "validating partial sums"));
  return *staged_invalid_;
}

kernels::InvalidScore TensorParallelJoin::FindInvalidOnDevice(const kernels::ScoreMatrix& p) {
  // The slow path of an error message: one download of the rows.
  const kernels::BackendMemory& mem = device_backend_->mem;
  const size_t row_bytes = static_cast<size_t>(p.tokens) * kernels::ScoreDtypeSize(p.dtype);
  std::vector<std::byte> host(row_bytes * static_cast<size_t>(p.layers));
  for (int64_t layer = 0; layer < p.layers; ++layer) {
    if (!mem.copy(host.data() + static_cast<size_t>(layer) * row_bytes, p.Row(layer), row_bytes,
                  kernels::CopyKind::kBackendToHost, stream_)
             .ok()) {
      return kernels::InvalidScore{};
    }
  }
  if (!mem.synchronize(stream_, "reading partial sums back").ok()) return kernels::InvalidScore{};
  return kernels::FindFirstInvalidScore(
      kernels::ScoreMatrix::Dense(host.data(), p.dtype, p.layers, p.tokens));
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
    return absl::StrCat("sequence '", expect.sequence_id, "' step ", report.step, " rank ",
                        report.rank, ": ");
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
    if (p.tokens != expect.tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "partial sums cover ", p.tokens, " tokens per layer, the cache holds ",
          expect.tokens, " (cached + the new token)"));
    }
    if (layers_ != 0 && p.layers != layers_) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "report has ", p.layers, " layers, earlier ranks reported ", layers_));
    }
    if (p.data == nullptr || p.layer_stride < p.tokens) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "malformed partial sums"));
    }
    const bool on_device = report.in_backend && device_backend_ != nullptr;
    int64_t invalid = 0;
    if (on_device) {
      absl::StatusOr<int64_t> counted = CountInvalidOnDevice(p);
      if (!counted.ok()) {
        return absl::InternalError(absl::StrCat(where(), counted.status().message()));
      }
      invalid = *counted;
    } else {
      backend_->count_invalid_scores(p, &invalid, nullptr);
    }
    if (invalid != 0) {
      const kernels::InvalidScore bad =
          on_device ? FindInvalidOnDevice(p) : kernels::FindFirstInvalidScore(p);
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "layer ", bad.layer, " partial sum ", bad.index, " is ", bad.value,
          "; partial sums must be finite and >= 0"));
    }
    slot.head_count = report.head_count;
    layers_ = p.layers;
    if (on_device) {
      // Accepted, in place: the rows stay where the worker wrote them until the join.
      slot.view = p;
      slot.pin = report.pin;
      slot.on_device = true;
      any_on_device_ = true;
      slot.arrived = true;
      ++arrived_;
      return absl::OkStatus();
    }
    // Accepted: copy it densely.
    const size_t row_bytes = static_cast<size_t>(p.tokens) * kernels::ScoreDtypeSize(p.dtype);
    slot.bytes.resize(row_bytes * static_cast<size_t>(p.layers));
    for (int64_t layer = 0; layer < p.layers; ++layer) {
      std::memcpy(slot.bytes.data() + static_cast<size_t>(layer) * row_bytes, p.Row(layer),
                  row_bytes);
    }
    slot.view = kernels::ScoreMatrix::Dense(slot.bytes.data(), p.dtype, p.layers, p.tokens);
  }
  if (has_scores && !expect.scoring_step) scores_ignored_ = true;
  slot.arrived = true;
  ++arrived_;
  return absl::OkStatus();
}

absl::StatusOr<kernels::ScoreMatrix> TensorParallelJoin::JoinOnDevice() {
  KVCM_CHECK(complete() && any_on_device_ && device_backend_ != nullptr);
  const kernels::BackendMemory& mem = device_backend_->mem;
  RETURN_IF_ERROR(mem.set_device(device_));
  if (stream_ == nullptr) RETURN_IF_ERROR(mem.device_stream(device_, &stream_));
  views_.clear();
  int64_t total_heads = 0;
  for (Slot& slot : slots_) {
    if (!slot.on_device) {
      // A host report of a step the others sent in device memory: uploaded (the copy is
      // done with the host bytes when it returns; the join reads it on the same stream).
      RETURN_IF_ERROR(
          EnsureDeviceBuffer(slot.bytes.size(), &slot.device_copy, &slot.device_copy_bytes));
      RETURN_IF_ERROR(mem.copy(slot.device_copy, slot.bytes.data(), slot.bytes.size(),
                               kernels::CopyKind::kHostToBackend, stream_));
      views_.push_back(kernels::ScoreMatrix::Dense(slot.device_copy, slot.view.dtype,
                                                   slot.view.layers, slot.view.tokens));
    } else {
      views_.push_back(slot.view);
    }
    total_heads += slot.head_count;
  }
  const kernels::ScoreMatrix& first = views_.front();
  void* joined = device_joined_;
  RETURN_IF_ERROR(EnsureDeviceBuffer(
      static_cast<size_t>(first.layers * first.tokens) * sizeof(float), &joined,
      &device_joined_bytes_));
  device_joined_ = static_cast<float*>(joined);
  device_backend_->join_rank_partials(views_.data(), static_cast<int64_t>(views_.size()),
                                      total_heads, device_joined_, stream_);
  return kernels::ScoreMatrix::Dense(device_joined_, kernels::ScoreDtype::kFloat32,
                                     first.layers, first.tokens);
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

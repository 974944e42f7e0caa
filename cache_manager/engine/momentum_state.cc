#include "cache_manager/engine/momentum_state.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "cache_manager/base/check.h"

namespace kvcm {

using kernels::CopyKind;

// The arrays of a device backend. Everything in the backend's memory is [capacity]
// unless stated; the staging buffers are host memory the backend copies to fastest.
struct MomentumState::DeviceArrays {
  const kernels::KernelBackend* backend = nullptr;
  int device = 0;
  kernels::StreamHandle stream = nullptr;
  int64_t capacity = 0;

  float* momentum = nullptr;
  float* scratch = nullptr;          // a scoring step's output until it is committed
  int64_t* positions = nullptr;
  int64_t* selected = nullptr;       // indices a step evicts
  int64_t* gathered = nullptr;       // their positions
  uint64_t* select_keys = nullptr;   // SelectLowest's scratch (the CPU kernels use it)
  int64_t* invalid = nullptr;        // [1]
  double* mean = nullptr;            // [1]
  void* scores = nullptr;            // host scores uploaded for a step
  size_t score_bytes = 0;

  int64_t* staged_indices = nullptr;    // [capacity] host
  int64_t* staged_positions = nullptr;  // [capacity] host
  int64_t* staged_invalid = nullptr;    // [1] host
  double* staged_mean = nullptr;        // [1] host

  // FirstUnprotectedSinkIndex without a download per step: the count of cached positions
  // below the threshold it was last asked for, kept up to date by appends and evictions.
  int64_t sink_threshold = -1;  // -1: not asked yet
  int64_t sink_count = 0;
  bool last_append_below_sinks = false;

  // Host copies for positions() and momentum().
  std::vector<int64_t> mirror_positions;
  std::vector<float> mirror_momentum;
  bool mirror_valid = false;

  ~DeviceArrays() {
    if (backend == nullptr) return;
    const kernels::BackendMemory& mem = backend->mem;
    (void)mem.set_device(device);
    (void)mem.synchronize(stream, "releasing a sequence");
    for (void* p : {static_cast<void*>(momentum), static_cast<void*>(scratch),
                    static_cast<void*>(positions), static_cast<void*>(selected),
                    static_cast<void*>(gathered), static_cast<void*>(select_keys),
                    static_cast<void*>(invalid), static_cast<void*>(mean), scores}) {
      mem.release(p);
    }
    for (void* p : {static_cast<void*>(staged_indices), static_cast<void*>(staged_positions),
                    static_cast<void*>(staged_invalid), static_cast<void*>(staged_mean)}) {
      mem.release_staging(p);
    }
  }
};

namespace {

template <typename T>
absl::Status Allocate(const kernels::BackendMemory& mem, int64_t count, T** ptr) {
  void* raw = nullptr;
  absl::Status status = mem.allocate(static_cast<size_t>(count) * sizeof(T), &raw);
  *ptr = static_cast<T*>(raw);
  return status;
}

template <typename T>
absl::Status AllocateStaging(const kernels::BackendMemory& mem, int64_t count, T** ptr) {
  void* raw = nullptr;
  absl::Status status = mem.allocate_staging(static_cast<size_t>(count) * sizeof(T), &raw);
  *ptr = static_cast<T*>(raw);
  return status;
}

// Bytes from the first score of a strided matrix to just after its last one.
size_t ScoreSpanBytes(const kernels::ScoreMatrix& scores) {
  if (scores.layers <= 0 || scores.tokens <= 0) return 0;
  return static_cast<size_t>((scores.layers - 1) * scores.layer_stride + scores.tokens) *
         kernels::ScoreDtypeSize(scores.dtype);
}

// Bytes per token of capacity. Host: positions (8), momentum (4), the update scratch (4),
// the selection keys (8) and the selected indices (8). Device: momentum, scratch,
// positions, selected, gathered, selection keys (4+4+8+8+8+8), the two host staging
// arrays (16) and the host index scratch (8).
int64_t BytesPerToken(const kernels::KernelBackend& backend) {
  return backend.memory == kernels::MemorySpace::kHost ? 32 : 64;
}

}  // namespace

int64_t MomentumState::BytesFor(int64_t tokens, const kernels::KernelBackend& backend) {
  const int64_t per_token = BytesPerToken(backend);
  if (tokens <= 0) return 0;
  if (tokens > std::numeric_limits<int64_t>::max() / per_token) {
    return std::numeric_limits<int64_t>::max();
  }
  return tokens * per_token;
}

int64_t MomentumState::capacity() const {
  return device_ != nullptr ? device_->capacity : capacity_;
}

int64_t MomentumState::reserved_bytes() const { return BytesFor(capacity(), *backend_); }

int64_t MomentumState::GrownCapacity() const {
  // Saturating: a budget of INT64_MAX tokens is legal (the cache then never evicts), and
  // budget + 1 wrapped (UBSan, found by open_sequence_fuzzer).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t most = std::max(budget_, size());
  const int64_t limit = most < kMax ? most + 1 : kMax;
  const int64_t doubled = capacity() < kMax / 2 ? 2 * capacity() : kMax;
  return std::max(size() + 1, std::min(doubled, limit));
}

int64_t MomentumState::BytesToAppend() const {
  if (size() + 1 <= capacity()) return 0;
  return BytesFor(GrownCapacity(), *backend_) - reserved_bytes();
}

namespace {

// The prefill cache {0 .. prefill_len-1} and its starting momentum.
struct PrefillCache {
  std::vector<int64_t> positions;
  std::vector<float> momentum;
};

PrefillCache MakePrefillCache(int64_t prefill_len, bool momentum_is_position) {
  PrefillCache cache;
  cache.positions.resize(static_cast<size_t>(prefill_len));
  cache.momentum.resize(static_cast<size_t>(prefill_len));
  for (int64_t i = 0; i < prefill_len; ++i) {
    cache.positions[static_cast<size_t>(i)] = i;
    cache.momentum[static_cast<size_t>(i)] = momentum_is_position ? static_cast<float>(i) : 0.0f;
  }
  return cache;
}

}  // namespace

MomentumState::MomentumState(int64_t prefill_len, int64_t budget, bool momentum_is_position,
                             const kernels::KernelBackend& backend, int device)
    : backend_(&backend), budget_(budget) {
  const PrefillCache cache = MakePrefillCache(prefill_len, momentum_is_position);
  Init(cache.positions, cache.momentum, device);
}

MomentumState::MomentumState(std::span<const int64_t> positions, std::span<const float> momentum,
                             int64_t budget, const kernels::KernelBackend& backend, int device)
    : backend_(&backend), budget_(budget) {
  KVCM_CHECK(positions.size() == momentum.size());
  Init(positions, momentum, device);
}

void MomentumState::Init(std::span<const int64_t> positions, std::span<const float> momentum,
                         int device) {
  const auto tokens = static_cast<int64_t>(positions.size());
  const int64_t capacity = tokens + 1;
  if (backend_->memory == kernels::MemorySpace::kHost) {
    Reserve(capacity);
    positions_.assign(positions.begin(), positions.end());
    momentum_.assign(momentum.begin(), momentum.end());
    return;
  }
  device_ = std::make_unique<DeviceArrays>();
  DeviceArrays& d = *device_;
  d.backend = backend_;
  d.device = device;
  const kernels::BackendMemory& mem = backend_->mem;
  if (!Check(mem.set_device(device)) || !Check(mem.device_stream(device, &d.stream)) ||
      !Check(Allocate(mem, 1, &d.invalid)) || !Check(Allocate(mem, 1, &d.mean)) ||
      !Check(AllocateStaging(mem, 1, &d.staged_invalid)) ||
      !Check(AllocateStaging(mem, 1, &d.staged_mean))) {
    return;
  }
  ReserveDevice(capacity);
  if (!status_.ok()) return;
  if (!Check(mem.copy(d.positions, positions.data(), positions.size() * sizeof(int64_t),
                      CopyKind::kHostToBackend, d.stream)) ||
      !Check(mem.copy(d.momentum, momentum.data(), momentum.size() * sizeof(float),
                      CopyKind::kHostToBackend, d.stream)) ||
      !Check(mem.synchronize(d.stream, "uploading the cache"))) {
    return;
  }
  device_size_ = tokens;
}

MomentumState::~MomentumState() = default;

bool MomentumState::Check(const absl::Status& status) const {
  if (!status.ok() && status_.ok()) status_ = status;
  return status.ok();
}

void MomentumState::Reserve(int64_t capacity) {
  capacity_ = capacity;
  const auto n = static_cast<size_t>(capacity);
  positions_.reserve(n);
  momentum_.reserve(n);
  update_scratch_.resize(n);
  select_scratch_.resize(n);
  selected_scratch_.resize(n);
}

void MomentumState::ReserveDevice(int64_t capacity) {
  DeviceArrays& d = *device_;
  const kernels::BackendMemory& mem = backend_->mem;
  DeviceArrays next;  // takes the old arrays on success, the new ones on failure
  next.backend = backend_;
  next.device = d.device;
  next.stream = d.stream;
  absl::Status status = Allocate(mem, capacity, &next.momentum);
  if (status.ok()) status = Allocate(mem, capacity, &next.scratch);
  if (status.ok()) status = Allocate(mem, capacity, &next.positions);
  if (status.ok()) status = Allocate(mem, capacity, &next.selected);
  if (status.ok()) status = Allocate(mem, capacity, &next.gathered);
  if (status.ok()) status = Allocate(mem, capacity, &next.select_keys);
  if (status.ok()) status = AllocateStaging(mem, capacity, &next.staged_indices);
  if (status.ok()) status = AllocateStaging(mem, capacity, &next.staged_positions);
  const size_t live = static_cast<size_t>(device_size_);
  if (status.ok() && live > 0) {
    status = mem.copy(next.momentum, d.momentum, live * sizeof(float), CopyKind::kWithinBackend,
                      d.stream);
    if (status.ok()) {
      status = mem.copy(next.positions, d.positions, live * sizeof(int64_t),
                        CopyKind::kWithinBackend, d.stream);
    }
  }
  if (status.ok()) status = mem.synchronize(d.stream, "resizing a sequence's arrays");
  if (!Check(status)) return;  // `next` releases the new arrays
  std::swap(d.momentum, next.momentum);
  std::swap(d.scratch, next.scratch);
  std::swap(d.positions, next.positions);
  std::swap(d.selected, next.selected);
  std::swap(d.gathered, next.gathered);
  std::swap(d.select_keys, next.select_keys);
  std::swap(d.staged_indices, next.staged_indices);
  std::swap(d.staged_positions, next.staged_positions);
  d.capacity = capacity;
  select_scratch_.resize(static_cast<size_t>(capacity));
}

void MomentumState::DownloadMirrors() const {
  DeviceArrays& d = *device_;
  if (d.mirror_valid || !status_.ok()) return;
  const kernels::BackendMemory& mem = backend_->mem;
  d.mirror_positions.resize(static_cast<size_t>(device_size_));
  d.mirror_momentum.resize(static_cast<size_t>(device_size_));
  if (!Check(mem.set_device(d.device)) ||
      !Check(mem.copy(d.mirror_positions.data(), d.positions,
                      d.mirror_positions.size() * sizeof(int64_t), CopyKind::kBackendToHost,
                      d.stream)) ||
      !Check(mem.copy(d.mirror_momentum.data(), d.momentum,
                      d.mirror_momentum.size() * sizeof(float), CopyKind::kBackendToHost,
                      d.stream)) ||
      !Check(mem.synchronize(d.stream, "reading a sequence's cache"))) {
    d.mirror_positions.clear();
    d.mirror_momentum.clear();
    return;
  }
  d.mirror_valid = true;
}

std::span<const int64_t> MomentumState::positions() const {
  if (device_ == nullptr) return positions_;
  DownloadMirrors();
  return device_->mirror_positions;
}

std::span<const float> MomentumState::momentum() const {
  if (device_ == nullptr) return momentum_;
  DownloadMirrors();
  return device_->mirror_momentum;
}

void MomentumState::ShrinkTo(int64_t budget) {
  const int64_t wanted = std::max(size(), budget) + 1;
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    if (d.capacity <= wanted || !status_.ok()) return;
    if (!Check(backend_->mem.set_device(d.device))) return;
    ReserveDevice(wanted);
    backend_->mem.release(d.scores);  // sized for the first step's scores
    d.scores = nullptr;
    d.score_bytes = 0;
    select_scratch_ = std::vector<uint64_t>(static_cast<size_t>(wanted));
    return;
  }
  if (capacity_ <= wanted) return;
  positions_.shrink_to_fit();
  momentum_.shrink_to_fit();
  update_scratch_ = std::vector<float>();
  select_scratch_ = std::vector<uint64_t>();
  selected_scratch_ = std::vector<int64_t>();
  Reserve(wanted);
}

void MomentumState::Append(int64_t position, float momentum) {
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    if (!status_.ok() || !Check(backend_->mem.set_device(d.device))) return;
    if (device_size_ + 1 > d.capacity) ReserveDevice(GrownCapacity());
    if (!status_.ok()) return;
    backend_->append_entry(d.momentum, d.positions, device_size_, position, momentum, nullptr,
                           d.stream);
    d.last_append_below_sinks = d.sink_threshold >= 0 && position < d.sink_threshold;
    if (d.last_append_below_sinks) ++d.sink_count;
    ++device_size_;
    d.mirror_valid = false;
    return;
  }
  KVCM_CHECK(positions_.empty() || position > positions_.back());
  if (size() + 1 > capacity_) Reserve(GrownCapacity());
  positions_.push_back(position);
  momentum_.push_back(momentum);
}

void MomentumState::AppendAtMean(int64_t position) {
  if (device_ == nullptr) {
    Append(position, static_cast<float>(MeanMomentum()));
    return;
  }
  DeviceArrays& d = *device_;
  if (!status_.ok() || !Check(backend_->mem.set_device(d.device))) return;
  if (device_size_ + 1 > d.capacity) ReserveDevice(GrownCapacity());
  if (!status_.ok()) return;
  // The mean stays on the device: the new entry reads it in stream order.
  backend_->mean_momentum(d.momentum, device_size_, d.mean, d.stream);
  backend_->append_entry(d.momentum, d.positions, device_size_, position, 0.0f, d.mean,
                         d.stream);
  d.last_append_below_sinks = d.sink_threshold >= 0 && position < d.sink_threshold;
  if (d.last_append_below_sinks) ++d.sink_count;
  ++device_size_;
  d.mirror_valid = false;
}

void MomentumState::PopBack() {
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    --device_size_;
    if (d.last_append_below_sinks) --d.sink_count;
    d.last_append_below_sinks = false;
    d.mirror_valid = false;
    return;
  }
  positions_.pop_back();
  momentum_.pop_back();
}

int64_t MomentumState::ApplyScores(const kernels::ScoreMatrix& scores,
                                   const kernels::MomentumUpdateOptions& options,
                                   ScoreSpace space) {
  KVCM_CHECK(scores.tokens == size());
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    const kernels::BackendMemory& mem = backend_->mem;
    if (!status_.ok() || !Check(mem.set_device(d.device))) return 0;
    kernels::ScoreMatrix on_device = scores;
    if (space == ScoreSpace::kHost) {
      const size_t bytes = ScoreSpanBytes(scores);
      if (bytes > d.score_bytes) {
        mem.release(d.scores);
        d.scores = nullptr;
        d.score_bytes = 0;
        if (!Check(mem.allocate(bytes, &d.scores))) return 0;
        d.score_bytes = bytes;
      }
      if (!Check(mem.copy(d.scores, scores.data, bytes, CopyKind::kHostToBackend, d.stream))) {
        return 0;
      }
      on_device.data = d.scores;
    }
    // Out of place: the momentum is replaced only once every score proved valid.
    backend_->update_momentum(d.momentum, d.scratch, device_size_, on_device, options,
                              d.invalid, d.stream);
    if (!Check(mem.copy(d.staged_invalid, d.invalid, sizeof(int64_t), CopyKind::kBackendToHost,
                        d.stream)) ||
        !Check(mem.synchronize(d.stream, "scoring step"))) {
      return 0;
    }
    if (*d.staged_invalid != 0) return *d.staged_invalid;
    std::swap(d.momentum, d.scratch);
    d.mirror_valid = false;
    return 0;
  }
  // A host backend's memory is host memory: kBackend scores are host scores.
  int64_t invalid = 0;
  backend_->update_momentum(momentum_.data(), update_scratch_.data(), size(), scores,
                            options, &invalid, nullptr);
  if (invalid != 0) return invalid;
  // Commit: the scratch becomes the momentum, and the old momentum the next scratch. Both
  // were reserved to capacity_, so the resizes neither allocate nor, in the steady state
  // (size() == capacity_), touch any element.
  const size_t n = momentum_.size();
  momentum_.swap(update_scratch_);
  momentum_.resize(n);
  update_scratch_.resize(static_cast<size_t>(capacity_));
  return 0;
}

kernels::InvalidScore MomentumState::FindFirstInvalidScore(const kernels::ScoreMatrix& scores,
                                                          ScoreSpace space) const {
  std::vector<std::byte> buffer;
  const kernels::ScoreMatrix on_host = HostView(scores, space, &buffer);
  if (on_host.data == nullptr) return kernels::InvalidScore{};
  return kernels::FindFirstInvalidScore(on_host);
}

kernels::ScoreMatrix MomentumState::HostView(const kernels::ScoreMatrix& scores,
                                             ScoreSpace space,
                                             std::vector<std::byte>* buffer) const {
  if (device_ == nullptr || space == ScoreSpace::kHost) return scores;
  DeviceArrays& d = *device_;
  const kernels::BackendMemory& mem = backend_->mem;
  if (!Check(mem.set_device(d.device))) return kernels::ScoreMatrix{};
  absl::StatusOr<kernels::ScoreMatrix> on_host = kernels::DownloadScores(mem, d.stream, scores, buffer);
  if (!Check(on_host.status())) return kernels::ScoreMatrix{};
  return *on_host;
}

int MomentumState::device() const { return device_ != nullptr ? device_->device : 0; }

double MomentumState::MeanMomentum() const {
  double mean = 0.0;
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    const kernels::BackendMemory& mem = backend_->mem;
    if (!status_.ok() || !Check(mem.set_device(d.device))) return 0.0;
    backend_->mean_momentum(d.momentum, device_size_, d.mean, d.stream);
    if (!Check(mem.copy(d.staged_mean, d.mean, sizeof(double), CopyKind::kBackendToHost,
                        d.stream)) ||
        !Check(mem.synchronize(d.stream, "mean momentum"))) {
      return 0.0;
    }
    return *d.staged_mean;
  }
  backend_->mean_momentum(momentum_.data(), size(), &mean, nullptr);
  return mean;
}

int64_t MomentumState::FirstUnprotectedSinkIndex(int64_t protect_sinks) const {
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    if (protect_sinks <= 0) return 0;
    if (d.sink_threshold != protect_sinks) {
      DownloadMirrors();
      if (!status_.ok()) return 0;
      d.sink_threshold = protect_sinks;
      d.sink_count = std::lower_bound(d.mirror_positions.begin(), d.mirror_positions.end(),
                                      protect_sinks) -
                     d.mirror_positions.begin();
      d.last_append_below_sinks = false;
    }
    return d.sink_count;
  }
  return std::lower_bound(positions_.begin(), positions_.end(), protect_sinks) -
         positions_.begin();
}

void MomentumState::EvictLowest(int64_t begin, int64_t end, int64_t k,
                                std::vector<int64_t>* evicted, std::vector<int64_t>* indices) {
  if (k <= 0) return;
  KVCM_CHECK(k <= end - begin);
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    if (!status_.ok() || !Check(backend_->mem.set_device(d.device))) return;
    backend_->select_lowest(d.momentum, begin, end, k, d.selected, d.select_keys, d.stream);
    EvictSelectedOnDevice(k, nullptr, evicted, indices);
    return;
  }
  backend_->select_lowest(momentum_.data(), begin, end, k, selected_scratch_.data(),
                          select_scratch_.data(), nullptr);
  EvictIndices(std::span<const int64_t>(selected_scratch_.data(), static_cast<size_t>(k)),
               evicted, indices);
}

void MomentumState::EvictSelectedOnDevice(int64_t k, const int64_t* selected_on_host,
                                          std::vector<int64_t>* evicted,
                                          std::vector<int64_t>* indices) {
  DeviceArrays& d = *device_;
  const kernels::BackendMemory& mem = backend_->mem;
  const size_t bytes = static_cast<size_t>(k) * sizeof(int64_t);
  backend_->gather_positions(d.positions, d.selected, k, d.gathered, d.stream);
  if (!Check(mem.copy(d.staged_positions, d.gathered, bytes, CopyKind::kBackendToHost,
                      d.stream))) {
    return;
  }
  if (selected_on_host == nullptr &&
      !Check(mem.copy(d.staged_indices, d.selected, bytes, CopyKind::kBackendToHost,
                      d.stream))) {
    return;
  }
  backend_->remove_entries(d.momentum, d.positions, device_size_, d.selected, k, d.stream);
  if (!Check(mem.synchronize(d.stream, "eviction"))) return;
  const int64_t* chosen = selected_on_host != nullptr ? selected_on_host : d.staged_indices;
  evicted->insert(evicted->end(), d.staged_positions, d.staged_positions + k);
  indices->insert(indices->end(), chosen, chosen + k);
  if (d.sink_threshold >= 0) {
    for (int64_t j = 0; j < k; ++j) d.sink_count -= d.staged_positions[j] < d.sink_threshold;
  }
  device_size_ -= k;
  d.mirror_valid = false;
}

void MomentumState::EvictIndices(std::span<const int64_t> indices,
                                 std::vector<int64_t>* evicted,
                                 std::vector<int64_t>* evicted_indices) {
  if (indices.empty()) return;
  if (device_ != nullptr) {
    DeviceArrays& d = *device_;
    const kernels::BackendMemory& mem = backend_->mem;
    if (!status_.ok() || !Check(mem.set_device(d.device))) return;
    if (!Check(mem.copy(d.selected, indices.data(), indices.size() * sizeof(int64_t),
                        CopyKind::kHostToBackend, d.stream))) {
      return;
    }
    EvictSelectedOnDevice(static_cast<int64_t>(indices.size()), indices.data(), evicted,
                          evicted_indices);
    return;
  }
  for (int64_t index : indices) evicted->push_back(positions_[static_cast<size_t>(index)]);
  evicted_indices->insert(evicted_indices->end(), indices.begin(), indices.end());
  backend_->remove_entries(momentum_.data(), positions_.data(), size(), indices.data(),
                           static_cast<int64_t>(indices.size()), nullptr);
  const size_t remaining = positions_.size() - indices.size();
  positions_.resize(remaining);
  momentum_.resize(remaining);
}

}  // namespace kvcm

#include "cache_manager/engine/momentum_state.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "cache_manager/base/check.h"

namespace kvcm {

using kernels::CopyKind;

namespace {

// Whether `backend` keeps its arrays in host memory (the CPU backend). Every step runs the
// same code on every backend; this is the one rule for what host memory lets the state
// skip, each a copy or an array a device needs and the host does not:
//   - host scores and host indices are already in the backend's memory: read in place,
//     never uploaded (an extra copy of the scores per step would be pure cost);
//   - results the kernels write (the selected indices, the invalid count, the mean) are
//     read where they were written: no staging arrays and no copies into them; the
//     evicted positions are gathered straight into the caller's vector (no `gathered`);
//   - the selection keys are the host index scratch (index_scratch()), one array, not two;
//   - positions() and momentum() view the arrays instead of a downloaded mirror.
// BytesPerToken counts the arrays this leaves, and Reserve allocates exactly those.
bool InHostMemory(const kernels::KernelBackend& backend) {
  return backend.memory == kernels::MemorySpace::kHost;
}

// Bytes per token of capacity. Every backend: momentum (4), the update scratch (4),
// positions (8), the selected indices (8) and the selection keys (8): 32. A device adds
// its gathered positions (8), the two host staging arrays (16) and a host index scratch
// apart from the keys (8): 64.
int64_t BytesPerToken(const kernels::KernelBackend& backend) {
  constexpr int64_t kEveryBackend = 2 * sizeof(float) + 2 * sizeof(int64_t) + sizeof(uint64_t);
  constexpr int64_t kDeviceOnly = 3 * sizeof(int64_t) + sizeof(uint64_t);
  return InHostMemory(backend) ? kEveryBackend : kEveryBackend + kDeviceOnly;
}

// Stream-ordered on `stream`, the state's: usable by the work the state enqueues there.
template <typename T>
absl::Status Allocate(const kernels::BackendMemory& mem, kernels::StreamHandle stream,
                      int64_t count, T** ptr) {
  void* raw = nullptr;
  absl::Status status = mem.allocate(static_cast<size_t>(count) * sizeof(T), stream, &raw);
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

void MomentumState::Arrays::Release(const kernels::BackendMemory& mem,
                                    kernels::StreamHandle stream) {
  for (void* p : {static_cast<void*>(momentum), static_cast<void*>(scratch),
                  static_cast<void*>(positions), static_cast<void*>(selected),
                  static_cast<void*>(select_keys), static_cast<void*>(gathered)}) {
    mem.release(p, stream);
  }
  mem.release_staging(staged_indices);
  mem.release_staging(staged_positions);
  *this = Arrays{};
}

int64_t MomentumState::BytesFor(int64_t tokens, const kernels::KernelBackend& backend) {
  const int64_t per_token = BytesPerToken(backend);
  if (tokens <= 0) return 0;
  if (tokens > std::numeric_limits<int64_t>::max() / per_token) {
    return std::numeric_limits<int64_t>::max();
  }
  return tokens * per_token;
}

int64_t MomentumState::reserved_bytes() const { return BytesFor(capacity_, *backend_); }

int64_t MomentumState::GrownCapacity() const {
  // Saturating: a budget of INT64_MAX tokens is legal (the cache then never evicts), and
  // budget + 1 wrapped (UBSan, found by open_sequence_fuzzer).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t most = std::max(budget_, size_);
  const int64_t limit = most < kMax ? most + 1 : kMax;
  const int64_t doubled = capacity_ < kMax / 2 ? 2 * capacity_ : kMax;
  return std::max(size_ + 1, std::min(doubled, limit));
}

int64_t MomentumState::BytesToAppend() const {
  if (size_ + 1 <= capacity_) return 0;
  return BytesFor(GrownCapacity(), *backend_) - reserved_bytes();
}

MomentumState::MomentumState(int64_t prefill_len, int64_t budget, bool momentum_is_position,
                             const kernels::KernelBackend& backend, int device)
    : backend_(&backend), budget_(budget), device_(InHostMemory(backend) ? 0 : device) {
  const PrefillCache cache = MakePrefillCache(prefill_len, momentum_is_position);
  Init(cache.positions, cache.momentum);
}

MomentumState::MomentumState(std::span<const int64_t> positions, std::span<const float> momentum,
                             int64_t budget, const kernels::KernelBackend& backend, int device)
    : backend_(&backend), budget_(budget), device_(InHostMemory(backend) ? 0 : device) {
  KVCM_CHECK(positions.size() == momentum.size());
  Init(positions, momentum);
}

void MomentumState::Init(std::span<const int64_t> positions, std::span<const float> momentum) {
  newest_position_ = positions.empty() ? std::numeric_limits<int64_t>::min() : positions.back();
  previous_newest_position_ = newest_position_;
  const kernels::BackendMemory& mem = backend_->mem;
  if (!Check(mem.set_device(device_)) || !Check(mem.device_stream(device_, &stream_)) ||
      !Check(Allocate(mem, stream_, 1, &invalid_)) ||
      !Check(Allocate(mem, stream_, 1, &mean_))) {
    return;
  }
  if (!InHostMemory(*backend_) && (!Check(AllocateStaging(mem, 1, &staged_invalid_)) ||
                                   !Check(AllocateStaging(mem, 1, &staged_mean_)))) {
    return;
  }
  Reserve(static_cast<int64_t>(positions.size()) + 1);
  if (!status_.ok()) return;
  if (!Check(mem.copy(arrays_.positions, positions.data(), positions.size() * sizeof(int64_t),
                      CopyKind::kHostToBackend, stream_)) ||
      !Check(mem.copy(arrays_.momentum, momentum.data(), momentum.size() * sizeof(float),
                      CopyKind::kHostToBackend, stream_)) ||
      !Check(mem.synchronize(stream_, "uploading the cache"))) {
    return;
  }
  size_ = static_cast<int64_t>(positions.size());
}

MomentumState::~MomentumState() {
  const kernels::BackendMemory& mem = backend_->mem;
  (void)mem.set_device(device_);
  (void)mem.synchronize(stream_, "releasing a sequence");
  arrays_.Release(mem, stream_);
  for (void* p : {static_cast<void*>(invalid_), static_cast<void*>(mean_), scores_,
                  static_cast<void*>(pooled_)}) {
    mem.release(p, stream_);
  }
  mem.release_staging(staged_invalid_);
  mem.release_staging(staged_mean_);
}

bool MomentumState::Check(const absl::Status& status) const {
  if (!status.ok() && status_.ok()) status_ = status;
  return status.ok();
}

void MomentumState::Reserve(int64_t capacity) {
  const kernels::BackendMemory& mem = backend_->mem;
  const bool device_arrays = !InHostMemory(*backend_);
  Arrays next;  // takes the old arrays on success, the new ones on failure
  absl::Status status = Allocate(mem, stream_, capacity, &next.momentum);
  if (status.ok()) status = Allocate(mem, stream_, capacity, &next.scratch);
  if (status.ok()) status = Allocate(mem, stream_, capacity, &next.positions);
  if (status.ok()) status = Allocate(mem, stream_, capacity, &next.selected);
  if (device_arrays) {
    if (status.ok()) status = Allocate(mem, stream_, capacity, &next.select_keys);
    if (status.ok()) status = Allocate(mem, stream_, capacity, &next.gathered);
    if (status.ok()) status = AllocateStaging(mem, capacity, &next.staged_indices);
    if (status.ok()) status = AllocateStaging(mem, capacity, &next.staged_positions);
  }
  const size_t live = static_cast<size_t>(size_);
  if (status.ok() && live > 0) {
    status = mem.copy(next.momentum, arrays_.momentum, live * sizeof(float),
                      CopyKind::kWithinBackend, stream_);
    if (status.ok()) {
      status = mem.copy(next.positions, arrays_.positions, live * sizeof(int64_t),
                        CopyKind::kWithinBackend, stream_);
    }
  }
  if (status.ok()) status = mem.synchronize(stream_, "resizing a sequence's arrays");
  if (!Check(status)) {
    next.Release(mem, stream_);
    return;
  }
  std::swap(arrays_, next);
  next.Release(mem, stream_);
  const auto n = static_cast<size_t>(capacity);
  if (index_scratch_.size() > n) index_scratch_ = std::vector<uint64_t>();  // shrinking
  index_scratch_.resize(n);
  capacity_ = capacity;
}

void MomentumState::DownloadMirrors() const {
  if (mirror_valid_ || !status_.ok()) return;
  const kernels::BackendMemory& mem = backend_->mem;
  mirror_positions_.resize(static_cast<size_t>(size_));
  mirror_momentum_.resize(static_cast<size_t>(size_));
  if (!Check(mem.set_device(device_)) ||
      !Check(mem.copy(mirror_positions_.data(), arrays_.positions,
                      mirror_positions_.size() * sizeof(int64_t), CopyKind::kBackendToHost,
                      stream_)) ||
      !Check(mem.copy(mirror_momentum_.data(), arrays_.momentum,
                      mirror_momentum_.size() * sizeof(float), CopyKind::kBackendToHost,
                      stream_)) ||
      !Check(mem.synchronize(stream_, "reading a sequence's cache"))) {
    mirror_positions_.clear();
    mirror_momentum_.clear();
    return;
  }
  mirror_valid_ = true;
}

std::span<const int64_t> MomentumState::positions() const {
  if (InHostMemory(*backend_)) return {arrays_.positions, static_cast<size_t>(size_)};
  DownloadMirrors();
  return mirror_positions_;
}

std::span<const float> MomentumState::momentum() const {
  if (InHostMemory(*backend_)) return {arrays_.momentum, static_cast<size_t>(size_)};
  DownloadMirrors();
  return mirror_momentum_;
}

void MomentumState::ShrinkTo(int64_t budget) {
  const int64_t wanted = std::max(size_, budget) + 1;
  if (capacity_ <= wanted || !status_.ok() || !Check(backend_->mem.set_device(device_))) {
    return;
  }
  Reserve(wanted);
  backend_->mem.release(scores_, stream_);  // sized for the first step's scores
  scores_ = nullptr;
  score_bytes_ = 0;
  backend_->mem.release(pooled_, stream_);  // likewise
  pooled_ = nullptr;
  pooled_bytes_ = 0;
}

void MomentumState::Append(int64_t position, float momentum) {
  AppendEntry(position, momentum, /*at_mean=*/false);
}

void MomentumState::AppendAtMean(int64_t position) {
  AppendEntry(position, 0.0f, /*at_mean=*/true);
}

void MomentumState::AppendEntry(int64_t position, float value, bool at_mean) {
  KVCM_CHECK(position > newest_position_);
  if (!status_.ok() || !Check(backend_->mem.set_device(device_))) return;
  if (size_ + 1 > capacity_) Reserve(GrownCapacity());
  if (!status_.ok()) return;
  // The mean stays in the backend's memory: the new entry reads it in stream order.
  if (at_mean) backend_->mean_momentum(arrays_.momentum, size_, mean_, stream_);
  backend_->append_entry(arrays_.momentum, arrays_.positions, size_, position, value,
                         at_mean ? mean_ : nullptr, stream_);
  last_append_below_sinks_ = sink_threshold_ >= 0 && position < sink_threshold_;
  if (last_append_below_sinks_) ++sink_count_;
  previous_newest_position_ = newest_position_;
  newest_position_ = position;
  ++size_;
  mirror_valid_ = false;
}

void MomentumState::PopBack() {
  --size_;
  if (last_append_below_sinks_) --sink_count_;
  last_append_below_sinks_ = false;
  newest_position_ = previous_newest_position_;
  mirror_valid_ = false;
}

template <typename T>
const T* MomentumState::ToHost(const T* src, T* staging, int64_t count) const {
  if (InHostMemory(*backend_)) return src;
  if (!Check(backend_->mem.copy(staging, src, static_cast<size_t>(count) * sizeof(T),
                                CopyKind::kBackendToHost, stream_))) {
    return nullptr;
  }
  return staging;
}

const void* MomentumState::ScoresInBackend(const kernels::ScoreMatrix& scores,
                                           ScoreSpace space) {
  if (space == ScoreSpace::kBackend || InHostMemory(*backend_)) return scores.data;
  const kernels::BackendMemory& mem = backend_->mem;
  const size_t bytes = ScoreSpanBytes(scores);
  if (bytes > score_bytes_) {
    mem.release(scores_, stream_);  // after the queued work that reads it
    scores_ = nullptr;
    score_bytes_ = 0;
    if (!Check(mem.allocate(bytes, stream_, &scores_))) return nullptr;
    score_bytes_ = bytes;
  }
  if (!Check(mem.copy(scores_, scores.data, bytes, CopyKind::kHostToBackend, stream_))) {
    return nullptr;
  }
  return scores_;
}

kernels::ScoreMatrix MomentumState::PooledScores(const kernels::ScoreMatrix& scores,
                                                 int64_t width) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(scores.layers, 0)) *
                       static_cast<size_t>(std::max<int64_t>(scores.tokens, 0)) * sizeof(float);
  if (bytes > pooled_bytes_) {
    backend_->mem.release(pooled_, stream_);  // after the queued work that reads it
    pooled_ = nullptr;
    pooled_bytes_ = 0;
    if (!Check(Allocate(backend_->mem, stream_, static_cast<int64_t>(bytes / sizeof(float)),
                        &pooled_))) {
      return kernels::ScoreMatrix{};
    }
    pooled_bytes_ = bytes;
  }
  // The validation of the given scores carries over: an invalid score pools to NaN, which
  // the update below counts.
  backend_->span_max_pool(scores, arrays_.positions, width, pooled_, stream_);
  return kernels::ScoreMatrix::Dense(pooled_, kernels::ScoreDtype::kFloat32, scores.layers,
                                     scores.tokens);
}

int64_t MomentumState::ApplyScores(const kernels::ScoreMatrix& scores,
                                   const kernels::MomentumUpdateOptions& options,
                                   ScoreSpace space, int64_t span_pool) {
  KVCM_CHECK(scores.tokens == size_);
  const kernels::BackendMemory& mem = backend_->mem;
  if (!status_.ok() || !Check(mem.set_device(device_))) return 0;
  kernels::ScoreMatrix in_backend = scores;
  in_backend.data = ScoresInBackend(scores, space);
  if (!status_.ok()) return 0;
  if (span_pool > 1) in_backend = PooledScores(in_backend, span_pool);
  if (!status_.ok()) return 0;
  // Out of place: the momentum is replaced only once every score proved valid.
  backend_->update_momentum(arrays_.momentum, arrays_.scratch, size_, in_backend, options,
                            invalid_, stream_);
  const int64_t* invalid = ToHost(invalid_, staged_invalid_, 1);
  if (invalid == nullptr || !Check(mem.synchronize(stream_, "scoring step"))) return 0;
  if (*invalid != 0) return *invalid;
  std::swap(arrays_.momentum, arrays_.scratch);
  mirror_valid_ = false;
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
  if (space == ScoreSpace::kHost || InHostMemory(*backend_)) return scores;
  const kernels::BackendMemory& mem = backend_->mem;
  if (!Check(mem.set_device(device_))) return kernels::ScoreMatrix{};
  absl::StatusOr<kernels::ScoreMatrix> on_host =
      kernels::DownloadScores(mem, stream_, scores, buffer);
  if (!Check(on_host.status())) return kernels::ScoreMatrix{};
  return *on_host;
}

int MomentumState::device() const { return device_; }

double MomentumState::MeanMomentum() const {
  const kernels::BackendMemory& mem = backend_->mem;
  if (!status_.ok() || !Check(mem.set_device(device_))) return 0.0;
  backend_->mean_momentum(arrays_.momentum, size_, mean_, stream_);
  const double* mean = ToHost(mean_, staged_mean_, 1);
  if (mean == nullptr || !Check(mem.synchronize(stream_, "mean momentum"))) return 0.0;
  return *mean;
}

int64_t MomentumState::FirstUnprotectedSinkIndex(int64_t protect_sinks) const {
  if (protect_sinks <= 0) return 0;
  if (sink_threshold_ != protect_sinks) {
    const std::span<const int64_t> cached = positions();
    if (!status_.ok()) return 0;
    sink_threshold_ = protect_sinks;
    sink_count_ = std::lower_bound(cached.begin(), cached.end(), protect_sinks) - cached.begin();
    last_append_below_sinks_ = false;
  }
  return sink_count_;
}

void MomentumState::EvictLowest(int64_t begin, int64_t end, int64_t k,
                                std::vector<int64_t>* evicted, std::vector<int64_t>* indices) {
  if (k <= 0) return;
  KVCM_CHECK(k <= end - begin);
  if (!status_.ok() || !Check(backend_->mem.set_device(device_))) return;
  uint64_t* keys = InHostMemory(*backend_) ? index_scratch_.data() : arrays_.select_keys;
  backend_->select_lowest(arrays_.momentum, begin, end, k, arrays_.selected, keys, stream_);
  EvictSelected(arrays_.selected, k, nullptr, evicted, indices);
}

void MomentumState::EvictIndices(std::span<const int64_t> indices,
                                 std::vector<int64_t>* evicted,
                                 std::vector<int64_t>* evicted_indices) {
  if (indices.empty()) return;
  const kernels::BackendMemory& mem = backend_->mem;
  if (!status_.ok() || !Check(mem.set_device(device_))) return;
  const auto k = static_cast<int64_t>(indices.size());
  // Host indices are already in a host backend's memory.
  const int64_t* selected = indices.data();
  if (!InHostMemory(*backend_)) {
    if (!Check(mem.copy(arrays_.selected, indices.data(), indices.size() * sizeof(int64_t),
                        CopyKind::kHostToBackend, stream_))) {
      return;
    }
    selected = arrays_.selected;
  }
  EvictSelected(selected, k, indices.data(), evicted, evicted_indices);
}

void MomentumState::EvictSelected(const int64_t* selected, int64_t k,
                                  const int64_t* selected_on_host,
                                  std::vector<int64_t>* evicted, std::vector<int64_t>* indices) {
  const kernels::BackendMemory& mem = backend_->mem;
  const size_t first = evicted->size();
  evicted->resize(first + static_cast<size_t>(k));
  int64_t* const out = evicted->data() + first;
  // In host memory the positions are gathered straight into `evicted`.
  int64_t* const gathered = InHostMemory(*backend_) ? out : arrays_.gathered;
  backend_->gather_positions(arrays_.positions, selected, k, gathered, stream_);
  const int64_t* positions = ToHost(gathered, arrays_.staged_positions, k);
  const int64_t* chosen = selected_on_host != nullptr
                              ? selected_on_host
                              : ToHost(selected, arrays_.staged_indices, k);
  if (positions != nullptr && chosen != nullptr) {
    backend_->remove_entries(arrays_.momentum, arrays_.positions, size_, selected, k, stream_);
  }
  if (positions == nullptr || chosen == nullptr ||
      !Check(mem.synchronize(stream_, "eviction"))) {
    evicted->resize(first);
    return;
  }
  if (positions != out) std::copy(positions, positions + k, out);  // a device's staging
  indices->insert(indices->end(), chosen, chosen + k);
  // The evicted positions ascend: only the last can be the newest.
  if (out[k - 1] == newest_position_) newest_position_ = std::numeric_limits<int64_t>::min();
  if (sink_threshold_ >= 0) {
    for (int64_t j = 0; j < k; ++j) sink_count_ -= out[j] < sink_threshold_;
  }
  size_ -= k;
  mirror_valid_ = false;
}

}  // namespace kvcm

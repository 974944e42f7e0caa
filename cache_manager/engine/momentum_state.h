// MomentumState: the cache of one sequence as the engine sees it: the cached positions in
// ascending order and one float32 momentum per position, plus the scratch the step needs
// so that steady-state steps allocate nothing.
//
// One implementation for every backend: the arrays live in the memory of the kernel
// backend the state was made with (kernels/backend.h; the CPU reference by default, whose
// memory is host memory), are allocated with its `mem` table, and every step runs its
// kernels on one stream of `device` (stream(): the making thread's), where the arrays are
// also allocated and freed (stream-ordered: growing them on a step waits for no other
// work). A scoring step reads the scores in the backend's memory (uploading host scores
// to a device first; ScoreSpace), updates into a second buffer that becomes the momentum
// only when every score was valid (double buffer: a rejected step leaves the state
// untouched), and only the step's evicted indices and positions, and the invalid-score
// count, cross back to the host. Each method that returns a result waits for the stream.
//
// Where the backend's memory is host memory (MemorySpace::kHost) the state skips the work
// and memory that only a device needs (momentum_state.cc, InHostMemory): host scores are
// read in place, results are read where the kernels wrote them (no staging copies), and
// positions() and momentum() view the arrays themselves; on a device they download a host
// copy on demand (tools, inspection, error messages).
//
// Every mutating method either completes or leaves the state as it was. A failure of the
// backend's memory or of a device is sticky: status() reports it (INTERNAL from a device,
// with the runtime's message) and the state must be discarded. Not thread-safe: a Sequence
// owns one and serializes access.
#ifndef KVCM_CACHE_MANAGER_ENGINE_MOMENTUM_STATE_H_
#define KVCM_CACHE_MANAGER_ENGINE_MOMENTUM_STATE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/momentum_update.h"
#include "kernels/score_validation.h"

namespace kvcm {

class MomentumState {
 public:
  // Where the scores given to ApplyScores live.
  enum class ScoreSpace : uint8_t {
    kHost,     // host memory (copied to the device first on a device backend)
    kBackend,  // the backend's memory, on `device` (read in place; on a host backend
               // that is host memory, the same as kHost)
  };

  // The prefill cache {0 .. prefill_len-1}. Momentum starts at 0, or at each token's own
  // position when `momentum_is_position` (recency). The arrays are sized for the prefill
  // plus the token each step adds, never for the budget (a client's number): they grow
  // with the cache, up to the budget plus one. `device`: the device of a device backend
  // (ignored on the host). Check status().
  MomentumState(int64_t prefill_len, int64_t budget, bool momentum_is_position,
                const kernels::KernelBackend& backend = kernels::CpuBackend(), int device = 0);
  // A cache restored as it was (a snapshot, a resumed sequence): `positions` ascending and
  // `momentum` of the same length. The arrays hold it plus the next token.
  // REQUIRES: positions.size() == momentum.size().
  MomentumState(std::span<const int64_t> positions, std::span<const float> momentum,
                int64_t budget, const kernels::KernelBackend& backend = kernels::CpuBackend(),
                int device = 0);
  ~MomentumState();

  MomentumState(const MomentumState&) = delete;
  MomentumState& operator=(const MomentumState&) = delete;

  int64_t size() const { return size_; }

  // The bytes the arrays of a state with room for `tokens` hold on `backend` (host and
  // device memory together), saturating at INT64_MAX: what a sequence opened with a
  // prefill of tokens - 1 allocates before its first step.
  static int64_t BytesFor(int64_t tokens, const kernels::KernelBackend& backend);
  // The bytes its arrays hold now.
  int64_t reserved_bytes() const;
  // The bytes the next Append (or AppendAtMean) allocates: 0 while there is room.
  int64_t BytesToAppend() const;
  // Views valid until the next mutating call (on a device backend: a host copy made by
  // the call, which waits for the device).
  std::span<const int64_t> positions() const;
  std::span<const float> momentum() const;

  // Adds a token after the newest one. REQUIRES: position > every cached position.
  void Append(int64_t position, float momentum);
  // Adds a token after the newest one at the mean momentum of the cached ones (SPEC.md,
  // a non-scoring step): Append(position, float(MeanMomentum())), without the round trip
  // to the host on a device backend.
  void AppendAtMean(int64_t position);
  // Removes the newest token (undoes Append).
  void PopBack();

  // Folds [layers, size()] scores into the momentum of every cached token. Returns
  // non-zero when some score is invalid (the count of invalid scores without pooling); the
  // momentum is then unchanged. `span_pool` > 1: each row is first max-pooled over that
  // many positions (kernels/span_pool.h, SPEC.md "Span pooling") into a buffer the state
  // keeps (grown to the largest step's [layers, size()] f32, released by ShrinkTo); the
  // validity is still that of the given scores.
  // REQUIRES: scores.tokens == size(); scores in `space` (kHost on a host backend);
  // span_pool 0, 1 or a width of kernels/span_pool.h.
  int64_t ApplyScores(const kernels::ScoreMatrix& scores,
                      const kernels::MomentumUpdateOptions& options,
                      ScoreSpace space = ScoreSpace::kHost, int64_t span_pool = 0);

  // The first invalid score of `scores` (same contract as ApplyScores), for the error
  // message of a rejected step.
  kernels::InvalidScore FindFirstInvalidScore(const kernels::ScoreMatrix& scores,
                                              ScoreSpace space = ScoreSpace::kHost) const;

  // `scores` as a host matrix: itself when it is in host memory, otherwise a dense copy
  // into `buffer` (a download that waits for the device; a failure is sticky and gives
  // an empty matrix). For the slow paths that read scores on the host.
  kernels::ScoreMatrix HostView(const kernels::ScoreMatrix& scores, ScoreSpace space,
                                std::vector<std::byte>* buffer) const;

  // The mean momentum of the cached tokens, in double (0 when empty).
  double MeanMomentum() const;

  // Index of the first cached token whose position is >= `protect_sinks`.
  int64_t FirstUnprotectedSinkIndex(int64_t protect_sinks) const;

  // Evicts the `k` lowest-momentum tokens among indices [begin, end) (ties: lower position)
  // and appends their positions, ascending, to `evicted` and their indices to `indices`.
  // REQUIRES: 0 <= k <= end - begin.
  void EvictLowest(int64_t begin, int64_t end, int64_t k, std::vector<int64_t>* evicted,
                   std::vector<int64_t>* indices);

  // Evicts the tokens at `indices` (ascending, distinct) and appends their positions to
  // `evicted` and the indices to `evicted_indices`.
  void EvictIndices(std::span<const int64_t> indices, std::vector<int64_t>* evicted,
                    std::vector<int64_t>* evicted_indices);

  // Releases scratch beyond what a cache of at most `budget` tokens needs (after the large
  // first-step eviction of a long prefill).
  void ShrinkTo(int64_t budget);

  // Scratch for callers that pick indices themselves (random); at least size() entries,
  // host memory. Overwrites the selection keys of a host backend (they are the same array).
  std::vector<uint64_t>& index_scratch() { return index_scratch_; }

  const kernels::KernelBackend& backend() const { return *backend_; }
  // The device of a device backend (0 on the host).
  int device() const;
  // The stream every operation of this state enqueues on: the device stream of the thread
  // that made it (kernels/stream_lanes.h), kept for the state's life whichever thread
  // steps it, so that its queued work stays in order. Work that reads or writes the
  // state's arrays (a tensor-parallel join's result) goes here too. nullptr on the host.
  kernels::StreamHandle stream() const { return stream_; }
  // OK, or the sticky failure of a device backend.
  const absl::Status& status() const { return status_; }

 private:
  // The arrays of [capacity] entries, in the backend's memory unless stated. Null where
  // the backend does not need them (momentum_state.cc, InHostMemory).
  struct Arrays {
    float* momentum = nullptr;
    float* scratch = nullptr;          // a scoring step's output until it is committed
    int64_t* positions = nullptr;
    int64_t* selected = nullptr;       // indices a step evicts
    uint64_t* select_keys = nullptr;   // select_lowest's scratch (device backends)
    int64_t* gathered = nullptr;       // the evicted positions (device backends)
    int64_t* staged_indices = nullptr;    // host staging (device backends)
    int64_t* staged_positions = nullptr;  // host staging (device backends)

    void Release(const kernels::BackendMemory& mem, kernels::StreamHandle stream);
  };

  // Both constructors: holds `positions` and `momentum`, with room for one more token.
  void Init(std::span<const int64_t> positions, std::span<const float> momentum);
  // Moves the arrays to ones of `capacity` entries (>= size()); on failure keeps them.
  void Reserve(int64_t capacity);
  // The capacity an Append grows a full state to: doubling, but never past what a cache
  // of `budget_` tokens plus a new one needs.
  int64_t GrownCapacity() const;
  // Records the first failure.
  bool Check(const absl::Status& status) const;
  // Append and AppendAtMean: `value`, or the mean momentum when `at_mean`.
  void AppendEntry(int64_t position, float value, bool at_mean);
  // Where the kernels read `scores` from: in place, or uploaded into `scores_`.
  // Null on failure.
  const void* ScoresInBackend(const kernels::ScoreMatrix& scores, ScoreSpace space);
  // `scores` (in the backend's memory) max-pooled over `width` positions into `pooled_`,
  // as a dense f32 matrix there. data == nullptr on failure.
  kernels::ScoreMatrix PooledScores(const kernels::ScoreMatrix& scores, int64_t width);
  // `count` values the kernels write to `src` (the backend's memory) as host memory,
  // readable after the next synchronize. Null on failure.
  template <typename T>
  const T* ToHost(const T* src, T* staging, int64_t count) const;
  // Evicts the `k` entries at `selected` (the backend's memory; `selected_on_host`: the
  // same indices in host memory when the caller gave them) and appends their positions
  // and indices to the outputs.
  void EvictSelected(const int64_t* selected, int64_t k, const int64_t* selected_on_host,
                     std::vector<int64_t>* evicted, std::vector<int64_t>* indices);
  // Device backends: the host copies positions() and momentum() return.
  void DownloadMirrors() const;

  const kernels::KernelBackend* backend_;
  const int64_t budget_;
  const int device_;
  kernels::StreamHandle stream_ = nullptr;
  int64_t size_ = 0;
  int64_t capacity_ = 0;
  Arrays arrays_;
  int64_t* invalid_ = nullptr;         // [1]
  double* mean_ = nullptr;             // [1]
  int64_t* staged_invalid_ = nullptr;  // [1] host staging (device backends)
  double* staged_mean_ = nullptr;      // [1] host staging (device backends)
  void* scores_ = nullptr;             // host scores uploaded for a step (device backends)
  size_t score_bytes_ = 0;
  float* pooled_ = nullptr;            // span-pooled rows of a step (span_pool > 1 only)
  size_t pooled_bytes_ = 0;
  // index_scratch(), [capacity] host; a host backend's selection keys.
  std::vector<uint64_t> index_scratch_;

  // Append's precondition, checked on every backend without reading the positions: the
  // newest cached position (INT64_MIN when empty or when an eviction took it: unknown
  // without a read, so unchecked), and its value before the last Append (PopBack).
  int64_t newest_position_;
  int64_t previous_newest_position_;

  // FirstUnprotectedSinkIndex without reading the positions each step: the count of cached
  // positions below the threshold it was last asked for, kept up to date by appends and
  // evictions.
  mutable int64_t sink_threshold_ = -1;  // -1: not asked yet
  mutable int64_t sink_count_ = 0;
  mutable bool last_append_below_sinks_ = false;

  // Device backends: the host copies for positions() and momentum().
  mutable std::vector<int64_t> mirror_positions_;
  mutable std::vector<float> mirror_momentum_;
  mutable bool mirror_valid_ = false;
  mutable absl::Status status_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_MOMENTUM_STATE_H_

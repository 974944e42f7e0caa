// MomentumState: the cache of one sequence as the engine sees it: the cached positions in
// ascending order and one float32 momentum per position, plus the scratch the step needs
// so that steady-state steps allocate nothing.
//
// The arithmetic runs on the kernel backend the state was made with (kernels/backend.h;
// the CPU reference by default), and the arrays live in that backend's memory:
//   - host backends: plain vectors; positions() and momentum() view them directly;
//   - device backends (CUDA, or the CPU's emulated device in tests): momentum, positions
//     and the step's scratch stay in device memory. A scoring step uploads the scores
//     (or reads them in place, ScoreSpace::kBackend), updates into a second buffer that
//     becomes the momentum only when every score was valid (double buffer: a rejected
//     step leaves the device state untouched), and only the step's evicted indices and
//     positions, and the invalid-score count, cross back to the host. positions() and
//     momentum() download a host copy on demand (tools, inspection, error messages).
//     The work runs on the backend's stream of `device`; each method that returns a
//     result waits for it.
//
// Every mutating method either completes or leaves the state as it was. A failure of
// the device (device backends only) is sticky: status() reports it (INTERNAL, with the
// runtime's message) and the state must be discarded. Not thread-safe: a Sequence owns
// one and serializes access.
#ifndef KVCM_CACHE_MANAGER_ENGINE_MOMENTUM_STATE_H_
#define KVCM_CACHE_MANAGER_ENGINE_MOMENTUM_STATE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
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
  // (ignored on the host). Check status() on a device backend.
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

  int64_t size() const {
    return device_ != nullptr ? device_size_ : static_cast<int64_t>(positions_.size());
  }

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

  // Folds [layers, size()] scores into the momentum of every cached token. Returns the
  // number of invalid scores; when it is non-zero the momentum is unchanged.
  // REQUIRES: scores.tokens == size(); scores in `space` (kHost on a host backend).
  int64_t ApplyScores(const kernels::ScoreMatrix& scores,
                      const kernels::MomentumUpdateOptions& options,
                      ScoreSpace space = ScoreSpace::kHost);

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
  // host memory.
  std::vector<uint64_t>& index_scratch() { return select_scratch_; }

  const kernels::KernelBackend& backend() const { return *backend_; }
  // The device of a device backend (0 on the host).
  int device() const;
  // OK, or the sticky failure of a device backend.
  const absl::Status& status() const { return status_; }

 private:
  // The device-resident arrays (momentum_state.cc), null on a host backend.
  struct DeviceArrays;

  // Both constructors: holds `positions` and `momentum`, with room for one more token.
  void Init(std::span<const int64_t> positions, std::span<const float> momentum, int device);
  void Reserve(int64_t capacity);
  void ReserveDevice(int64_t capacity);
  int64_t capacity() const;
  // The capacity an Append grows a full state to: doubling, but never past what a cache
  // of `budget_` tokens plus a new one needs.
  int64_t GrownCapacity() const;
  // Device backends: records the first failure.
  bool Check(const absl::Status& status) const;
  // Device backends: copies the selected entries' indices and positions to the host,
  // removes them, and appends them to the outputs. `selected_on_host`: the indices are
  // already known on the host (EvictIndices).
  void EvictSelectedOnDevice(int64_t k, const int64_t* selected_on_host,
                             std::vector<int64_t>* evicted, std::vector<int64_t>* indices);
  void DownloadMirrors() const;

  const kernels::KernelBackend* backend_;
  const int64_t budget_;

  // Host backends.
  std::vector<int64_t> positions_;
  std::vector<float> momentum_;
  std::vector<float> update_scratch_;      // receives the updated momentum before commit
  std::vector<uint64_t> select_scratch_;   // packed selection keys (device: index_scratch)
  std::vector<int64_t> selected_scratch_;  // indices chosen for eviction
  int64_t capacity_ = 0;

  // Device backends.
  std::unique_ptr<DeviceArrays> device_;
  int64_t device_size_ = 0;
  mutable absl::Status status_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_ENGINE_MOMENTUM_STATE_H_

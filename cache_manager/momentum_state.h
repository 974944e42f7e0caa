// MomentumState: the cache of one sequence as the engine sees it: the cached positions in
// ascending order and one float32 momentum per position, plus the scratch the step needs
// so that steady-state steps allocate nothing.
//
// Every mutating method either completes or leaves the state as it was. Not thread-safe:
// a Sequence owns one and serializes access.
#ifndef KVCM_CACHE_MANAGER_MOMENTUM_STATE_H_
#define KVCM_CACHE_MANAGER_MOMENTUM_STATE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/momentum_update.h"

namespace kvcm {

class MomentumState {
 public:
  // The prefill cache {0 .. prefill_len-1}. Momentum starts at 0, or at each token's own
  // position when `momentum_is_position` (recency). Scratch is sized for the larger of the
  // prefill and the budget, plus the token each step adds.
  MomentumState(int64_t prefill_len, int64_t budget, bool momentum_is_position);

  MomentumState(const MomentumState&) = delete;
  MomentumState& operator=(const MomentumState&) = delete;

  int64_t size() const { return static_cast<int64_t>(positions_.size()); }
  std::span<const int64_t> positions() const { return positions_; }
  std::span<const float> momentum() const { return momentum_; }

  // Adds a token after the newest one. REQUIRES: position > every cached position.
  void Append(int64_t position, float momentum);
  // Removes the newest token (undoes Append).
  void PopBack();

  // Folds [layers, size()] scores into the momentum of every cached token. Returns the
  // number of invalid scores; when it is non-zero the momentum is unchanged.
  // REQUIRES: scores.tokens == size(), scores in host memory.
  int64_t ApplyScores(const kernels::ScoreMatrix& scores,
                      const kernels::MomentumUpdateOptions& options);

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

  // Scratch for callers that pick indices themselves (random); at least size() entries.
  std::vector<uint64_t>& index_scratch() { return select_scratch_; }

 private:
  void Reserve(int64_t capacity);

  std::vector<int64_t> positions_;
  std::vector<float> momentum_;
  std::vector<float> update_scratch_;      // receives the updated momentum before commit
  std::vector<uint64_t> select_scratch_;   // packed selection keys
  std::vector<int64_t> selected_scratch_;  // indices chosen for eviction
  int64_t capacity_ = 0;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_MOMENTUM_STATE_H_

// CPU reference of kernels/span_pool.h.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/score_loader.h"
#include "kernels/half_float.h"
#include "kernels/span_pool.h"

namespace kvcm::kernels::cpu {
namespace {

template <ScoreDtype D>
using Loader = ScoreLoader<D>;

inline bool Valid(float v) { return v >= 0.0f && v <= FLT_MAX; }

// The indices of the window's candidates for the maximum, values strictly decreasing from
// front to back. A window holds at most kMaxSpanPoolWidth entries (positions are distinct
// integers), so a fixed ring suffices and a step allocates nothing.
class MonotonicDeque {
 public:
  bool empty() const { return head_ == tail_; }
  int64_t front() const { return ring_[head_ % kCapacity]; }
  int64_t back() const { return ring_[(tail_ - 1) % kCapacity]; }
  void pop_front() { ++head_; }
  void pop_back() { --tail_; }
  void push_back(int64_t index) { ring_[tail_++ % kCapacity] = index; }

 private:
  static constexpr uint64_t kCapacity = 256;  // > kMaxSpanPoolWidth
  int64_t ring_[kCapacity];
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
};

// Pools one row. `next` is the first entry not yet in the window: the window of entry i
// is [first entry with position >= p_i - half, last entry with position <= p_i + half].
template <ScoreDtype D>
void PoolRow(const typename Loader<D>::T* row, const int64_t* positions, int64_t tokens,
             int64_t half, float* out) {
  MonotonicDeque deque;
  int64_t next = 0;
  for (int64_t i = 0; i < tokens; ++i) {
    // Stale entries leave before new ones come, so the ring never holds more than one
    // window (compared by difference: no p_i + half to overflow).
    while (!deque.empty() && positions[i] - positions[deque.front()] > half) deque.pop_front();
    while (next < tokens && positions[next] - positions[i] <= half) {
      const float v = Loader<D>::Load(row[next]);
      while (!deque.empty() && !(Loader<D>::Load(row[deque.back()]) > v)) deque.pop_back();
      deque.push_back(next++);
    }
    const float own = Loader<D>::Load(row[i]);
    out[i] =
        Valid(own) ? Loader<D>::Load(row[deque.front()]) : std::numeric_limits<float>::quiet_NaN();
  }
}

template <ScoreDtype D>
void PoolRows(const ScoreMatrix& scores, const int64_t* positions, int64_t half, float* out) {
  using T = typename Loader<D>::T;
  for (int64_t layer = 0; layer < scores.layers; ++layer) {
    PoolRow<D>(static_cast<const T*>(scores.Row(layer)), positions, scores.tokens, half,
               out + layer * scores.tokens);
  }
}

}  // namespace

void SpanMaxPool(ScoreMatrix scores, const int64_t* positions, int64_t width, float* out,
                 StreamHandle /*stream*/) {
  if (scores.layers <= 0 || scores.tokens <= 0) return;
  const int64_t half = (width - 1) / 2;
  switch (scores.dtype) {
    case ScoreDtype::kFloat32:
      return PoolRows<ScoreDtype::kFloat32>(scores, positions, half, out);
    case ScoreDtype::kFloat16:
      return PoolRows<ScoreDtype::kFloat16>(scores, positions, half, out);
    case ScoreDtype::kBFloat16:
      return PoolRows<ScoreDtype::kBFloat16>(scores, positions, half, out);
  }
}

}  // namespace kvcm::kernels::cpu

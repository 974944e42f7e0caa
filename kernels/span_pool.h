// Span pooling (docs/SPEC.md, "Span pooling"): before a scoring step's rows become momentum,
// each row is max-pooled over a window of k neighbouring POSITIONS, so that a token next
// to an attended one keeps its score and a hit keeps its span (SnapKV-style pooling).
//
//   out(l, i) = max { s(l, j) : |positions[j] - positions[i]| <= (k - 1) / 2 }
//
// Neighbours are by position distance among the entries present, not by index: after
// evictions the cache has gaps, and a token across a gap wider than the half window is not
// a neighbour. Positions are strictly ascending, so a window holds at most k entries.
//
// Validation stays with the received values: an entry whose own score is invalid
// (negative, NaN or infinite) comes out NaN, so that the fused validation of
// UpdateMomentum, reading the pooled rows, rejects exactly the steps that carried an
// invalid score. The other entries of such a row are unspecified (the step is rejected).
// Where every score is valid the result is exact (a max of float32 values), the same on
// every backend. Stateless and thread-safe.
#ifndef KVCM_KERNELS_SPAN_POOL_H_
#define KVCM_KERNELS_SPAN_POOL_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels {

// The widths a policy may ask for: odd, 3 to 255 (1, or 0, means no pooling).
inline constexpr int64_t kMinSpanPoolWidth = 3;
inline constexpr int64_t kMaxSpanPoolWidth = 255;

namespace cpu {

// scores:    [layers, tokens] f32/f16/bf16, host, possibly strided.
// positions: [tokens] i64, host, strictly ascending: the position of each column.
// width:     k, odd, kMinSpanPoolWidth <= k <= kMaxSpanPoolWidth.
// out:       [layers, tokens] f32 dense, host; must not overlap `scores`.
// stream:    nullptr.
// O(tokens) per row: a monotonic deque over the window (at most k entries, on the stack).
void SpanMaxPool(ScoreMatrix scores, const int64_t* positions, int64_t width, float* out,
                 StreamHandle stream);

}  // namespace cpu
}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_SPAN_POOL_H_

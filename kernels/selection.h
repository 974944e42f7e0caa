// Selection of the tokens to evict and removal of evicted entries from the engine's
// per-token arrays.
//
// Order: lower momentum first; on equal momentum the lower index first. Callers keep their
// arrays in ascending position order, so "lower index" is SPEC.md's "lower position".
// The order is made total by sorting on the key (momentum bits, index), which for
// non-negative floats orders exactly like (value, index); -0.0 is treated as +0.0.
// Stateless and thread-safe.
#ifndef KVCM_KERNELS_SELECTION_H_
#define KVCM_KERNELS_SELECTION_H_

#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels {
namespace cpu {

// Selects the k lowest of values[begin, end) and writes their indices (into `values`) in
// ascending order to `selected`. O(end - begin): a linear scan for k == 1, a selection
// (not a sort) on packed keys otherwise.
// REQUIRES: 0 <= begin <= end, 0 <= k <= end - begin, values >= 0 (not NaN).
// values:   [end] f32, host.      selected: [k] i64, host.
// scratch:  [end - begin] u64, host (unused when k <= 1 or k == end - begin).
void SelectLowest(const float* values, int64_t begin, int64_t end, int64_t k,
                  int64_t* selected, uint64_t* scratch, StreamHandle stream);

// Selects the k highest of values[0, count): exactly the complement of
// SelectLowest(values, 0, count, count - k), so ties go to the higher index. Writes their
// indices in ascending order to `selected`. O(count) whatever k: a histogram of the values'
// top bits (2,048 log-spaced buckets) finds the bucket of the k-th highest, and a selection
// runs inside that bucket only. For the eviction-quality diagnostics' top sets.
// REQUIRES: 0 <= k <= count, values >= 0 (not NaN).
// values:   [count] f32, host.    selected: [k] i64, host.
// scratch:  [count] u64, host (unused when k == 0 or k == count).
void SelectHighest(const float* values, int64_t count, int64_t k, int64_t* selected,
                   uint64_t* scratch, StreamHandle stream);

// Removes the entries at `indices` (ascending, distinct, < n) from both arrays, keeping the
// order of the survivors; the arrays then hold n - k entries.
// momentum: [n] f32, host.  positions: [n] i64, host.  indices: [k] i64, host.
void RemoveEntries(float* momentum, int64_t* positions, int64_t n, const int64_t* indices,
                   int64_t k, StreamHandle stream);

}  // namespace cpu
}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_SELECTION_H_

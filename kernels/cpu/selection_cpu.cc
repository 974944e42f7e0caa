// CPU reference of kernels/selection.h.
#include <algorithm>
#include <bit>
#include <cstring>

#include "kernels/cpu/hot_loops.h"
#include "kernels/selection.h"

namespace kvcm::kernels::cpu {
namespace {

// (momentum, index) packed so that unsigned order is the eviction order. For values >= 0
// the IEEE bit pattern orders like the value; -0.0 is folded onto +0.0.
inline uint64_t EvictionKey(float value, int64_t offset) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  bits = (bits & 0x7fffffffu) == 0 ? 0u : bits;
  return (static_cast<uint64_t>(bits) << 32) | static_cast<uint64_t>(offset);
}

}  // namespace

void SelectLowest(const float* values, int64_t begin, int64_t end, int64_t k,
                  int64_t* selected, uint64_t* scratch, StreamHandle /*stream*/) {
  const int64_t count = end - begin;
  if (k <= 0) return;
  if (k >= count) {
    for (int64_t i = 0; i < count; ++i) selected[i] = begin + i;
    return;
  }
  if (k == 1) {
    selected[0] = SelectedHotLoops().arg_min(values, begin, end);  // the first of equal minima
    return;
  }
  for (int64_t i = 0; i < count; ++i) scratch[i] = EvictionKey(values[begin + i], i);
  std::nth_element(scratch, scratch + (k - 1), scratch + count);
  const uint64_t threshold = scratch[k - 1];
  // Keys are distinct, so exactly k indices have a key <= threshold; emitting them in a
  // scan gives ascending order without sorting.
  int64_t written = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (EvictionKey(values[begin + i], i) <= threshold) selected[written++] = begin + i;
  }
}

void RemoveEntries(float* momentum, int64_t* positions, int64_t n, const int64_t* indices,
                   int64_t k, StreamHandle /*stream*/) {
  if (k <= 0) return;
  int64_t write = indices[0];
  for (int64_t j = 0; j < k; ++j) {
    const int64_t from = indices[j] + 1;
    const int64_t to = j + 1 < k ? indices[j + 1] : n;
    const int64_t len = to - from;
    if (len > 0) {
      std::memmove(momentum + write, momentum + from, static_cast<size_t>(len) * sizeof(float));
      std::memmove(positions + write, positions + from,
                   static_cast<size_t>(len) * sizeof(int64_t));
      write += len;
    }
  }
}

}  // namespace kvcm::kernels::cpu

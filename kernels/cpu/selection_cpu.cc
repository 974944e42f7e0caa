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

void SelectHighest(const float* values, int64_t count, int64_t k, int64_t* selected,
                   uint64_t* scratch, StreamHandle /*stream*/) {
  if (k <= 0) return;
  if (k >= count) {
    for (int64_t i = 0; i < count; ++i) selected[i] = i;
    return;
  }
  // Buckets: the top 11 bits of a key (the exponent and 3 mantissa bits of a value >= 0,
  // +inf included), in key order.
  constexpr int kBuckets = 2048;
  const auto bucket = [](uint64_t key) { return static_cast<size_t>(key >> 52); };
  uint32_t histogram[kBuckets] = {};
  for (int64_t i = 0; i < count; ++i) ++histogram[bucket(EvictionKey(values[i], i))];
  int64_t above = 0;  // keys in buckets above the boundary one
  size_t boundary = kBuckets - 1;
  while (above + histogram[boundary] < k) above += histogram[boundary--];
  // The k - above highest keys of the boundary bucket complete the set; the lowest of them
  // is the threshold, and since buckets order like keys, the set is every key >= it.
  int64_t m = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t key = EvictionKey(values[i], i);
    scratch[m] = key;
    m += bucket(key) == boundary ? 1 : 0;
  }
  const int64_t need = k - above;  // 1 .. m
  std::nth_element(scratch, scratch + (m - need), scratch + m);
  const uint64_t threshold = scratch[m - need];
  // Branch-free emission into the scratch (k < count slots, one spare for the last write).
  int64_t written = 0;
  for (int64_t i = 0; i < count; ++i) {
    scratch[written] = static_cast<uint64_t>(i);
    written += EvictionKey(values[i], i) >= threshold ? 1 : 0;
  }
  for (int64_t j = 0; j < k; ++j) selected[j] = static_cast<int64_t>(scratch[j]);
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

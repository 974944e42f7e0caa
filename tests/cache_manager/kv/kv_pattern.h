// Test helpers: fill KV block storage with bytes that name the token, layer and K/V they
// belong to, so a test can tell after a compaction whether every token's K and V landed
// in its new slot and nothing else was touched. Host memory only.
#ifndef KVCM_TESTS_POOLS_KV_PATTERN_H_
#define KVCM_TESTS_POOLS_KV_PATTERN_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/kv_compaction.h"

namespace kvcm::testing {

// The byte at `offset` of (token, layer, kv)'s row: distinct for nearby tokens and layers.
inline uint8_t PatternByte(int64_t token, int64_t layer, int64_t kv, int64_t offset) {
  const uint64_t x = static_cast<uint64_t>(token) * 0x9e3779b97f4a7c15ull +
                     static_cast<uint64_t>(layer) * 0xbf58476d1ce4e5b9ull +
                     static_cast<uint64_t>(kv) * 0x94d049bb133111ebull +
                     static_cast<uint64_t>(offset) * 0x2545f4914f6cdd1dull;
  return static_cast<uint8_t>((x >> 56) ^ (x >> 24));
}

// Writes token `token`'s pattern into every layer's K and V of `slot`.
inline void WriteToken(void* storage, const kernels::KvBlockLayout& layout, int64_t slot,
                       int64_t token) {
  auto* base = static_cast<uint8_t*>(storage);
  for (int64_t layer = 0; layer < layout.layers; ++layer) {
    for (int64_t kv = 0; kv < 2; ++kv) {
      uint8_t* row = base + layout.Offset(slot, layer, kv);
      for (int64_t b = 0; b < layout.TokenBytes(); ++b) row[b] = PatternByte(token, layer, kv, b);
    }
  }
}

// "" when `slot` holds token `token`'s pattern, else where it first differs.
inline std::string CheckToken(const void* storage, const kernels::KvBlockLayout& layout,
                              int64_t slot, int64_t token) {
  const auto* base = static_cast<const uint8_t*>(storage);
  for (int64_t layer = 0; layer < layout.layers; ++layer) {
    for (int64_t kv = 0; kv < 2; ++kv) {
      const uint8_t* row = base + layout.Offset(slot, layer, kv);
      for (int64_t b = 0; b < layout.TokenBytes(); ++b) {
        if (row[b] != PatternByte(token, layer, kv, b)) {
          return "slot " + std::to_string(slot) + " layer " + std::to_string(layer) +
                 (kv == 0 ? " K" : " V") + " byte " + std::to_string(b) +
                 " does not hold token " + std::to_string(token);
        }
      }
    }
  }
  return "";
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_POOLS_KV_PATTERN_H_

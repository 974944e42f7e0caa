// CPU reference of kernels/kv_compaction.h.
#include <cstring>

#include "kernels/kv_compaction.h"

namespace kvcm::kernels::cpu {

void CompactKv(void* storage, const KvBlockLayout& layout, const KvMove* moves,
               int64_t num_moves, StreamHandle /*stream*/) {
  auto* base = static_cast<std::byte*>(storage);
  const size_t token_bytes = static_cast<size_t>(layout.TokenBytes());
  for (int64_t m = 0; m < num_moves; ++m) {
    for (int64_t layer = 0; layer < layout.layers; ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        std::memcpy(base + layout.Offset(moves[m].dst_slot, layer, kv),
                    base + layout.Offset(moves[m].src_slot, layer, kv), token_bytes);
      }
    }
  }
}

}  // namespace kvcm::kernels::cpu

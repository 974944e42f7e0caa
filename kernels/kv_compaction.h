// KV compaction: copies the keys and values of whole tokens from one slot of a rank's KV
// block storage to another, so that survivors of eviction can be packed and whole blocks
// returned to the pool (cache_manager/kv/block_pool.h plans the moves).
//
// Block storage layout (one rank, row-major, no padding):
//
//   [blocks][layers][2 (0 = K, 1 = V)][tokens_per_block][kv_heads][head_dim]  of `dtype`
//
// A slot is `block * tokens_per_block + token_in_block`. One token of one layer's K (or V)
// is a contiguous run of kv_heads * head_dim elements (TokenBytes), so moving a token is
// 2 * layers contiguous copies. A block is contiguous (BlockBytes), which lets a pool hand
// out blocks as plain offsets into one allocation.
//
// The CPU reference (namespace cpu) and the CUDA kernel (kernels/cuda/kv_compaction_cuda.h)
// share the signature; their parity is pinned by tests/gpu. Stateless and thread-safe.
#ifndef KVCM_KERNELS_KV_COMPACTION_H_
#define KVCM_KERNELS_KV_COMPACTION_H_

#include <cstddef>
#include <cstdint>

#include "kernels/score_matrix.h"

namespace kvcm::kernels {

enum class KvDtype : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int64_t KvDtypeSize(KvDtype dtype) { return dtype == KvDtype::kFloat32 ? 4 : 2; }

// The geometry of one rank's KV blocks: what the model and the tensor-parallel split fix.
struct KvBlockLayout {
  int64_t tokens_per_block = 16;
  int64_t layers = 1;
  int64_t kv_heads = 1;  // on this rank
  int64_t head_dim = 1;
  KvDtype dtype = KvDtype::kFloat16;

  // Bytes of one token's K (or V) in one layer.
  constexpr int64_t TokenBytes() const { return kv_heads * head_dim * KvDtypeSize(dtype); }
  // Bytes of one token's K and V over all layers: what a move copies.
  constexpr int64_t TokenFootprintBytes() const { return 2 * layers * TokenBytes(); }
  constexpr int64_t BlockBytes() const { return tokens_per_block * TokenFootprintBytes(); }
  // Byte offset of (slot, layer, kv) from the start of the storage; kv: 0 = K, 1 = V.
  constexpr int64_t Offset(int64_t slot, int64_t layer, int64_t kv) const {
    const int64_t block = slot / tokens_per_block;
    const int64_t token = slot % tokens_per_block;
    return (((block * layers + layer) * 2 + kv) * tokens_per_block + token) * TokenBytes();
  }
};

// One token to move: every layer's K and V of `src_slot` is copied to `dst_slot`.
struct KvMove {
  int64_t src_slot = 0;
  int64_t dst_slot = 0;
};

namespace cpu {

// Applies `moves` to `storage`. The moves are independent: no slot is the destination of
// two moves, and no destination is the source of any move (a plan moves survivors into
// free slots), so they may run in any order or all at once.
// storage: [blocks, layers, 2, tokens_per_block, kv_heads, head_dim] of layout.dtype, host;
//          every slot named by a move lies inside it.
// moves:   [num_moves], host.   stream: nullptr.
void CompactKv(void* storage, const KvBlockLayout& layout, const KvMove* moves,
               int64_t num_moves, StreamHandle stream);

}  // namespace cpu
}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_KV_COMPACTION_H_

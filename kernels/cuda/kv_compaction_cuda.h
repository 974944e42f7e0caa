// CUDA kernel of kernels/kv_compaction.h (same signature, same bytes as the CPU
// reference). Device memory, cudaStream_t; enqueues only, never allocates. Thread-safe.
#ifndef KVCM_KERNELS_CUDA_KV_COMPACTION_CUDA_H_
#define KVCM_KERNELS_CUDA_KV_COMPACTION_CUDA_H_

#include <cstdint>

#include "kernels/kv_compaction.h"

namespace kvcm::kernels::cuda {

// storage: [blocks, layers, 2, tokens_per_block, kv_heads, head_dim], device.
// moves:   [num_moves], device (independent moves, see cpu::CompactKv).
void CompactKv(void* storage, const KvBlockLayout& layout, const KvMove* moves,
               int64_t num_moves, StreamHandle stream);

}  // namespace kvcm::kernels::cuda

#endif  // KVCM_KERNELS_CUDA_KV_COMPACTION_CUDA_H_

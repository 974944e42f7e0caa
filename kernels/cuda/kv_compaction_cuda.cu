// CUDA kernel of kernels/cuda/kv_compaction_cuda.h.
//
// A "row" is one token's K or V in one layer: TokenBytes contiguous bytes at both ends of
// a move. A team of threads (32, 64, 128 or 256) copies one row in the widest unit that the
// row size and the storage alignment allow (16, 8, 4 or 2 bytes); a 256-thread block
// carries 256 / team rows at a time and walks the rows grid-stride.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/kv_compaction_cuda.h"

namespace kvcm::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename Unit>
__global__ void __launch_bounds__(kThreads)
    CompactKvKernel(char* storage, KvBlockLayout layout, const KvMove* moves, int64_t rows,
                    int team) {
  const int64_t units = layout.TokenBytes() / static_cast<int64_t>(sizeof(Unit));
  const int64_t rows_per_block = kThreads / team;
  const int member = static_cast<int>(threadIdx.x) % team;
  const int64_t rows_per_move = 2 * layout.layers;
  for (int64_t row = blockIdx.x * rows_per_block + threadIdx.x / team; row < rows;
       row += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const KvMove move = moves[row / rows_per_move];
    const int64_t layer_kv = row % rows_per_move;
    const int64_t layer = layer_kv / 2;
    const int64_t kv = layer_kv % 2;
    const auto* src =
        reinterpret_cast<const Unit*>(storage + layout.Offset(move.src_slot, layer, kv));
    auto* dst = reinterpret_cast<Unit*>(storage + layout.Offset(move.dst_slot, layer, kv));
    for (int64_t u = member; u < units; u += team) dst[u] = src[u];
  }
}

template <typename Unit>
void Launch(void* storage, const KvBlockLayout& layout, const KvMove* moves, int64_t rows,
            cudaStream_t stream) {
  const int64_t units = layout.TokenBytes() / static_cast<int64_t>(sizeof(Unit));
  // Team size: the row's units rounded up to a power of two from a warp to the block, so
  // teams tile the block exactly.
  int team = 32;
  while (team < kThreads && team < units) team *= 2;
  const int64_t rows_per_block = kThreads / team;
  int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  blocks = blocks < 1 ? 1 : (blocks > (1 << 20) ? (1 << 20) : blocks);
  CompactKvKernel<Unit><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      static_cast<char*>(storage), layout, moves, rows, team);
}

}  // namespace

void CompactKv(void* storage, const KvBlockLayout& layout, const KvMove* moves,
               int64_t num_moves, StreamHandle stream) {
  if (num_moves <= 0) return;
  const int64_t rows = num_moves * 2 * layout.layers;
  const auto stream_handle = static_cast<cudaStream_t>(stream);
  // Every row starts at a multiple of TokenBytes from `storage`, so a unit divides all row
  // addresses when it divides both.
  const uint64_t alignment = reinterpret_cast<uintptr_t>(storage) |
                             static_cast<uint64_t>(layout.TokenBytes());
  if (alignment % 16 == 0) {
    Launch<uint4>(storage, layout, moves, rows, stream_handle);
  } else if (alignment % 8 == 0) {
    Launch<uint2>(storage, layout, moves, rows, stream_handle);
  } else if (alignment % 4 == 0) {
    Launch<uint32_t>(storage, layout, moves, rows, stream_handle);
  } else {
    Launch<uint16_t>(storage, layout, moves, rows, stream_handle);
  }
}

}  // namespace kvcm::kernels::cuda

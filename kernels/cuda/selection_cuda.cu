// CUDA kernels of kernels/cuda/selection_cuda.h.
//
// SelectLowest, k == 1: a block-wide minimum of the packed key (bits << 32 | offset).
// SelectLowest, 1 < k < count: a radix select finds T, the value bits of the k-th lowest
// key, in four 8-bit passes (histograms in shared memory); `need` = how many keys with
// bits == T belong to the k lowest. The selection is then every element with bits < T
// plus the first `need` with bits == T (the tie rule: lower index first), written in index
// order by an ordered scan: element i lands at less_before(i) + min(equal_before(i), need).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/selection_cuda.h"

namespace kvcm::kernels::cuda {
namespace {

using detail::AsStream;

constexpr int kBlockThreads = 1024;
constexpr int kItems = 8;  // per thread per chunk: loads in flight while the block waits
constexpr int64_t kChunk = int64_t{kBlockThreads} * kItems;
constexpr uint32_t kNoDigit = 256;
constexpr uint32_t kAfterEverything = 0xffffffffu;  // above any non-negative float's bits

// The value half of the eviction key (kernels/cpu/selection_cpu.cc): -0.0 folds onto +0.0.
__device__ inline uint32_t KeyBits(float value) {
  const uint32_t bits = __float_as_uint(value);
  return (bits & 0x7fffffffu) == 0 ? 0u : bits;
}

struct MinKey {
  __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
    return b < a ? b : a;
  }
};

__global__ void __launch_bounds__(kBlockThreads)
    ArgMinKernel(const float* values, int64_t begin, int64_t count, int64_t* selected) {
  using Reduce = cub::BlockReduce<unsigned long long, kBlockThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const float* v = values + begin;
  unsigned long long best = ~0ull;
  for (int64_t i = threadIdx.x; i < count; i += kBlockThreads) {
    const unsigned long long key =
        (static_cast<unsigned long long>(KeyBits(v[i])) << 32) | static_cast<uint32_t>(i);
    best = key < best ? key : best;
  }
  const unsigned long long lowest = Reduce(storage).Reduce(best, MinKey{});
  if (threadIdx.x == 0) selected[0] = begin + static_cast<int64_t>(lowest & 0xffffffffull);
}

__global__ void __launch_bounds__(kBlockThreads)
    SelectAllKernel(int64_t begin, int64_t count, int64_t* selected) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    selected[i] = begin + i;
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    SelectLowestKernel(const float* values, int64_t begin, int64_t count, int64_t k,
                       int64_t* selected) {
  using DigitScan = cub::BlockScan<uint32_t, kBlockThreads>;
  using PairScan = cub::BlockScan<unsigned long long, kBlockThreads>;
  __shared__ union {
    typename DigitScan::TempStorage digit;
    typename PairScan::TempStorage pair;
  } scan;
  __shared__ uint32_t histogram[256];
  __shared__ uint32_t chosen_prefix;
  __shared__ uint32_t chosen_rank;

  const float* v = values + begin;
  const uint32_t tid = threadIdx.x;
  const uint32_t lane = tid & 31u;

  // Radix select, most significant byte first. `rank` is the 1-based rank of the wanted
  // key among the keys whose bits match `prefix` under `mask`.
  uint32_t prefix = 0;
  uint32_t mask = 0;
  uint32_t rank = static_cast<uint32_t>(k);
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) histogram[tid] = 0;
    __syncthreads();
    for (int64_t base = 0; base < count; base += kChunk) {  // uniform trip count
      uint32_t digit[kItems];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int64_t i = base + int64_t{j} * kBlockThreads + tid;
        digit[j] = kNoDigit;
        if (i < count) {
          const uint32_t bits = KeyBits(v[i]);
          if ((bits & mask) == prefix) digit[j] = (bits >> shift) & 0xffu;
        }
      }
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        // One shared atomic per distinct digit in the warp: scores crowd into few bins.
        const uint32_t peers = __match_any_sync(0xffffffffu, digit[j]);
        if (digit[j] != kNoDigit && lane == static_cast<uint32_t>(__ffs(peers) - 1)) {
          atomicAdd(&histogram[digit[j]], static_cast<uint32_t>(__popc(peers)));
        }
      }
    }
    __syncthreads();
    const uint32_t in_bin = tid < 256 ? histogram[tid] : 0u;
    uint32_t before = 0;
    DigitScan(scan.digit).ExclusiveSum(in_bin, before);
    if (tid < 256 && before < rank && rank <= before + in_bin) {
      chosen_prefix = prefix | (tid << shift);
      chosen_rank = rank - before;
    }
    __syncthreads();
    prefix = chosen_prefix;
    rank = chosen_rank;
    mask |= 0xffu << shift;
  }
  const uint32_t threshold = prefix;
  const uint32_t need = rank;

  // Ordered compaction. Each thread owns kItems consecutive elements, so a block scan over
  // threads counts in index order; the two counts travel packed as (equal << 32 | less).
  uint32_t less_total = 0;
  uint32_t equal_total = 0;
  for (int64_t base = 0; base < count; base += kChunk) {
    uint32_t bits[kItems];
    unsigned long long mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + int64_t{tid} * kItems + j;
      bits[j] = i < count ? KeyBits(v[i]) : kAfterEverything;
      mine += bits[j] < threshold ? 1ull : (bits[j] == threshold ? (1ull << 32) : 0ull);
    }
    unsigned long long before = 0;
    unsigned long long aggregate = 0;
    PairScan(scan.pair).ExclusiveSum(mine, before, aggregate);
    uint32_t less = less_total + static_cast<uint32_t>(before);
    uint32_t equal = equal_total + static_cast<uint32_t>(before >> 32);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + int64_t{tid} * kItems + j;
      if (bits[j] < threshold) {
        selected[less + (equal < need ? equal : need)] = begin + i;
        ++less;
      } else if (bits[j] == threshold) {
        if (equal < need) selected[less + equal] = begin + i;
        ++equal;
      }
    }
    less_total += static_cast<uint32_t>(aggregate);
    equal_total += static_cast<uint32_t>(aggregate >> 32);
    __syncthreads();  // the scan storage is reused by the next chunk
  }
}

// Stable in-place removal in chunks: a chunk's survivors are all read into registers
// before any is written, and a survivor only ever moves down, so every write lands on an
// element that has already been read.
__global__ void __launch_bounds__(kBlockThreads)
    RemoveEntriesKernel(float* momentum, int64_t* positions, int64_t n, const int64_t* indices,
                        int64_t k) {
  using CountScan = cub::BlockScan<uint32_t, kBlockThreads>;
  __shared__ typename CountScan::TempStorage scan;
  __shared__ uint8_t removed[kChunk];
  const uint32_t tid = threadIdx.x;
  int64_t removed_before = 0;  // indices below `base`
  for (int64_t base = indices[0]; base < n; base += kChunk) {
    for (int64_t j = tid; j < kChunk; j += kBlockThreads) removed[j] = 0;
    __syncthreads();
    for (int64_t j = removed_before + tid; j < k; j += kBlockThreads) {
      const int64_t index = indices[j];
      if (index >= base + kChunk) break;
      removed[index - base] = 1;
    }
    __syncthreads();
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) mine += removed[tid * kItems + j];
    uint32_t before = 0;
    uint32_t aggregate = 0;
    CountScan(scan).ExclusiveSum(mine, before, aggregate);

    float kept_momentum[kItems];
    int64_t kept_position[kItems];
    int64_t destination[kItems];
    int64_t shift = removed_before + before;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + int64_t{tid} * kItems + j;
      destination[j] = -1;
      if (removed[tid * kItems + j] != 0) {
        ++shift;
      } else if (i < n) {
        destination[j] = i - shift;
        kept_momentum[j] = momentum[i];
        kept_position[j] = positions[i];
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (destination[j] >= 0) {
        momentum[destination[j]] = kept_momentum[j];
        positions[destination[j]] = kept_position[j];
      }
    }
    removed_before += aggregate;
    __syncthreads();
  }
}

}  // namespace

void SelectLowest(const float* values, int64_t begin, int64_t end, int64_t k,
                  int64_t* selected, uint64_t* /*scratch*/, StreamHandle stream) {
  const int64_t count = end - begin;
  if (k <= 0) return;
  if (k >= count) {
    const int64_t blocks = (count + kBlockThreads - 1) / kBlockThreads;
    SelectAllKernel<<<static_cast<unsigned int>(blocks < 65535 ? blocks : 65535), kBlockThreads,
                      0, AsStream(stream)>>>(begin, count, selected);
  } else if (k == 1) {
    ArgMinKernel<<<1, kBlockThreads, 0, AsStream(stream)>>>(values, begin, count, selected);
  } else {
    SelectLowestKernel<<<1, kBlockThreads, 0, AsStream(stream)>>>(values, begin, count, k,
                                                                   selected);
  }
}

void RemoveEntries(float* momentum, int64_t* positions, int64_t n, const int64_t* indices,
                   int64_t k, StreamHandle stream) {
  if (k <= 0) return;
  RemoveEntriesKernel<<<1, kBlockThreads, 0, AsStream(stream)>>>(momentum, positions, n,
                                                                  indices, k);
}

}  // namespace kvcm::kernels::cuda

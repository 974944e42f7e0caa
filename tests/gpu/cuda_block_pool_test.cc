// The CUDA backend of the KV block pools: device memory, the IPC export, exhaustion, and
// compaction moving the right bytes with the CUDA kernel (checked against the pattern each
// token was written with). Opening the IPC handle needs a second process and is left to
// the worker integration tests.
#include "cache_manager/cuda_block_pool.h"

#include <cuda_runtime_api.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/pools/kv_pattern.h"

namespace kvcm {
namespace {

using kernels::KvBlockLayout;
using kernels::KvDtype;

// 16 tokens per block, 4 layers, 8 kv heads of 128 fp16 (2 KiB rows): 256 KiB blocks.
constexpr KvBlockLayout kLayout{16, 4, 8, 128, KvDtype::kFloat16};

std::unique_ptr<BlockPool> MakeDevicePool(int64_t blocks, int32_t rank = 0) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = blocks * kLayout.BlockBytes();
  options.rank = rank;
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = CreateCudaBlockPool(options, 0);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

std::vector<uint8_t> Download(const BlockPool& pool) {
  std::vector<uint8_t> host(static_cast<size_t>(pool.storage().bytes()));
  const cudaError_t error =
      cudaMemcpy(host.data(), pool.storage().data(), host.size(), cudaMemcpyDeviceToHost);
  EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
  return host;
}

void Upload(const BlockPool& pool, const std::vector<uint8_t>& host) {
  const cudaError_t error =
      cudaMemcpy(pool.storage().data(), host.data(), host.size(), cudaMemcpyHostToDevice);
  EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
}

TEST(CudaBlockPoolTest, RejectsADeviceThatDoesNotExist) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = kLayout.BlockBytes();
  EXPECT_EQ(CreateCudaBlockPool(options, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaBlockPoolTest, LivesInDeviceMemoryAndExportsAnIpcHandle) {
  KVCM_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockPool> pool = MakeDevicePool(8, /*rank=*/1);
  ASSERT_NE(pool, nullptr);
  const BlockPoolUsage usage = pool->Usage();
  EXPECT_EQ(usage.rank, 1);
  EXPECT_EQ(usage.space, MemorySpace::kDevice);
  EXPECT_EQ(usage.capacity_blocks, 8);
  EXPECT_EQ(usage.block_bytes, kLayout.BlockBytes());
  const MemoryExport& exported = pool->memory_export();
  EXPECT_EQ(exported.kind, MemoryExport::Kind::kCudaIpc);
  EXPECT_EQ(exported.cuda_ipc_handle.size(), sizeof(cudaIpcMemHandle_t));
  EXPECT_EQ(exported.device, 0);
  EXPECT_EQ(exported.bytes, 8 * kLayout.BlockBytes());
  cudaPointerAttributes attributes;
  KVCM_ASSERT_CUDA(cudaPointerGetAttributes(&attributes, pool->storage().data()));
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, 0);
  // Zero-filled.
  for (uint8_t b : Download(*pool)) ASSERT_EQ(b, 0);
}

TEST(CudaBlockPoolTest, AFullDevicePoolIsResourceExhausted) {
  KVCM_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockPool> pool = MakeDevicePool(4);
  ASSERT_NE(pool, nullptr);
  absl::StatusOr<BlockLease> lease = pool->Lease(64);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->Append(1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Lease(1).status().code(), absl::StatusCode::kResourceExhausted);
  lease->Release();
  EXPECT_EQ(pool->Usage().used_blocks, 0);
}

TEST(CudaBlockPoolTest, CompactionMovesEveryLiveTokensKAndVOnTheDevice) {
  KVCM_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockPool> pool = MakeDevicePool(64);
  ASSERT_NE(pool, nullptr);
  std::mt19937_64 rng(5);
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    BlockLease lease = *pool->Lease(400 + 97 * round);
    // The worker writes every token's K and V ...
    std::vector<uint8_t> host = Download(*pool);
    std::vector<int64_t> ids(static_cast<size_t>(lease.size()));
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = 10000 * round + static_cast<int64_t>(i);
      testing::WriteToken(host.data(), kLayout, lease.slots()[i], ids[i]);
    }
    Upload(*pool, host);
    // ... the first step evicts most of them ...
    std::vector<int64_t> evict;
    for (int64_t i = 0; i < lease.size(); ++i) {
      if (rng() % 10 != 0) evict.push_back(i);
    }
    ASSERT_TRUE(lease.Evict(evict).ok());
    for (auto it = evict.rbegin(); it != evict.rend(); ++it) ids.erase(ids.begin() + *it);
    // ... and compaction packs the survivors.
    const int64_t used_before = pool->Usage().used_blocks;
    absl::StatusOr<CompactionPlan> plan = lease.Compact();
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(plan->moves.empty());
    EXPECT_EQ(lease.block_count(), (lease.size() + 15) / 16);
    EXPECT_EQ(pool->Usage().used_blocks,
              used_before - static_cast<int64_t>(plan->released_blocks.size()));
    host = Download(*pool);
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_EQ(testing::CheckToken(host.data(), kLayout, lease.slots()[i], ids[i]), "");
    }
  }
  EXPECT_EQ(pool->Usage().used_blocks, 0);
}

}  // namespace
}  // namespace kvcm

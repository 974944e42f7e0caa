// The CUDA backend of the KV block pools: device memory, the zero fill complete and
// ordered before the pool is used, the optional IPC export with the device's UUID and PCI
// bus id, exhaustion, compaction moving the right bytes with the CUDA kernel (checked
// against the pattern each token was written with), and a second process mapping the
// pool by its handle (kvcm_gpu_ipc_child) and seeing the parent's bytes, before and after
// a compaction.
#include "cache_manager/cuda_block_pool.h"

#include <cuda_runtime_api.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
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

// The pool's work runs on its own non-blocking stream, which the legacy stream of these
// copies does not wait for: wait for the whole device on both sides.
std::vector<uint8_t> Download(const BlockPool& pool) {
  std::vector<uint8_t> host(static_cast<size_t>(pool.storage().bytes()));
  cudaError_t error = cudaDeviceSynchronize();
  if (error == cudaSuccess) {
    error = cudaMemcpy(host.data(), pool.storage().data(), host.size(), cudaMemcpyDeviceToHost);
  }
  EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
  return host;
}

// A pageable cudaMemcpy may return before its DMA has landed.
void Upload(const BlockPool& pool, const std::vector<uint8_t>& host) {
  cudaError_t error =
      cudaMemcpy(pool.storage().data(), host.data(), host.size(), cudaMemcpyHostToDevice);
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
}

std::string Hex(const std::string& bytes) {
  std::string hex;
  char digits[3];
  for (unsigned char c : bytes) {
    std::snprintf(digits, sizeof(digits), "%02x", c);
    hex += digits;
  }
  return hex;
}

// Runs kvcm_gpu_ipc_child (next to this test's executable) on `pool`'s export, checking
// that slot `slots[i]` holds token `ids[i]`; returns its exit status.
int RunIpcChild(const BlockPool& pool, std::span<const int64_t> slots,
                const std::vector<int64_t>& ids) {
  const absl::StatusOr<CudaIpcExport> exported = CudaIpcExportOf(pool.storage());
  EXPECT_TRUE(exported.ok()) << exported.status();
  if (!exported.ok()) return -1;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  const std::string child = (self.parent_path() / "kvcm_gpu_ipc_child").string();
  const std::string checks = ::testing::TempDir() + "/ipc_checks_" + std::to_string(getpid());
  {
    std::ofstream out(checks);
    for (size_t i = 0; i < ids.size(); ++i) out << slots[i] << " " << ids[i] << "\n";
  }
  std::vector<std::string> args = {child,
                                   Hex(exported->handle),
                                   exported->identity.uuid,
                                   std::to_string(exported->bytes),
                                   std::to_string(kLayout.tokens_per_block),
                                   std::to_string(kLayout.layers),
                                   std::to_string(kLayout.kv_heads),
                                   std::to_string(kLayout.head_dim),
                                   std::to_string(static_cast<int>(kLayout.dtype)),
                                   checks};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, child.c_str(), nullptr, nullptr, argv.data(), environ);
  EXPECT_EQ(spawned, 0) << "cannot start " << child;
  if (spawned != 0) return -1;
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  std::filesystem::remove(checks);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(CudaBlockPoolTest, RejectsADeviceThatDoesNotExist) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = kLayout.BlockBytes();
  EXPECT_EQ(CreateCudaBlockPool(options, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaBlockPoolTest, HostStorageHasNoCudaExport) {
  // Needs no GPU.
  absl::StatusOr<std::unique_ptr<KvStorage>> host = NewHostKvStorage(4096, HostStorageOptions{});
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(CudaIpcExportOf(**host).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaBlockPoolTest, TheZeroFillIsCompleteWhenThePoolIsHandedOut) {
  KVCM_SKIP_WITHOUT_GPU();
  // Large enough that a fill still running would be seen: the fill must have run on the
  // storage's stream and been waited for, so no stream of this process is busy with it,
  // and work enqueued right away on any stream sees zeros.
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  KVCM_ASSERT_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t blocks = std::min<int64_t>(static_cast<int64_t>(free_bytes / 4) / kLayout.BlockBytes(),
                                           (int64_t{4} << 30) / kLayout.BlockBytes());
  ASSERT_GT(blocks, 0);
  std::unique_ptr<BlockPool> pool = MakeDevicePool(blocks);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(cudaStreamQuery(cudaStreamLegacy), cudaSuccess)
      << "pool creation returned with work still running on the legacy stream";
  cudaStream_t other = nullptr;
  KVCM_ASSERT_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  // Read the last block (the fill's end) from an unrelated non-blocking stream.
  std::vector<uint8_t> tail(static_cast<size_t>(kLayout.BlockBytes()), 0xff);
  const auto* last = static_cast<const uint8_t*>(pool->storage().data()) +
                     (blocks - 1) * kLayout.BlockBytes();
  KVCM_ASSERT_CUDA(cudaMemcpyAsync(tail.data(), last, tail.size(), cudaMemcpyDeviceToHost, other));
  KVCM_ASSERT_CUDA(cudaStreamSynchronize(other));
  KVCM_ASSERT_CUDA(cudaStreamDestroy(other));
  for (uint8_t b : tail) ASSERT_EQ(b, 0);
}

TEST(CudaBlockPoolTest, TheIpcExportIsOptional) {
  KVCM_SKIP_WITHOUT_GPU();
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = 2 * kLayout.BlockBytes();
  CudaStorageOptions storage;
  storage.export_ipc = false;
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = CreateCudaBlockPool(options, 0, storage);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->memory_export().kind, MemoryExport::Kind::kNone);
  EXPECT_EQ(CudaIpcExportOf((*pool)->storage()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*pool)->Usage().space, MemorySpace::kDevice);
}

TEST(CudaBlockPoolTest, TheExportNamesTheGpuByUuidAndPciBusId) {
  KVCM_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockPool> pool = MakeDevicePool(2);
  ASSERT_NE(pool, nullptr);
  const absl::StatusOr<CudaIpcExport> exported = CudaIpcExportOf(pool->storage());
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->handle.size(), sizeof(cudaIpcMemHandle_t));
  EXPECT_EQ(exported->device, 0);
  EXPECT_EQ(exported->bytes, 2 * kLayout.BlockBytes());
  cudaDeviceProp properties{};
  KVCM_ASSERT_CUDA(cudaGetDeviceProperties(&properties, 0));
  ASSERT_EQ(exported->identity.uuid.size(), 40u) << exported->identity.uuid;  // GPU-8-4-4-4-12
  EXPECT_EQ(exported->identity.uuid.rfind("GPU-", 0), 0u);
  char bus_id[32] = {};
  KVCM_ASSERT_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), 0));
  EXPECT_EQ(exported->identity.pci_bus_id, std::string(bus_id));
  const absl::StatusOr<CudaDeviceIdentity> described = DescribeCudaDevice(0);
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ(described->uuid, exported->identity.uuid);
  // What DescribeKvPools sends a worker (server/translate.cc copies the MemoryExport).
  EXPECT_EQ(pool->memory_export().device_uuid, exported->identity.uuid);
  EXPECT_EQ(pool->memory_export().device_pci_bus_id, exported->identity.pci_bus_id);
}

TEST(CudaBlockPoolTest, ASecondProcessMapsThePoolAndSeesTheBytesAlsoAfterACompaction) {
  KVCM_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockPool> pool = MakeDevicePool(64);
  ASSERT_NE(pool, nullptr);
  BlockLease lease = *pool->Lease(500);
  std::vector<uint8_t> host = Download(*pool);
  std::vector<int64_t> ids(static_cast<size_t>(lease.size()));
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = 7000 + static_cast<int64_t>(i);
    testing::WriteToken(host.data(), kLayout, lease.slots()[i], ids[i]);
  }
  Upload(*pool, host);
  EXPECT_EQ(RunIpcChild(*pool, lease.slots(), ids), 0);
  // The child really checks: a wrong token for one slot fails it.
  std::vector<int64_t> wrong = ids;
  wrong[123] += 1;
  EXPECT_EQ(RunIpcChild(*pool, lease.slots(), wrong), 1);
  // Evict most tokens, compact on the device, and look again from the child.
  std::vector<int64_t> evict;
  for (int64_t i = 0; i < lease.size(); ++i) {
    if (i % 5 != 0) evict.push_back(i);
  }
  ASSERT_TRUE(lease.Evict(evict).ok());
  for (auto it = evict.rbegin(); it != evict.rend(); ++it) ids.erase(ids.begin() + *it);
  absl::StatusOr<CompactionPlan> plan = lease.Compact();
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_FALSE(plan->moves.empty());
  EXPECT_EQ(RunIpcChild(*pool, lease.slots(), ids), 0);
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

// The CUDA backend of the KV block pools: device memory, the zero fill complete and
// ordered before the pool is used, the optional IPC export with the device's UUID and PCI
// bus id, exhaustion, compaction moving the right bytes with the CUDA kernel (checked
// against the pattern each token was written with), and a second process mapping the
// pool by its handle (kvcm_gpu_ipc_child) and seeing the parent's bytes, before and after
// a compaction; and a second process writing score rows into exported device memory (a
// daemon-created CUDA score region) that the engine reads in place.
#include "cache_manager/kv/cuda_block_pool.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <utility>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cache_manager/engine/sequence.h"
#include "cache_manager/kv/ipc_export_size.h"
#include "cache_manager/tp/tensor_parallel_join.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/cache_manager/kv/kv_pattern.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvcm {
namespace {

using kernels::KvBlockLayout;
using kernels::KvDtype;

// The tests that export memory to another process need CUDA IPC: on a GPU in
// exclusive-process compute mode (or without IPC) they skip, saying why.
#define KVCM_SKIP_WITHOUT_IPC()                                              \
  do {                                                                       \
    const absl::StatusOr<GpuComputeMode> mode = ComputeModeOf(0);            \
    ASSERT_TRUE(mode.ok()) << mode.status();                                 \
    const std::string why = IpcExportUnavailableReason(0, *mode, true);      \
    if (!why.empty()) GTEST_SKIP() << why;                                   \
  } while (0)

// 16 tokens per block, 4 layers, 8 kv heads of 128 fp16 (2 KiB rows): 256 KiB blocks.
constexpr KvBlockLayout kLayout{16, 4, 8, 128, KvDtype::kFloat16};

// At least `blocks` blocks; exactly that many without the IPC export. Exported, the cap is
// the blocks' bytes rounded up to whole IPC units, which hold as many blocks as fit.
std::unique_ptr<BlockPool> MakeDevicePool(int64_t blocks, int32_t rank = 0,
                                          bool export_ipc = true) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = blocks * kLayout.BlockBytes();
  if (export_ipc) options.memory_bytes = CudaIpcAllocationBytes(options.memory_bytes);
  options.rank = rank;
  CudaStorageOptions storage;
  storage.export_ipc = export_ipc;
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = CreateCudaBlockPool(options, 0, storage);
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

// Runs kvcm_gpu_ipc_child (next to this test's executable) with `args`; returns its exit
// status (-1 when it could not start or was killed).
int RunChild(std::vector<std::string> args) {
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  const std::string child = (self.parent_path() / "kvcm_gpu_ipc_child").string();
  args.insert(args.begin(), child);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, child.c_str(), nullptr, nullptr, argv.data(), environ);
  EXPECT_EQ(spawned, 0) << "cannot start " << child;
  if (spawned != 0) return -1;
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs the child on `pool`'s export, checking that slot `slots[i]` holds token `ids[i]`;
// returns its exit status.
int RunIpcChild(const BlockPool& pool, std::span<const int64_t> slots,
                const std::vector<int64_t>& ids) {
  const absl::StatusOr<CudaIpcExport> exported = CudaIpcExportOf(pool.storage());
  EXPECT_TRUE(exported.ok()) << exported.status();
  if (!exported.ok()) return -1;
  const std::string checks = ::testing::TempDir() + "/ipc_checks_" + std::to_string(getpid());
  {
    std::ofstream out(checks);
    for (size_t i = 0; i < ids.size(); ++i) out << slots[i] << " " << ids[i] << "\n";
  }
  const int status = RunChild({Hex(exported->handle), exported->identity.uuid,
                               std::to_string(exported->bytes),
                               std::to_string(kLayout.tokens_per_block),
                               std::to_string(kLayout.layers), std::to_string(kLayout.kv_heads),
                               std::to_string(kLayout.head_dim),
                               std::to_string(static_cast<int>(kLayout.dtype)), checks});
  std::filesystem::remove(checks);
  return status;
}

TEST(CudaBlockPoolTest, RejectsADeviceThatDoesNotExist) {
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = kLayout.BlockBytes();
  EXPECT_EQ(CreateCudaBlockPool(options, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaBlockPoolTest, AnExportedPoolsCapMustHoldAWholeIpcUnit) {
  // Refused before any device is touched: runs without a GPU.
  BlockPoolOptions options;
  options.layout = kLayout;
  options.memory_bytes = kCudaIpcGranularity - 1;
  const absl::Status refused = CreateCudaBlockPool(options, 0).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("whole units of 2097152 bytes"), std::string::npos) << refused;
}

// cudaIpcGetMemHandle names the allocator's whole underlying allocation: every exported
// storage must be an allocation of its own, of whole 2 MiB units, so that no two of them
// (nor the engine's small arrays allocated between them) share a 2 MiB block.
TEST(CudaBlockPoolTest, TwoExportedRegionsNeverShareAnIpcBlock) {
  KVCM_SKIP_WITHOUT_GPU();
  KVCM_SKIP_WITHOUT_IPC();
  using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  KVCM_ASSERT_CUDA(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 3020,
                                                    cudaEnableDefault, &found));
  ASSERT_EQ(found, cudaDriverEntryPointSuccess);
  const auto address_range = reinterpret_cast<MemGetAddressRangeFn>(fn);

  std::vector<std::unique_ptr<KvStorage>> regions;
  std::vector<void*> neighbours;
  for (int64_t bytes : {int64_t{4096}, int64_t{777}, kCudaIpcGranularity + 1}) {
    absl::StatusOr<std::unique_ptr<KvStorage>> region = NewCudaKvStorage(bytes, 0);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_EQ((*region)->bytes(), CudaIpcAllocationBytes(bytes));
    EXPECT_EQ((*region)->memory_export().bytes, (*region)->bytes());
    regions.push_back(*std::move(region));
    void* small = nullptr;  // what the engine allocates between two regions
    KVCM_ASSERT_CUDA(cudaMalloc(&small, 256));
    neighbours.push_back(small);
  }
  const auto blocks_of = [](const void* p, int64_t bytes) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    return std::pair<uintptr_t, uintptr_t>(a / kCudaIpcGranularity,
                                           (a + static_cast<uintptr_t>(bytes) - 1) /
                                               kCudaIpcGranularity);
  };
  for (size_t i = 0; i < regions.size(); ++i) {
    SCOPED_TRACE("region " + std::to_string(i));
    // The handle's allocation is exactly the region.
    CUdeviceptr base = 0;
    size_t size = 0;
    ASSERT_EQ(address_range(&base, &size, reinterpret_cast<CUdeviceptr>(regions[i]->data())),
              CUDA_SUCCESS);
    EXPECT_EQ(reinterpret_cast<void*>(base), regions[i]->data());
    EXPECT_EQ(static_cast<int64_t>(size), regions[i]->bytes());
    const auto [first, last] = blocks_of(regions[i]->data(), regions[i]->bytes());
    const auto disjoint = [&, first = first, last = last](const void* p, int64_t bytes) {
      const auto [f, l] = blocks_of(p, bytes);
      return l < first || f > last;
    };
    for (size_t j = 0; j < regions.size(); ++j) {
      if (j == i) continue;
      EXPECT_TRUE(disjoint(regions[j]->data(), regions[j]->bytes())) << "region " << j;
    }
    for (void* small : neighbours) EXPECT_TRUE(disjoint(small, 256));
  }
  for (void* small : neighbours) cudaFree(small);
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
  KVCM_SKIP_WITHOUT_IPC();
  std::unique_ptr<BlockPool> pool = MakeDevicePool(2);
  ASSERT_NE(pool, nullptr);
  const absl::StatusOr<CudaIpcExport> exported = CudaIpcExportOf(pool->storage());
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->handle.size(), sizeof(cudaIpcMemHandle_t));
  EXPECT_EQ(exported->device, 0);
  EXPECT_EQ(exported->bytes, kCudaIpcGranularity);  // 2 blocks asked, a whole unit exported
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
  KVCM_SKIP_WITHOUT_IPC();
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
  KVCM_SKIP_WITHOUT_IPC();
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
  std::unique_ptr<BlockPool> pool = MakeDevicePool(4, /*rank=*/0, /*export_ipc=*/false);
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

// Writes `rows` into `exported` at `offset` from another process (kvcm_gpu_ipc_child
// write), as a worker's capture kernel fills a daemon-created score region.
void WriteFromWorker(const CudaIpcExport& exported, size_t offset, const std::vector<float>& rows) {
  const std::string file = ::testing::TempDir() + "/ipc_rows_" + std::to_string(getpid());
  {
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(rows.data()),
              static_cast<std::streamsize>(rows.size() * sizeof(float)));
  }
  EXPECT_EQ(RunChild({"write", Hex(exported.handle), exported.identity.uuid,
                      std::to_string(offset), file}),
            0);
  std::filesystem::remove(file);
}

std::vector<float> RandomRows(std::mt19937_64& rng, int64_t n) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> rows(static_cast<size_t>(n));
  for (float& x : rows) x = u(rng) * u(rng);
  return rows;
}

// The worker flow of a CUDA score region the daemon creates (CreateScoreRegion with
// --engine_backend=cuda), without gRPC: the region is the daemon's exported device memory
// (NewCudaKvStorage); a worker process opens it by handle and writes each step's rows;
// the engine reads them in place on the GPU (ScoreSpace::kBackend), and a
// tensor-parallel step joins two ranks' rows there. Decisions and momentum must equal the
// host engine's on the same scores, bit for bit.
TEST(CudaScoreRegionTest, AWorkerProcessWritesScoresThatTheEngineReadsInPlace) {
  KVCM_SKIP_WITHOUT_GPU();
  KVCM_SKIP_WITHOUT_IPC();
  constexpr int64_t kLayers = 4;
  absl::StatusOr<std::unique_ptr<KvStorage>> region = NewCudaKvStorage(int64_t{8} << 20, 0);
  ASSERT_TRUE(region.ok()) << region.status();
  const absl::StatusOr<CudaIpcExport> exported = CudaIpcExportOf(**region);
  ASSERT_TRUE(exported.ok()) << exported.status();
  std::mt19937_64 rng(29);

  SequenceOptions options;
  options.prefill_len = 3000;
  options.budget = BudgetSpec::Tokens(256);
  options.preset = "inertia";
  absl::StatusOr<std::unique_ptr<Sequence>> host = Sequence::Create("host", options);
  options.backend = &kernels::cuda::CudaBackend();
  absl::StatusOr<std::unique_ptr<Sequence>> device = Sequence::Create("device", options);
  ASSERT_TRUE(host.ok() && device.ok());
  for (int64_t step = 1; step <= 8; ++step) {
    const int64_t tokens = (*host)->next_score_length();
    const std::vector<float> rows = RandomRows(rng, kLayers * tokens);
    const size_t offset = static_cast<size_t>(step % 2) * (size_t{4} << 20);  // two ranges
    WriteFromWorker(*exported, offset, rows);
    const auto on_host =
        kernels::ScoreMatrix::Dense(rows.data(), kernels::ScoreDtype::kFloat32, kLayers, tokens);
    const auto in_region = kernels::ScoreMatrix::Dense(
        static_cast<std::byte*>((*region)->data()) + offset, kernels::ScoreDtype::kFloat32,
        kLayers, tokens);
    EvictionDecision hd, dd;
    ASSERT_TRUE((*host)->Step(step, &on_host, &hd).ok());
    const absl::Status stepped =
        (*device)->Step(step, &in_region, &dd, MomentumState::ScoreSpace::kBackend);
    ASSERT_TRUE(stepped.ok()) << stepped;
    ASSERT_EQ(hd.evicted, dd.evicted) << "step " << step;
  }
  const auto hm = (*host)->state().momentum(), dm = (*device)->state().momentum();
  ASSERT_EQ(hm.size(), dm.size());
  EXPECT_EQ(std::memcmp(hm.data(), dm.data(), hm.size() * sizeof(float)), 0);

  // Two ranks' head sums, written by the worker side by side, joined on the GPU.
  const int64_t tokens = 777;
  const std::vector<float> r0 = RandomRows(rng, kLayers * tokens), r1 = RandomRows(rng, kLayers * tokens);
  WriteFromWorker(*exported, 0, r0);
  WriteFromWorker(*exported, size_t{4} << 20, r1);
  TensorParallelJoin on_host(2), on_gpu(2, kernels::CpuBackend(), &kernels::cuda::CudaBackend(), 0);
  const JoinExpectation expect{"tp", 1, tokens, true};
  for (int32_t rank : {1, 0}) {
    const std::vector<float>& rows = rank == 0 ? r0 : r1;
    RankReport report;
    report.rank = rank;
    report.step = 1;
    report.head_count = 2 + rank;
    report.partial_sums =
        kernels::ScoreMatrix::Dense(rows.data(), kernels::ScoreDtype::kFloat32, kLayers, tokens);
    ASSERT_TRUE(on_host.Add(report, expect).ok());
    report.partial_sums.data =
        static_cast<std::byte*>((*region)->data()) + (rank == 0 ? 0 : (size_t{4} << 20));
    report.in_backend = true;
    ASSERT_TRUE(on_gpu.Add(report, expect).ok());
  }
  const kernels::ScoreMatrix want = on_host.Join();
  absl::StatusOr<kernels::ScoreMatrix> joined = on_gpu.JoinOnDevice();
  ASSERT_TRUE(joined.ok()) << joined.status();
  std::vector<float> got(static_cast<size_t>(kLayers * tokens));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), joined->data, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), want.data, got.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace kvcm

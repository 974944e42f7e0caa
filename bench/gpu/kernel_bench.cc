// kvcache-kernel-bench: the CUDA kernels next to the CPU reference, on the shapes that
// matter for serving (32 layers):
//
//   FirstStep128k/<dtype>/{cpu,cuda}  step 1 of a 131,072-token prefill at 90% compression:
//                                     fused update + validation over 131,073 tokens, select
//                                     the 117,966 lowest, remove them
//   SteadyStep6400/<dtype>/{cpu,cuda} a decode step at a 6,400-token budget: update 6,401
//                                     tokens, select the lowest one, remove it
//   Compaction64k/{cpu,cuda}          a 65,536-token fp16 cache (8 kv heads x 128 dims,
//                                     128 KiB per token, 8 GiB) after evicting 90% at random:
//                                     the moves of BlockLease::PlanCompaction
//
// Times are per step, around the kernels only on the CPU (a steady clock); the CUDA steps
// are timed end to end on the host's clock (launches, the update into a second buffer,
// selection, removal and the evicted indices' copy to the host, until the stream is done;
// `gpu_us` is the device's own span by CUDA events), not the scores' upload (they are
// taken to be resident, as in a CUDA score region or after an NCCL join). Every CUDA
// case checks its result against the CPU reference afterwards and reports a mismatch as
// its error; without a GPU the CUDA cases report "no CUDA device" and are skipped.
//
// Run: build/bin/kvcache-kernel-bench [--benchmark_filter=Steady]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "cache_manager/kv/block_pool.h"
#include "kernels/half_float.h"
#include "kernels/kv_compaction.h"
#include "kernels/momentum_update.h"
#include "kernels/selection.h"

#if KVCM_BENCH_CUDA
#include <cuda_runtime_api.h>

#include "cache_manager/kv/cuda_block_pool.h"
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/kv_compaction_cuda.h"
#include "kernels/cuda/momentum_update_cuda.h"
#include "kernels/cuda/selection_cuda.h"
#endif

namespace kvcm {
namespace {

using kernels::KvBlockLayout;
using kernels::KvDtype;
using kernels::ScoreDtype;
using kernels::ScoreMatrix;

constexpr int64_t kLayers = 32;

struct StepShape {
  const char* name;
  int64_t tokens;  // scores per layer: the cache before the step plus the new token
  int64_t evict;   // tokens the step evicts
};
// 90% of a 131,072-token prefill: budget 13,107, so step 1 evicts 131,073 - 13,107.
constexpr StepShape kFirstStep{"FirstStep128k", 131073, 131073 - 13107};
constexpr StepShape kSteadyStep{"SteadyStep6400", 6401, 1};

// A step's host inputs: scores in `dtype` (dense rows), momentum, positions.
struct StepInputs {
  ScoreDtype dtype;
  int64_t tokens;
  std::vector<uint8_t> scores;
  std::vector<float> momentum;
  std::vector<int64_t> positions;

  ScoreMatrix Scores(const void* data) const {
    return ScoreMatrix::Dense(data, dtype, kLayers, tokens);
  }
};

StepInputs MakeStepInputs(const StepShape& shape, ScoreDtype dtype) {
  StepInputs in{dtype, shape.tokens, {}, {}, {}};
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const size_t n = static_cast<size_t>(kLayers * shape.tokens);
  in.scores.resize(n * kernels::ScoreDtypeSize(dtype));
  for (size_t i = 0; i < n; ++i) {
    const float x = uniform(rng);
    const float v = x * x * x * 1e-3f;  // attention-like: mostly tiny, a few large
    if (dtype == ScoreDtype::kFloat32) {
      std::memcpy(in.scores.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h =
          dtype == ScoreDtype::kFloat16 ? kernels::FloatToFloat16(v) : kernels::FloatToBFloat16(v);
      std::memcpy(in.scores.data() + 2 * i, &h, 2);
    }
  }
  in.momentum.resize(static_cast<size_t>(shape.tokens));
  for (float& m : in.momentum) m = uniform(rng) * 1e-3f;
  in.momentum.back() = 0.0f;  // the new token joins a scoring step at 0
  in.positions.resize(static_cast<size_t>(shape.tokens));
  for (size_t i = 0; i < in.positions.size(); ++i) in.positions[i] = static_cast<int64_t>(i);
  return in;
}

double Seconds(std::chrono::steady_clock::time_point from) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
}

void CpuStep(benchmark::State& state, StepShape shape, ScoreDtype dtype) {
  const StepInputs in = MakeStepInputs(shape, dtype);
  std::vector<float> momentum;
  std::vector<int64_t> positions;
  std::vector<int64_t> selected(static_cast<size_t>(shape.evict));
  std::vector<uint64_t> scratch(static_cast<size_t>(shape.tokens));
  const kernels::MomentumUpdateOptions options;
  for (auto _ : state) {
    momentum = in.momentum;  // untimed reset: the step works in place
    positions = in.positions;
    const auto start = std::chrono::steady_clock::now();
    int64_t invalid = 0;
    kernels::cpu::UpdateMomentum(momentum.data(), momentum.data(), shape.tokens,
                                 in.Scores(in.scores.data()), options, &invalid, nullptr);
    kernels::cpu::SelectLowest(momentum.data(), 0, shape.tokens, shape.evict, selected.data(),
                               scratch.data(), nullptr);
    kernels::cpu::RemoveEntries(momentum.data(), positions.data(), shape.tokens,
                                selected.data(), shape.evict, nullptr);
    state.SetIterationTime(Seconds(start));
    benchmark::DoNotOptimize(invalid);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(in.scores.size()));
}

// A pool holding a 65,536-token cache after a 90% random eviction, and the moves of
// BlockLease::PlanCompaction that pack it (members destroyed lease first, then pool).
struct CompactionCase {
  std::unique_ptr<BlockPool> pool;
  BlockLease lease;
  CompactionPlan plan;
};

constexpr KvBlockLayout kCompactionLayout{16, kLayers, 8, 128, KvDtype::kFloat16};
constexpr int64_t kCompactionTokens = 65536;

BlockPoolOptions CompactionPoolOptions() {
  BlockPoolOptions options;
  options.layout = kCompactionLayout;
  options.memory_bytes = kCompactionTokens / kCompactionLayout.tokens_per_block *
                         kCompactionLayout.BlockBytes();
  return options;
}

absl::StatusOr<CompactionCase> MakeCompaction(
    absl::StatusOr<std::unique_ptr<BlockPool>> pool) {
  if (!pool.ok()) return pool.status();
  CompactionCase c{std::move(pool).value(), {}, {}};
  absl::StatusOr<BlockLease> lease = c.pool->Lease(kCompactionTokens);
  if (!lease.ok()) return lease.status();
  c.lease = std::move(lease).value();
  std::mt19937_64 rng(7);
  std::vector<int64_t> evict;
  for (int64_t i = 0; i < kCompactionTokens; ++i) {
    if (rng() % 10 != 0) evict.push_back(i);
  }
  if (absl::Status s = c.lease.Evict(evict); !s.ok()) return s;
  c.plan = c.lease.PlanCompaction();
  return c;
}

void SetCompactionCounters(benchmark::State& state, const CompactionPlan& plan) {
  const int64_t moved = static_cast<int64_t>(plan.moves.size());
  state.counters["moves"] = static_cast<double>(moved);
  state.SetBytesProcessed(state.iterations() * moved * kCompactionLayout.TokenFootprintBytes());
}

void CpuCompaction(benchmark::State& state) {
  absl::StatusOr<CompactionCase> c = MakeCompaction(BlockPool::CreateHost(CompactionPoolOptions()));
  if (!c.ok()) {
    state.SkipWithError(std::string(c.status().message()).c_str());
    return;
  }
  // Touch every row the moves read or write, so the timing sees real pages, not the
  // kernel's shared zero page.
  auto* storage = static_cast<uint8_t*>(c->pool->storage().data());
  for (const kernels::KvMove& m : c->plan.moves) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        std::memset(storage + kCompactionLayout.Offset(m.src_slot, layer, kv), 0x5a,
                    static_cast<size_t>(kCompactionLayout.TokenBytes()));
        std::memset(storage + kCompactionLayout.Offset(m.dst_slot, layer, kv), 0,
                    static_cast<size_t>(kCompactionLayout.TokenBytes()));
      }
    }
  }
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    kernels::cpu::CompactKv(storage, kCompactionLayout, c->plan.moves.data(),
                            static_cast<int64_t>(c->plan.moves.size()), nullptr);
    state.SetIterationTime(Seconds(start));
  }
  SetCompactionCounters(state, c->plan);
}

#if KVCM_BENCH_CUDA

// Device memory for a benchmark, freed on scope exit.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  explicit DeviceBuffer(size_t n) { cudaMalloc(reinterpret_cast<void**>(&ptr), (n ? n : 1) * sizeof(T)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Events and a stream for timing GPU work.
struct GpuTimer {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  GpuTimer() {
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
  }
  ~GpuTimer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  double Seconds() {
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    return static_cast<double>(ms) / 1000.0;
  }
};

bool SkipWithoutGpu(benchmark::State& state) {
  const absl::StatusOr<int> devices = kernels::cuda::VisibleDeviceCount();
  if (!devices.ok()) {
    state.SkipWithError(std::string(devices.status().message()).c_str());
    return true;
  }
  if (*devices > 0) return false;
  state.SkipWithError("no CUDA device on this machine");
  return true;
}

// Reports the first CUDA failure of the benchmark as its error.
void CheckCuda(benchmark::State& state, const char* what) {
  const absl::Status status = kernels::cuda::SyncStatus(nullptr, what);
  const absl::Status launch = kernels::cuda::LaunchStatus(what);
  const absl::Status& bad = !status.ok() ? status : launch;
  if (!bad.ok()) state.SkipWithError(std::string(bad.message()).c_str());
}

// The CPU reference's result of one step on `in`: what the CUDA step must reproduce.
struct StepResult {
  std::vector<int64_t> selected;
  std::vector<float> momentum;     // after removal
  std::vector<int64_t> positions;  // after removal
};

StepResult CpuReferenceStep(const StepInputs& in, const StepShape& shape) {
  StepResult r;
  r.momentum.resize(in.momentum.size());
  r.positions = in.positions;
  r.selected.resize(static_cast<size_t>(shape.evict));
  std::vector<uint64_t> scratch(static_cast<size_t>(shape.tokens));
  int64_t invalid = 0;
  kernels::cpu::UpdateMomentum(in.momentum.data(), r.momentum.data(), shape.tokens,
                               in.Scores(in.scores.data()), kernels::MomentumUpdateOptions{},
                               &invalid, nullptr);
  kernels::cpu::SelectLowest(r.momentum.data(), 0, shape.tokens, shape.evict, r.selected.data(),
                             scratch.data(), nullptr);
  kernels::cpu::RemoveEntries(r.momentum.data(), r.positions.data(), shape.tokens,
                              r.selected.data(), shape.evict, nullptr);
  r.momentum.resize(static_cast<size_t>(shape.tokens - shape.evict));
  r.positions.resize(static_cast<size_t>(shape.tokens - shape.evict));
  return r;
}

template <typename T>
std::string FirstDifference(const char* what, const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return std::string(what) + ": " + std::to_string(got.size()) + " elements, the CPU has " +
           std::to_string(want.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return std::string(what) + "[" + std::to_string(i) + "] is " + std::to_string(got[i]) +
             ", the CPU reference has " + std::to_string(want[i]);
    }
  }
  return "";
}

// A scoring step as the device-resident engine runs it: the update out of place (the
// double buffer), the selection, the removal, and the evicted indices copied to pinned
// host memory. Manual time is the host's wall clock from the first launch until the
// stream is done (end to end, launches included); `gpu_us` is the same span by CUDA
// events. After timing, the last iteration's results are checked against the CPU
// reference element by element: a mismatch is an error of the benchmark.
void CudaStep(benchmark::State& state, StepShape shape, ScoreDtype dtype) {
  if (SkipWithoutGpu(state)) return;
  const StepInputs in = MakeStepInputs(shape, dtype);
  const StepResult want = CpuReferenceStep(in, shape);
  const size_t tokens = static_cast<size_t>(shape.tokens);
  const size_t evict = static_cast<size_t>(shape.evict);
  DeviceBuffer<uint8_t> scores(in.scores.size());
  DeviceBuffer<float> momentum_init(tokens), momentum(tokens);
  DeviceBuffer<int64_t> positions_init(tokens), positions(tokens);
  DeviceBuffer<int64_t> selected(evict), invalid(1);
  int64_t* host_selected = nullptr;  // pinned: the decision goes back to the host
  cudaMallocHost(reinterpret_cast<void**>(&host_selected), evict * sizeof(int64_t));
  cudaMemcpy(scores.ptr, in.scores.data(), in.scores.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(momentum_init.ptr, in.momentum.data(), tokens * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(positions_init.ptr, in.positions.data(), tokens * sizeof(int64_t),
             cudaMemcpyHostToDevice);
  // The timer's stream is non-blocking: it does not wait for the legacy stream's copies.
  cudaDeviceSynchronize();
  GpuTimer timer;
  const kernels::MomentumUpdateOptions options;
  double gpu_seconds = 0.0;
  for (auto _ : state) {
    // Untimed: back to the step's inputs (positions are removed from in place).
    cudaMemcpyAsync(positions.ptr, positions_init.ptr, tokens * sizeof(int64_t),
                    cudaMemcpyDeviceToDevice, timer.stream);
    cudaStreamSynchronize(timer.stream);
    const auto start = std::chrono::steady_clock::now();
    cudaEventRecord(timer.start, timer.stream);
    kernels::cuda::UpdateMomentum(momentum_init.ptr, momentum.ptr, shape.tokens,
                                  in.Scores(scores.ptr), options, invalid.ptr, timer.stream);
    kernels::cuda::SelectLowest(momentum.ptr, 0, shape.tokens, shape.evict, selected.ptr,
                                nullptr, timer.stream);
    kernels::cuda::RemoveEntries(momentum.ptr, positions.ptr, shape.tokens, selected.ptr,
                                 shape.evict, timer.stream);
    cudaMemcpyAsync(host_selected, selected.ptr, evict * sizeof(int64_t), cudaMemcpyDeviceToHost,
                    timer.stream);
    cudaEventRecord(timer.stop, timer.stream);
    cudaStreamSynchronize(timer.stream);
    state.SetIterationTime(Seconds(start));
    gpu_seconds += timer.Seconds();
  }
  state.counters["gpu_us"] = benchmark::Counter(
      1e6 * gpu_seconds / static_cast<double>(std::max<int64_t>(1, state.iterations())));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(in.scores.size()));
  CheckCuda(state, "CUDA step");
  // The result check.
  std::vector<int64_t> got_selected(host_selected, host_selected + evict);
  cudaFreeHost(host_selected);
  std::vector<float> got_momentum(tokens);
  std::vector<int64_t> got_positions(tokens);
  cudaMemcpy(got_momentum.data(), momentum.ptr, tokens * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(got_positions.data(), positions.ptr, tokens * sizeof(int64_t), cudaMemcpyDeviceToHost);
  got_momentum.resize(want.momentum.size());
  got_positions.resize(want.positions.size());
  std::string bad = FirstDifference("selected", got_selected, want.selected);
  if (bad.empty()) bad = FirstDifference("momentum", got_momentum, want.momentum);
  if (bad.empty()) bad = FirstDifference("positions", got_positions, want.positions);
  if (!bad.empty()) state.SkipWithError(("result differs from the CPU reference: " + bad).c_str());
}

// Each block of the pool holds one byte value, so a copied row shows where it came from.
uint8_t BlockFill(int64_t block) { return static_cast<uint8_t>(1 + block % 251); }

void CudaCompaction(benchmark::State& state) {
  if (SkipWithoutGpu(state)) return;
  absl::StatusOr<CompactionCase> c = MakeCompaction(CreateCudaBlockPool(CompactionPoolOptions(), 0));
  if (!c.ok()) {
    state.SkipWithError(std::string(c.status().message()).c_str());
    return;
  }
  const std::vector<kernels::KvMove>& moves = c->plan.moves;
  auto* storage = static_cast<uint8_t*>(c->pool->storage().data());
  const int64_t blocks = c->pool->storage().bytes() / kCompactionLayout.BlockBytes();
  for (int64_t b = 0; b < blocks; ++b) {
    cudaMemset(storage + b * kCompactionLayout.BlockBytes(), BlockFill(b),
               static_cast<size_t>(kCompactionLayout.BlockBytes()));
  }
  DeviceBuffer<kernels::KvMove> device_moves(moves.size());
  cudaMemcpy(device_moves.ptr, moves.data(), moves.size() * sizeof(kernels::KvMove),
             cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();  // the fills and the copy ran on the legacy stream
  GpuTimer timer;
  for (auto _ : state) {
    cudaEventRecord(timer.start, timer.stream);
    kernels::cuda::CompactKv(storage, kCompactionLayout, device_moves.ptr,
                             static_cast<int64_t>(moves.size()), timer.stream);
    cudaEventRecord(timer.stop, timer.stream);
    state.SetIterationTime(timer.Seconds());
  }
  SetCompactionCounters(state, c->plan);
  CheckCuda(state, "CUDA compaction");
  // The result check: sampled moves' destination rows hold their source block's bytes.
  cudaDeviceSynchronize();
  std::vector<uint8_t> row(static_cast<size_t>(kCompactionLayout.TokenBytes()));
  const size_t step = std::max<size_t>(1, moves.size() / 256);
  for (size_t m = 0; m < moves.size(); m += step) {
    const int64_t src_block = moves[m].src_slot / kCompactionLayout.tokens_per_block;
    for (int64_t layer = 0; layer < kLayers; layer += 7) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        cudaMemcpy(row.data(), storage + kCompactionLayout.Offset(moves[m].dst_slot, layer, kv),
                   row.size(), cudaMemcpyDeviceToHost);
        for (uint8_t b : row) {
          if (b != BlockFill(src_block)) {
            state.SkipWithError(("compaction result: slot " + std::to_string(moves[m].dst_slot) +
                                 " does not hold slot " + std::to_string(moves[m].src_slot) +
                                 "'s bytes")
                                    .c_str());
            return;
          }
        }
      }
    }
  }
}

#endif  // KVCM_BENCH_CUDA

void RegisterAll() {
  for (const StepShape& shape : {kFirstStep, kSteadyStep}) {
    for (ScoreDtype dtype : {ScoreDtype::kFloat32, ScoreDtype::kFloat16}) {
      const std::string name =
          std::string(shape.name) + "/" + kernels::ScoreDtypeName(dtype) + "/";
      benchmark::RegisterBenchmark((name + "cpu").c_str(), CpuStep, shape, dtype)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
#if KVCM_BENCH_CUDA
      benchmark::RegisterBenchmark((name + "cuda").c_str(), CudaStep, shape, dtype)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
#endif
    }
  }
  benchmark::RegisterBenchmark("Compaction64k/fp16/cpu", CpuCompaction)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
#if KVCM_BENCH_CUDA
  benchmark::RegisterBenchmark("Compaction64k/fp16/cuda", CudaCompaction)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
#endif
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvcm::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

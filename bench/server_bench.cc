// BM_ServerStep: the daemon's step path without the network. One decoded StepBatch of 16
// full-refresh reports (the steady step of BM_EngineStep/steady, 32 layers x 6,401 tokens,
// float32, each for its own sequence) goes through the StepBatchProcessor and the engine
// threads, and the benchmark waits for the batch's completion. Compare it with
// 16 x BM_EngineStep/steady from the same run (docs/BENCHMARKS.md): the difference is what
// the server adds around its engine (grouping by engine thread, the hand-over, decoding
// the reports, writing the Decisions).
//
//   BM_ServerStep/shm/T     the 16 reports reference one range of a score region, so the
//                           engine reads the same 819 KB BM_EngineStep/steady reads
//   BM_ServerStep/inline/T  each report carries its own copy inline (13 MB a batch, as off
//                           the network): adds the memory traffic of 16 distinct blocks
//   BM_EngineSteps16/distinct  the inline case's floor: 16 sequences stepped in a loop
//                           in-process over 16 distinct copies, no server
// T: engine threads (0: one per core).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/kv/score_regions.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "server/metrics.h"
#include "server/step_batch_processor.h"

namespace kvcm {
namespace {

constexpr int64_t kLayers = 32;
constexpr int64_t kContext = 64000;
constexpr int kReports = 16;

std::string RandomScoreBytes(int64_t layers, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(static_cast<size_t>(layers * tokens));
  for (float& v : s) {
    const float x = u(rng);
    v = x * x * x * 1e-3f;
  }
  return std::string(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(float));
}

// Waits for one batch at a time.
class Waiter final : public server::BatchCompletion {
 public:
  void BatchDone(server::PendingBatch*) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    done_ = false;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

// A score region holding `bytes`, registered with `regions`; unlinked when destroyed.
class BenchRegion {
 public:
  BenchRegion(ScoreRegions& regions, const std::string& bytes)
      : name_("/kvcm-bench-" + std::to_string(getpid())) {
    const int fd = shm_open(name_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes.size())) != 0) std::abort();
    void* base = mmap(nullptr, bytes.size(), PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) std::abort();
    std::memcpy(base, bytes.data(), bytes.size());
    munmap(base, bytes.size());
    close(fd);
    absl::StatusOr<uint64_t> id = regions.Register("", name_, bytes.size());
    if (!id.ok()) std::abort();
    id_ = *id;
  }
  ~BenchRegion() { shm_unlink(name_.c_str()); }
  uint64_t id() const { return id_; }

 private:
  std::string name_;
  uint64_t id_ = 0;
};

void BM_ServerStep(benchmark::State& state, bool by_region) {
  const auto threads = static_cast<int32_t>(
      state.range(0) > 0 ? state.range(0) : std::max(1u, std::thread::hardware_concurrency()));
  SequenceTable table;
  StepExecutor executor(threads, 1024);
  server::ServerMetrics metrics(server::BuildInfo{});
  ScoreRegions regions(ScoreRegionsOptions{});
  server::StepBatchProcessor processor(&table, &executor, &regions, &metrics);

  SequenceOptions options;
  options.prefill_len = kContext;
  options.budget = BudgetSpec::Ratio(0.9);
  options.preset = "inertia";
  const std::string first = RandomScoreBytes(kLayers, kContext + 1, 1);
  const auto first_matrix = kernels::ScoreMatrix::Dense(first.data(), kernels::ScoreDtype::kFloat32,
                                                        kLayers, kContext + 1);
  ::kvcache::v1::StepBatch batch;
  EvictionDecision decision;
  int64_t tokens = 0;
  for (int i = 0; i < kReports; ++i) {
    const std::string id = "bench-" + std::to_string(i);
    if (!table.Open(id, options).ok() || !table.Step(id, 1, &first_matrix, &decision).ok()) {
      state.SkipWithError("setup failed");
      return;
    }
    tokens = decision.cache_size + 1;
    ::kvcache::v1::StepReport* report = batch.add_reports();
    report->set_sequence_id(id);
    report->set_layers(static_cast<int32_t>(kLayers));
    report->set_dtype(::kvcache::v1::SCORE_DTYPE_FLOAT32);
  }
  const std::string steady = RandomScoreBytes(kLayers, tokens, 3);
  std::unique_ptr<BenchRegion> region;
  if (by_region) region = std::make_unique<BenchRegion>(regions, steady);
  for (auto& report : *batch.mutable_reports()) {
    if (by_region) {
      ::kvcache::v1::ScoreRef* ref = report.mutable_score_ref();
      ref->set_region(region->id());
      ref->set_offset(0);
      ref->set_byte_size(steady.size());
    } else {
      report.set_scores(steady);
    }
  }

  server::PendingBatch pending;
  Waiter waiter;
  int64_t step = 2;
  for (auto _ : state) {
    for (auto& report : *batch.mutable_reports()) report.set_step(step);
    processor.Process(batch, "", server::Rpc::kStepStream, &pending, &waiter);
    waiter.Wait();
    const auto& d = pending.reply().decisions(0);
    if (d.code() != 0) {
      state.SkipWithError(d.message().c_str());
      break;
    }
    ++step;
  }
  state.counters["engine_threads"] = threads;
  state.SetBytesProcessed(state.iterations() * kReports * kLayers * tokens *
                          static_cast<int64_t>(sizeof(float)));
}
BENCHMARK_CAPTURE(BM_ServerStep, shm, true)->Arg(1)->Arg(2)->Arg(0)->UseRealTime();
BENCHMARK_CAPTURE(BM_ServerStep, inline, false)->Arg(1)->Arg(2)->Arg(0)->UseRealTime();

void BM_EngineSteps16Distinct(benchmark::State& state) {
  SequenceOptions options;
  options.prefill_len = kContext;
  options.budget = BudgetSpec::Ratio(0.9);
  options.preset = "inertia";
  const std::string first = RandomScoreBytes(kLayers, kContext + 1, 1);
  const auto first_matrix = kernels::ScoreMatrix::Dense(first.data(), kernels::ScoreDtype::kFloat32,
                                                        kLayers, kContext + 1);
  std::vector<std::unique_ptr<Sequence>> sequences;
  EvictionDecision decision;
  for (int i = 0; i < kReports; ++i) {
    sequences.push_back(*Sequence::Create("bench-" + std::to_string(i), options));
    if (!sequences.back()->Step(1, &first_matrix, &decision).ok()) std::abort();
  }
  const int64_t tokens = decision.cache_size + 1;
  const std::string steady = RandomScoreBytes(kLayers, tokens, 3);
  const std::vector<std::string> copies(kReports, steady);
  int64_t step = 2;
  for (auto _ : state) {
    for (int i = 0; i < kReports; ++i) {
      const auto m = kernels::ScoreMatrix::Dense(copies[static_cast<size_t>(i)].data(),
                                                 kernels::ScoreDtype::kFloat32, kLayers, tokens);
      if (!sequences[static_cast<size_t>(i)]->Step(step, &m, &decision).ok()) std::abort();
    }
    ++step;
  }
}
BENCHMARK(BM_EngineSteps16Distinct)->Name("BM_EngineSteps16/distinct");

}  // namespace
}  // namespace kvcm

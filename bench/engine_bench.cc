// kvcache-bench: the engine's step cost against the cost of merely reading the scores.
//
//   BM_ScoreReadFloor          a plain loop that reads one step's scores once and does the
//                              EMA arithmetic, nothing else: the floor for a scoring step
//   BM_EngineStep/steady       a scoring step at a 6,400-token budget (64k context at 90%),
//                              32 layers: validate, update, select, evict one token
//   BM_EngineStep/steady_f16   the same with float16 scores
//   BM_EngineStep/first_step_64k  step 1 of a 64k-token prefill: one large eviction
//   BM_EngineStep/lazy_skip    a non-scoring step of inertia_lazy4 at the same budget
//   BM_TableStep/steady        the steady step through SequenceTable (lookup and lock)
//   BM_EngineStep/steady_diagnostics, BM_TableStep/steady_diagnostics
//                              the same two steady steps with the eviction-quality
//                              diagnostics on every step (every 1, sample 1): their cost
//   BM_TableStep/steady_events the steady table step with a KvEventLog attached (no
//                              subscriber): the cost of publishing its events
//   BM_TableStep/steady_watched  the same with one subscriber reading on another thread,
//                              woken by the appends (a condition variable)
//
// Run: build/bin/kvcache-bench --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/events/kv_events.h"
#include "cache_manager/table/sequence_table.h"
#include "kernels/cpu/hot_loops.h"
#include "kernels/half_float.h"
#include "kernels/momentum_update.h"
#include "kernels/selection.h"

namespace kvcm {
namespace {

constexpr int64_t kLayers = 32;
constexpr int64_t kContext = 64000;
constexpr double kRatio = 0.9;  // budget 6,400

std::vector<float> RandomScores(int64_t layers, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(static_cast<size_t>(layers * tokens));
  for (float& v : s) {
    const float x = u(rng);
    v = x * x * x * 1e-3f;
  }
  return s;
}

SequenceOptions Options(const char* preset) {
  SequenceOptions o;
  o.prefill_len = kContext;
  o.budget = BudgetSpec::Ratio(kRatio);
  o.preset = preset;
  return o;
}

// A sequence past its first step: the cache holds exactly the budget. `diagnostics`:
// eviction-quality diagnostics on every scoring step.
std::unique_ptr<Sequence> SteadySequence(const char* preset, bool diagnostics = false) {
  auto s = *Sequence::Create("bench", Options(preset));
  if (diagnostics) s->EnableDiagnostics(1);
  const std::vector<float> first = RandomScores(kLayers, kContext + 1, 1);
  const auto m = kernels::ScoreMatrix::Dense(first.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                             kContext + 1);
  EvictionDecision d;
  if (!s->Step(1, &m, &d).ok()) std::abort();
  return s;
}

// The floor loop, compiled for the same instruction set the engine's kernels dispatch to
// on this machine (see kernels/cpu/hot_loops.h), so the ratio compares like with like.
#if defined(__x86_64__)
__attribute__((target("avx2"))) void EmaFloorAvx2(float* momentum, const float* scores,
                                                  int64_t layers, int64_t tokens) {
  for (int64_t l = 0; l < layers; ++l) {
    const float* row = scores + l * tokens;
    for (int64_t i = 0; i < tokens; ++i) momentum[i] = 0.8f * momentum[i] + 0.2f * row[i];
  }
}
#endif

void EmaFloorBaseline(float* momentum, const float* scores, int64_t layers, int64_t tokens) {
  for (int64_t l = 0; l < layers; ++l) {
    const float* row = scores + l * tokens;
    for (int64_t i = 0; i < tokens; ++i) momentum[i] = 0.8f * momentum[i] + 0.2f * row[i];
  }
}

void BM_ScoreReadFloor(benchmark::State& state) {
  const int64_t tokens = 6401;
  const std::vector<float> scores = RandomScores(kLayers, tokens, 2);
  std::vector<float> momentum(static_cast<size_t>(tokens), 0.0f);
  auto* floor = &EmaFloorBaseline;
#if defined(__x86_64__)
  if (std::string(kernels::cpu::SelectedHotLoops().isa) == "avx2") floor = &EmaFloorAvx2;
#endif
  state.SetLabel(kernels::cpu::SelectedHotLoops().isa);
  for (auto _ : state) {
    floor(momentum.data(), scores.data(), kLayers, tokens);
    benchmark::DoNotOptimize(momentum.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kLayers * tokens * 4);
}
BENCHMARK(BM_ScoreReadFloor);

// The pieces of a steady step, for attributing its cost.
void BM_Kernel_UpdateMomentum(benchmark::State& state) {
  const int64_t tokens = 6401;
  const std::vector<float> scores = RandomScores(kLayers, tokens, 2);
  std::vector<float> in(static_cast<size_t>(tokens), 0.0f), out(in.size());
  const auto m = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                             tokens);
  int64_t invalid = 0;
  for (auto _ : state) {
    kernels::cpu::UpdateMomentum(in.data(), out.data(), tokens, m,
                                 {kernels::ScoreAggregation::kEma, 0.8}, &invalid, nullptr);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_Kernel_UpdateMomentum);

void BM_Kernel_SelectLowestOne(benchmark::State& state) {
  const std::vector<float> values = RandomScores(1, 6401, 9);
  int64_t selected = 0;
  for (auto _ : state) {
    kernels::cpu::SelectLowest(values.data(), 0, 6401, 1, &selected, nullptr, nullptr);
    benchmark::DoNotOptimize(selected);
  }
}
BENCHMARK(BM_Kernel_SelectLowestOne);

template <kernels::ScoreDtype kDtype, bool kDiagnostics = false>
void BM_EngineStepSteady(benchmark::State& state) {
  auto s = SteadySequence("inertia", kDiagnostics);
  const int64_t tokens = s->cache_size() + 1;
  const std::vector<float> scores = RandomScores(kLayers, tokens, 3);
  std::vector<uint16_t> half;
  const void* data = scores.data();
  if (kDtype == kernels::ScoreDtype::kFloat16) {
    for (float v : scores) half.push_back(kernels::FloatToFloat16(v));
    data = half.data();
  }
  const auto m = kernels::ScoreMatrix::Dense(data, kDtype, kLayers, tokens);
  EvictionDecision d;
  int64_t t = 2;
  int64_t measured = 0;
  for (auto _ : state) {
    if (!s->Step(t++, &m, &d).ok()) state.SkipWithError("step failed");
    if constexpr (kDiagnostics) measured += d.diagnostics.measured ? 1 : 0;
    benchmark::DoNotOptimize(d.evicted.data());
  }
  state.SetBytesProcessed(state.iterations() * kLayers * tokens *
                          static_cast<int64_t>(kernels::ScoreDtypeSize(kDtype)));
  if constexpr (kDiagnostics) {
    state.counters["measured"] = static_cast<double>(measured) /
                                 static_cast<double>(std::max<int64_t>(1, state.iterations()));
  }
}
BENCHMARK(BM_EngineStepSteady<kernels::ScoreDtype::kFloat32>)->Name("BM_EngineStep/steady");
BENCHMARK(BM_EngineStepSteady<kernels::ScoreDtype::kFloat16>)->Name("BM_EngineStep/steady_f16");
BENCHMARK(BM_EngineStepSteady<kernels::ScoreDtype::kFloat32, true>)
    ->Name("BM_EngineStep/steady_diagnostics");

void BM_EngineStepFirst(benchmark::State& state) {
  const std::vector<float> scores = RandomScores(kLayers, kContext + 1, 4);
  const auto m = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                             kContext + 1);
  EvictionDecision d;
  for (auto _ : state) {
    state.PauseTiming();
    auto s = *Sequence::Create("bench", Options("inertia"));
    state.ResumeTiming();
    if (!s->Step(1, &m, &d).ok()) state.SkipWithError("step failed");
    benchmark::DoNotOptimize(d.evicted.data());
    state.PauseTiming();
    s.reset();
    state.ResumeTiming();
  }
  state.counters["evicted"] = static_cast<double>(d.evicted.size());
}
BENCHMARK(BM_EngineStepFirst)->Name("BM_EngineStep/first_step_64k")->Unit(benchmark::kMillisecond);

void BM_EngineStepLazySkip(benchmark::State& state) {
  auto s = SteadySequence("inertia_lazy4");
  const std::vector<float> scores = RandomScores(kLayers, s->cache_size() + 1, 5);
  const auto m = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                             s->cache_size() + 1);
  EvictionDecision d;
  int64_t t = 2;
  for (auto _ : state) {
    if (s->next_needs_scores()) {  // keep the scoring steps out of the measurement
      state.PauseTiming();
      if (!s->Step(t++, &m, &d).ok()) state.SkipWithError("step failed");
      state.ResumeTiming();
    }
    if (!s->Step(t++, nullptr, &d).ok()) state.SkipWithError("step failed");
    benchmark::DoNotOptimize(d.evicted.data());
  }
}
BENCHMARK(BM_EngineStepLazySkip)->Name("BM_EngineStep/lazy_skip");

// kEvents: 0 no KV event log, 1 a log and no subscriber, 2 a log and one subscriber.
template <bool kDiagnostics, int kEvents = 0>
void BM_TableStepSteady(benchmark::State& state) {
  auto log = kEvents > 0 ? std::make_unique<KvEventLog>() : nullptr;  // outlives the table
  SequenceTableOptions options;
  if (kDiagnostics) options.diagnostics = {1, 1.0};
  options.kv_events = log.get();
  SequenceTable table(options);
  // 64 other sequences in the table, as a loaded daemon would have.
  for (int i = 0; i < 64; ++i) {
    SequenceOptions o;
    o.prefill_len = 100;
    o.budget = BudgetSpec::Tokens(10);
    o.preset = "inertia";
    (void)table.Open("other-" + std::to_string(i), o);
  }
  if (!table.Open("bench", Options("inertia")).ok()) std::abort();
  const std::vector<float> first = RandomScores(kLayers, kContext + 1, 1);
  const auto m1 = kernels::ScoreMatrix::Dense(first.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                              kContext + 1);
  EvictionDecision d;
  if (!table.Step("bench", 1, &m1, &d).ok()) std::abort();
  const std::vector<float> scores = RandomScores(kLayers, d.cache_size + 1, 3);
  const auto m = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                             d.cache_size + 1);
  // kEvents 2: a subscriber reading on its own thread, sleeping until an append wakes it.
  std::mutex mu;
  std::condition_variable cv;
  bool woken = false;
  std::atomic<bool> stop{false};
  std::unique_ptr<KvEventSubscription> subscription;
  std::thread reader;
  if constexpr (kEvents == 2) {
    subscription = *table.SubscribeKvEvents(0, "", "");
    subscription->SetWakeup([&] {
      std::lock_guard<std::mutex> lock(mu);
      woken = true;
      cv.notify_one();
    });
    reader = std::thread([&] {
      KvEvent e;
      while (!stop.load()) {
        if (subscription->Next(&e) == KvEventSubscription::Poll::kEvent) continue;
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, std::chrono::milliseconds(1), [&] { return woken; });
        woken = false;
      }
    });
  }
  int64_t t = 2;
  int64_t measured = 0;
  for (auto _ : state) {
    if (!table.Step("bench", t++, &m, &d).ok()) state.SkipWithError("step failed");
    if constexpr (kDiagnostics) measured += d.diagnostics.measured ? 1 : 0;
    benchmark::DoNotOptimize(d.evicted.data());
  }
  if constexpr (kEvents == 2) {
    stop = true;
    reader.join();
    subscription.reset();
  }
  if constexpr (kDiagnostics) {
    state.counters["measured"] = static_cast<double>(measured) /
                                 static_cast<double>(std::max<int64_t>(1, state.iterations()));
  }
}
BENCHMARK(BM_TableStepSteady<false>)->Name("BM_TableStep/steady");
BENCHMARK(BM_TableStepSteady<true>)->Name("BM_TableStep/steady_diagnostics");
BENCHMARK(BM_TableStepSteady<false, 1>)->Name("BM_TableStep/steady_events");
BENCHMARK(BM_TableStepSteady<false, 2>)->Name("BM_TableStep/steady_watched");

}  // namespace
}  // namespace kvcm

BENCHMARK_MAIN();

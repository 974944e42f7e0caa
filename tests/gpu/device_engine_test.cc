// The device-resident engine (MomentumState on a device backend, SequenceOptions::backend)
// against the host engine: every golden trace and seeded random runs (every preset,
// protected sinks and recent tokens, random eviction, folded rows, float16 scores, a long
// prefill, rejected steps) step a host sequence and a device one side by side, and every
// decision, every position and every momentum bit must agree. A rejected step (invalid
// scores) must leave the device state bit for bit as it was (the double buffer).
//
// Built twice: device_engine_test runs the device path on the CPU's emulated device
// (kernels::EmulatedDeviceBackend(): the same code path, host memory behind it) and needs
// no GPU; gpu_device_engine_test (label gpu, KVCM_DEVICE_ENGINE_CUDA) runs it on CUDA and
// skips without a device.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cache_manager/engine/sequence.h"
#include "clients/replay/trace.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/half_float.h"
#include "kernels/stream_lanes.h"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/clients/golden.h"

#if KVCM_DEVICE_ENGINE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_util.h"
#endif

namespace kvcm {
namespace {

// The golden vectors: KVCM_TEST_DATA_DIR when set (tests/gpu/run.sh --prebuilt points it
// at the carry's copy), else this checkout's.
std::string GoldenDir() {
  const char* dir = std::getenv("KVCM_TEST_DATA_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) + "/golden" : testing::GoldenDir();
}

// The golden traces of GoldenDir() (the carried data directory on a bare GPU machine).
std::vector<std::string> GoldenNames() { return testing::GoldenNames(GoldenDir()); }

const kernels::KernelBackend& DeviceBackend() {
#if KVCM_DEVICE_ENGINE_CUDA
  return kernels::cuda::CudaBackend();
#else
  return kernels::EmulatedDeviceBackend();
#endif
}

class DeviceEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if KVCM_DEVICE_ENGINE_CUDA
    KVCM_SKIP_WITHOUT_GPU();
#endif
  }
};

// A host sequence and a device one opened with the same options.
struct Pair {
  std::unique_ptr<Sequence> host;
  std::unique_ptr<Sequence> device;
};

Pair Open(SequenceOptions options) {
  Pair p;
  absl::StatusOr<std::unique_ptr<Sequence>> host = Sequence::Create("host", options);
  EXPECT_TRUE(host.ok()) << host.status();
  options.backend = &DeviceBackend();
  absl::StatusOr<std::unique_ptr<Sequence>> device = Sequence::Create("device", options);
  EXPECT_TRUE(device.ok()) << device.status();
  if (host.ok()) p.host = std::move(host).value();
  if (device.ok()) p.device = std::move(device).value();
  // The device sequence really runs the device-resident path.
  if (p.device != nullptr) {
    EXPECT_EQ(p.device->state().backend().memory, kernels::MemorySpace::kDevice);
  }
  return p;
}

// Both caches hold the same positions and bit-identical momentum.
void ExpectSameState(const Sequence& host, const Sequence& device, const std::string& where) {
  ASSERT_TRUE(device.state().status().ok()) << where << ": " << device.state().status();
  const auto hp = host.state().positions();
  const auto dp = device.state().positions();
  ASSERT_EQ(std::vector<int64_t>(hp.begin(), hp.end()), std::vector<int64_t>(dp.begin(), dp.end()))
      << where;
  const auto hm = host.state().momentum();
  const auto dm = device.state().momentum();
  ASSERT_EQ(hm.size(), dm.size()) << where;
  for (size_t i = 0; i < hm.size(); ++i) {
    ASSERT_EQ(std::memcmp(&hm[i], &dm[i], sizeof(float)), 0)
        << where << ": momentum of position " << hp[i] << " is " << hm[i] << " on the host, "
        << dm[i] << " on the device";
  }
}

// One step on both; the outcomes (status code, decision) must agree.
void StepBoth(Pair& p, int64_t step, const kernels::ScoreMatrix* scores, const std::string& where,
              bool check_state = true) {
  EvictionDecision hd;
  EvictionDecision dd;
  const absl::Status hs = p.host->Step(step, scores, &hd);
  const absl::Status ds = p.device->Step(step, scores, &dd);
  ASSERT_EQ(hs.code(), ds.code()) << where << ": host " << hs << ", device " << ds;
  if (hs.ok()) {
    ASSERT_EQ(hd.evicted, dd.evicted) << where;
    ASSERT_EQ(hd.evicted_indices, dd.evicted_indices) << where;
    ASSERT_EQ(hd.cache_size, dd.cache_size) << where;
    ASSERT_EQ(hd.next_needs_scores, dd.next_needs_scores) << where;
  } else {
    EXPECT_EQ(hs.message().substr(hs.message().find(':')), ds.message().substr(ds.message().find(':')))
        << where;
  }
  if (check_state) ExpectSameState(*p.host, *p.device, where);
}

TEST_F(DeviceEngineTest, EveryGoldenTraceDecidesAlikeOnTheDevice) {
  const std::vector<std::string> names = GoldenNames();
  ASSERT_FALSE(names.empty());
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    absl::StatusOr<std::unique_ptr<replay::TraceReader>> reader =
        replay::TraceReader::Open(GoldenDir() + "/" + name + ".trace.jsonl");
    ASSERT_TRUE(reader.ok()) << reader.status();
    Pair p = Open((*reader)->header().ToSequenceOptions());
    ASSERT_NE(p.device, nullptr);
    ExpectSameState(*p.host, *p.device, "prefill");
    replay::TraceStep step;
    while (true) {
      absl::StatusOr<bool> more = (*reader)->Next(&step);
      ASSERT_TRUE(more.ok()) << more.status();
      if (!*more) break;
      const kernels::ScoreMatrix m = step.Matrix();
      StepBoth(p, step.step, step.layers > 0 ? &m : nullptr, "step " + std::to_string(step.step));
    }
  }
}

// Rows of `dtype` for the device and the host alike.
struct Rows {
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  kernels::ScoreMatrix matrix;
};

Rows RandomRows(std::mt19937_64& rng, int64_t layers, int64_t tokens, kernels::ScoreDtype dtype,
                bool ties) {
  Rows r;
  const int64_t stride = tokens + 3;  // strided rows: the upload must honour the stride
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  r.f32.assign(static_cast<size_t>(layers * stride), -1.0f);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      const float x = u(rng);
      r.f32[static_cast<size_t>(l * stride + t)] =
          ties ? static_cast<float>(rng() % 5) / 4.0f : x * x * x * 1e-3f;
    }
  }
  if (dtype != kernels::ScoreDtype::kFloat32) {
    for (float v : r.f32) {
      r.f16.push_back(dtype == kernels::ScoreDtype::kFloat16 ? kernels::FloatToFloat16(v)
                                                             : kernels::FloatToBFloat16(v));
    }
    r.matrix = kernels::ScoreMatrix{r.f16.data(), dtype, layers, tokens, stride};
  } else {
    r.matrix = kernels::ScoreMatrix{r.f32.data(), dtype, layers, tokens, stride};
  }
  return r;
}

struct RandomCase {
  const char* preset;
  int64_t prefill;
  int64_t budget;
  int64_t sinks;
  int64_t recent;
  bool folded;
  kernels::ScoreDtype dtype;
  bool ties;
};

TEST_F(DeviceEngineTest, RandomRunsDecideAlikeAndRejectedStepsChangeNothing) {
  const RandomCase cases[] = {
      {"inertia", 300, 30, 0, 0, false, kernels::ScoreDtype::kFloat32, false},
      {"inertia", 300, 30, 4, 8, false, kernels::ScoreDtype::kFloat16, true},
      {"inertia_lazy4", 200, 40, 2, 0, false, kernels::ScoreDtype::kFloat32, false},
      {"score_free", 150, 20, 0, 3, false, kernels::ScoreDtype::kFloat32, true},
      {"tova", 120, 60, 0, 0, false, kernels::ScoreDtype::kBFloat16, true},
      {"h2o", 256, 64, 0, 0, false, kernels::ScoreDtype::kFloat32, false},
      {"streaming_llm", 100, 16, 0, 0, false, kernels::ScoreDtype::kFloat32, false},
      {"random", 180, 25, 3, 2, false, kernels::ScoreDtype::kFloat32, false},
      {"inertia", 400, 50, 0, 0, true, kernels::ScoreDtype::kFloat32, false},
      {"inertia_lazy4", 20000, 2000, 0, 0, false, kernels::ScoreDtype::kFloat32, false},
  };
  std::mt19937_64 rng(77);
  for (const RandomCase& c : cases) {
    SCOPED_TRACE(std::string(c.preset) + " prefill " + std::to_string(c.prefill) +
                 (c.folded ? " folded" : ""));
    SequenceOptions options;
    options.prefill_len = c.prefill;
    options.budget = BudgetSpec::Tokens(c.budget);
    options.preset = c.preset;
    options.policy.seed = 5;
    if (c.folded) {
      options.score_layout = ScoreLayout::kFolded;
      options.layers = 6;
    }
    Pair p = Open(options);
    ASSERT_NE(p.device, nullptr);
    if (c.sinks > 0 || c.recent > 0) {
      // Presets fix their protections; open the field-by-field policy instead.
      Policy policy = p.host->policy();
      policy.preset.clear();
      policy.protect_sinks = c.sinks;
      policy.protect_recent = c.recent;
      options.preset.clear();
      options.policy = policy;
      p = Open(options);
      ASSERT_NE(p.device, nullptr);
    }
    const int64_t layers = c.folded ? 1 : 4;
    for (int64_t step = 1; step <= 60; ++step) {
      const std::string where = "step " + std::to_string(step);
      const bool scoring = p.host->next_needs_scores();
      const int64_t tokens = p.host->next_score_length();
      if (scoring && step % 7 == 3) {
        // A rejected step first: one invalid score somewhere; both must refuse it and the
        // device state must be exactly as before.
        Rows bad = RandomRows(rng, layers, tokens, c.dtype, c.ties);
        const size_t at = static_cast<size_t>(rng() % static_cast<uint64_t>(tokens));
        if (c.dtype == kernels::ScoreDtype::kFloat32) {
          bad.f32[at] = -0.25f;
        } else {
          bad.f16[at] = c.dtype == kernels::ScoreDtype::kFloat16 ? kernels::FloatToFloat16(-0.25f)
                                                                 : kernels::FloatToBFloat16(-0.25f);
        }
        StepBoth(p, step, &bad.matrix, where + " (rejected)");
        if (::testing::Test::HasFatalFailure()) return;
        // ... and a wrongly sized one.
        Rows short_rows = RandomRows(rng, layers, tokens - 1, c.dtype, c.ties);
        StepBoth(p, step, &short_rows.matrix, where + " (too short)");
        if (::testing::Test::HasFatalFailure()) return;
      }
      if (scoring) {
        Rows rows = RandomRows(rng, layers, tokens, c.dtype, c.ties);
        StepBoth(p, step, &rows.matrix, where);
      } else {
        StepBoth(p, step, nullptr, where);
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_EQ(p.host->stats().steps, 60);
  }
}

// Sequences a growing cache (prefill 60, budget 200: the arrays grow on the step path,
// then every step evicts) stepped `steps` times with random scores, host and device side
// by side, on the calling thread.
void GrowAndStep(Pair& p, uint64_t seed, int64_t steps) {
  std::mt19937_64 rng(seed);
  for (int64_t step = 1; step <= steps; ++step) {
    const std::string where = "step " + std::to_string(step);
    if (p.host->next_needs_scores()) {
      Rows rows = RandomRows(rng, 3, p.host->next_score_length(), kernels::ScoreDtype::kFloat32,
                             false);
      StepBoth(p, step, &rows.matrix, where, /*check_state=*/step % 16 == 0);
    } else {
      StepBoth(p, step, nullptr, where, /*check_state=*/step % 16 == 0);
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(p.device->stats().steps, steps);
  EXPECT_EQ(p.device->state().size(), 200) << "grown to the budget";
}

SequenceOptions Growing(const char* preset) { return testing::PresetOptions(60, 200, preset); }

// Engine threads step their sequences at once, each on a stream of its own lane
// (kernels/stream_lanes.h) with work queued and not waited for between calls: every
// decision and momentum bit is still the host's.
TEST_F(DeviceEngineTest, ThreadsSteppingTheirOwnSequencesAtOnceDecideAsTheHost) {
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      kernels::SetThreadStreamLane(kernels::EngineThreadStreamLane(t));
      Pair p = Open(Growing(t % 2 == 0 ? "inertia" : "inertia_lazy4"));
      if (p.device == nullptr) return;
      GrowAndStep(p, 100 + static_cast<uint64_t>(t), 240);
      ExpectSameState(*p.host, *p.device, "thread " + std::to_string(t) + " at the end");
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// A sequence opened on one thread and stepped on another keeps the stream it was made
// with: its queued work stays in order.
TEST_F(DeviceEngineTest, ASequenceSteppedByAnotherThreadKeepsItsStream) {
  std::unique_ptr<Pair> p;
  kernels::StreamHandle opened_on = nullptr;
  std::thread opener([&] {
    kernels::SetThreadStreamLane(7);
    p = std::make_unique<Pair>(Open(Growing("inertia")));
    if (p->device != nullptr) opened_on = p->device->state().stream();
  });
  opener.join();
  ASSERT_NE(p->device, nullptr);
  std::thread stepper([&] {
    kernels::SetThreadStreamLane(8);
    kernels::StreamHandle mine = nullptr;
    ASSERT_TRUE(DeviceBackend().mem.device_stream(0, &mine).ok());
    EXPECT_NE(mine, opened_on) << "the lanes' streams differ";
    GrowAndStep(*p, 9, 200);
    EXPECT_EQ(p->device->state().stream(), opened_on);
  });
  stepper.join();
  ExpectSameState(*p->host, *p->device, "the end");
}

#if KVCM_DEVICE_ENGINE_CUDA
// A sequence's arrays come from the device's memory pool, which keeps what is freed: a
// second sequence growing the same way, and any number of steady steps, take nothing more
// from the driver (no cudaMalloc, which would synchronize the device, on the step path).
TEST_F(DeviceEngineTest, GrowingArraysReuseThePoolsMemory) {
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  const auto reserved = [&pool] {
    uint64_t bytes = 0;
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &bytes),
              cudaSuccess);
    return bytes;
  };
  {
    Pair first = Open(Growing("inertia"));
    ASSERT_NE(first.device, nullptr);
    GrowAndStep(first, 1, 200);
  }
  uint64_t threshold = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
            cudaSuccess);
  EXPECT_EQ(threshold, UINT64_MAX) << "freed memory stays in the pool";
  const uint64_t after_first = reserved();
  EXPECT_GT(after_first, 0u);
  Pair second = Open(Growing("inertia"));
  ASSERT_NE(second.device, nullptr);
  GrowAndStep(second, 2, 300);
  EXPECT_LE(reserved(), after_first) << "the second sequence's growth reused the first's memory";
}
#endif  // KVCM_DEVICE_ENGINE_CUDA

// kvcache-replay (next to this test's executable) with its sequence on the device
// backend reproduces every golden vector byte for byte.
TEST_F(DeviceEngineTest, TheReplayToolOnTheDeviceReproducesEveryGoldenVector) {
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  const std::string replay = (self.parent_path() / "kvcache-replay").string();
  ASSERT_TRUE(std::filesystem::exists(replay)) << replay;
#if KVCM_DEVICE_ENGINE_CUDA
  const char* device = "cuda";
#else
  const char* device = "emulated";
#endif
  for (const std::string& name : GoldenNames()) {
    SCOPED_TRACE(name);
    const std::string command = replay + " --device " + device + " --trace " + GoldenDir() +
                                "/" + name + ".trace.jsonl";
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr) << command;
    std::string out;
    char buffer[4096];
    size_t got = 0;
    while ((got = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, got);
    EXPECT_EQ(pclose(pipe), 0) << command;
    EXPECT_EQ(out, testing::ReadFile(GoldenDir() + "/" + name + ".decisions.jsonl"));
  }
}

// `rows` copied into the device backend's memory (what a worker's capture kernel writes
// into a daemon-created CUDA score region), freed with the object.
class BackendScores {
 public:
  explicit BackendScores(const kernels::ScoreMatrix& rows) : matrix_(rows) {
    const kernels::BackendMemory& mem = DeviceBackend().mem;
    const size_t bytes = static_cast<size_t>((rows.layers - 1) * rows.layer_stride + rows.tokens) *
                         kernels::ScoreDtypeSize(rows.dtype);
    kernels::StreamHandle stream = nullptr;
    EXPECT_TRUE(mem.set_device(0).ok());
    EXPECT_TRUE(mem.device_stream(0, &stream).ok());
    EXPECT_TRUE(mem.allocate(bytes, stream, &data_).ok());
    EXPECT_TRUE(mem.copy(data_, rows.data, bytes, kernels::CopyKind::kHostToBackend, stream).ok());
    EXPECT_TRUE(mem.synchronize(stream, "test scores").ok());
    matrix_.data = data_;
  }
  ~BackendScores() {
    kernels::StreamHandle stream = nullptr;
    if (DeviceBackend().mem.device_stream(0, &stream).ok()) {
      DeviceBackend().mem.release(data_, stream);
    }
  }
  BackendScores(const BackendScores&) = delete;
  BackendScores& operator=(const BackendScores&) = delete;
  const kernels::ScoreMatrix& matrix() const { return matrix_; }

 private:
  void* data_ = nullptr;
  kernels::ScoreMatrix matrix_;
};

// Scores that already sit in the device's memory (ScoreSpace::kBackend, a daemon-created
// score region) are read in place and decide exactly like host scores on the host, for
// every dtype and strided rows; a step whose device scores hold an invalid value is
// refused with the same message (the slow path reads them back) and changes nothing.
TEST_F(DeviceEngineTest, ScoresInDeviceMemoryDecideLikeHostScores) {
  std::mt19937_64 rng(91);
  for (const auto& [preset, dtype] :
       {std::pair{"inertia", kernels::ScoreDtype::kFloat32},
        std::pair{"inertia_lazy4", kernels::ScoreDtype::kFloat16},
        std::pair{"h2o", kernels::ScoreDtype::kBFloat16}}) {
    SCOPED_TRACE(preset);
    SequenceOptions options;
    options.prefill_len = 200;
    options.budget = BudgetSpec::Tokens(40);
    options.preset = preset;
    Pair p = Open(options);
    ASSERT_NE(p.device, nullptr);
    for (int64_t step = 1; step <= 30; ++step) {
      const std::string where = "step " + std::to_string(step);
      if (!p.host->next_needs_scores()) {
        StepBoth(p, step, nullptr, where);
        if (::testing::Test::HasFatalFailure()) return;
        continue;
      }
      const int64_t tokens = p.host->next_score_length();
      if (step % 5 == 1) {
        Rows bad = RandomRows(rng, 3, tokens, dtype, false);
        const size_t at = static_cast<size_t>(tokens / 2);
        if (dtype == kernels::ScoreDtype::kFloat32) {
          bad.f32[at] = -1.0f;
        } else {
          bad.f16[at] = dtype == kernels::ScoreDtype::kFloat16 ? kernels::FloatToFloat16(-1.0f)
                                                               : kernels::FloatToBFloat16(-1.0f);
        }
        const BackendScores on_device(bad.matrix);
        EvictionDecision hd, dd;
        const absl::Status hs = p.host->Step(step, &bad.matrix, &hd);
        const absl::Status ds = p.device->Step(step, &on_device.matrix(), &dd,
                                               MomentumState::ScoreSpace::kBackend);
        ASSERT_EQ(hs.code(), absl::StatusCode::kInvalidArgument) << hs;
        ASSERT_EQ(ds.code(), hs.code()) << ds;
        EXPECT_EQ(hs.message().substr(hs.message().find(':')),
                  ds.message().substr(ds.message().find(':')));
        ExpectSameState(*p.host, *p.device, where + " (rejected)");
        if (::testing::Test::HasFatalFailure()) return;
      }
      Rows rows = RandomRows(rng, 3, tokens, dtype, false);
      const BackendScores on_device(rows.matrix);
      EvictionDecision hd, dd;
      ASSERT_TRUE(p.host->Step(step, &rows.matrix, &hd).ok());
      ASSERT_TRUE(
          p.device->Step(step, &on_device.matrix(), &dd, MomentumState::ScoreSpace::kBackend).ok());
      ASSERT_EQ(hd.evicted, dd.evicted) << where;
      ASSERT_EQ(hd.cache_size, dd.cache_size) << where;
      ExpectSameState(*p.host, *p.device, where);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

#if !KVCM_DEVICE_ENGINE_CUDA
// The emulated device, counting the copies from the host into its memory.
int host_to_device_copies = 0;

absl::Status CountingCopy(void* dst, const void* src, size_t bytes, kernels::CopyKind kind,
                          kernels::StreamHandle stream) {
  if (kind == kernels::CopyKind::kHostToBackend) ++host_to_device_copies;
  return kernels::EmulatedDeviceBackend().mem.copy(dst, src, bytes, kind, stream);
}

// "In place" is literal: a scoring step with kBackend scores copies nothing from the host
// to the device, while the same step with host scores uploads them once.
TEST(DeviceScoresTest, ScoresInDeviceMemoryAreNotCopiedFromTheHost) {
  static const kernels::KernelBackend counting = [] {
    kernels::KernelBackend backend = kernels::EmulatedDeviceBackend();
    backend.name = "counting-device";
    backend.mem.copy = &CountingCopy;
    return backend;
  }();
  SequenceOptions options;
  options.prefill_len = 50;
  options.budget = BudgetSpec::Tokens(20);
  options.preset = "inertia";
  options.backend = &counting;
  absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("in-place", options);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<float> scores(2 * 51, 0.25f);
  const auto m = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, 2, 51);
  EvictionDecision d;
  // Steps 2 and 3 do the same work (one token in, one out) but for where the scores are.
  ASSERT_TRUE((*s)->Step(1, &m, &d).ok());
  const auto steady = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, 2, 21);
  host_to_device_copies = 0;
  ASSERT_TRUE((*s)->Step(2, &steady, &d, MomentumState::ScoreSpace::kBackend).ok());
  const int in_place = host_to_device_copies;
  host_to_device_copies = 0;
  ASSERT_TRUE((*s)->Step(3, &steady, &d).ok());
  EXPECT_EQ(host_to_device_copies, in_place + 1);
  EXPECT_EQ(in_place, 0);
}

// A device that fails on demand: the emulated device with its allocation or its waits
// failing once a countdown reaches zero.
int allocations_left = 0;
int synchronizations_left = 0;

absl::Status FailingAllocate(size_t bytes, kernels::StreamHandle stream, void** ptr) {
  if (allocations_left-- <= 0) return absl::InternalError("cudaMalloc: out of memory (injected)");
  return kernels::EmulatedDeviceBackend().mem.allocate(bytes, stream, ptr);
}

absl::Status FailingSynchronize(kernels::StreamHandle stream, const char* what) {
  if (synchronizations_left-- <= 0) {
    return absl::InternalError(std::string(what) + ": cudaErrorIllegalAddress (injected)");
  }
  return kernels::EmulatedDeviceBackend().mem.synchronize(stream, what);
}

kernels::KernelBackend FailingDevice() {
  kernels::KernelBackend backend = kernels::EmulatedDeviceBackend();
  backend.name = "failing-device";
  backend.mem.allocate = &FailingAllocate;
  backend.mem.synchronize = &FailingSynchronize;
  return backend;
}

// A sequence of `prefill` tokens, budget 10, on the failing device.
SequenceOptions OnFailingDevice(int64_t prefill, const char* preset) {
  static const kernels::KernelBackend backend = FailingDevice();
  SequenceOptions options;
  options.prefill_len = prefill;
  options.budget = BudgetSpec::Tokens(10);
  options.preset = preset;
  options.backend = &backend;
  return options;
}

TEST(DeviceFailureTest, AnAllocationFailureFailsTheOpen) {
  const SequenceOptions options = OnFailingDevice(100, "inertia");
  for (int allowed : {0, 1, 3, 6}) {
    allocations_left = allowed;
    synchronizations_left = 1000;
    absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("oom", options);
    ASSERT_FALSE(s.ok()) << "allowed " << allowed;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInternal);
    EXPECT_NE(s.status().message().find("out of memory (injected)"), std::string::npos)
        << s.status();
  }
}

TEST(DeviceFailureTest, ADeviceFailureIsInternalOnThatStepAndEveryLaterOne) {
  const SequenceOptions options = OnFailingDevice(20, "inertia_lazy4");
  allocations_left = 1000;
  synchronizations_left = 1000;
  absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("broken", options);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<float> scores(21, 0.5f);
  const auto m = kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, 1, 21);
  EvictionDecision d;
  ASSERT_TRUE((*s)->Step(1, &m, &d).ok());
  ASSERT_TRUE((*s)->Step(2, nullptr, &d).ok());
  synchronizations_left = 0;  // the next wait fails: the device "faulted"
  const absl::Status failed = (*s)->Step(3, nullptr, &d);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(failed.message().find("injected"), std::string::npos) << failed;
  EXPECT_EQ((*s)->last_step(), 2);  // the step did not count
  synchronizations_left = 1000;  // the device is back, but the sequence stays broken
  EXPECT_EQ((*s)->Step(3, nullptr, &d).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*s)->Step(4, nullptr, &d).code(), absl::StatusCode::kInternal);
}
#endif  // !KVCM_DEVICE_ENGINE_CUDA

TEST_F(DeviceEngineTest, AStepOutOfOrderIsRefusedAlike) {
  SequenceOptions options;
  options.prefill_len = 10;
  options.budget = BudgetSpec::Tokens(5);
  options.preset = "inertia_lazy4";
  Pair p = Open(options);
  ASSERT_NE(p.device, nullptr);
  StepBoth(p, 2, nullptr, "step 2 first");
}

}  // namespace
}  // namespace kvcm

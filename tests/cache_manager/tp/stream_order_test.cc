// Which device stream a sequence's work goes to. A device backend's streams are one per
// thread lane (kernels/stream_lanes.h), and a sequence's arrays are written by queued
// work, not waited for, so everything a sequence does must stay on the stream its state
// was made with, whichever thread steps it: its kernels, the stream-ordered growth of its
// arrays, and a tensor-parallel join whose result its step reads next. The emulated device
// gives each lane a distinct stream handle; here every kernel, allocation, release and
// copy records the stream it was given, and the steps run on another thread (another
// lane) than the one that opened the sequence.
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/persist/restart.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/stream_lanes.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using kernels::StreamHandle;

// What the recording backend saw: the stream of each call, by what was called.
struct Seen {
  std::mutex mu;
  std::vector<std::pair<std::string, StreamHandle>> calls;

  void Add(std::string what, StreamHandle stream) {
    std::lock_guard<std::mutex> lock(mu);
    calls.emplace_back(std::move(what), stream);
  }
  std::vector<std::pair<std::string, StreamHandle>> Take() {
    std::lock_guard<std::mutex> lock(mu);
    return std::exchange(calls, {});
  }
};

Seen& Recorded() {
  static Seen* const seen = new Seen;
  return *seen;
}

// A kernel entry that records its stream (every entry's last parameter) and runs the CPU
// reference.
template <auto kKernel>
struct StreamRecorder;
template <typename R, typename... Args, R (*kKernel)(Args...)>
struct StreamRecorder<kKernel> {
  static R Run(Args... args) {
    static_assert(std::is_same_v<std::tuple_element_t<sizeof...(Args) - 1, std::tuple<Args...>>,
                                 StreamHandle>);
    Recorded().Add("kernel", std::get<sizeof...(Args) - 1>(std::tie(args...)));
    return kKernel(args...);
  }
};

absl::Status RecordedAllocate(size_t bytes, StreamHandle stream, void** ptr) {
  Recorded().Add("allocate", stream);
  return kernels::EmulatedDeviceBackend().mem.allocate(bytes, stream, ptr);
}

void RecordedRelease(void* ptr, StreamHandle stream) {
  if (ptr != nullptr) Recorded().Add("release", stream);
  kernels::EmulatedDeviceBackend().mem.release(ptr, stream);
}

absl::Status RecordedCopy(void* dst, const void* src, size_t bytes, kernels::CopyKind kind,
                          StreamHandle stream) {
  Recorded().Add("copy", stream);
  return kernels::EmulatedDeviceBackend().mem.copy(dst, src, bytes, kind, stream);
}

const kernels::KernelBackend& RecordingDevice() {
  static const kernels::KernelBackend backend = [] {
    kernels::KernelBackend b = kernels::EmulatedDeviceBackend();
    b.name = "recording-device";
#define KVCM_RECORD_ENTRY(kernel, entry) b.entry = &StreamRecorder<&kernels::cpu::kernel>::Run;
    KVCM_KERNEL_ENTRIES(KVCM_RECORD_ENTRY)
#undef KVCM_RECORD_ENTRY
    b.mem.allocate = &RecordedAllocate;
    b.mem.release = &RecordedRelease;
    b.mem.copy = &RecordedCopy;
    return b;
  }();
  return backend;
}

// Runs `body` on a new thread of lane `lane`.
template <typename Body>
void OnLane(int lane, Body body) {
  std::thread thread([lane, &body] {
    kernels::SetThreadStreamLane(lane);
    body();
  });
  thread.join();
}

constexpr int kOpeningLane = 5;
constexpr int kSteppingLane = 9;

// Every call recorded since the last check went to the opening thread's stream.
void ExpectAllOnTheSequencesStream(int64_t step) {
  const StreamHandle want = kernels::EmulatedStream(kOpeningLane);
  for (const auto& [what, stream] : Recorded().Take()) {
    EXPECT_EQ(stream, want) << what << " of step " << step << " went to stream "
                            << (stream == kernels::EmulatedStream(kSteppingLane)
                                    ? "of the stepping thread"
                                    : "neither the sequence's nor the stepping thread's");
  }
}

// Submits `report` of sequence "s", whose decision must come at once or with the last rank.
void Submit(SequenceTable& table, const RankReport& report,
            std::vector<EvictionDecision>* decided) {
  const absl::Status submitted =
      table.SubmitRankReport("s", report, [decided](const absl::StatusOr<EvictionDecision>& d) {
        ASSERT_TRUE(d.ok()) << d.status();
        decided->push_back(*d);
      });
  ASSERT_TRUE(submitted.ok()) << submitted;
}

// A cache that grows from its prefill to its budget (the arrays grow on the step path),
// then evicts each step.
SequenceOptions Growing(const char* preset) {
  SequenceOptions o = testing::PresetOptions(40, 120, preset);
  o.backend = &RecordingDevice();
  return o;
}

TEST(StreamOrderTest, ATensorParallelSequenceStaysOnItsStreamWhicheverThreadStepsIt) {
  SequenceTable table;
  SequenceTable reference;
  OnLane(kOpeningLane, [&] { ASSERT_TRUE(table.Open("s", Growing("inertia"), 2).ok()); });
  SequenceOptions on_cpu = testing::PresetOptions(40, 120, "inertia");
  ASSERT_TRUE(reference.Open("s", on_cpu, 2).ok());
  (void)Recorded().Take();
  std::mt19937_64 rng(3);
  int64_t cache = 40;
  for (int64_t t = 1; t <= 120; ++t) {
    const auto layers = testing::RandomLayers(rng, 2, cache + 1, false);
    testing::DenseScores dense(layers);
    std::vector<EvictionDecision> got, want;
    OnLane(kSteppingLane, [&] {
      for (int32_t rank : {1, 0}) {
        RankReport r;
        r.rank = rank;
        r.step = t;
        r.head_count = 1;
        r.partial_sums = dense.matrix;
        r.in_backend = true;  // the emulated device's memory is host memory
        Submit(table, r, &got);
        r.in_backend = false;
        Submit(reference, r, &want);
      }
    });
    ASSERT_EQ(got.size(), 2u);
    ASSERT_EQ(want.size(), 2u);
    ASSERT_EQ(got[0].evicted, want[0].evicted) << "step " << t;
    ExpectAllOnTheSequencesStream(t);
    cache = got[0].cache_size;
  }
  EXPECT_EQ(cache, 120) << "the cache reached its budget: the arrays grew on steps";
  OnLane(kSteppingLane, [&] { ASSERT_TRUE(table.Close("s").ok()); });
  ExpectAllOnTheSequencesStream(-1);  // its arrays are freed on its stream too
}

TEST(StreamOrderTest, ASingleRankSequenceStaysOnItsStreamWhicheverThreadStepsIt) {
  for (const char* preset : {"inertia", "inertia_lazy4", "tova"}) {
    SCOPED_TRACE(preset);
    SequenceTable table;
    OnLane(kOpeningLane, [&] { ASSERT_TRUE(table.Open("s", Growing(preset)).ok()); });
    (void)Recorded().Take();
    std::mt19937_64 rng(5);
    int64_t cache = 40;
    bool needs_scores = true;
    for (int64_t t = 1; t <= 100; ++t) {
      const auto layers = testing::RandomLayers(rng, 2, cache + 1, false);
      testing::DenseScores dense(layers);
      EvictionDecision decision;
      OnLane(kSteppingLane, [&] {
        const absl::Status stepped =
            table.Step("s", t, needs_scores ? &dense.matrix : nullptr, &decision);
        ASSERT_TRUE(stepped.ok()) << stepped;
      });
      ExpectAllOnTheSequencesStream(t);
      cache = decision.cache_size;
      needs_scores = decision.next_needs_scores;
    }
    OnLane(kSteppingLane, [&] { ASSERT_TRUE(table.Close("s").ok()); });
    ExpectAllOnTheSequencesStream(-1);
  }
}

// A restart rebuilds every sequence on the start-up thread; each must still take the
// stream of the engine thread that will step it (the daemon's lane of its shard), not the
// start-up thread's, which every restored sequence would otherwise share for its life.
TEST(StreamOrderTest, ARestoredSequenceTakesTheStreamOfTheThreadThatWillStepIt) {
  SequenceTableOptions options;
  options.engine_backend = &RecordingDevice();
  SequenceTable before(options);
  const std::vector<std::pair<std::string, int>> lanes = {{"a", 11}, {"b", 12}, {"c", 13}};
  for (const auto& [id, lane] : lanes) {
    ASSERT_TRUE(before.Open(id, testing::PresetOptions(40, 120, "inertia")).ok());
  }
  const EngineSnapshot snapshot = CaptureEngine(before, nullptr, 1);
  SequenceTable after(options);
  (void)Recorded().Take();
  const int own_lane = kernels::ThreadStreamLane();
  const RestoreReport report =
      RestoreEngine(snapshot, &after, nullptr, [&lanes](absl::string_view id) {
        for (const auto& [known, lane] : lanes) {
          if (known == id) return lane;
        }
        return 0;
      });
  ASSERT_EQ(report.restored, 3) << (report.failures.empty() ? "" : report.failures[0]);
  EXPECT_EQ(kernels::ThreadStreamLane(), own_lane) << "the caller's lane is given back";
  std::set<StreamHandle> restored_on;
  for (const auto& [what, stream] : Recorded().Take()) restored_on.insert(stream);
  EXPECT_EQ(restored_on, (std::set<StreamHandle>{kernels::EmulatedStream(11),
                                                 kernels::EmulatedStream(12),
                                                 kernels::EmulatedStream(13)}));
  std::mt19937_64 rng(8);
  for (const auto& [id, lane] : lanes) {
    SCOPED_TRACE(id);
    testing::DenseScores dense(testing::RandomLayers(rng, 2, 41, false));
    EvictionDecision decision;
    OnLane(kSteppingLane, [&] {
      const absl::Status stepped = after.Step(id, 1, &dense.matrix, &decision);
      ASSERT_TRUE(stepped.ok()) << stepped;
    });
    const auto calls = Recorded().Take();
    EXPECT_FALSE(calls.empty());
    for (const auto& [what, stream] : calls) {
      EXPECT_EQ(stream, kernels::EmulatedStream(lane)) << what;
    }
  }
}

// The engine's threads each enqueue on a stream of their own, none on the one every
// other thread shares.
TEST(StreamOrderTest, EachEngineThreadHasAStreamOfItsOwn) {
  constexpr int32_t kThreads = 4;
  StepExecutor executor(kThreads, 8);
  struct Context {
    std::mutex mu;
    std::vector<StreamHandle> by_shard = std::vector<StreamHandle>(kThreads, nullptr);
    int done = 0;
    std::condition_variable all_done;
  } context;
  for (int32_t shard = 0; shard < kThreads; ++shard) {
    ASSERT_TRUE(executor.Post(shard, {[](void* c, int32_t index) {
                                        auto& ctx = *static_cast<Context*>(c);
                                        StreamHandle stream = nullptr;
                                        (void)kernels::EmulatedDeviceBackend().mem.device_stream(
                                            0, &stream);
                                        std::lock_guard<std::mutex> lock(ctx.mu);
                                        ctx.by_shard[static_cast<size_t>(index)] = stream;
                                        if (++ctx.done == kThreads) ctx.all_done.notify_all();
                                      },
                                      &context}));
  }
  std::unique_lock<std::mutex> lock(context.mu);
  context.all_done.wait(lock, [&] { return context.done == kThreads; });
  for (int32_t shard = 0; shard < kThreads; ++shard) {
    SCOPED_TRACE(absl::StrCat("engine thread ", shard));
    const StreamHandle stream = context.by_shard[static_cast<size_t>(shard)];
    EXPECT_EQ(stream, kernels::EmulatedStream(kernels::EngineThreadStreamLane(shard)));
    EXPECT_NE(stream, kernels::EmulatedStream(0)) << "the lane the other threads share";
    for (int32_t other = 0; other < shard; ++other) {
      EXPECT_NE(stream, context.by_shard[static_cast<size_t>(other)]);
    }
  }
}

TEST(StreamLanesTest, LanesWrapAndEngineThreadsNeverShareTheDefault) {
  OnLane(0, [] { EXPECT_EQ(kernels::ThreadStreamLane(), 0); });
  std::thread fresh([] { EXPECT_EQ(kernels::ThreadStreamLane(), 0) << "a new thread's lane"; });
  fresh.join();
  OnLane(kernels::kStreamLanes + 3, [] { EXPECT_EQ(kernels::ThreadStreamLane(), 3); });
  OnLane(-1, [] { EXPECT_EQ(kernels::ThreadStreamLane(), kernels::kStreamLanes - 1); });
  for (int shard = 0; shard < 3 * kernels::kStreamLanes; ++shard) {
    const int lane = kernels::EngineThreadStreamLane(shard);
    EXPECT_GE(lane, 1);
    EXPECT_LT(lane, kernels::kStreamLanes);
    if (shard + 1 < kernels::kStreamLanes) {
      EXPECT_EQ(lane, shard + 1);
    }
  }
}

}  // namespace
}  // namespace kvcm

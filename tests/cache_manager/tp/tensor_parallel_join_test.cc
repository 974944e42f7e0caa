#include "cache_manager/tp/tensor_parallel_join.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cache_manager/table/sequence_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half_float.h"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/cache_manager/tp/wide_range_partials.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

JoinExpectation Expect(int64_t step, int64_t tokens, bool scoring) {
  return JoinExpectation{"seq", step, tokens, scoring};
}

RankReport Report(int32_t rank, int64_t step, const std::vector<float>& sums, int64_t layers,
                  int64_t heads) {
  RankReport r;
  r.rank = rank;
  r.step = step;
  r.partial_sums = kernels::ScoreMatrix::Dense(sums.data(), kernels::ScoreDtype::kFloat32, layers,
                                               static_cast<int64_t>(sums.size()) / layers);
  r.head_count = heads;
  return r;
}

TEST(TensorParallelJoinTest, LayerScoreIsTotalSumOverTotalHeads) {
  TensorParallelJoin join(2);
  const std::vector<float> r0 = {0.5f, 1.5f, 1.0f, 1.0f};  // 2 heads, 1 layer x 4
  const std::vector<float> r1 = {0.5f, 0.5f, 1.0f, 0.0f};  // 2 heads
  ASSERT_TRUE(join.Add(Report(1, 3, r1, 1, 2), Expect(3, 4, true)).ok());
  EXPECT_FALSE(join.complete());
  EXPECT_EQ(join.MissingRanks(), std::vector<int32_t>{0});
  ASSERT_TRUE(join.Add(Report(0, 3, r0, 1, 2), Expect(3, 4, true)).ok());
  ASSERT_TRUE(join.complete());
  const kernels::ScoreMatrix joined = join.Join();
  ASSERT_EQ(joined.layers, 1);
  const float* v = static_cast<const float*>(joined.data);
  EXPECT_EQ(std::vector<float>(v, v + 4), (std::vector<float>{0.25f, 0.5f, 0.5f, 0.25f}));
}

TEST(TensorParallelJoinTest, RejectsBadReportsAndKeepsTheGoodOnes) {
  TensorParallelJoin join(3);
  const std::vector<float> ok = {0.1f, 0.2f, 0.3f};
  ASSERT_TRUE(join.Add(Report(0, 5, ok, 1, 1), Expect(5, 3, true)).ok());

  absl::Status s = join.Add(Report(3, 5, ok, 1, 1), Expect(5, 3, true));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rank 3"));
  s = join.Add(Report(1, 6, ok, 1, 1), Expect(5, 3, true));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  s = join.Add(Report(0, 5, ok, 1, 1), Expect(5, 3, true));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("already reported"));
  s = join.Add(Report(1, 5, ok, 1, 0), Expect(5, 3, true));
  EXPECT_THAT(s.message(), HasSubstr("head_count"));
  const std::vector<float> short_row = {0.1f, 0.2f};
  s = join.Add(Report(1, 5, short_row, 1, 1), Expect(5, 3, true));
  EXPECT_THAT(s.message(), HasSubstr("cover 2 tokens"));
  const std::vector<float> two_layers = {0.1f, 0.2f, 0.3f, 0.1f, 0.2f, 0.3f};
  s = join.Add(Report(1, 5, two_layers, 2, 1), Expect(5, 3, true));
  EXPECT_THAT(s.message(), HasSubstr("2 layers, earlier ranks reported 1"));
  const std::vector<float> negative = {0.1f, -0.2f, 0.3f};
  s = join.Add(Report(1, 5, negative, 1, 1), Expect(5, 3, true));
  EXPECT_THAT(s.message(), HasSubstr("layer 0 partial sum 1 is -0.2"));
  RankReport none;
  none.rank = 2;
  none.step = 5;
  s = join.Add(none, Expect(5, 3, true));
  EXPECT_THAT(s.message(), HasSubstr("carries no partial sums"));

  EXPECT_EQ(join.arrived(), 1);  // none of the rejected reports counted
  ASSERT_TRUE(join.Add(Report(1, 5, ok, 1, 1), Expect(5, 3, true)).ok());
  ASSERT_TRUE(join.Add(Report(2, 5, ok, 1, 1), Expect(5, 3, true)).ok());
  EXPECT_TRUE(join.complete());
}

TEST(TensorParallelJoinTest, NonScoringStepNeedsNoScoresAndIgnoresThem) {
  TensorParallelJoin join(2);
  RankReport none;
  none.rank = 0;
  none.step = 2;
  ASSERT_TRUE(join.Add(none, Expect(2, 10, false)).ok());
  const std::vector<float> stray = {-1.0f};  // not even valid: ignored, not checked
  ASSERT_TRUE(join.Add(Report(1, 2, stray, 1, 1), Expect(2, 10, false)).ok());
  EXPECT_TRUE(join.any_scores_ignored());
  EXPECT_EQ(join.Join().layers, 0);
  join.Reset();
  EXPECT_EQ(join.arrived(), 0);
  EXPECT_FALSE(join.any_scores_ignored());
}

// The same trace through 1, 2, 4 and 8 ranks gives identical decisions: each rank holds
// h_p heads that all saw the pooled row, so its partial sum is the row times h_p.
TEST(TensorParallelJoinTest, DecisionsDoNotDependOnTheNumberOfRanks) {
  for (const char* preset : {"inertia", "inertia_lazy4", "tova", "h2o"}) {
    SCOPED_TRACE(preset);
    std::vector<std::vector<EvictionDecision>> runs;
    for (int32_t ranks : {1, 2, 4, 8}) {
      SequenceTable table;
      SequenceOptions o;
      o.prefill_len = 200;
      o.budget = BudgetSpec::Ratio(0.9);
      o.preset = preset;
      ASSERT_TRUE(table.Open("s", o, ranks).ok());
      std::mt19937_64 rng(11);
      std::vector<EvictionDecision> decisions;
      int64_t cache = 200;
      for (int64_t t = 1; t <= 30; ++t) {
        const bool scoring = Policy::FromPreset(preset, 20)->IsScoringStep(t);
        const auto layers = testing::RandomLayers(rng, 3, cache + 1, false);
        testing::DenseScores dense(layers);
        std::vector<EvictionDecision> got;
        for (int32_t i = 0; i < ranks; ++i) {
          const int32_t rank = (i * 3 + static_cast<int32_t>(t)) % ranks;  // scrambled arrival
          const int64_t heads = 1 + (rank % 2);
          std::vector<float> sums(dense.data.size());
          for (size_t k = 0; k < sums.size(); ++k) sums[k] = dense.data[k] * static_cast<float>(heads);
          RankReport r;
          r.rank = rank;
          r.step = t;
          r.head_count = heads;
          if (scoring) {
            r.partial_sums = dense.matrix;
            r.partial_sums.data = sums.data();
          }
          ASSERT_TRUE(table
                          .SubmitRankReport("s", r,
                                            [&got](const absl::StatusOr<EvictionDecision>& d) {
                                              ASSERT_TRUE(d.ok()) << d.status();
                                              got.push_back(*d);
                                            })
                          .ok());
          if (i + 1 < ranks) {
            EXPECT_TRUE(got.empty()) << "decided before every rank reported";
          }
        }
        ASSERT_EQ(static_cast<int32_t>(got.size()), ranks);
        for (const auto& d : got) EXPECT_EQ(d.evicted, got.front().evicted);
        decisions.push_back(got.front());
        cache = got.front().cache_size;
      }
      runs.push_back(decisions);
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      for (size_t t = 0; t < runs[0].size(); ++t) {
        EXPECT_EQ(runs[r][t].evicted, runs[0][t].evicted) << "step " << t + 1;
        EXPECT_EQ(runs[r][t].next_needs_scores, runs[0][t].next_needs_scores);
      }
    }
  }
}

TEST(TensorParallelJoinTest, MixedDtypesJoinInDouble) {
  TensorParallelJoin join(2);
  const std::vector<float> r0 = {0.5f, 0.25f};
  std::vector<uint16_t> r1 = {kernels::FloatToFloat16(0.5f), kernels::FloatToFloat16(0.75f)};
  ASSERT_TRUE(join.Add(Report(0, 1, r0, 1, 1), Expect(1, 2, true)).ok());
  RankReport half;
  half.rank = 1;
  half.step = 1;
  half.head_count = 1;
  half.partial_sums = kernels::ScoreMatrix::Dense(r1.data(), kernels::ScoreDtype::kFloat16, 1, 2);
  ASSERT_TRUE(join.Add(half, Expect(1, 2, true)).ok());
  const float* v = static_cast<const float*>(join.Join().data);
  EXPECT_EQ(v[0], 0.5f);
  EXPECT_EQ(v[1], 0.5f);
}

// `ranks` rows of `n` partial sums, uniform in [0, max).
std::vector<std::vector<float>> RandomRankSums(uint64_t seed, int ranks, int64_t n, float max) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, max);
  std::vector<std::vector<float>> sums(static_cast<size_t>(ranks),
                                       std::vector<float>(static_cast<size_t>(n)));
  for (auto& rank : sums) {
    for (float& x : rank) x = u(rng);
  }
  return sums;
}

// Reports whose partial sums already sit in a device's memory (the emulated device here:
// host memory behind the device code path) are referenced in place, pinned until the
// step is done, validated on the device, and joined there: bit for bit what the host join
// makes of the same bytes, whichever ranks arrive in device memory.
TEST(TensorParallelJoinTest, ReportsInDeviceMemoryJoinOnTheDeviceExactlyAsOnTheHost) {
  const kernels::KernelBackend& device = kernels::EmulatedDeviceBackend();
  constexpr int64_t kLayers = 3, kTokens = 41;
  const std::vector<std::vector<float>> sums = RandomRankSums(17, 3, kLayers * kTokens, 2.0f);
  const int64_t heads[] = {1, 3, 2};
  TensorParallelJoin host(3);
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(host.Add(Report(r, 2, sums[r], kLayers, heads[r]), Expect(2, kTokens, true)).ok());
  }
  ASSERT_FALSE(host.any_on_device());
  const kernels::ScoreMatrix want_matrix = host.Join();
  const float* w = static_cast<const float*>(want_matrix.data);
  const std::vector<float> want(w, w + kLayers * kTokens);

  // Which ranks send device memory: all, some, one.
  for (const std::vector<bool>& on_device :
       {std::vector<bool>{true, true, true}, {false, true, false}, {true, false, true}}) {
    TensorParallelJoin join(3, kernels::CpuBackend(), &device, 0);
    std::vector<std::shared_ptr<const void>> pins;
    for (int32_t r = 2; r >= 0; --r) {  // arrival order: last rank first
      RankReport report = Report(r, 2, sums[r], kLayers, heads[r]);
      report.in_backend = on_device[static_cast<size_t>(r)];
      if (report.in_backend) {
        pins.push_back(std::make_shared<int>(r));
        report.pin = pins.back();
      }
      ASSERT_TRUE(join.Add(report, Expect(2, kTokens, true)).ok());
    }
    ASSERT_TRUE(join.any_on_device());
    for (const auto& pin : pins) EXPECT_EQ(pin.use_count(), 2) << "the join holds the region";
    absl::StatusOr<kernels::ScoreMatrix> joined = join.JoinOnDevice();
    ASSERT_TRUE(joined.ok()) << joined.status();
    // In the device's memory: not any rank's bytes, nor the host join's.
    const float* v = static_cast<const float*>(joined->data);
    EXPECT_NE(joined->data, want_matrix.data);
    EXPECT_EQ(std::vector<float>(v, v + kLayers * kTokens), want);
    join.Reset();
    for (const auto& pin : pins) EXPECT_EQ(pin.use_count(), 1) << "released with the step";
    EXPECT_FALSE(join.any_on_device());
  }
}

// The CPU twins of the NCCL join, counting its calls.
class CountingJoiner final : public CrossDeviceJoiner {
 public:
  absl::Status Join(std::span<const kernels::ScoreMatrix> partials, std::span<const int> devices,
                    int64_t total_heads, int out_device, float* out) override {
    ++calls;
    last_devices.assign(devices.begin(), devices.end());
    return cpu.Join(partials, devices, total_heads, out_device, out);
  }
  int calls = 0;
  std::vector<int> last_devices;
  CpuCrossDeviceJoiner cpu;
};

// Partial sums one per rank on distinct devices (regions placed on each rank's device)
// go to the cross-device joiner, the NCCL all-reduce on GPUs; any other mix is gathered
// onto the sequence's device and joined there. Every way gives the host join's bits.
TEST(TensorParallelJoinTest, PartialSumsOnOneDevicePerRankAreJoinedAcrossTheDevices) {
  const kernels::KernelBackend& device = kernels::EmulatedDeviceBackend();
  constexpr int64_t kLayers = 2, kTokens = 29;
  const std::vector<std::vector<float>> sums = RandomRankSums(23, 3, kLayers * kTokens, 3.0f);
  TensorParallelJoin host(3);
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(host.Add(Report(r, 1, sums[r], kLayers, 1 + r), Expect(1, kTokens, true)).ok());
  }
  const kernels::ScoreMatrix want_matrix = host.Join();
  const float* w = static_cast<const float*>(want_matrix.data);
  const std::vector<float> want(w, w + kLayers * kTokens);

  struct Case {
    std::vector<int> devices;  // -2: a host report
    bool across;               // whether the cross-device joiner runs
  };
  for (const Case& c : {Case{{0, 1, 2}, true}, Case{{2, 0, 1}, true}, Case{{0, 1, -2}, false},
                        Case{{1, 1, 0}, false}, Case{{1, 2, 3}, false}, Case{{0, 0, 0}, false}}) {
    SCOPED_TRACE(::testing::PrintToString(c.devices));
    CountingJoiner joiner;
    TensorParallelJoin join(3, kernels::CpuBackend(), &device, 0, &joiner);
    for (int32_t r = 0; r < 3; ++r) {
      RankReport report = Report(r, 1, sums[r], kLayers, 1 + r);
      report.in_backend = c.devices[static_cast<size_t>(r)] != -2;
      report.device = c.devices[static_cast<size_t>(r)];
      ASSERT_TRUE(join.Add(report, Expect(1, kTokens, true)).ok());
    }
    absl::StatusOr<kernels::ScoreMatrix> joined = join.JoinOnDevice();
    ASSERT_TRUE(joined.ok()) << joined.status();
    const float* v = static_cast<const float*>(joined->data);
    EXPECT_EQ(std::vector<float>(v, v + kLayers * kTokens), want);
    EXPECT_EQ(joiner.calls, c.across ? 1 : 0);
    if (c.across) {
      EXPECT_EQ(joiner.last_devices, c.devices);
    }
  }
}

// The CPU joiner is the NCCL joiner's reference, so it must sum in rank order whatever
// the values: with 3 or more ranks of wide-range partials the double sum rounds, and
// another order (NCCL's ring or tree) would give other floats.
TEST(CpuCrossDeviceJoinerTest, SumsWideRangePartialsInRankOrder) {
  constexpr int64_t kLayers = 3, kTokens = 1001;
  for (int32_t ranks : {3, 4, 5, 8}) {
    SCOPED_TRACE(::testing::PrintToString(ranks) + " ranks");
    const std::vector<std::vector<float>> partials =
        testing::WideRangePartials(41 + static_cast<uint64_t>(ranks), ranks, kLayers * kTokens);
    const int64_t heads = 3 * ranks;  // not a power of two: the division rounds too
    std::vector<kernels::ScoreMatrix> views;
    std::vector<int> devices;
    for (int32_t r = 0; r < ranks; ++r) {
      views.push_back(kernels::ScoreMatrix::Dense(partials[static_cast<size_t>(r)].data(),
                                                  kernels::ScoreDtype::kFloat32, kLayers, kTokens));
      devices.push_back(ranks - 1 - r);  // the rank, not the device number, sets the order
    }
    std::vector<int32_t> rank_order(static_cast<size_t>(ranks));
    std::iota(rank_order.begin(), rank_order.end(), 0);
    const std::vector<float> want = testing::FoldInOrder(partials, rank_order, heads);
    // The data can tell: the reverse order rounds some element differently.
    const std::vector<int32_t> reverse(rank_order.rbegin(), rank_order.rend());
    EXPECT_NE(testing::FoldInOrder(partials, reverse, heads), want);
    for (int out_device : {0, ranks - 1}) {
      std::vector<float> out(want.size(), -1.0f);
      CpuCrossDeviceJoiner joiner;
      ASSERT_TRUE(joiner.Join(views, devices, heads, out_device, out.data()).ok());
      EXPECT_EQ(out, want) << "out on device " << out_device;
    }
  }
}

TEST(TensorParallelJoinTest, AnInvalidPartialSumInDeviceMemoryIsRefusedByName) {
  const kernels::KernelBackend& device = kernels::EmulatedDeviceBackend();
  TensorParallelJoin join(2, kernels::CpuBackend(), &device, 0);
  const std::vector<float> ok = {0.1f, 0.2f, 0.3f};
  const std::vector<float> bad = {0.1f, 0.2f, std::numeric_limits<float>::infinity()};
  RankReport refused = Report(1, 4, bad, 1, 1);
  refused.in_backend = true;
  const absl::Status s = join.Add(refused, Expect(4, 3, true));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_THAT(s.message(), HasSubstr("layer 0 partial sum 2 is inf"));
  EXPECT_EQ(join.arrived(), 0);
  EXPECT_FALSE(join.any_on_device());
  RankReport good = Report(1, 4, ok, 1, 1);
  good.in_backend = true;
  ASSERT_TRUE(join.Add(good, Expect(4, 3, true)).ok());
  ASSERT_TRUE(join.Add(Report(0, 4, ok, 1, 1), Expect(4, 3, true)).ok());
  absl::StatusOr<kernels::ScoreMatrix> joined = join.JoinOnDevice();
  ASSERT_TRUE(joined.ok()) << joined.status();
  const float* v = static_cast<const float*>(joined->data);
  EXPECT_EQ(std::vector<float>(v, v + 3), (std::vector<float>{0.1f, 0.2f, 0.3f}));
}

// The emulated device with a stream wait that counts: when the step's regions are let go,
// the join's queued reads of them must have been waited for.
int stream_waits = 0;
absl::Status CountedWait(kernels::StreamHandle stream, const char* what) {
  ++stream_waits;
  return kernels::EmulatedDeviceBackend().mem.synchronize(stream, what);
}

TEST(TensorParallelJoinTest, ResetWaitsForTheDeviceJoinBeforeReleasingItsRegions) {
  kernels::KernelBackend device = kernels::EmulatedDeviceBackend();
  device.mem.synchronize = &CountedWait;
  const std::vector<float> sums = {0.25f, 0.5f, 1.0f};
  // The waits counted when each region's last pin goes (-1: still held).
  std::vector<int> waits_at_release(2, -1);
  for (bool joined_on_device : {true, false}) {
    SCOPED_TRACE(joined_on_device ? "after JoinOnDevice" : "a step refused before the join");
    std::fill(waits_at_release.begin(), waits_at_release.end(), -1);
    TensorParallelJoin join(2, kernels::CpuBackend(), &device, 0);
    for (int32_t r = 0; r < 2; ++r) {
      RankReport report = Report(r, 3, sums, 1, 1);
      report.in_backend = true;
      report.pin = std::shared_ptr<const int>(new int(r), [&waits_at_release, r](const int* p) {
        waits_at_release[static_cast<size_t>(r)] = stream_waits;
        delete p;
      });
      ASSERT_TRUE(join.Add(report, Expect(3, 3, true)).ok());
    }
    if (joined_on_device) {
      ASSERT_TRUE(join.JoinOnDevice().ok());
    }
    const int before = stream_waits;
    join.Reset();
    EXPECT_EQ(waits_at_release, std::vector<int>(2, joined_on_device ? before + 1 : before))
        << "both regions released by Reset, after one wait exactly when a join was queued";
    // Nothing queued since: a second Reset does not wait again.
    join.Reset();
    EXPECT_EQ(stream_waits, joined_on_device ? before + 1 : before);
  }
}

// The cross-device joiner writes the result on streams of its own, so a result buffer
// just allocated (stream-ordered on the sequence's stream) needs that stream run dry
// first; a steady step, whose buffer is already there, waits for nothing before the join.
TEST(TensorParallelJoinTest, AJoinAcrossDevicesWaitsForTheStreamOnlyAfterAllocating) {
  kernels::KernelBackend device = kernels::EmulatedDeviceBackend();
  device.mem.synchronize = &CountedWait;
  CountingJoiner joiner;
  TensorParallelJoin join(2, kernels::CpuBackend(), &device, 0, &joiner);
  const std::vector<float> small = {0.25f, 0.5f}, large = {0.25f, 0.5f, 1.0f};
  // (sums, whether the result buffer grows)
  for (const auto& [sums, grows] : std::vector<std::pair<std::vector<float>, bool>>{
           {small, true}, {small, false}, {large, true}, {small, false}}) {
    const auto tokens = static_cast<int64_t>(sums.size());
    for (int32_t r = 0; r < 2; ++r) {
      RankReport report = Report(r, 1, sums, 1, 1);
      report.in_backend = true;
      report.device = r;
      ASSERT_TRUE(join.Add(report, Expect(1, tokens, true)).ok());
    }
    const int before = stream_waits;
    ASSERT_TRUE(join.JoinOnDevice().ok());
    EXPECT_EQ(stream_waits - before, grows ? 1 : 0) << sums.size() << " tokens";
    join.Reset();
  }
  EXPECT_EQ(joiner.calls, 4);
}

}  // namespace
}  // namespace kvcm

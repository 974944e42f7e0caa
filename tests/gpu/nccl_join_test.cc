// The tensor-parallel join on the GPUs (NcclCommunicator, one rank per device) against the
// host join: with 1, 2, 4 and 8 ranks (as many as this machine has GPUs; NCCL runs one rank
// per device) the root's joined scores, whichever rank is the root, equal
// kernels::cpu::JoinRankPartials bit for bit, also on wide-range partials whose sum depends
// on the order of the ranks; a sequence stepped with them decides exactly like the host
// join; and the daemon's joiner (NcclCrossDeviceJoiner) finishes on its own streams while
// the engine's stream of a device is held up.
#include "kernels/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cache_manager/table/sequence_table.h"
#include "cache_manager/tp/nccl_cross_device_join.h"
#include "cache_manager/tp/tensor_parallel_join.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/half_float.h"
#include "kernels/momentum_update.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/cache_manager/tp/wide_range_partials.h"
#include "tests/gpu/rank_join_fixture.h"

namespace kvcm {
namespace {

using kernels::ScoreDtype;
using kernels::ScoreMatrix;
using kernels::cuda::JoinRoot;
using kernels::cuda::NcclCommunicator;
using kernels::cuda::RankJoinBuffers;
using kernels::cuda::ScopedDevice;
using testing::DeviceArray;
using testing::HeadRows;

constexpr int64_t kPad = 2;  // partial sums are sent with layer_stride = tokens + kPad

TEST(NcclCommunicatorTest, RejectsARepeatedOrMissingDevice) {
  // Checked before NCCL is touched: runs without a GPU.
  EXPECT_EQ(NcclCommunicator::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create({0, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create({1 << 20}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// One rank's device buffers, allocated on its device.
struct RankState {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  std::unique_ptr<DeviceArray<uint8_t>> partial;
  std::unique_ptr<DeviceArray<uint8_t>> staging;
  std::unique_ptr<DeviceArray<uint8_t>> gathered;
  std::unique_ptr<DeviceArray<float>> joined;
  std::vector<uint8_t> host_partial;  // what was uploaded
  ScoreMatrix host_view;
  ScoreMatrix device_view;
};

class NcclJoinTest : public ::testing::TestWithParam<int32_t> {
 protected:
  void SetUp() override {
    KVCM_SKIP_WITHOUT_GPU();
    const int devices = testing::GpuCountOrFail();
    if (devices < ranks()) {
      GTEST_SKIP() << ranks() << " ranks need " << ranks()
                   << " GPUs (NCCL runs one rank per device); this machine has " << devices;
    }
    std::vector<int> ids(static_cast<size_t>(ranks()));
    std::iota(ids.begin(), ids.end(), 0);
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm = NcclCommunicator::Create(ids);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(comm).value();
    state_.resize(static_cast<size_t>(ranks()));
    for (int32_t r = 0; r < ranks(); ++r) {
      ScopedDevice on(r);
      ASSERT_TRUE(on.status().ok()) << on.status();
      RankState& s = state_[static_cast<size_t>(r)];
      s.device = r;
      KVCM_ASSERT_CUDA(cudaStreamCreate(&s.stream));
      KVCM_ASSERT_CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }
  }

  void TearDown() override {
    for (RankState& s : state_) {
      ScopedDevice on(s.device);
      s.partial.reset();
      s.staging.reset();
      s.gathered.reset();
      s.joined.reset();
      if (s.done != nullptr) cudaEventDestroy(s.done);
      if (s.stream != nullptr) cudaStreamDestroy(s.stream);
    }
  }

  int32_t ranks() const { return GetParam(); }

  // Joins rank r's [layers, tokens] `sums[r]` (sent as `dtype`, with layer_stride =
  // tokens + kPad) onto `root` with NCCL and returns the root's joined scores;
  // `host_views` receives the uploaded partials.
  std::vector<float> JoinSums(const std::vector<std::vector<float>>& sums, int64_t layers,
                              int64_t tokens, ScoreDtype dtype, int32_t root,
                              int64_t total_heads, std::vector<ScoreMatrix>* host_views) {
    const int64_t stride = tokens + kPad;
    const size_t size = kernels::ScoreDtypeSize(dtype);
    const size_t n = static_cast<size_t>(layers * tokens);
    std::vector<RankJoinBuffers> buffers;
    std::vector<void*> done;
    host_views->clear();
    for (int32_t r = 0; r < ranks(); ++r) {
      RankState& s = state_[static_cast<size_t>(r)];
      const std::vector<float>& rank_sums = sums[static_cast<size_t>(r)];
      s.host_partial.assign(static_cast<size_t>(layers * stride) * size, 0);
      for (int64_t l = 0; l < layers; ++l) {
        for (int64_t t = 0; t < tokens; ++t) {
          const float v = rank_sums[static_cast<size_t>(l * tokens + t)];
          uint8_t* at = s.host_partial.data() + static_cast<size_t>(l * stride + t) * size;
          if (dtype == ScoreDtype::kFloat32) {
            std::memcpy(at, &v, 4);
          } else {
            const uint16_t h = kernels::FloatToFloat16(v);
            std::memcpy(at, &h, 2);
          }
        }
      }
      ScopedDevice on(s.device);
      s.partial = std::make_unique<DeviceArray<uint8_t>>(s.host_partial);
      s.staging = std::make_unique<DeviceArray<uint8_t>>(n * size);
      s.gathered = std::make_unique<DeviceArray<uint8_t>>(static_cast<size_t>(ranks()) * n * 4);
      s.joined = std::make_unique<DeviceArray<float>>(n);
      s.host_view = ScoreMatrix{s.host_partial.data(), dtype, layers, tokens, stride};
      s.device_view = s.host_view;
      s.device_view.data = s.partial->get();
      host_views->push_back(s.host_view);
      buffers.push_back(RankJoinBuffers{s.device_view, s.staging->get(), s.stream, s.done});
      done.push_back(s.done);
    }
    RankState& at_root = state_[static_cast<size_t>(root)];
    const JoinRoot target{root, at_root.gathered->get(), at_root.joined->get()};
    const absl::Status status = comm_->JoinPartialSums(buffers, total_heads, target);
    EXPECT_TRUE(status.ok()) << status;
    const absl::Status waited = comm_->Wait(done, absl::Seconds(60));
    EXPECT_TRUE(waited.ok()) << waited;
    ScopedDevice on(at_root.device);
    return at_root.joined->Download();
  }

  // The head rows split among the ranks, as JoinSums takes them.
  std::vector<float> Join(const HeadRows& rows, ScoreDtype dtype, int32_t root,
                          std::vector<ScoreMatrix>* host_views) {
    const int64_t heads_per_rank = testing::kTotalHeads / ranks();
    std::vector<std::vector<float>> sums;
    for (int32_t r = 0; r < ranks(); ++r) {
      sums.push_back(testing::PartialSums(rows, r * heads_per_rank, heads_per_rank));
    }
    return JoinSums(sums, rows.layers, rows.tokens, dtype, root, testing::kTotalHeads,
                    host_views);
  }

  std::unique_ptr<NcclCommunicator> comm_;
  std::vector<RankState> state_;
};

TEST_P(NcclJoinTest, EveryRootGetsTheHostJoinBitForBit) {
  std::mt19937_64 rng(31);
  for (ScoreDtype dtype : {ScoreDtype::kFloat32, ScoreDtype::kFloat16}) {
    for (int64_t tokens : {1, 7, 111, 4096, 65537}) {
      SCOPED_TRACE(std::string(kernels::ScoreDtypeName(dtype)) + " tokens " + std::to_string(tokens));
      const HeadRows rows = testing::RandomHeadRows(rng, testing::kTotalHeads, testing::kJoinLayers, tokens);
      for (int32_t root = 0; root < ranks(); ++root) {
        std::vector<ScoreMatrix> host_views;
        const std::vector<float> joined = Join(rows, dtype, root, &host_views);
        std::vector<float> want(static_cast<size_t>(rows.layers * tokens));
        kernels::cpu::JoinRankPartials(host_views.data(), ranks(), testing::kTotalHeads,
                                       want.data(), nullptr);
        EXPECT_EQ(want, testing::PooledScores(rows));
        EXPECT_EQ(joined, want) << "root " << root;
      }
    }
  }
}

// Partials whose sum depends on the order of the ranks (tests/cache_manager/tp/
// wide_range_partials.h): the GPUs sum them in rank order, as the CPU joiner does, where
// an all-reduce would add them in NCCL's ring or tree order.
TEST_P(NcclJoinTest, WideRangePartialsJoinInRankOrderLikeTheCpuJoiner) {
  if (ranks() < 3) GTEST_SKIP() << "the order of 1 or 2 ranks cannot change a sum";
  constexpr int64_t kLayers = 3, kTokens = 2049;
  const std::vector<std::vector<float>> sums =
      testing::WideRangePartials(43, ranks(), kLayers * kTokens);
  const int64_t heads = 3 * ranks();
  std::vector<int32_t> order(static_cast<size_t>(ranks()));
  std::iota(order.begin(), order.end(), 0);
  const std::vector<float> want = testing::FoldInOrder(sums, order, heads);
  ASSERT_NE(testing::FoldInOrder(sums, {order.rbegin(), order.rend()}, heads), want);
  std::vector<ScoreMatrix> cpu_views;
  std::vector<int> devices;
  for (int32_t r = 0; r < ranks(); ++r) {
    cpu_views.push_back(ScoreMatrix::Dense(sums[static_cast<size_t>(r)].data(),
                                           ScoreDtype::kFloat32, kLayers, kTokens));
    devices.push_back(r);
  }
  std::vector<float> cpu(want.size());
  ASSERT_TRUE(CpuCrossDeviceJoiner().Join(cpu_views, devices, heads, 0, cpu.data()).ok());
  EXPECT_EQ(cpu, want);
  for (int32_t root : {0, ranks() - 1}) {
    std::vector<ScoreMatrix> host_views;
    EXPECT_EQ(JoinSums(sums, kLayers, kTokens, ScoreDtype::kFloat32, root, heads, &host_views), cpu)
        << "root " << root;
  }
  // The daemon's joiner, on the devices' memory.
  std::vector<std::unique_ptr<DeviceArray<float>>> on_device;
  std::vector<ScoreMatrix> device_views;
  for (int32_t r = 0; r < ranks(); ++r) {
    ScopedDevice on(r);
    on_device.push_back(std::make_unique<DeviceArray<float>>(sums[static_cast<size_t>(r)]));
    device_views.push_back(
        ScoreMatrix::Dense(on_device.back()->get(), ScoreDtype::kFloat32, kLayers, kTokens));
  }
  ScopedDevice on(0);
  DeviceArray<float> out(want.size());
  NcclCrossDeviceJoiner joiner(absl::Seconds(60));
  const absl::Status joined = joiner.Join(device_views, devices, heads, 0, out.get());
  ASSERT_TRUE(joined.ok()) << joined;
  EXPECT_EQ(out.Download(), cpu);
}

// The engine's stream of a device may be busy with other sequences' steps: the join runs
// on streams of its own and finishes within its timeout all the same.
TEST_P(NcclJoinTest, ABusyEngineStreamDoesNotHoldUpTheJoin) {
  constexpr int64_t kLayers = 2, kTokens = 333;
  std::vector<std::unique_ptr<DeviceArray<float>>> on_device;
  std::vector<ScoreMatrix> views;
  std::vector<int> devices;
  for (int32_t r = 0; r < ranks(); ++r) {
    ScopedDevice on(r);
    on_device.push_back(std::make_unique<DeviceArray<float>>(
        std::vector<float>(static_cast<size_t>(kLayers * kTokens), 0.25f * static_cast<float>(r + 1))));
    views.push_back(ScoreMatrix::Dense(on_device.back()->get(), ScoreDtype::kFloat32, kLayers, kTokens));
    devices.push_back(r);
  }
  ScopedDevice on(0);
  DeviceArray<float> out(static_cast<size_t>(kLayers * kTokens));
  // Hold the engine's stream of device 0 for 3 s: longer than the join's timeout.
  kernels::StreamHandle engine_stream = nullptr;
  ASSERT_TRUE(kernels::cuda::CudaBackend().mem.device_stream(0, &engine_stream).ok());
  KVCM_ASSERT_CUDA(cudaLaunchHostFunc(
      static_cast<cudaStream_t>(engine_stream),
      [](void*) { std::this_thread::sleep_for(std::chrono::seconds(3)); }, nullptr));
  NcclCrossDeviceJoiner joiner(absl::Seconds(1));
  const absl::Status joined = joiner.Join(views, devices, ranks(), 0, out.get());
  EXPECT_TRUE(joined.ok()) << joined;
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(engine_stream)), cudaErrorNotReady)
      << "the engine's stream was to be still busy";
  KVCM_ASSERT_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(engine_stream)));
  // sum over r of 0.25 (r + 1), divided by the ranks.
  const float want = static_cast<float>(0.25 * (ranks() + 1) * ranks() / 2 / ranks());
  EXPECT_EQ(out.Download(), std::vector<float>(out.size(), want));
}

TEST_P(NcclJoinTest, ASequenceSteppedWithTheGpuJoinDecidesLikeTheHostJoin) {
  constexpr int64_t kSteps = 40;
  constexpr uint64_t kSeed = 2718;
  for (const char* preset : testing::kJoinPresets) {
    SCOPED_TRACE(preset);
    SequenceTable table;
    ASSERT_TRUE(table.Open("gpu", testing::JoinTestSequence(preset)).ok());
    const std::vector<EvictionDecision> got = testing::RunJoinedSteps(
        preset, kSteps, kSeed, [&](int64_t step, const HeadRows* rows, EvictionDecision* d) {
          std::vector<float> scores;
          if (rows != nullptr) {
            std::vector<ScoreMatrix> host_views;
            scores = Join(*rows, ScoreDtype::kFloat32, ranks() - 1, &host_views);
          }
          return testing::StepWithScores(table, "gpu", step, rows, scores, d);
        });
    testing::ExpectSameDecisions(got, testing::ReferenceDecisions(preset, kSteps, kSeed));
  }
}

// The daemon's join of partial sums that sit one per rank on distinct GPUs (score regions
// created with a rank): TensorParallelJoin hands them to NcclCrossDeviceJoiner, whose
// result on the sequence's GPU (rank 0's) is the host join's, bit for bit; a second join
// reuses the clique.
TEST_P(NcclJoinTest, TheDaemonsJoinAcrossGpusEqualsTheHostJoin) {
  std::mt19937_64 rng(37);
  NcclCrossDeviceJoiner joiner(absl::Seconds(60));
  for (int64_t tokens : {5, 6401}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    const HeadRows rows =
        testing::RandomHeadRows(rng, testing::kTotalHeads, testing::kJoinLayers, tokens);
    const int64_t heads_per_rank = testing::kTotalHeads / ranks();
    TensorParallelJoin on_host(ranks());
    TensorParallelJoin on_gpus(ranks(), kernels::CpuBackend(), &kernels::cuda::CudaBackend(), 0,
                               &joiner);
    const JoinExpectation expect{"tp", 1, tokens, true};
    std::vector<std::vector<float>> sums;
    std::vector<std::unique_ptr<DeviceArray<float>>> on_device;
    for (int32_t r = 0; r < ranks(); ++r) {
      sums.push_back(testing::PartialSums(rows, r * heads_per_rank, heads_per_rank));
      ScopedDevice on(r);
      on_device.push_back(std::make_unique<DeviceArray<float>>(sums.back()));
    }
    KVCM_ASSERT_CUDA(cudaDeviceSynchronize());
    for (int32_t r = ranks() - 1; r >= 0; --r) {
      RankReport report;
      report.rank = r;
      report.step = 1;
      report.head_count = heads_per_rank;
      report.partial_sums = ScoreMatrix::Dense(sums[static_cast<size_t>(r)].data(),
                                               ScoreDtype::kFloat32, rows.layers, tokens);
      ASSERT_TRUE(on_host.Add(report, expect).ok());
      report.partial_sums.data = on_device[static_cast<size_t>(r)]->get();
      report.in_backend = true;
      report.device = r;
      const absl::Status added = on_gpus.Add(report, expect);
      ASSERT_TRUE(added.ok()) << added;
    }
    const ScoreMatrix want = on_host.Join();
    absl::StatusOr<ScoreMatrix> joined = on_gpus.JoinOnDevice();
    ASSERT_TRUE(joined.ok()) << joined.status();
    ScopedDevice on(0);
    KVCM_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> got(static_cast<size_t>(rows.layers * tokens));
    KVCM_ASSERT_CUDA(cudaMemcpy(got.data(), joined->data, got.size() * sizeof(float),
                                cudaMemcpyDeviceToHost));
    const float* w = static_cast<const float*>(want.data);
    EXPECT_EQ(got, std::vector<float>(w, w + got.size()));
  }
}

TEST_P(NcclJoinTest, WaitRefusesTheWrongNumberOfEvents) {
  std::vector<void*> too_few(static_cast<size_t>(ranks()) - 1);
  EXPECT_EQ(comm_->Wait(too_few, absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(NcclJoinTest, RejectsAJoinWithoutEveryRankOrARoot) {
  std::vector<RankJoinBuffers> too_many(static_cast<size_t>(ranks()) + 1);
  EXPECT_EQ(comm_->JoinPartialSums(too_many, testing::kTotalHeads, JoinRoot{}).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<RankJoinBuffers> right(static_cast<size_t>(ranks()));
  EXPECT_EQ(comm_->JoinPartialSums(right, 0, JoinRoot{}).code(),
            absl::StatusCode::kInvalidArgument);
  JoinRoot outside;
  outside.rank = ranks();
  EXPECT_EQ(comm_->JoinPartialSums(right, testing::kTotalHeads, outside).code(),
            absl::StatusCode::kInvalidArgument);
}

// Named by rank count (".../ranks2"): tests/gpu/run.sh lets exactly the cases that need
// more GPUs than the machine has skip.
INSTANTIATE_TEST_SUITE_P(Ranks, NcclJoinTest, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int32_t>& param_info) {
                           return "ranks" + std::to_string(param_info.param);
                         });

}  // namespace
}  // namespace kvcm

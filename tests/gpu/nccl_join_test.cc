// The tensor-parallel join on the GPUs (NcclCommunicator, one rank per device) against the
// host join: with 1, 2, 4 and 8 ranks (as many as this machine has GPUs; NCCL runs one rank
// per device) every rank's joined scores equal kernels::cpu::JoinRankPartials bit for bit,
// and a sequence stepped with them decides exactly like the host join.
#include "kernels/cuda/nccl_communicator.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache_manager/table/sequence_table.h"
#include "cache_manager/tp/nccl_cross_device_join.h"
#include "cache_manager/tp/tensor_parallel_join.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/half_float.h"
#include "kernels/momentum_update.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/rank_join_fixture.h"

namespace kvcm {
namespace {

using kernels::ScoreDtype;
using kernels::ScoreMatrix;
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
  std::unique_ptr<DeviceArray<uint8_t>> partial;
  std::unique_ptr<DeviceArray<double>> workspace;
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
      state_[static_cast<size_t>(r)].device = r;
      KVCM_ASSERT_CUDA(cudaStreamCreate(&state_[static_cast<size_t>(r)].stream));
    }
  }

  void TearDown() override {
    for (RankState& s : state_) {
      ScopedDevice on(s.device);
      s.partial.reset();
      s.workspace.reset();
      s.joined.reset();
      if (s.stream != nullptr) cudaStreamDestroy(s.stream);
    }
  }

  int32_t ranks() const { return GetParam(); }

  // Splits `rows` among the ranks, joins the partial sums with NCCL and returns every
  // rank's joined [layers, tokens] scores; `host_views` receives the uploaded partials.
  std::vector<std::vector<float>> Join(const HeadRows& rows, ScoreDtype dtype,
                                       std::vector<ScoreMatrix>* host_views) {
    const int64_t heads_per_rank = testing::kTotalHeads / ranks();
    const int64_t stride = rows.tokens + kPad;
    const size_t size = kernels::ScoreDtypeSize(dtype);
    const size_t n = static_cast<size_t>(rows.layers * rows.tokens);
    std::vector<RankJoinBuffers> buffers;
    host_views->clear();
    for (int32_t r = 0; r < ranks(); ++r) {
      RankState& s = state_[static_cast<size_t>(r)];
      const std::vector<float> sums = testing::PartialSums(rows, r * heads_per_rank, heads_per_rank);
      s.host_partial.assign(static_cast<size_t>(rows.layers * stride) * size, 0);
      for (int64_t l = 0; l < rows.layers; ++l) {
        for (int64_t t = 0; t < rows.tokens; ++t) {
          const float v = sums[static_cast<size_t>(l * rows.tokens + t)];
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
      s.workspace = std::make_unique<DeviceArray<double>>(n);
      s.joined = std::make_unique<DeviceArray<float>>(n);
      s.host_view = ScoreMatrix{s.host_partial.data(), dtype, rows.layers, rows.tokens, stride};
      s.device_view = s.host_view;
      s.device_view.data = s.partial->get();
      host_views->push_back(s.host_view);
      buffers.push_back(RankJoinBuffers{s.device_view, s.workspace->get(), s.joined->get(), s.stream});
    }
    const absl::Status status = comm_->JoinPartialSums(buffers, testing::kTotalHeads);
    EXPECT_TRUE(status.ok()) << status;
    std::vector<kernels::StreamHandle> streams;
    for (const RankState& s : state_) streams.push_back(s.stream);
    const absl::Status waited = comm_->Wait(streams, absl::Seconds(60));
    EXPECT_TRUE(waited.ok()) << waited;
    std::vector<std::vector<float>> joined;
    for (RankState& s : state_) {
      ScopedDevice on(s.device);
      const absl::Status synced = kernels::cuda::SyncStatus(s.stream, "join");
      EXPECT_TRUE(synced.ok()) << synced;
      joined.push_back(s.joined->Download());
    }
    return joined;
  }

  std::unique_ptr<NcclCommunicator> comm_;
  std::vector<RankState> state_;
};

TEST_P(NcclJoinTest, EveryRankGetsTheHostJoinBitForBit) {
  std::mt19937_64 rng(31);
  for (ScoreDtype dtype : {ScoreDtype::kFloat32, ScoreDtype::kFloat16}) {
    for (int64_t tokens : {1, 7, 111, 4096, 65537}) {
      SCOPED_TRACE(std::string(kernels::ScoreDtypeName(dtype)) + " tokens " + std::to_string(tokens));
      const HeadRows rows = testing::RandomHeadRows(rng, testing::kTotalHeads, testing::kJoinLayers, tokens);
      std::vector<ScoreMatrix> host_views;
      const std::vector<std::vector<float>> joined = Join(rows, dtype, &host_views);
      std::vector<float> want(static_cast<size_t>(rows.layers * tokens));
      kernels::cpu::JoinRankPartials(host_views.data(), ranks(), testing::kTotalHeads,
                                     want.data(), nullptr);
      EXPECT_EQ(want, testing::PooledScores(rows));
      for (int32_t r = 0; r < ranks(); ++r) {
        EXPECT_EQ(joined[static_cast<size_t>(r)], want) << "rank " << r;
      }
    }
  }
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
            scores = Join(*rows, ScoreDtype::kFloat32, &host_views).front();
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

TEST_P(NcclJoinTest, WaitRefusesTheWrongNumberOfStreams) {
  std::vector<kernels::StreamHandle> too_few(static_cast<size_t>(ranks()) - 1);
  EXPECT_EQ(comm_->Wait(too_few, absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(NcclJoinTest, RejectsAJoinWithoutEveryRank) {
  std::vector<RankJoinBuffers> too_many(static_cast<size_t>(ranks()) + 1);
  EXPECT_EQ(comm_->JoinPartialSums(too_many, testing::kTotalHeads).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<RankJoinBuffers> right(static_cast<size_t>(ranks()));
  EXPECT_EQ(comm_->JoinPartialSums(right, 0).code(), absl::StatusCode::kInvalidArgument);
}

// Named by rank count (".../ranks2"): tests/gpu/run.sh lets exactly the cases that need
// more GPUs than the machine has skip.
INSTANTIATE_TEST_SUITE_P(Ranks, NcclJoinTest, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int32_t>& param_info) {
                           return "ranks" + std::to_string(param_info.param);
                         });

}  // namespace
}  // namespace kvcm

// Every golden vector through a real kvcached, from C++: single rank and tensor-parallel.
#include "clients/replay/grpc_backend.h"
#include "clients/replay/replay_run.h"
#include "gtest/gtest.h"
#include "tests/clients/golden.h"
#include "tests/server/daemon_process.h"

namespace kvcm {
namespace {

class GoldenThroughDaemonTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    auto d = testing::DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(daemon_->SignalAndWait(SIGTERM, absl::Seconds(30)), 0);
    delete daemon_;
  }
  static testing::DaemonProcess* daemon_;
};
testing::DaemonProcess* GoldenThroughDaemonTest::daemon_ = nullptr;

TEST_P(GoldenThroughDaemonTest, MatchesExactlyAloneAndAcrossRanks) {
  const std::string want =
      testing::ReadFile(testing::GoldenDir() + "/" + GetParam() + ".decisions.jsonl");
  for (int32_t tp : {1, 2, 4}) {
    replay::ReplayOptions options;
    options.trace_path = testing::GoldenDir() + "/" + GetParam() + ".trace.jsonl";
    options.sequence_id = GetParam() + "-tp" + std::to_string(tp);
    options.tp_ranks = tp;
    std::ostringstream out;
    options.decisions = &out;
    auto backend = replay::NewGrpcBackend(daemon_->grpc_address());
    ASSERT_TRUE(backend.ok()) << backend.status();
    absl::StatusOr<replay::ReplaySummary> summary = replay::RunReplay(options, **backend);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(out.str(), want) << "tp " << tp;
  }
}

INSTANTIATE_TEST_SUITE_P(AllGoldenVectors, GoldenThroughDaemonTest,
                         ::testing::ValuesIn(testing::GoldenNames()),
                         [](const auto& test_param) { return test_param.param; });

}  // namespace
}  // namespace kvcm

// Every golden vector through a real kvcached, from C++: single rank and tensor-parallel,
// with the scores inline (grpc) and in shared-memory score regions (shm), per-layer and
// folded, and with one or several engine threads.
#include <csignal>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "clients/replay/grpc_backend.h"
#include "clients/replay/replay_run.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/clients/golden.h"
#include "tests/server/daemon_process.h"

namespace kvcm {
namespace {

using replay::ScoreTransport;
using ::testing::HasSubstr;

struct Replay {
  std::string golden;
  std::string sequence_id;
  int32_t tp = 1;
  bool folded = false;
  bool momentum = false;
  std::string dir = testing::GoldenDir();  // where the trace lies
};

// The decisions (JSON Lines) of one replay of a golden trace through `backend`.
absl::StatusOr<std::string> RunGolden(const Replay& r, replay::ReplayBackend& backend) {
  replay::ReplayOptions options;
  options.trace_path = r.dir + "/" + r.golden + ".trace.jsonl";
  options.sequence_id = r.sequence_id;
  options.tp_ranks = r.tp;
  options.folded = r.folded;
  options.with_momentum = r.momentum;
  std::ostringstream out;
  options.decisions = &out;
  RETURN_IF_ERROR(replay::RunReplay(options, backend).status());
  return out.str();
}

absl::StatusOr<std::string> RunGoldenThroughDaemon(const Replay& r, const std::string& address,
                                                   ScoreTransport transport) {
  ASSIGN_OR_RETURN(std::unique_ptr<replay::ReplayBackend> backend,
                   replay::NewGrpcBackend({.address = address, .transport = transport}));
  return RunGolden(r, *backend);
}

std::string Want(const std::string& golden, const std::string& dir = testing::GoldenDir()) {
  return testing::ReadFile(dir + "/" + golden + ".decisions.jsonl");
}

class GoldenThroughDaemonTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    auto d = testing::DaemonProcess::Start({"--allow_shm_scores"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(daemon_->SignalAndWait(SIGTERM, absl::Seconds(30)), 0);
    delete daemon_;
  }

  // Score bytes the daemon received over `transport`, so far.
  static double ScoreBytes(ScoreTransport transport) {
    absl::StatusOr<std::string> text = testing::HttpGet(daemon_->metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return testing::MetricValue(
        text.ok() ? *text : "",
        absl::StrCat(R"(kvcache_score_bytes_total{dtype="float32",transport=")",
                     MetricTransport(transport), R"("})"));
  }
  // The metric's transport label: a created region is a region like a registered one.
  static absl::string_view MetricTransport(ScoreTransport transport) {
    return transport == ScoreTransport::kGrpc ? "grpc" : "shm";
  }

  static testing::DaemonProcess* daemon_;
};
testing::DaemonProcess* GoldenThroughDaemonTest::daemon_ = nullptr;

TEST_P(GoldenThroughDaemonTest, MatchesExactlyOverEveryTransportAloneAndAcrossRanks) {
  const std::string want = Want(GetParam());
  double grpc_bytes = 0;  // what the grpc runs sent inline; the region runs must send as much
  for (ScoreTransport transport : {ScoreTransport::kGrpc, ScoreTransport::kShm,
                                   ScoreTransport::kCreated, ScoreTransport::kCreatedPerRank}) {
    const double inline_before = ScoreBytes(ScoreTransport::kGrpc);
    const double shm_before = ScoreBytes(ScoreTransport::kShm);
    for (int32_t tp : {1, 2, 4}) {
      const Replay r{.golden = GetParam(),
                     .sequence_id = absl::StrCat(GetParam(), "-tp", tp, "-",
                                                 replay::ScoreTransportName(transport)),
                     .tp = tp};
      absl::StatusOr<std::string> got =
          RunGoldenThroughDaemon(r, daemon_->grpc_address(), transport);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, want) << "tp " << tp << ", transport "
                            << replay::ScoreTransportName(transport);
    }
    const double inline_sent = ScoreBytes(ScoreTransport::kGrpc) - inline_before;
    const double shm_sent = ScoreBytes(ScoreTransport::kShm) - shm_before;
    if (transport == ScoreTransport::kGrpc) {
      EXPECT_EQ(shm_sent, 0);
      grpc_bytes = inline_sent;
    } else {
      // Every score byte went through the regions, none inline.
      EXPECT_EQ(inline_sent, 0);
      EXPECT_EQ(shm_sent, grpc_bytes);
    }
  }
}

// The folded layout over the daemon decides exactly as the embedded engine folds.
TEST_P(GoldenThroughDaemonTest, FoldedDecidesLikeTheEmbeddedEngineFolded) {
  for (int32_t tp : {1, 2}) {
    Replay r{.golden = GetParam(), .sequence_id = "", .tp = tp, .folded = true, .momentum = true};
    std::unique_ptr<replay::ReplayBackend> embedded = replay::NewEmbeddedBackend();
    r.sequence_id = absl::StrCat(GetParam(), "-folded-embedded-tp", tp);
    absl::StatusOr<std::string> want = RunGolden(r, *embedded);
    ASSERT_TRUE(want.ok()) << want.status();
    for (ScoreTransport transport :
         {ScoreTransport::kGrpc, ScoreTransport::kShm, ScoreTransport::kCreated}) {
      r.sequence_id = absl::StrCat(GetParam(), "-folded-tp", tp, "-",
                                   replay::ScoreTransportName(transport));
      absl::StatusOr<std::string> got =
          RunGoldenThroughDaemon(r, daemon_->grpc_address(), transport);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, *want) << "tp " << tp << ", transport "
                             << replay::ScoreTransportName(transport);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllGoldenVectors, GoldenThroughDaemonTest,
                         ::testing::ValuesIn(testing::GoldenNames()),
                         [](const auto& test_param) { return test_param.param; });

// Span pooling (SPEC.md, "Span pooling") through the daemon: the policy's span_pool crosses
// the wire, and every span-pooled golden decides exactly as the float64 model did, alone
// and across ranks (the daemon pools the joined rows), inline and through score regions,
// on the CPU engine and on the device path (the emulated device); folded, as the embedded
// engine folds.
TEST(GoldenSpanPoolDaemonTest, MatchesTheSpanPoolGoldenVectorsOnEveryEngine) {
  const std::string dir = testing::SpanPoolGoldenDir();
  std::unique_ptr<replay::ReplayBackend> embedded = replay::NewEmbeddedBackend();
  for (const char* engine : {"cpu", "emulated"}) {
    auto daemon = testing::DaemonProcess::Start(
        {absl::StrCat("--engine_backend=", engine), "--allow_shm_scores"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    for (const std::string& golden : testing::GoldenNames(dir)) {
      for (int32_t tp : {1, 2}) {
        for (ScoreTransport transport : {ScoreTransport::kGrpc, ScoreTransport::kCreated}) {
          const Replay r{.golden = golden,
                         .sequence_id = absl::StrCat(golden, "-", engine, "-tp", tp, "-",
                                                     replay::ScoreTransportName(transport)),
                         .tp = tp, .dir = dir};
          absl::StatusOr<std::string> got =
              RunGoldenThroughDaemon(r, (*daemon)->grpc_address(), transport);
          ASSERT_TRUE(got.ok()) << r.sequence_id << ": " << got.status();
          EXPECT_EQ(*got, Want(golden, dir)) << r.sequence_id;
        }
      }
      Replay folded{.golden = golden, .sequence_id = absl::StrCat(golden, "-", engine, "-folded"),
                    .folded = true, .momentum = true, .dir = dir};
      absl::StatusOr<std::string> want = RunGolden(folded, *embedded);
      absl::StatusOr<std::string> got =
          RunGoldenThroughDaemon(folded, (*daemon)->grpc_address(), ScoreTransport::kGrpc);
      ASSERT_TRUE(want.ok() && got.ok()) << want.status() << " " << got.status();
      EXPECT_EQ(*got, *want) << folded.sequence_id;
    }
    EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(30)), 0);
  }
}

TEST(GoldenShmTransportTest, NeedsADaemonThatAllowsShmScores) {
  auto daemon = testing::DaemonProcess::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  absl::StatusOr<std::string> got = RunGoldenThroughDaemon(
      {.golden = "ema_every_step", .sequence_id = "shm-refused"}, (*daemon)->grpc_address(),
      ScoreTransport::kShm);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("ema_every_step.trace.jsonl:2:"));
  EXPECT_THAT(got.status().message(), HasSubstr("--allow_shm_scores"));
}

// kvcached --engine_backend=emulated: every sequence's momentum and positions take the
// device-resident code path (explicit copies, double buffer, staged decisions; GPU.md) on
// the CPU's emulated device, which is what --backend=cuda runs on a GPU. Every golden, alone
// and across ranks, inline and through score regions, per layer and folded: the same
// decisions as the CPU engine, and the same momentum bits.
TEST(GoldenDeviceEngineTest, TheDevicePathDecidesLikeTheCpuEngine) {
  auto daemon = testing::DaemonProcess::Start({"--engine_backend=emulated", "--allow_shm_scores"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_THAT((*daemon)->Log(), HasSubstr("engine cpu-emulated-device"));
  std::unique_ptr<replay::ReplayBackend> embedded = replay::NewEmbeddedBackend();
  for (const std::string& golden : testing::GoldenNames()) {
    for (int32_t tp : {1, 2}) {
      for (bool folded : {false, true}) {
        Replay r{.golden = golden, .sequence_id = "", .tp = tp, .folded = folded, .momentum = true};
        r.sequence_id = absl::StrCat(golden, "-cpu-tp", tp, folded ? "-folded" : "");
        absl::StatusOr<std::string> want = RunGolden(r, *embedded);
        ASSERT_TRUE(want.ok()) << want.status();
        // kCreated: the daemon's regions are the emulated device's memory, which the
        // engine reads in place (ScoreSpace::kBackend), as a CUDA engine its GPU regions.
        // kCreatedPerRank: each rank's region on a device of its own, the partial sums
        // joined across the devices (the CPU twins of the NCCL join).
        for (ScoreTransport transport : {ScoreTransport::kGrpc, ScoreTransport::kShm,
                                         ScoreTransport::kCreated,
                                         ScoreTransport::kCreatedPerRank}) {
          r.sequence_id = absl::StrCat(golden, "-device-tp", tp, folded ? "-folded-" : "-",
                                       replay::ScoreTransportName(transport));
          absl::StatusOr<std::string> got =
              RunGoldenThroughDaemon(r, (*daemon)->grpc_address(), transport);
          ASSERT_TRUE(got.ok()) << r.sequence_id << ": " << got.status();
          EXPECT_EQ(*got, *want) << r.sequence_id;
        }
      }
      // And the decisions alone are the golden file's.
      Replay plain{.golden = golden, .sequence_id = absl::StrCat(golden, "-device-plain-tp", tp),
                   .tp = tp};
      absl::StatusOr<std::string> got =
          RunGoldenThroughDaemon(plain, (*daemon)->grpc_address(), ScoreTransport::kGrpc);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, Want(golden)) << plain.sequence_id;
    }
  }
  EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(30)), 0);
}

// --engine_backend=cuda where no GPU is visible (or CUDA was not built) refuses to start,
// saying why, rather than deciding on the CPU behind the operator's back.
TEST(GoldenDeviceEngineTest, CudaEngineWithoutAGpuRefusesToStart) {
  auto daemon = testing::DaemonProcess::Start({"--engine_backend=cuda"});
  if (daemon.ok()) {
    // A machine with a GPU: it started on it; nothing more to check here (tests/gpu does).
    EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(30)), 0);
    GTEST_SKIP() << "a CUDA device is visible";
  }
  EXPECT_THAT(daemon.status().message(), HasSubstr("--engine_backend=cuda"));
}

// Every golden at 1, 2 and 4 ranks, all at once, through daemons with one and with three
// engine threads: the sequences share the threads, each stays pinned to one, and each
// one's steps are decided in order (every decision exact).
TEST(GoldenEngineThreadsTest, PinningKeepsEverySequencesOrder) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(absl::StrCat("--engine_threads=", threads));
    auto daemon = testing::DaemonProcess::Start({absl::StrCat("--engine_threads=", threads)});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    std::vector<Replay> replays;
    for (const std::string& golden : testing::GoldenNames()) {
      for (int32_t tp : {1, 2, 4}) {
        replays.push_back(
            {.golden = golden, .sequence_id = absl::StrCat(golden, "-tp", tp), .tp = tp});
      }
    }
    std::vector<absl::StatusOr<std::string>> got(replays.size(), std::string());
    std::vector<std::thread> workers;
    for (size_t i = 0; i < replays.size(); ++i) {
      workers.emplace_back([&, i] {
        got[i] = RunGoldenThroughDaemon(replays[i], (*daemon)->grpc_address(),
                                        ScoreTransport::kGrpc);
      });
    }
    for (std::thread& w : workers) w.join();
    for (size_t i = 0; i < replays.size(); ++i) {
      ASSERT_TRUE(got[i].ok()) << replays[i].sequence_id << ": " << got[i].status();
      EXPECT_EQ(*got[i], Want(replays[i].golden)) << replays[i].sequence_id;
    }
    EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(30)), 0);
  }
}

}  // namespace
}  // namespace kvcm

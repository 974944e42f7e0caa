// Every golden vector through the replay library, exactly, alone and through the
// tensor-parallel join; and the momentum output's consistency.
#include <sstream>
#include <string>

#include "absl/strings/str_split.h"
#include "clients/replay/replay_backend.h"
#include "clients/replay/replay_run.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/clients/golden.h"

namespace kvcm::replay {
namespace {

using ::kvcm::testing::GoldenDir;
using ::kvcm::testing::GoldenNames;
using ::kvcm::testing::ReadFile;

std::string Replay(const std::string& name, int32_t tp, bool momentum = false,
                   const std::string& dir = GoldenDir()) {
  ReplayOptions options;
  options.trace_path = dir + "/" + name + ".trace.jsonl";
  options.tp_ranks = tp;
  options.with_momentum = momentum;
  std::ostringstream out;
  options.decisions = &out;
  auto backend = NewEmbeddedBackend();
  absl::StatusOr<ReplaySummary> summary = RunReplay(options, *backend);
  EXPECT_TRUE(summary.ok()) << summary.status();
  return out.str();
}

TEST(GoldenTest, ThereAreGoldenVectors) { EXPECT_GE(GoldenNames().size(), 10u); }

class GoldenReplayTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenReplayTest, ReproducesTheDecisionsExactly) {
  const std::string want = ReadFile(GoldenDir() + "/" + GetParam() + ".decisions.jsonl");
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(Replay(GetParam(), 1), want);
}

TEST_P(GoldenReplayTest, TensorParallelJoinGivesTheSameDecisions) {
  const std::string want = ReadFile(GoldenDir() + "/" + GetParam() + ".decisions.jsonl");
  for (int32_t tp : {2, 3, 4, 8}) EXPECT_EQ(Replay(GetParam(), tp), want) << "tp " << tp;
}

TEST_P(GoldenReplayTest, MomentumOutputDescribesTheCacheAfterEachStep) {
  const std::string plain = Replay(GetParam(), 1);
  const std::string with_momentum = Replay(GetParam(), 1, /*momentum=*/true);
  std::vector<std::string> a = absl::StrSplit(plain, '\n', absl::SkipEmpty());
  std::vector<std::string> b = absl::StrSplit(with_momentum, '\n', absl::SkipEmpty());
  ASSERT_EQ(a.size(), b.size());
  std::vector<int64_t> cache;  // replayed from the decisions alone
  const std::string trace = ReadFile(GoldenDir() + "/" + GetParam() + ".trace.jsonl");
  const auto header = nlohmann::json::parse(trace.substr(0, trace.find('\n')));
  const int64_t prefill = header["prefill_len"].get<int64_t>();
  for (int64_t p = 0; p < prefill; ++p) cache.push_back(p);
  for (size_t i = 0; i < a.size(); ++i) {
    const auto x = nlohmann::json::parse(a[i]);
    const auto y = nlohmann::json::parse(b[i]);
    for (const char* key : {"step", "evicted", "cache_size", "next_needs_scores"}) {
      ASSERT_EQ(x[key], y[key]) << key;
    }
    cache.push_back(prefill + x["step"].get<int64_t>() - 1);
    for (int64_t e : x["evicted"].get<std::vector<int64_t>>()) {
      cache.erase(std::find(cache.begin(), cache.end(), e));
    }
    const auto positions = y["momentum"]["positions"].get<std::vector<int64_t>>();
    const auto values = y["momentum"]["values"].get<std::vector<double>>();
    EXPECT_EQ(positions, cache) << "step " << x["step"];
    EXPECT_EQ(values.size(), positions.size());
    for (double v : values) EXPECT_GE(v, 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllGoldenVectors, GoldenReplayTest, ::testing::ValuesIn(GoldenNames()),
                         [](const auto& test_param) { return test_param.param; });

// Span pooling (SPEC.md, "Span pooling"): the header's span_pool reaches the engine, which
// pools the joined rows, so the decisions are those of the float64 model at every rank count.
class SpanPoolGoldenReplayTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpanPoolGoldenReplayTest, ReproducesTheDecisionsExactlyAloneAndJoined) {
  const std::string dir = ::kvcm::testing::SpanPoolGoldenDir();
  const std::string want = ReadFile(dir + "/" + GetParam() + ".decisions.jsonl");
  ASSERT_FALSE(want.empty());
  for (int32_t tp : {1, 2, 3}) {
    EXPECT_EQ(Replay(GetParam(), tp, /*momentum=*/false, dir), want) << "tp " << tp;
  }
}

INSTANTIATE_TEST_SUITE_P(AllSpanPoolVectors, SpanPoolGoldenReplayTest,
                         ::testing::ValuesIn(GoldenNames(::kvcm::testing::SpanPoolGoldenDir())),
                         [](const auto& test_param) { return test_param.param; });

TEST(ReplaySummaryTest, CountsScoringSkippedAndIgnoredSteps) {
  ReplayOptions options;
  options.trace_path = GoldenDir() + "/ema_lazy4.trace.jsonl";
  auto backend = NewEmbeddedBackend();
  absl::StatusOr<ReplaySummary> s = RunReplay(options, *backend);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->budget, 50);
  EXPECT_EQ(s->final_cache_size, 50);
  EXPECT_EQ(s->stats.scoring_steps + s->stats.skipped_scoring_steps, s->stats.steps);
  EXPECT_EQ(s->stats.scoring_steps, (s->stats.steps + 3) / 4);
  const std::string table = FormatSummaryTable({*s});
  EXPECT_NE(table.find("ema_lazy4"), std::string::npos);
}

}  // namespace
}  // namespace kvcm::replay

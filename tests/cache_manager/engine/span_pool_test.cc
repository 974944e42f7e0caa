// Span pooling in the engine (docs/SPEC.md, "Span pooling"): the policy's validation, a
// pooled step equal to an unpooled step fed the rows pooled by the definition, a needle
// that survives whole only with pooling, invalid scores judged as received, the emulated
// device path, and the golden vectors of tests/data/golden_span_pool reproduced exactly.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/engine/sequence.h"
#include "clients/replay/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "nlohmann/json.hpp"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/clients/golden.h"

namespace kvcm {
namespace {

using ::kvcm::testing::DenseScores;
using ::kvcm::testing::GoldenNames;
using ::kvcm::testing::Layers;
using ::kvcm::testing::SpanPoolGoldenDir;
using ::kvcm::testing::StepWith;
using ::testing::HasSubstr;

SequenceOptions Options(Aggregation aggregation, Refresh refresh, int64_t span_pool,
                        int64_t prefill = 40, int64_t budget = 12) {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = BudgetSpec::Tokens(budget);
  o.policy.aggregation = aggregation;
  o.policy.refresh = refresh;
  o.policy.span_pool = span_pool;
  return o;
}

std::unique_ptr<Sequence> CreateOrDie(const SequenceOptions& options) {
  absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("s", options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// The definition read literally: each entry the max over entries within (k-1)/2 positions.
Layers PlainPool(const Layers& rows, const std::vector<int64_t>& positions, int64_t k) {
  Layers out = rows;
  const int64_t half = (k - 1) / 2;
  for (size_t l = 0; l < rows.size(); ++l) {
    for (size_t i = 0; i < positions.size(); ++i) {
      for (size_t j = 0; j < positions.size(); ++j) {
        if (std::llabs(positions[j] - positions[i]) <= half) {
          out[l][i] = std::max(out[l][i], rows[l][j]);
        }
      }
    }
  }
  return out;
}

// The cache a step's scores cover: the cached positions, then the new token.
std::vector<int64_t> StepPositions(const Sequence& s, int64_t step) {
  std::vector<int64_t> p(s.state().positions().begin(), s.state().positions().end());
  p.push_back(s.prefill_len() + step - 1);
  return p;
}

// ---------------------------------------------------------------------------------------
// Validation.

TEST(SpanPoolPolicyTest, OffAndOddWidthsFrom3To255AreAccepted) {
  for (int64_t k : {0, 1, 3, 7, 255}) {
    EXPECT_TRUE(Sequence::Create("s", Options(Aggregation::kEma, Refresh::kEveryStep, k)).ok())
        << k;
  }
}

TEST(SpanPoolPolicyTest, EvenNegativeAndTooWideAreRefusedNamingTheField) {
  for (int64_t k : {-1, -3, 2, 4, 254, 256, 257, 1 << 20}) {
    absl::StatusOr<std::unique_ptr<Sequence>> s =
        Sequence::Create("s", Options(Aggregation::kEma, Refresh::kEveryStep, k));
    ASSERT_FALSE(s.ok()) << k;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr("policy.span_pool is " + std::to_string(k)));
  }
}

TEST(SpanPoolPolicyTest, AggregationsWithoutScoresRefuseIt) {
  for (Aggregation a : {Aggregation::kRecency, Aggregation::kRandom}) {
    absl::StatusOr<std::unique_ptr<Sequence>> s =
        Sequence::Create("s", Options(a, Refresh::kEveryStep, 3));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(),
                HasSubstr("policy.span_pool needs an aggregation that reads scores"));
    // Off is fine with them.
    EXPECT_TRUE(Sequence::Create("s", Options(a, Refresh::kEveryStep, 1)).ok());
  }
}

TEST(SpanPoolPolicyTest, APresetKeepsTheRequestsSpanPool) {
  SequenceOptions o = testing::PresetOptions(40, 12, "inertia_lazy4");
  o.policy.span_pool = 7;
  std::unique_ptr<Sequence> s = CreateOrDie(o);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->policy().span_pool, 7);
  EXPECT_EQ(s->policy().refresh, Refresh::kLazy);
  EXPECT_THAT(s->policy().DebugString(), HasSubstr("span_pool=7"));
  o.preset = "streaming_llm";  // recency: no scores to pool
  EXPECT_FALSE(Sequence::Create("s", o).ok());
}

// ---------------------------------------------------------------------------------------
// The step.

struct EquivalenceCase {
  Aggregation aggregation;
  Refresh refresh;
  int64_t k;
  int64_t layers;
};

// Pooling inside the engine equals pooling by the definition outside it: same decisions,
// same momentum bits, step after step (the cache gains gaps as it evicts).
void ExpectPooledEqualsPrePooled(const EquivalenceCase& c, const kernels::KernelBackend& backend) {
  SequenceOptions pooled_options = Options(c.aggregation, c.refresh, c.k, 60, 15);
  pooled_options.backend = &backend;
  std::unique_ptr<Sequence> pooled = CreateOrDie(pooled_options);
  std::unique_ptr<Sequence> plain = CreateOrDie(Options(c.aggregation, c.refresh, 0, 60, 15));
  ASSERT_TRUE(pooled != nullptr && plain != nullptr);
  std::mt19937_64 rng(static_cast<uint64_t>(c.k * 10 + c.layers));
  for (int64_t step = 1; step <= 30; ++step) {
    SCOPED_TRACE(absl::StrCat("k ", c.k, " step ", step));
    const std::vector<int64_t> positions = StepPositions(*plain, step);
    Layers rows;
    if (plain->next_needs_scores()) {
      rows = testing::RandomLayers(rng, c.layers, static_cast<int64_t>(positions.size()),
                                   /*ties=*/step % 3 == 0);
    }
    EvictionDecision a, b;
    ASSERT_TRUE(StepWith(*pooled, step, rows, &a).ok());
    const Layers pre_pooled = rows.empty() ? rows : PlainPool(rows, positions, c.k);
    ASSERT_TRUE(StepWith(*plain, step, pre_pooled, &b).ok());
    ASSERT_EQ(a.evicted, b.evicted);
    ASSERT_EQ(a.next_needs_scores, b.next_needs_scores);
    const auto ma = pooled->state().momentum();
    const auto mb = plain->state().momentum();
    ASSERT_EQ(std::vector<float>(ma.begin(), ma.end()), std::vector<float>(mb.begin(), mb.end()));
  }
}

TEST(SpanPoolStepTest, APooledStepEqualsAnUnpooledStepFedThePooledRows) {
  for (const EquivalenceCase& c :
       {EquivalenceCase{Aggregation::kEma, Refresh::kEveryStep, 3, 3},
        EquivalenceCase{Aggregation::kEma, Refresh::kLazy, 7, 2},
        EquivalenceCase{Aggregation::kCumulative, Refresh::kEveryStep, 15, 2},
        EquivalenceCase{Aggregation::kSingleStep, Refresh::kEveryStep, 5, 4},
        EquivalenceCase{Aggregation::kEma, Refresh::kScoreFree, 255, 1}}) {
    ExpectPooledEqualsPrePooled(c, kernels::CpuBackend());
    ExpectPooledEqualsPrePooled(c, kernels::EmulatedDeviceBackend());
  }
}

TEST(SpanPoolStepTest, AFoldedSequencePoolsItsOneRow) {
  SequenceOptions folded = Options(Aggregation::kEma, Refresh::kEveryStep, 5, 30, 10);
  folded.score_layout = ScoreLayout::kFolded;
  folded.layers = 4;
  SequenceOptions plain_options = folded;
  plain_options.policy.span_pool = 0;
  std::unique_ptr<Sequence> pooled = CreateOrDie(folded);
  std::unique_ptr<Sequence> plain = CreateOrDie(plain_options);
  ASSERT_TRUE(pooled != nullptr && plain != nullptr);
  std::mt19937_64 rng(5);
  for (int64_t step = 1; step <= 12; ++step) {
    const std::vector<int64_t> positions = StepPositions(*plain, step);
    const Layers row = testing::RandomLayers(rng, 1, static_cast<int64_t>(positions.size()), false);
    EvictionDecision a, b;
    ASSERT_TRUE(StepWith(*pooled, step, row, &a).ok());
    ASSERT_TRUE(StepWith(*plain, step, PlainPool(row, positions, 5), &b).ok());
    ASSERT_EQ(a.evicted, b.evicted) << "step " << step;
  }
}

// Only the needle's first token is attended; pooling keeps its whole span, the plain
// policy keeps the first token and loses the rest to the background.
std::vector<int64_t> NeedleSurvivors(int64_t k) {
  std::unique_ptr<Sequence> s =
      CreateOrDie(Options(Aggregation::kEma, Refresh::kEveryStep, k, 64, 16));
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t step = 1; step <= 10; ++step) {
    const std::vector<int64_t> positions = StepPositions(*s, step);
    std::vector<float> row;
    for (int64_t p : positions) {
      row.push_back(p == 30 ? 1.0f : (p > 30 && p < 35 ? 0.0001f : 0.1f * u(rng)));
    }
    EvictionDecision d;
    EXPECT_TRUE(StepWith(*s, step, {row}, &d).ok());
  }
  std::vector<int64_t> needle;
  for (int64_t p : s->state().positions()) {
    if (p >= 30 && p < 35) needle.push_back(p);
  }
  return needle;
}

TEST(SpanPoolStepTest, ANeedleWhoseFirstTokenIsAttendedSurvivesWhole) {
  EXPECT_EQ(NeedleSurvivors(9), (std::vector<int64_t>{30, 31, 32, 33, 34}));
  EXPECT_EQ(NeedleSurvivors(0), (std::vector<int64_t>{30}));
}

TEST(SpanPoolStepTest, AnInvalidReceivedScoreRejectsTheStepAndIsNamed) {
  std::unique_ptr<Sequence> s =
      CreateOrDie(Options(Aggregation::kEma, Refresh::kEveryStep, 7, 10, 6));
  ASSERT_NE(s, nullptr);
  // A negative score next to a large one: pooling would hide it, validation must not.
  std::vector<float> row(11, 0.5f);
  row[4] = -0.25f;
  EvictionDecision d;
  const absl::Status st = StepWith(*s, 1, {row}, &d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("position 4"));
  EXPECT_EQ(s->state().size(), 10);  // unchanged
  EXPECT_EQ(s->last_step(), 0);
  row[4] = 0.0f;
  EXPECT_TRUE(StepWith(*s, 1, {row}, &d).ok());
}

// ---------------------------------------------------------------------------------------
// The golden vectors of span pooling, stepped through a Sequence.

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

class SpanPoolGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpanPoolGoldenTest, TheEngineReproducesTheFloat64DecisionsExactly) {
  const std::string base = SpanPoolGoldenDir() + "/" + GetParam();
  auto reader = replay::TraceReader::Open(base + ".trace.jsonl");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_GT((*reader)->header().policy.span_pool, 1);
  std::unique_ptr<Sequence> s = CreateOrDie((*reader)->header().ToSequenceOptions());
  ASSERT_NE(s, nullptr);
  const std::vector<std::string> want = ReadLines(base + ".decisions.jsonl");
  replay::TraceStep step;
  size_t index = 0;
  for (; *(*reader)->Next(&step); ++index) {
    ASSERT_LT(index, want.size());
    const kernels::ScoreMatrix m = step.Matrix();
    EvictionDecision d;
    ASSERT_TRUE(s->Step(step.step, step.layers > 0 ? &m : nullptr, &d).ok());
    const auto expected = nlohmann::json::parse(want[index]);
    ASSERT_EQ(d.evicted, expected["evicted"].get<std::vector<int64_t>>()) << "step " << step.step;
    ASSERT_EQ(d.cache_size, expected["cache_size"].get<int64_t>());
    ASSERT_EQ(d.next_needs_scores, expected["next_needs_scores"].get<bool>());
  }
  EXPECT_EQ(index, want.size());
}

TEST(SpanPoolGoldenSetTest, ThereAreSpanPoolGoldenVectors) {
  EXPECT_GE(GoldenNames(SpanPoolGoldenDir()).size(), 6u);
}

INSTANTIATE_TEST_SUITE_P(AllSpanPoolVectors, SpanPoolGoldenTest,
                         ::testing::ValuesIn(GoldenNames(SpanPoolGoldenDir())),
                         [](const auto& test_param) { return test_param.param; });

}  // namespace
}  // namespace kvcm

// One test per rule of SPEC.md's step procedure, and one per "consequence worth a test".
#include "cache_manager/engine/sequence.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::Layers;
using ::kvcm::testing::StepWith;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::unique_ptr<Sequence> Make(int64_t prefill, BudgetSpec budget, Policy policy,
                               std::string preset = "") {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = budget;
  o.policy = policy;
  o.preset = std::move(preset);
  absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("seq", o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

Policy Ema(double alpha = 0.8) {
  Policy p;
  p.alpha = alpha;
  return p;
}

Layers Uniform(int64_t layers, int64_t tokens, float v) {
  return Layers(static_cast<size_t>(layers), std::vector<float>(static_cast<size_t>(tokens), v));
}

float MomentumOf(const Sequence& s, int64_t position) {
  const auto positions = s.state().positions();
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] == position) return s.state().momentum()[i];
  }
  ADD_FAILURE() << "position " << position << " not cached";
  return -1;
}

// --- Registration ---

TEST(SequenceRegistrationTest, RejectsInvalidOptionsNamingTheSequence) {
  SequenceOptions o;
  o.prefill_len = 0;
  o.budget = BudgetSpec::Tokens(4);
  absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("req-7", o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("req-7"));
  EXPECT_THAT(s.status().message(), HasSubstr("prefill_len"));

  o.prefill_len = 10;
  o.policy.protect_sinks = 3;
  o.policy.protect_recent = 2;
  EXPECT_FALSE(Sequence::Create("x", o).ok());  // 3 + 2 > 4
  o.policy.protect_recent = 1;
  EXPECT_TRUE(Sequence::Create("x", o).ok());

  o.preset = "nope";
  EXPECT_THAT(Sequence::Create("x", o).status().message(), HasSubstr("nope"));
}

TEST(SequenceRegistrationTest, PresetTakesTheSeedFromThePolicy) {
  SequenceOptions o;
  o.prefill_len = 10;
  o.budget = BudgetSpec::Tokens(4);
  o.preset = "random";
  o.policy.seed = 42;
  o.policy.alpha = 0.1;  // ignored: the preset decides
  auto s = *Sequence::Create("x", o);
  EXPECT_EQ(s->policy().seed, 42u);
  EXPECT_EQ(s->policy().aggregation, Aggregation::kRandom);
  EXPECT_EQ(s->policy().alpha, 0.8);
}

TEST(SequenceRegistrationTest, PrefillIsCachedInOrder) {
  auto s = Make(5, BudgetSpec::Tokens(3), Ema());
  EXPECT_THAT(s->state().positions(), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_EQ(s->cache_size(), 5);
  EXPECT_EQ(s->last_step(), 0);
  EXPECT_TRUE(s->next_needs_scores());
}

// --- Rule 1: steps arrive in order ---

TEST(SequenceStepTest, FirstStepMustBeOne) {
  auto s = Make(4, BudgetSpec::Tokens(4), Ema());
  EvictionDecision d;
  absl::Status st = StepWith(*s, 2, Uniform(1, 5, 0.1f), &d);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("expected step 1"));
  st = StepWith(*s, 0, Uniform(1, 5, 0.1f), &d);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SequenceStepTest, RepeatedOrSkippedStepIsRejectedAndChangesNothing) {
  auto s = Make(4, BudgetSpec::Tokens(3), Ema());
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.1f, 0.5f, 0.2f, 0.9f, 0.3f}}, &d).ok());
  const std::vector<int64_t> before(s->state().positions().begin(), s->state().positions().end());
  const std::vector<float> m_before(s->state().momentum().begin(), s->state().momentum().end());
  EXPECT_EQ(StepWith(*s, 1, Uniform(1, 4, 0.1f), &d).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StepWith(*s, 3, Uniform(1, 4, 0.1f), &d).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->last_step(), 1);
  EXPECT_THAT(s->state().positions(), ::testing::ElementsAreArray(before));
  EXPECT_THAT(s->state().momentum(), ::testing::ElementsAreArray(m_before));
  EXPECT_TRUE(StepWith(*s, 2, Uniform(1, 4, 0.1f), &d).ok());
}

// --- Rule 2: the new token's initial momentum ---

TEST(SequenceStepTest, NewTokenStartsAtZeroOnAScoringStep) {
  // alpha 0.5, one layer: the new token ends at 0.5 * 0 + 0.5 * s.
  auto s = Make(2, BudgetSpec::Tokens(10), Ema(0.5));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.2f, 0.4f, 0.8f}}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 2), 0.4f);
}

TEST(SequenceStepTest, NewTokenStartsAtTheMeanMomentumOnANonScoringStep) {
  Policy p = Ema(0.5);
  p.refresh = Refresh::kScoreFree;
  auto s = Make(2, BudgetSpec::Tokens(10), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.2f, 0.4f, 0.9f}}, &d).ok());
  auto mean_of = [&](std::initializer_list<int64_t> positions) {
    double sum = 0;  // the spec's mean is taken in double
    for (int64_t pos : positions) sum += static_cast<double>(MomentumOf(*s, pos));
    return static_cast<float>(sum / static_cast<double>(positions.size()));
  };
  const float want3 = mean_of({0, 1, 2});
  ASSERT_TRUE(StepWith(*s, 2, {}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 3), want3);
  // Over the tokens cached before the new one joins, the previous newcomer included.
  const float want4 = mean_of({0, 1, 2, 3});
  ASSERT_TRUE(StepWith(*s, 3, {}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 4), want4);
}

TEST(SequenceStepTest, BudgetOfOneKeepsExactlyOneToken) {
  // The cache before a step is never empty (prefill >= 1, budget >= 1), so the mean of an
  // empty cache never arises; the smallest cache is one token.
  Policy p = Ema();
  p.refresh = Refresh::kScoreFree;
  auto s = Make(1, BudgetSpec::Tokens(1), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.0f, 0.0f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(0));  // equal momentum: the lower position goes
  ASSERT_TRUE(StepWith(*s, 2, {}, &d).ok());
  EXPECT_EQ(s->cache_size(), 1);
}

TEST(SequenceStepTest, RecencyMomentumIsThePosition) {
  Policy p;
  p.aggregation = Aggregation::kRecency;
  auto s = Make(4, BudgetSpec::Tokens(10), p);
  EXPECT_THAT(s->state().momentum(), ElementsAre(0.0f, 1.0f, 2.0f, 3.0f));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, {}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 4), 4.0f);
  EXPECT_FALSE(d.next_needs_scores);
}

// --- Rule 3: scores on scoring steps ---

TEST(SequenceStepTest, ScoringStepWithoutScoresIsRejected) {
  auto s = Make(3, BudgetSpec::Tokens(2), Ema());
  EvictionDecision d;
  absl::Status st = s->Step(1, nullptr, &d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("step 1"));
  EXPECT_THAT(st.message(), HasSubstr("scoring step"));
  EXPECT_EQ(s->last_step(), 0);
  EXPECT_EQ(s->cache_size(), 3);
}

TEST(SequenceStepTest, WronglySizedScoresAreRejectedNamingTheSizes) {
  auto s = Make(3, BudgetSpec::Tokens(2), Ema());
  EvictionDecision d;
  absl::Status st = StepWith(*s, 1, Uniform(2, 3, 0.1f), &d);  // needs 4
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("3 tokens per layer"));
  EXPECT_THAT(st.message(), HasSubstr("holds 4"));
  EXPECT_EQ(s->cache_size(), 3);
}

TEST(SequenceStepTest, NegativeNanOrInfiniteScoresAreRejectedAndChangeNothing) {
  for (float bad : {-0.001f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    auto s = Make(3, BudgetSpec::Tokens(2), Ema());
    EvictionDecision d;
    Layers layers = Uniform(3, 4, 0.25f);
    layers[2][1] = bad;
    absl::Status st = StepWith(*s, 1, layers, &d);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("layer 2 score 1 (position 1)"));
    EXPECT_EQ(s->cache_size(), 3);
    EXPECT_EQ(s->last_step(), 0);
    EXPECT_THAT(s->state().momentum(), ElementsAre(0.0f, 0.0f, 0.0f));
    // The same step with good scores then goes through.
    EXPECT_TRUE(StepWith(*s, 1, Uniform(3, 4, 0.25f), &d).ok());
  }
}

TEST(SequenceStepTest, ScoresOnANonScoringStepAreIgnoredAndCounted) {
  Policy p = Ema();
  p.refresh = Refresh::kLazy;
  p.refresh_interval = 2;
  auto s = Make(3, BudgetSpec::Tokens(10), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Uniform(1, 4, 0.5f), &d).ok());
  const std::vector<float> before(s->state().momentum().begin(), s->state().momentum().end());
  // Even malformed scores are ignored: the step does not read them.
  ASSERT_TRUE(StepWith(*s, 2, Uniform(1, 2, -1.0f), &d).ok());
  EXPECT_TRUE(d.scores_ignored);
  EXPECT_FALSE(d.scored);
  EXPECT_EQ(s->stats().ignored_score_reports, 1);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(s->state().momentum()[i], before[i]);
}

TEST(SequenceStepTest, EmaFoldsLayersInOrder) {
  // alpha 0.5, two layers over [m=0]: m = 0.25 * s0 + 0.5 * s1.
  auto s = Make(1, BudgetSpec::Tokens(10), Ema(0.5));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.8f, 0.4f}, {0.2f, 0.6f}}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 0), 0.5f * (0.5f * 0.8f) + 0.5f * 0.2f);
  EXPECT_EQ(MomentumOf(*s, 1), 0.5f * (0.5f * 0.4f) + 0.5f * 0.6f);
  // The previous step decays by alpha^K.
  ASSERT_TRUE(StepWith(*s, 2, Layers{{0, 0, 0}, {0, 0, 0}}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 0), 0.5f * (0.5f * (0.5f * (0.5f * 0.8f) + 0.5f * 0.2f)));
}

TEST(SequenceStepTest, CumulativeAddsEveryLayer) {
  Policy p;
  p.aggregation = Aggregation::kCumulative;
  auto s = Make(1, BudgetSpec::Tokens(10), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.25f, 0.5f}, {0.5f, 0.125f}}, &d).ok());
  ASSERT_TRUE(StepWith(*s, 2, Layers{{1.0f, 1.0f, 1.0f}}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 0), 1.75f);
  EXPECT_EQ(MomentumOf(*s, 1), 1.625f);
  EXPECT_EQ(MomentumOf(*s, 2), 1.0f);
}

TEST(SequenceStepTest, SingleStepKeepsOnlyTheMeanOverLayersOfThisStep) {
  Policy p;
  p.aggregation = Aggregation::kSingleStep;
  auto s = Make(1, BudgetSpec::Tokens(10), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.9f, 0.1f}, {0.7f, 0.3f}}, &d).ok());
  ASSERT_TRUE(StepWith(*s, 2, Layers{{0.25f, 0.5f, 0.75f}, {0.75f, 0.0f, 0.25f}}, &d).ok());
  EXPECT_EQ(MomentumOf(*s, 0), 0.5f);
  EXPECT_EQ(MomentumOf(*s, 1), 0.25f);
  EXPECT_EQ(MomentumOf(*s, 2), 0.5f);
}

// --- Rule 4: eviction ---

TEST(SequenceEvictionTest, LowestMomentumGoesFirst) {
  auto s = Make(4, BudgetSpec::Tokens(4), Ema(0.0));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.4f, 0.1f, 0.3f, 0.5f, 0.2f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(1));
}

TEST(SequenceEvictionTest, EqualMomentumEvictsTheLowerPosition) {
  auto s = Make(4, BudgetSpec::Tokens(2), Ema(0.0));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.5f, 0.2f, 0.5f, 0.2f, 0.2f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(1, 3, 4));
}

TEST(SequenceEvictionTest, TheNewTokenMayBeEvictedInItsOwnStep) {
  auto s = Make(3, BudgetSpec::Tokens(3), Ema(0.0));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.5f, 0.4f, 0.3f, 0.1f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(3));
  EXPECT_THAT(s->state().positions(), ElementsAre(0, 1, 2));
}

TEST(SequenceEvictionTest, SinksAreNeverEvicted) {
  Policy p = Ema(0.0);
  p.protect_sinks = 2;
  auto s = Make(5, BudgetSpec::Tokens(3), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.0f, 0.0f, 0.5f, 0.4f, 0.6f, 0.7f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(2, 3, 4));
  EXPECT_THAT(s->state().positions(), ElementsAre(0, 1, 5));
}

TEST(SequenceEvictionTest, RecentTokensAreNeverEvicted) {
  Policy p = Ema(0.0);
  p.protect_recent = 2;
  auto s = Make(5, BudgetSpec::Tokens(3), p);
  EvictionDecision d;
  // The two newest cached tokens (positions 4 and 5) are protected despite low scores.
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.9f, 0.3f, 0.2f, 0.8f, 0.0f, 0.0f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(1, 2, 3));
  EXPECT_THAT(s->state().positions(), ElementsAre(0, 4, 5));
}

TEST(SequenceEvictionTest, EvictionIsIrreversible) {
  auto s = Make(3, BudgetSpec::Tokens(3), Ema(0.0));
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.0f, 0.5f, 0.5f, 0.5f}}, &d).ok());
  EXPECT_THAT(d.evicted, ElementsAre(0));
  for (int64_t t = 2; t <= 5; ++t) {
    ASSERT_TRUE(StepWith(*s, t, Layers{std::vector<float>(4, 0.5f)}, &d).ok());
    for (int64_t pos : s->state().positions()) EXPECT_NE(pos, 0);
  }
}

TEST(SequenceEvictionTest, RandomIsSeededAndSparesProtectedTokens) {
  Policy p;
  p.aggregation = Aggregation::kRandom;
  p.protect_sinks = 3;
  p.protect_recent = 2;
  auto run = [&](uint64_t seed) {
    p.seed = seed;
    auto s = Make(100, BudgetSpec::Tokens(10), p);
    std::vector<int64_t> all;
    EvictionDecision d;
    for (int64_t t = 1; t <= 30; ++t) {
      EXPECT_TRUE(s->Step(t, nullptr, &d).ok());
      EXPECT_TRUE(std::is_sorted(d.evicted.begin(), d.evicted.end()));
      for (int64_t pos : d.evicted) {
        EXPECT_GE(pos, 3);
        EXPECT_LT(pos, 100 + t - 2);  // never one of the 2 newest
        all.push_back(pos);
      }
    }
    auto positions = s->state().positions();
    EXPECT_THAT(std::vector<int64_t>(positions.begin(), positions.begin() + 3), ElementsAre(0, 1, 2));
    EXPECT_EQ(positions[positions.size() - 1], 129);
    EXPECT_EQ(positions[positions.size() - 2], 128);
    return all;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(SequenceEvictionTest, RandomChoosesRoughlyUniformly) {
  // One eviction from 10 unprotected tokens, over many seeds: each index about 10%.
  Policy p;
  p.aggregation = Aggregation::kRandom;
  std::vector<int> hits(11, 0);
  for (uint64_t seed = 0; seed < 5000; ++seed) {
    p.seed = seed;
    auto s = Make(10, BudgetSpec::Tokens(10), p);
    EvictionDecision d;
    ASSERT_TRUE(s->Step(1, nullptr, &d).ok());
    ASSERT_EQ(d.evicted.size(), 1u);
    ++hits[static_cast<size_t>(d.evicted[0])];
  }
  for (int h : hits) {
    EXPECT_GT(h, 350);
    EXPECT_LT(h, 570);
  }
}

// --- Rule 5: the decision ---

TEST(SequenceDecisionTest, ReportsEvictedAscendingCacheSizeAndNextScoring) {
  Policy p = Ema(0.0);
  p.refresh = Refresh::kLazy;
  p.refresh_interval = 3;
  auto s = Make(6, BudgetSpec::Tokens(3), p);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, Layers{{0.6f, 0.1f, 0.5f, 0.0f, 0.9f, 0.2f, 0.8f}}, &d).ok());
  EXPECT_EQ(d.step, 1);
  EXPECT_THAT(d.evicted, ElementsAre(1, 2, 3, 5));  // the four lowest, ascending
  EXPECT_EQ(d.cache_size, 3);
  EXPECT_FALSE(d.next_needs_scores);  // lazy r=3: steps 1, 4, 7 score
  ASSERT_TRUE(s->Step(2, nullptr, &d).ok());
  EXPECT_FALSE(d.next_needs_scores);
  ASSERT_TRUE(s->Step(3, nullptr, &d).ok());
  EXPECT_TRUE(d.next_needs_scores);
  EXPECT_EQ(d.step, 3);
}

// --- Consequences worth a test ---

TEST(SequenceConsequenceTest, NinetyPercentEvictsTheExcessAtStepOneThenOnePerStep) {
  auto s = Make(256, BudgetSpec::Ratio(0.9), Ema());
  ASSERT_EQ(s->budget(), 25);
  std::mt19937_64 rng(3);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, testing::RandomLayers(rng, 4, 257, false), &d).ok());
  EXPECT_EQ(d.evicted.size(), 256u + 1 - 25);
  EXPECT_EQ(d.cache_size, 25);
  for (int64_t t = 2; t <= 20; ++t) {
    ASSERT_TRUE(StepWith(*s, t, testing::RandomLayers(rng, 4, 26, false), &d).ok());
    EXPECT_EQ(d.evicted.size(), 1u);
    EXPECT_EQ(d.cache_size, 25);
  }
}

TEST(SequenceConsequenceTest, ScoreFreeNeverNeedsScoresAfterStepOne) {
  auto s = Make(50, BudgetSpec::Ratio(0.9), Policy{}, "score_free");
  EXPECT_TRUE(s->next_needs_scores());
  std::mt19937_64 rng(5);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(*s, 1, testing::RandomLayers(rng, 3, 51, false), &d).ok());
  EXPECT_FALSE(d.next_needs_scores);
  for (int64_t t = 2; t <= 40; ++t) {
    ASSERT_TRUE(s->Step(t, nullptr, &d).ok()) << t;
    EXPECT_FALSE(d.next_needs_scores);
  }
  EXPECT_EQ(s->stats().scoring_steps, 1);
  EXPECT_EQ(s->stats().skipped_scoring_steps, 39);
}

}  // namespace
}  // namespace kvcm

// Randomized property tests: the engine against the plain reference model of SPEC.md
// (tests/cache_manager/reference_engine.h), and the equivalences SPEC.md promises.
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/policy/token_budget.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/cache_manager/reference_engine.h"

namespace kvcm {
namespace {

using ::kvcm::testing::Layers;
using ::kvcm::testing::RandomLayers;
using ::kvcm::testing::ReferenceEngine;
using ::kvcm::testing::StepWith;

struct RandomCase {
  SequenceOptions options;
  int64_t budget = 0;
  int64_t layers = 1;
  int64_t steps = 1;
  bool ties = false;
  std::string description;
};

RandomCase MakeCase(std::mt19937_64& rng, bool allow_random_aggregation) {
  RandomCase c;
  auto pick = [&](int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  c.options.prefill_len = pick(1, 300);
  if (rng() % 2 == 0) {
    c.options.budget = BudgetSpec::Tokens(pick(1, c.options.prefill_len + 30));
  } else {
    const double ratios[] = {0.0, 0.5, 0.75, 0.9, 0.95, 0.3};
    c.options.budget = BudgetSpec::Ratio(ratios[rng() % 6]);
  }
  c.budget = *ResolveBudget(c.options.prefill_len, c.options.budget);
  Policy& p = c.options.policy;
  const int aggregations = allow_random_aggregation ? 5 : 4;
  const Aggregation kinds[] = {Aggregation::kEma, Aggregation::kCumulative,
                               Aggregation::kSingleStep, Aggregation::kRecency,
                               Aggregation::kRandom};
  p.aggregation = kinds[rng() % static_cast<uint64_t>(aggregations)];
  const Refresh refreshes[] = {Refresh::kEveryStep, Refresh::kLazy, Refresh::kScoreFree};
  p.refresh = refreshes[rng() % 3];
  p.refresh_interval = pick(1, 5);
  p.alpha = rng() % 5 == 0 ? 0.0 : std::uniform_real_distribution<double>(0.0, 0.99)(rng);
  p.protect_sinks = rng() % 3 == 0 ? pick(0, c.budget) : 0;
  p.protect_recent = rng() % 3 == 0 ? pick(0, c.budget - p.protect_sinks) : 0;
  p.seed = rng();
  c.layers = pick(1, 6);
  c.steps = pick(1, 60);
  c.ties = rng() % 2 == 0;
  c.description = absl::StrCat("L0=", c.options.prefill_len, " B=", c.budget, " ",
                               p.DebugString(), " layers=", c.layers, " steps=", c.steps,
                               c.ties ? " ties" : "");
  return c;
}

TEST(SequencePropertyTest, MatchesThePlainReferenceModel) {
  std::mt19937_64 rng(20261130);
  for (int round = 0; round < 400; ++round) {
    const RandomCase c = MakeCase(rng, /*allow_random_aggregation=*/false);
    SCOPED_TRACE(c.description);
    auto engine = *Sequence::Create("prop", c.options);
    ReferenceEngine reference(c.options.prefill_len, c.budget, c.options.policy);
    EvictionDecision d;
    for (int64_t t = 1; t <= c.steps; ++t) {
      const bool scoring = c.options.policy.IsScoringStep(t);
      const Layers layers =
          scoring ? RandomLayers(rng, c.layers, engine->cache_size() + 1, c.ties) : Layers{};
      ASSERT_TRUE(StepWith(*engine, t, layers, &d).ok()) << "step " << t;
      const auto want = reference.Step(t, layers);
      ASSERT_EQ(d.evicted, want.evicted) << "step " << t;
      ASSERT_EQ(d.cache_size, want.cache_size) << "step " << t;
      ASSERT_EQ(d.next_needs_scores, want.next_needs_scores) << "step " << t;
      ASSERT_EQ(std::vector<int64_t>(engine->state().positions().begin(),
                                     engine->state().positions().end()),
                reference.positions())
          << "step " << t;
      for (size_t i = 0; i < reference.momentum().size(); ++i) {
        ASSERT_FLOAT_EQ(engine->state().momentum()[i], reference.momentum()[i])
            << "step " << t << " index " << i;
      }
    }
  }
}

TEST(SequencePropertyTest, CountsAndProtectionsHoldForEveryPolicy) {
  std::mt19937_64 rng(77);
  for (int round = 0; round < 300; ++round) {
    const RandomCase c = MakeCase(rng, /*allow_random_aggregation=*/true);
    SCOPED_TRACE(c.description);
    auto s = *Sequence::Create("prop", c.options);
    const Policy& p = c.options.policy;
    EvictionDecision d;
    for (int64_t t = 1; t <= c.steps; ++t) {
      const int64_t before = s->cache_size();
      const std::vector<int64_t> cached(s->state().positions().begin(),
                                        s->state().positions().end());
      const Layers layers = p.IsScoringStep(t)
                                ? RandomLayers(rng, c.layers, before + 1, c.ties)
                                : Layers{};
      ASSERT_TRUE(StepWith(*s, t, layers, &d).ok());
      const int64_t new_position = c.options.prefill_len + t - 1;
      // Exactly the excess goes, and the cache never exceeds the budget.
      EXPECT_EQ(static_cast<int64_t>(d.evicted.size()), std::max<int64_t>(0, before + 1 - c.budget));
      EXPECT_EQ(d.cache_size, std::min(before + 1, c.budget));
      EXPECT_TRUE(std::is_sorted(d.evicted.begin(), d.evicted.end()));
      // Evicted tokens were cached (or are the new one) and are unprotected.
      std::vector<int64_t> with_new = cached;
      with_new.push_back(new_position);
      for (int64_t pos : d.evicted) {
        EXPECT_GE(pos, p.protect_sinks);
        auto it = std::find(with_new.begin(), with_new.end(), pos);
        ASSERT_NE(it, with_new.end());
        const int64_t index = it - with_new.begin();
        EXPECT_LT(index, static_cast<int64_t>(with_new.size()) - p.protect_recent);
      }
      auto positions = s->state().positions();
      EXPECT_TRUE(std::is_sorted(positions.begin(), positions.end()));
      EXPECT_EQ(d.next_needs_scores, p.IsScoringStep(t + 1));
    }
  }
}

// Runs the same scores through two policies and expects identical decisions and momentum.
void ExpectSameRun(const SequenceOptions& a, const SequenceOptions& b, int64_t layers,
                   int64_t steps, uint64_t seed, bool b_takes_last_layer_only) {
  std::mt19937_64 rng(seed);
  auto sa = *Sequence::Create("a", a);
  auto sb = *Sequence::Create("b", b);
  EvictionDecision da, db;
  for (int64_t t = 1; t <= steps; ++t) {
    Layers scores = RandomLayers(rng, layers, sa->cache_size() + 1, seed % 2 == 0);
    ASSERT_TRUE(StepWith(*sa, t, scores, &da).ok());
    if (b_takes_last_layer_only) scores = Layers{scores.back()};
    ASSERT_TRUE(StepWith(*sb, t, scores, &db).ok());
    ASSERT_EQ(da.evicted, db.evicted) << "step " << t;
    ASSERT_EQ(da.next_needs_scores, db.next_needs_scores);
    ASSERT_TRUE(std::equal(sa->state().momentum().begin(), sa->state().momentum().end(),
                           sb->state().momentum().begin(), sb->state().momentum().end()));
  }
}

TEST(SequencePropertyTest, LazyWithIntervalOneEqualsEveryStep) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    SequenceOptions every;
    every.prefill_len = 50 + static_cast<int64_t>(seed) * 7;
    every.budget = BudgetSpec::Ratio(0.8);
    every.policy.alpha = 0.1 * static_cast<double>(seed % 10);
    SequenceOptions lazy = every;
    lazy.policy.refresh = Refresh::kLazy;
    lazy.policy.refresh_interval = 1;
    ExpectSameRun(every, lazy, 4, 40, seed, false);
  }
}

TEST(SequencePropertyTest, EmaWithAlphaZeroKeepsOnlyTheLastLayer) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    SequenceOptions all_layers;
    all_layers.prefill_len = 64;
    all_layers.budget = BudgetSpec::Tokens(16);
    all_layers.policy.alpha = 0.0;
    all_layers.policy.protect_recent = static_cast<int64_t>(seed % 4);
    ExpectSameRun(all_layers, all_layers, 5, 30, seed, /*b_takes_last_layer_only=*/true);
  }
}

}  // namespace
}  // namespace kvcm

#include "cache_manager/policy/policy.h"
#include "cache_manager/policy/token_budget.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(BudgetTest, TokensAreTakenAsGiven) {
  EXPECT_EQ(*ResolveBudget(100, BudgetSpec::Tokens(30)), 30);
  EXPECT_EQ(*ResolveBudget(10, BudgetSpec::Tokens(50)), 50);  // may exceed the prefill
}

TEST(BudgetTest, RatioIsFlooredWithTheEpsilonOfTheSpec) {
  EXPECT_EQ(*ResolveBudget(256, BudgetSpec::Ratio(0.9)), 25);   // 25.6
  EXPECT_EQ(*ResolveBudget(64000, BudgetSpec::Ratio(0.9)), 6400);
  // (1 - 0.3) * 10 is 6.9999999999999996 in double: the 1e-9 makes it 7.
  EXPECT_EQ(*ResolveBudget(10, BudgetSpec::Ratio(0.3)), 7);
  EXPECT_EQ(*ResolveBudget(10, BudgetSpec::Ratio(0.9)), 1);
  EXPECT_EQ(*ResolveBudget(7, BudgetSpec::Ratio(0.0)), 7);
}

TEST(BudgetTest, RatioBudgetIsAtLeastOne) {
  EXPECT_EQ(*ResolveBudget(5, BudgetSpec::Ratio(0.9)), 1);  // floor(0.5) = 0
  EXPECT_EQ(*ResolveBudget(1, BudgetSpec::Ratio(0.99)), 1);
}

TEST(BudgetTest, RejectsBadSpecs) {
  EXPECT_EQ(ResolveBudget(0, BudgetSpec::Tokens(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveBudget(10, BudgetSpec{}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveBudget(10, BudgetSpec{5, 0.5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveBudget(10, BudgetSpec::Tokens(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveBudget(10, BudgetSpec::Ratio(1.0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveBudget(10, BudgetSpec::Ratio(-0.1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ResolveBudget(10, BudgetSpec::Ratio(1.5)).status().message().find("compression_ratio"),
            absl::string_view::npos);
}

TEST(PolicyTest, PresetsExpandAsTheSpecSays) {
  Policy p = *Policy::FromPreset("inertia", 100);
  EXPECT_EQ(p.aggregation, Aggregation::kEma);
  EXPECT_EQ(p.alpha, 0.8);
  EXPECT_EQ(p.refresh, Refresh::kEveryStep);

  p = *Policy::FromPreset("inertia_lazy4", 100);
  EXPECT_EQ(p.refresh, Refresh::kLazy);
  EXPECT_EQ(p.refresh_interval, 4);
  EXPECT_EQ(p.alpha, 0.8);

  p = *Policy::FromPreset("score_free", 100);
  EXPECT_EQ(p.aggregation, Aggregation::kEma);
  EXPECT_EQ(p.refresh, Refresh::kScoreFree);

  p = *Policy::FromPreset("tova", 100);
  EXPECT_EQ(p.aggregation, Aggregation::kSingleStep);
  EXPECT_EQ(p.refresh, Refresh::kEveryStep);

  p = *Policy::FromPreset("h2o", 101);
  EXPECT_EQ(p.aggregation, Aggregation::kCumulative);
  EXPECT_EQ(p.protect_recent, 50);  // B/2, integer division

  p = *Policy::FromPreset("streaming_llm", 100);
  EXPECT_EQ(p.aggregation, Aggregation::kRecency);
  EXPECT_EQ(p.protect_sinks, 4);

  p = *Policy::FromPreset("random", 100);
  EXPECT_EQ(p.aggregation, Aggregation::kRandom);
  EXPECT_EQ(p.preset, "random");

  EXPECT_EQ(Policy::FromPreset("inertia2", 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Policy::PresetNames().size(), 7u);
}

TEST(PolicyTest, ValidationNamesTheField) {
  Policy p;
  p.alpha = 1.0;
  EXPECT_NE(p.Validate(10).message().find("alpha"), absl::string_view::npos);
  p.alpha = -0.01;
  EXPECT_FALSE(p.Validate(10).ok());
  p = Policy{};
  p.refresh_interval = 0;
  EXPECT_NE(p.Validate(10).message().find("refresh_interval"), absl::string_view::npos);
  p = Policy{};
  p.protect_sinks = 6;
  p.protect_recent = 5;
  EXPECT_NE(p.Validate(10).message().find("budget"), absl::string_view::npos);
  p.protect_recent = 4;
  EXPECT_TRUE(p.Validate(10).ok());
  p.protect_sinks = -1;
  EXPECT_FALSE(p.Validate(10).ok());
  p = Policy{};
  p.alpha = 0.0;
  EXPECT_TRUE(p.Validate(1).ok());
}

// SPEC.md "Span pooling": 0 or 1 off, else odd 3 to 255, and only where scores are read.
TEST(PolicyTest, SpanPoolIsOffOrAnOddWidthFrom3To255) {
  Policy p;
  for (int64_t k : {0, 1, 3, 5, 253, 255}) {
    p.span_pool = k;
    EXPECT_TRUE(p.Validate(10).ok()) << k;
    EXPECT_EQ(p.PoolsSpans(), k > 1);
  }
  for (int64_t k : {-1, -3, 2, 8, 256, 257, 999}) {
    p.span_pool = k;
    const absl::Status s = p.Validate(10);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_NE(s.message().find("policy.span_pool is " + std::to_string(k)),
              absl::string_view::npos)
        << s.message();
  }
  p.span_pool = 3;
  for (Aggregation a : {Aggregation::kRecency, Aggregation::kRandom}) {
    p.aggregation = a;
    EXPECT_NE(p.Validate(10).message().find(
                  "policy.span_pool needs an aggregation that reads scores"),
              absl::string_view::npos);
  }
  Policy q;
  q.span_pool = 3;
  EXPECT_FALSE(q == Policy{});  // part of the policy's identity (snapshots compare it)
}

TEST(PolicyTest, UnknownEnumNamesAreRejected) {
  EXPECT_EQ(*ParseAggregation("single_step"), Aggregation::kSingleStep);
  EXPECT_EQ(*ParseRefresh("score_free"), Refresh::kScoreFree);
  EXPECT_EQ(ParseAggregation("emma").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRefresh("sometimes").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PolicyTest, ScoringStepsFollowTheRefresh) {
  Policy p;
  for (int64_t t = 1; t <= 9; ++t) EXPECT_TRUE(p.IsScoringStep(t));
  p.refresh = Refresh::kLazy;
  p.refresh_interval = 4;
  std::vector<int64_t> scoring;
  for (int64_t t = 1; t <= 13; ++t) {
    if (p.IsScoringStep(t)) scoring.push_back(t);
  }
  EXPECT_EQ(scoring, (std::vector<int64_t>{1, 5, 9, 13}));
  p.refresh = Refresh::kScoreFree;
  EXPECT_TRUE(p.IsScoringStep(1));
  for (int64_t t = 2; t <= 9; ++t) EXPECT_FALSE(p.IsScoringStep(t));
  for (Aggregation a : {Aggregation::kRecency, Aggregation::kRandom}) {
    p.aggregation = a;
    p.refresh = Refresh::kEveryStep;
    EXPECT_FALSE(p.IsScoringStep(1));
    EXPECT_FALSE(p.UsesScores());
  }
}

}  // namespace
}  // namespace kvcm

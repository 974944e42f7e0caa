// ResolvePolicyRequest: the default preset, a preset excluding the fields, the fields
// over Policy's defaults, and the seed with either.
#include "cache_manager/policy/policy_request.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(PolicyRequestTest, NothingAskedIsTheDefaultPreset) {
  PolicyRequest request;
  request.seed = 9;  // a seed alone asks for no policy
  absl::StatusOr<RequestedPolicy> got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->preset, "inertia");
  EXPECT_EQ(got->preset, kDefaultPreset);
  EXPECT_EQ(got->policy.seed, 9u);
}

TEST(PolicyRequestTest, TheDefaultPresetExists) {
  EXPECT_TRUE(Policy::FromPreset(kDefaultPreset, 16).ok());
}

TEST(PolicyRequestTest, APresetIsTakenWithItsSeed) {
  PolicyRequest request;
  request.preset = "tova";
  request.seed = 3;
  absl::StatusOr<RequestedPolicy> got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->preset, "tova");
  EXPECT_EQ(got->policy.seed, 3u);
}

// SPEC.md "Span pooling": span_pool goes with a preset, with the fields, or alone (the
// default preset then), like the seed.
TEST(PolicyRequestTest, SpanPoolGoesWithAPresetWithTheFieldsOrAlone) {
  PolicyRequest request;
  request.preset = "inertia_lazy4";
  request.span_pool = 7;
  absl::StatusOr<RequestedPolicy> got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->preset, "inertia_lazy4");
  EXPECT_EQ(got->policy.span_pool, 7);

  request.preset.clear();
  got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->preset, kDefaultPreset);
  EXPECT_EQ(got->policy.span_pool, 7);

  request.aggregation = Aggregation::kCumulative;
  got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->preset, "");
  EXPECT_EQ(got->policy.aggregation, Aggregation::kCumulative);
  EXPECT_EQ(got->policy.span_pool, 7);
}

TEST(PolicyRequestTest, APresetWithAnyFieldIsRefused) {
  const auto with = [](auto set) {
    PolicyRequest request;
    request.preset = "tova";
    set(request);
    return ResolvePolicyRequest(request).status();
  };
  for (const absl::Status& refused :
       {with([](PolicyRequest& r) { r.aggregation = Aggregation::kEma; }),
        with([](PolicyRequest& r) { r.alpha = 0.5; }),
        with([](PolicyRequest& r) { r.refresh = Refresh::kEveryStep; }),
        with([](PolicyRequest& r) { r.refresh_interval = 4; }),
        with([](PolicyRequest& r) { r.protect_sinks = 1; }),
        with([](PolicyRequest& r) { r.protect_recent = 1; })}) {
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.message(),
              "policy: preset 'tova' is given together with policy fields; give a preset (and "
              "seed) or the fields");
  }
}

TEST(PolicyRequestTest, FieldsOverridePolicyDefaults) {
  PolicyRequest request;
  request.refresh = Refresh::kLazy;
  request.protect_recent = 2;
  request.seed = 5;
  absl::StatusOr<RequestedPolicy> got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->preset, "");
  Policy expected;
  expected.refresh = Refresh::kLazy;
  expected.protect_recent = 2;
  expected.seed = 5;
  EXPECT_EQ(got->policy, expected);
}

TEST(PolicyRequestTest, AllFieldsAreCarried) {
  PolicyRequest request;
  request.aggregation = Aggregation::kCumulative;
  request.alpha = 0.25;
  request.refresh = Refresh::kScoreFree;
  request.refresh_interval = 7;
  request.protect_sinks = 3;
  request.protect_recent = 4;
  absl::StatusOr<RequestedPolicy> got = ResolvePolicyRequest(request);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->policy.aggregation, Aggregation::kCumulative);
  EXPECT_EQ(got->policy.alpha, 0.25);
  EXPECT_EQ(got->policy.refresh, Refresh::kScoreFree);
  EXPECT_EQ(got->policy.refresh_interval, 7);
  EXPECT_EQ(got->policy.protect_sinks, 3);
  EXPECT_EQ(got->policy.protect_recent, 4);
}

TEST(PolicyRequestTest, HasFieldsIgnoresPresetAndSeed) {
  PolicyRequest request;
  request.preset = "h2o";
  request.seed = 1;
  EXPECT_FALSE(request.HasFields());
  request.alpha = 0.8;  // the default's value still counts as given
  EXPECT_TRUE(request.HasFields());
}

}  // namespace
}  // namespace kvcm

// The open request's rules outside the policy: the default tensor-parallel world and a
// worker's resume.
#include "cache_manager/engine/open_request.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;

TEST(OpenRequestTest, AnUnsetTpWorldIsOneRank) {
  EXPECT_EQ(TpWorldSizeOrDefault(0), 1);
  EXPECT_EQ(TpWorldSizeOrDefault(1), 1);
  EXPECT_EQ(TpWorldSizeOrDefault(4), 4);
  EXPECT_EQ(TpWorldSizeOrDefault(-2), -2);  // left to the table's check
}

TEST(OpenRequestTest, AResumeBeforeTheFirstStepIsRefused) {
  for (int64_t last_step : {0, -1}) {
    absl::StatusOr<SequenceProgress> got = WorkerResume(last_step, {0, 1});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(got.status().message(),
              absl::StrCat("resume: last_step is ", last_step,
                           "; it must be >= 1 (a sequence before its first step is opened "
                           "without resume)"));
  }
}

TEST(OpenRequestTest, AResumeCarriesStepAndPositionsButNoMomentum) {
  absl::StatusOr<SequenceProgress> got = WorkerResume(3, {0, 2, 5});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->last_step, 3);
  EXPECT_THAT(got->positions, ElementsAre(0, 2, 5));
  EXPECT_TRUE(got->momentum.empty());
  EXPECT_TRUE(got->rng_state.empty());
}

}  // namespace
}  // namespace kvcm

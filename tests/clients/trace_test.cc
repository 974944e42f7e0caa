#include "clients/replay/trace.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::replay {
namespace {

using ::testing::HasSubstr;

TEST(TraceHeaderTest, ParsesEitherBudgetForm) {
  auto h = ParseTraceHeader(
      R"({"format":"kvtrace/1","prefill_len":256,"compression_ratio":0.9,)"
      R"("policy":{"aggregation":"ema","alpha":0.8,"refresh":"lazy","refresh_interval":4}})");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->prefill_len, 256);
  EXPECT_EQ(*h->budget.compression_ratio, 0.9);
  EXPECT_EQ(h->policy.refresh, Refresh::kLazy);
  EXPECT_EQ(h->policy.refresh_interval, 4);
  h = ParseTraceHeader(R"({"format":"kvtrace/1","prefill_len":5,"budget_tokens":3,"policy":{"preset":"h2o"}})");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h->budget.budget_tokens, 3);
  EXPECT_EQ(h->preset, "h2o");
}

TEST(TraceHeaderTest, RejectsWrongFormatTypesAndUnknownPolicyFields) {
  EXPECT_THAT(ParseTraceHeader(R"({"format":"kvtrace/2","prefill_len":5})").status().message(),
              HasSubstr("kvtrace/1"));
  EXPECT_THAT(ParseTraceHeader(R"({"format":"kvtrace/1"})").status().message(),
              HasSubstr("prefill_len"));
  EXPECT_THAT(ParseTraceHeader(R"({"format":"kvtrace/1","prefill_len":"5"})").status().message(),
              HasSubstr("integer"));
  EXPECT_THAT(ParseTraceHeader(R"({"format":"kvtrace/1","prefill_len":5,"policy":{"alpah":0.5}})")
                  .status()
                  .message(),
              HasSubstr("alpah"));
  EXPECT_THAT(
      ParseTraceHeader(R"({"format":"kvtrace/1","prefill_len":5,"policy":{"aggregation":"max"}})")
          .status()
          .message(),
      HasSubstr("unknown aggregation 'max'"));
  EXPECT_THAT(ParseTraceHeader("[1,2]").status().message(), HasSubstr("not a JSON object"));
  EXPECT_THAT(ParseTraceHeader("{").status().message(), HasSubstr("malformed JSON"));
}

TEST(TraceStepTest, ParsesScoresLayerMajor) {
  TraceStep s;
  ASSERT_TRUE(ParseTraceStep(R"({"step":3,"layers":[[0.5,0.25],[1,0]]})", &s).ok());
  EXPECT_EQ(s.step, 3);
  EXPECT_EQ(s.layers, 2);
  EXPECT_EQ(s.tokens, 2);
  EXPECT_EQ(s.scores, (std::vector<float>{0.5f, 0.25f, 1.0f, 0.0f}));
  ASSERT_TRUE(ParseTraceStep(R"({"step":4})", &s).ok());
  EXPECT_EQ(s.layers, 0);
  EXPECT_TRUE(s.scores.empty());
}

TEST(TraceStepTest, RejectsRaggedOrNonNumericLayersNamingTheStep) {
  TraceStep s;
  EXPECT_THAT(ParseTraceStep(R"({"step":3,"layers":[[0.5,0.25],[1]]})", &s).message(),
              HasSubstr("step 3: layer 1 has 1 scores, layer 0 has 2"));
  EXPECT_THAT(ParseTraceStep(R"({"step":3,"layers":[[0.5,"x"]]})", &s).message(),
              HasSubstr("step 3: layer 0 score 1 is not a number"));
  EXPECT_THAT(ParseTraceStep(R"({"step":3,"layers":[0.5]})", &s).message(),
              HasSubstr("layer 0 is not a list"));
  EXPECT_THAT(ParseTraceStep(R"({"layers":[]})", &s).message(), HasSubstr("no \"step\""));
  EXPECT_THAT(ParseTraceStep(R"({"step":1.5})", &s).message(), HasSubstr("integer"));
}

// Found by fuzz/trace_fuzzer: a number too large for a double made nlohmann::json throw
// out_of_range, which the parser did not catch, and kvcache-replay terminated.
TEST(TraceStepTest, ANumberBeyondADoubleIsAMalformedLineNotACrash) {
  TraceStep s;
  const absl::Status score = ParseTraceStep(R"({"step":1,"layers":[[0.5,1e400]]})", &s);
  EXPECT_EQ(score.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(score.message(), HasSubstr("malformed JSON"));
  EXPECT_THAT(score.message(), HasSubstr("number overflow"));
  EXPECT_EQ(ParseTraceHeader(R"({"format":"kvtrace/1","prefill_len":8,"compression_ratio":1e999})")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm::replay

// kvcache-replay as a user runs it: exit codes, what lands on stdout, stderr and --out.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/clients/golden.h"

namespace kvcm {
namespace {

using ::kvcm::testing::GoldenDir;
using ::kvcm::testing::GoldenNames;
using ::kvcm::testing::ReadFile;
using ::testing::HasSubstr;

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class ReplayCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("kvcm_replay_cli_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  Result Run(const std::string& args) {
    const std::string out = (dir_ / "stdout").string();
    const std::string err = (dir_ / "stderr").string();
    const std::string cmd = absl::StrCat(KVCM_BIN_DIR, "/kvcache-replay ", args, " >", out,
                                         " 2>", err);
    const int status = std::system(cmd.c_str());
    Result r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = ReadFile(out);
    r.err = ReadFile(err);
    return r;
  }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

  // The header and first `steps` step lines of a golden trace.
  static std::string GoldenPrefix(const std::string& name, size_t steps) {
    std::vector<std::string> lines =
        absl::StrSplit(ReadFile(GoldenDir() + "/" + name + ".trace.jsonl"), '\n');
    lines.resize(steps + 1);
    return absl::StrCat(absl::StrJoin(lines, "\n"), "\n");
  }

  static size_t Lines(const std::string& s) {
    return static_cast<size_t>(std::count(s.begin(), s.end(), '\n'));
  }

  // Exit status 2, one line on stderr naming file:line and the step; and exactly
  // `decided` decisions before it on stdout.
  void ExpectRejected(const Result& r, const std::string& file_line, const std::string& step,
                      size_t decided) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(Lines(r.err), 1u) << r.err;
    EXPECT_THAT(r.err, HasSubstr(file_line));
    EXPECT_THAT(r.err, HasSubstr(step));
    EXPECT_EQ(Lines(r.out), decided) << r.out;
  }

  std::filesystem::path dir_;
};

TEST_F(ReplayCliTest, WritesGoldenDecisionsToStdoutOrToAFile) {
  const std::string trace = GoldenDir() + "/ema_every_step.trace.jsonl";
  const std::string want = ReadFile(GoldenDir() + "/ema_every_step.decisions.jsonl");
  Result r = Run("--trace " + trace);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, want);
  EXPECT_TRUE(r.err.empty());
  const std::string out = (dir_ / "decisions.jsonl").string();
  r = Run(absl::StrCat("--trace ", trace, " --out ", out, " --tp 3"));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(ReadFile(out), want);
}

TEST_F(ReplayCliTest, SummaryGoesWhereDecisionsDoNot) {
  const std::string trace = GoldenDir() + "/ema_lazy4.trace.jsonl";
  Result r = Run("--trace " + trace + " --summary");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("skipped"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("skipped")));
  r = Run("--trace " + trace + " --summary --out " + (dir_ / "d").string());
  EXPECT_THAT(r.out, HasSubstr("ema_lazy4"));
}

TEST_F(ReplayCliTest, MomentumAddsTheCacheToEveryDecision) {
  Result r = Run("--momentum --trace " + GoldenDir() + "/recency_sinks.trace.jsonl");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(Lines(r.out), 20u);
  EXPECT_THAT(r.out, HasSubstr(R"("momentum":{"positions":[0,1,2,3,53,)"));
}

TEST_F(ReplayCliTest, CompareTableHasARowPerPreset) {
  Result r = Run("--compare all --trace " + GoldenDir() + "/shift_protected.trace.jsonl");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* p : {"inertia ", "inertia_lazy4", "score_free", "tova", "h2o",
                        "streaming_llm", "random"}) {
    EXPECT_THAT(r.out, HasSubstr(p));
  }
}

TEST_F(ReplayCliTest, MalformedJson) {
  const std::string path =
      Write("t.jsonl", GoldenPrefix("ema_every_step", 2) + R"({"step":3,"layers":[[0.1,)" "\n");
  ExpectRejected(Run("--trace " + path), "t.jsonl:4:", "step 3", 2);
  EXPECT_THAT(Run("--trace " + path).err, HasSubstr("malformed JSON"));
}

TEST_F(ReplayCliTest, NanIsNotJsonAndIsRejected) {
  const std::string path =
      Write("t.jsonl", GoldenPrefix("ema_every_step", 1) + R"({"step":2,"layers":[[NaN]]})" "\n");
  ExpectRejected(Run("--trace " + path), "t.jsonl:3:", "step 2", 1);
}

TEST_F(ReplayCliTest, WrongLength) {
  const std::string path =
      Write("t.jsonl", GoldenPrefix("ema_every_step", 3) + R"({"step":4,"layers":[[0.1,0.2]]})" "\n");
  const Result r = Run("--trace " + path);
  ExpectRejected(r, "t.jsonl:5:", "step 4", 3);
  EXPECT_THAT(r.err, HasSubstr("scores cover 2 tokens per layer, the cache holds 26"));
}

TEST_F(ReplayCliTest, NegativeScore) {
  std::string text = GoldenPrefix("ema_every_step", 2);
  const size_t at = text.rfind("[[") + 2;  // first score of step 2
  text.insert(at, "-");
  const Result r = Run("--trace " + Write("t.jsonl", text));
  ExpectRejected(r, "t.jsonl:3:", "step 2", 1);
  EXPECT_THAT(r.err, HasSubstr("layer 0 score 0"));
}

TEST_F(ReplayCliTest, HugeScoreOverflowsToInfinityAndIsRejected) {
  std::string text = GoldenPrefix("ema_every_step", 2);
  const size_t at = text.rfind("[[") + 2;
  text.insert(at, "1e39,");  // also makes the row one longer: replace a value instead
  text.erase(at + 5, text.find(',', at + 5) - (at + 5) + 1);
  const Result r = Run("--trace " + Write("t.jsonl", text));
  ExpectRejected(r, "t.jsonl:3:", "step 2", 1);
  EXPECT_THAT(r.err, HasSubstr("inf"));
}

TEST_F(ReplayCliTest, MissingScoresOnAScoringStep) {
  const std::string path = Write("t.jsonl", GoldenPrefix("ema_lazy4", 4) + R"({"step":5})" "\n");
  const Result r = Run("--trace " + path);
  ExpectRejected(r, "t.jsonl:6:", "step 5", 4);
  EXPECT_THAT(r.err, HasSubstr("scoring step"));
}

TEST_F(ReplayCliTest, OutOfOrderStep) {
  const std::string path = Write("t.jsonl", GoldenPrefix("score_free", 2) + R"({"step":4})" "\n");
  const Result r = Run("--trace " + path);
  ExpectRejected(r, "t.jsonl:4:", "step 4", 2);
  EXPECT_THAT(r.err, HasSubstr("expected step 3"));
}

TEST_F(ReplayCliTest, InvalidPolicy) {
  const std::string path = Write(
      "t.jsonl",
      R"({"format":"kvtrace/1","prefill_len":10,"budget_tokens":4,"policy":{"aggregation":"ema","alpha":1.5}})"
      "\n{\"step\":1}\n");
  const Result r = Run("--trace " + path);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(Lines(r.err), 1u);
  EXPECT_THAT(r.err, HasSubstr("t.jsonl:1:"));
  EXPECT_THAT(r.err, HasSubstr("alpha"));
  EXPECT_TRUE(r.out.empty());
}

// SPEC.md "Span pooling": the header's span_pool is replayed (every span-pooled golden, as
// the float64 model decided it), and a bad one is refused naming the field.
TEST_F(ReplayCliTest, SpanPoolFromTheHeaderIsReplayedAndABadOneIsNamed) {
  const std::string dir = ::kvcm::testing::SpanPoolGoldenDir();
  for (const std::string& name : GoldenNames(dir)) {
    const Result r = Run(absl::StrCat("--trace ", dir, "/", name, ".trace.jsonl --tp 2"));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.err;
    EXPECT_EQ(r.out, ReadFile(dir + "/" + name + ".decisions.jsonl")) << name;
  }
  const std::string path = Write(
      "t.jsonl",
      R"({"format":"kvtrace/1","prefill_len":10,"budget_tokens":4,"policy":{"span_pool":4}})"
      "\n{\"step\":1}\n");
  const Result r = Run("--trace " + path);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("policy.span_pool is 4"));
}

TEST_F(ReplayCliTest, BothBudgetsOrNeither) {
  const std::string both = Write(
      "b.jsonl", R"({"format":"kvtrace/1","prefill_len":10,"budget_tokens":4,"compression_ratio":0.5})" "\n");
  EXPECT_EQ(Run("--trace " + both).exit_code, 2);
  const std::string neither = Write("n.jsonl", R"({"format":"kvtrace/1","prefill_len":10})" "\n");
  EXPECT_THAT(Run("--trace " + neither).err, HasSubstr("exactly one of budget_tokens"));
}

// The numbers of the JSON list that follows `key` in a decision line.
std::vector<double> ListAfter(const std::string& line, const std::string& key) {
  const size_t begin = line.find(key);
  if (begin == std::string::npos) return {};
  const size_t open = line.find('[', begin) + 1;
  std::vector<double> values;
  for (absl::string_view item :
       absl::StrSplit(line.substr(open, line.find(']', open) - open), ',', absl::SkipEmpty())) {
    double v = 0;
    EXPECT_TRUE(absl::SimpleAtod(item, &v)) << item;
    values.push_back(v);
  }
  return values;
}

// --folded sends one folded row per step: its momentum is the per-layer rule's up to
// float32 rounding (all terms are >= 0, so the difference is relative and tiny), never
// the same bytes everywhere (then nothing was folded), and on these far-from-tie traces
// the decisions stay the same.
TEST_F(ReplayCliTest, FoldedMomentumIsThePerLayerMomentumWithinRoundingOnEveryGoldenTrace) {
  int folded_somewhere = 0, same_decisions = 0;
  for (const std::string& name : GoldenNames()) {
    SCOPED_TRACE(name);
    const std::string trace = GoldenDir() + "/" + name + ".trace.jsonl";
    const Result per_layer = Run("--momentum --trace " + trace);
    const Result folded = Run("--folded --momentum --trace " + trace);
    ASSERT_EQ(folded.exit_code, 0) << folded.err;
    EXPECT_TRUE(folded.err.empty()) << folded.err;
    const std::vector<std::string> a = absl::StrSplit(per_layer.out, '\n', absl::SkipEmpty());
    const std::vector<std::string> b = absl::StrSplit(folded.out, '\n', absl::SkipEmpty());
    ASSERT_EQ(a.size(), b.size());
    bool differs = false, same = true;
    for (size_t i = 0; i < a.size(); ++i) {
      const std::vector<double> pa = ListAfter(a[i], "\"positions\""), pb = ListAfter(b[i], "\"positions\"");
      same = same && ListAfter(a[i], "\"evicted\"") == ListAfter(b[i], "\"evicted\"");
      if (pa != pb) continue;  // a decision the rounding changed: compare where caches agree
      const std::vector<double> va = ListAfter(a[i], "\"values\""), vb = ListAfter(b[i], "\"values\"");
      ASSERT_EQ(va.size(), vb.size());
      for (size_t j = 0; j < va.size(); ++j) {
        ASSERT_LE(std::abs(va[j] - vb[j]), 1e-4 * std::max(va[j], vb[j]))
            << "line " << i + 1 << " position " << pa[j];
        differs = differs || va[j] != vb[j];
      }
    }
    folded_somewhere += differs ? 1 : 0;
    same_decisions += same ? 1 : 0;
  }
  // ema with alpha 0 and recency fold exactly; every other golden trace rounds differently.
  EXPECT_GE(folded_somewhere, 6);
  EXPECT_EQ(same_decisions, static_cast<int>(GoldenNames().size()));
}

TEST_F(ReplayCliTest, FoldedThroughTheTensorParallelJoinDecidesAlike) {
  for (const char* name : {"ema_lazy4", "cumulative_recent"}) {
    const std::string trace = GoldenDir() + "/" + name + ".trace.jsonl";
    const Result one = Run("--folded --momentum --trace " + trace);
    const Result three = Run("--folded --momentum --tp 3 --trace " + trace);
    EXPECT_EQ(three.exit_code, 0) << three.err;
    EXPECT_EQ(three.out, one.out) << name;
  }
}

TEST_F(ReplayCliTest, FoldedRejectsALayerCountThatChanges) {
  const std::string path = Write(
      "t.jsonl", GoldenPrefix("ema_every_step", 2) + R"({"step":3,"layers":[[0.1],[0.2],[0.3]]})" "\n");
  const Result r = Run("--folded --trace " + path);
  ExpectRejected(r, "t.jsonl:4:", "step 3", 2);
  EXPECT_THAT(r.err, HasSubstr("3 layer rows, but this folded replay folds 4"));
}

TEST_F(ReplayCliTest, FoldedStillRejectsBadScores) {
  std::string text = GoldenPrefix("ema_every_step", 2);
  text.insert(text.rfind("[[") + 2, "-");  // first score of step 2, layer 0
  const Result r = Run("--folded --trace " + Write("t.jsonl", text));
  ExpectRejected(r, "t.jsonl:3:", "step 2", 1);
  // Checked before folding: in the folded row the negative score would be outweighed.
  EXPECT_THAT(r.err, HasSubstr("layer 0 score 0 is -"));
  EXPECT_THAT(r.err, HasSubstr("before folding"));
}

TEST_F(ReplayCliTest, UsageErrors) {
  Result r = Run("");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--trace"));
  r = Run("--trace " + (dir_ / "missing.jsonl").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot open"));
}

TEST_F(ReplayCliTest, TransportMustBeGrpcOrShmAndShmNeedsAServer) {
  const std::string trace = GoldenDir() + "/ema_lazy4.trace.jsonl";
  // Refused before anything is replayed or connected to.
  Result r = Run("--trace " + trace + " --server 127.0.0.1:1 --transport tcp");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--transport is 'tcp'; it must be grpc or shm"));
  EXPECT_TRUE(r.out.empty());
  r = Run("--trace " + trace + " --transport SHM");  // names are case-sensitive
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--transport is 'SHM'"));
  r = Run("--trace " + trace + " --transport shm");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--transport shm needs --server"));
  EXPECT_TRUE(r.out.empty());
  // The default and an explicit grpc replay the embedded engine as before.
  const std::string want = ReadFile(GoldenDir() + "/ema_lazy4.decisions.jsonl");
  r = Run("--trace " + trace + " --transport grpc");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, want);
}

TEST_F(ReplayCliTest, HelpNamesTheTransports) {
  const Result r = Run("--help=transport");
  EXPECT_THAT(r.out + r.err, HasSubstr("--server ADDR [--transport grpc|shm|created|created_per_rank]"));
  EXPECT_THAT(r.out + r.err, HasSubstr("--allow_shm_scores"));
  EXPECT_THAT(r.out + r.err, HasSubstr("default: \"grpc\""));
}

}  // namespace
}  // namespace kvcm

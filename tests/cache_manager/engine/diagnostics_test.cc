// Eviction-quality diagnostics (cache_manager/engine/diagnostics.h): every figure on hand-computed
// cases, the sampling cadence and the id hash, "off" computing nothing, steady steps
// allocating nothing, and every golden trace stepped with diagnostics on every step against
// the same figures computed offline from the trace (checked against its golden decisions).
// This binary counts heap allocations (tests/cache_manager/count_allocations.h).
#include "cache_manager/engine/diagnostics.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/table/sequence_table.h"
#include "clients/replay/trace.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/count_allocations.h"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/cache_manager/reference_engine.h"
#include "tests/clients/golden.h"


namespace kvcm {
namespace {

using ::kvcm::testing::DenseScores;
using ::kvcm::testing::GoldenDir;
using ::kvcm::testing::GoldenNames;
using ::kvcm::testing::Layers;
using ::kvcm::testing::PresetOptions;
using ::kvcm::testing::StepWith;

// Observes one step with explicit candidates: `scores` [layers][n], `candidates` the n
// positions, `evicted_indices` into them, `momentum` of the retained ones.
StepDiagnostics ObserveStep(SequenceDiagnostics& diag, int64_t k, const Layers& scores,
                            const std::vector<int64_t>& candidates,
                            const std::vector<int64_t>& evicted_indices,
                            const std::vector<float>& momentum) {
  std::vector<int64_t> retained, evicted;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const bool out = std::find(evicted_indices.begin(), evicted_indices.end(),
                               static_cast<int64_t>(i)) != evicted_indices.end();
    (out ? evicted : retained).push_back(candidates[i]);
  }
  DenseScores dense(scores);
  StepDiagnostics d;
  diag.Observe(k, dense.matrix, retained, momentum, evicted_indices, evicted, &d);
  return d;
}

TEST(SequenceDiagnosticsTest, TopKIsATenthOfTheBudgetRoundedUp) {
  EXPECT_EQ(DiagnosticsTopK(1), 1);
  EXPECT_EQ(DiagnosticsTopK(10), 1);
  EXPECT_EQ(DiagnosticsTopK(11), 2);
  EXPECT_EQ(DiagnosticsTopK(25), 3);
  EXPECT_EQ(DiagnosticsTopK(6400), 640);
}

TEST(SequenceDiagnosticsTest, HandComputedFiguresOfConsecutiveSteps) {
  SequenceDiagnostics diag(/*every=*/1, /*budget=*/11);  // k = 2
  ASSERT_EQ(diag.top_k(), 2);
  // k=1: candidates 0..4, raw [0.5 0.1 0.4 0.3 0.2]: R = {0,2}; evicts 1; the cache
  // {0,2,3,4} has momentum [0.1 0.9 0.8 0.2]: M = {2,3}. The first examined step primes.
  StepDiagnostics d = ObserveStep(diag, 1, {{0.5f, 0.1f, 0.4f, 0.3f, 0.2f}}, {0, 1, 2, 3, 4},
                                  {1}, {0.1f, 0.9f, 0.8f, 0.2f});
  EXPECT_FALSE(d.measured);

  // k=2: candidates {0,2,3,4,5}, raw [0.1 0.2 0.6 0.5 0.3]: R = {3,4}; evicts 0; the cache
  // {2,3,4,5} has momentum [0.7 0.6 0.8 0.1]: M = {2,4}.
  d = ObserveStep(diag, 2, {{0.1f, 0.2f, 0.6f, 0.5f, 0.3f}}, {0, 2, 3, 4, 5}, {0},
                  {0.7f, 0.6f, 0.8f, 0.1f});
  ASSERT_TRUE(d.measured);
  EXPECT_DOUBLE_EQ(d.raw_topk_churn, 1.0);                 // {3,4} vs {0,2}
  EXPECT_DOUBLE_EQ(d.momentum_topk_churn, 1.0 - 1.0 / 3.0);  // {2,4} vs {2,3}
  EXPECT_DOUBLE_EQ(d.raw_momentum_jaccard, 1.0 / 3.0);     // {4} of {2,3,4}
  EXPECT_TRUE(d.small_change);                             // only 4 entered M
  EXPECT_EQ(d.evicted, 1);
  EXPECT_EQ(d.evicted_relevant, 0);                        // 0 is not in R_2

  // k=3: every raw score and momentum equal: the tie rule keeps the higher positions,
  // R = {5,6}, M = {4,5} (of the cache {2,3,4,5}); the new token 6 is evicted in its own
  // step while in R.
  d = ObserveStep(diag, 3, {{0.2f, 0.2f, 0.2f, 0.2f, 0.2f}}, {2, 3, 4, 5, 6}, {4},
                  {0.5f, 0.5f, 0.5f, 0.5f});
  ASSERT_TRUE(d.measured);
  EXPECT_DOUBLE_EQ(d.raw_topk_churn, 1.0);                 // {5,6} vs {3,4}
  EXPECT_DOUBLE_EQ(d.momentum_topk_churn, 1.0 - 1.0 / 3.0);  // {4,5} vs {2,4}
  EXPECT_DOUBLE_EQ(d.raw_momentum_jaccard, 1.0 / 3.0);     // {5} of {4,5,6}
  EXPECT_TRUE(d.small_change);                             // only 5 entered M
  EXPECT_EQ(d.evicted, 1);
  EXPECT_EQ(d.evicted_relevant, 1);

  // k=4: candidates {2,3,4,5,7}, raw [0.9 0.8 0.1 0.1 0.1]: R = {2,3}; evicts 4 and 5;
  // the cache {2,3,7} has momentum [0.3 0.2 0.9]: M = {2,7}, two tokens new to M.
  d = ObserveStep(diag, 4, {{0.9f, 0.8f, 0.1f, 0.1f, 0.1f}}, {2, 3, 4, 5, 7}, {2, 3},
                  {0.3f, 0.2f, 0.9f});
  ASSERT_TRUE(d.measured);
  EXPECT_DOUBLE_EQ(d.raw_topk_churn, 1.0);
  EXPECT_DOUBLE_EQ(d.momentum_topk_churn, 1.0);            // {2,7} vs {4,5}
  EXPECT_DOUBLE_EQ(d.raw_momentum_jaccard, 1.0 / 3.0);     // {2} of {2,3,7}
  EXPECT_FALSE(d.small_change);
  EXPECT_EQ(d.evicted, 2);
  EXPECT_EQ(d.evicted_relevant, 0);

  // k=5: R and M both {2,7}: no churn of M, full agreement.
  d = ObserveStep(diag, 5, {{0.9f, 0.1f, 0.8f, 0.2f}}, {2, 3, 7, 8}, {1},
                  {0.5f, 0.9f, 0.1f});
  ASSERT_TRUE(d.measured);
  EXPECT_DOUBLE_EQ(d.raw_topk_churn, 1.0 - 1.0 / 3.0);     // {2,7} vs {2,3}
  EXPECT_DOUBLE_EQ(d.momentum_topk_churn, 0.0);
  EXPECT_DOUBLE_EQ(d.raw_momentum_jaccard, 1.0);
  EXPECT_TRUE(d.small_change);
  EXPECT_EQ(d.evicted_relevant, 0);
}

TEST(SequenceDiagnosticsTest, RawScoreIsTheMeanOverLayers) {
  // Layer 0 alone ranks {0,1} on top, layer 1 alone {2,3}; the mean [0.5 0.45 0.45 0.6]
  // ranks {0,3}. Evicting 0 is then relevant (it is in R), and against M = {2,3} the
  // Jaccard is 1/3: layer 0 alone would give (1, 0), layer 1 alone (0, 1).
  SequenceDiagnostics diag(1, 11);
  ObserveStep(diag, 1, {{0.1f, 0.2f, 0.3f}}, {0, 1, 2}, {}, {0.1f, 0.2f, 0.3f});
  const StepDiagnostics d =
      ObserveStep(diag, 2, {{1.0f, 0.9f, 0.0f, 0.6f}, {0.0f, 0.0f, 0.9f, 0.6f}}, {0, 1, 2, 3},
                  {0}, {0.1f, 0.9f, 0.8f});
  ASSERT_TRUE(d.measured);
  EXPECT_EQ(d.evicted_relevant, 1);
  EXPECT_DOUBLE_EQ(d.raw_momentum_jaccard, 1.0 / 3.0);
}

TEST(SequenceDiagnosticsTest, FewerCandidatesThanKPutEveryTokenInBothSets) {
  SequenceDiagnostics diag(1, 30);  // k = 3
  ObserveStep(diag, 1, {{0.1f, 0.2f}}, {0, 1}, {}, {0.1f, 0.2f});
  const StepDiagnostics d =
      ObserveStep(diag, 2, {{0.3f, 0.2f, 0.1f}}, {0, 1, 2}, {}, {0.3f, 0.2f, 0.1f});
  ASSERT_TRUE(d.measured);
  EXPECT_DOUBLE_EQ(d.raw_topk_churn, 1.0 - 2.0 / 3.0);  // the new token joined both
  EXPECT_DOUBLE_EQ(d.momentum_topk_churn, 1.0 - 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(d.raw_momentum_jaccard, 1.0);
  EXPECT_TRUE(d.small_change);
  EXPECT_EQ(d.evicted, 0);
}

TEST(SequenceDiagnosticsTest, EveryNMeasuresOneConsecutivePairPerNScoringSteps) {
  SequenceDiagnostics diag(/*every=*/3, /*budget=*/2);
  std::vector<int64_t> examined, measured;
  for (int64_t k = 1; k <= 10; ++k) {
    if (diag.Examines(k)) examined.push_back(k);
    // Candidates: the cache {0,1} plus a new token, evicted in its own step.
    const StepDiagnostics d =
        ObserveStep(diag, k, {{0.5f, 0.4f, 0.1f}}, {0, 1, k + 1}, {2}, {0.5f, 0.4f});
    if (d.measured) measured.push_back(k);
  }
  EXPECT_EQ(examined, (std::vector<int64_t>{2, 3, 5, 6, 8, 9}));
  EXPECT_EQ(measured, (std::vector<int64_t>{3, 6, 9}));

  SequenceDiagnostics every_step(1, 2);
  for (int64_t k = 1; k <= 4; ++k) EXPECT_TRUE(every_step.Examines(k));
}

TEST(SampledForDiagnosticsTest, IsAFixedHashOfTheIdAndMonotoneInTheFraction) {
  int sampled = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::string id = absl::StrCat("req-", i);
    const bool at_half = SampledForDiagnostics({1, 0.5}, id);
    EXPECT_EQ(at_half, SampledForDiagnostics({7, 0.5}, id));  // `every` does not choose
    if (at_half) {
      ++sampled;
      EXPECT_TRUE(SampledForDiagnostics({1, 0.75}, id)) << id;
    }
    EXPECT_TRUE(SampledForDiagnostics({1, 1.0}, id));
    EXPECT_FALSE(SampledForDiagnostics({1, 0.0}, id));
    EXPECT_FALSE(SampledForDiagnostics({0, 1.0}, id));  // every 0: off
  }
  EXPECT_GT(sampled, 900);
  EXPECT_LT(sampled, 1100);
  // Pinned: a fixed hash (not a per-process seeded one) picks the same ids on every daemon,
  // build and restart.
  std::vector<int> picked;
  for (int i = 0; i < 24; ++i) {
    if (SampledForDiagnostics({1, 0.5}, absl::StrCat("req-", i))) picked.push_back(i);
  }
  EXPECT_EQ(picked, (std::vector<int>{0, 1, 3, 8, 9, 10, 11, 12, 15, 16, 19}));
}

TEST(SequenceDiagnosticsTest, TableSamplesAtOpenAndOffMeasuresNothing) {
  std::mt19937_64 rng(3);
  for (const DiagnosticsOptions& diagnostics :
       {DiagnosticsOptions{0, 1.0}, DiagnosticsOptions{1, 0.0}, DiagnosticsOptions{1, 1.0}}) {
    SequenceTableOptions options;
    options.diagnostics = diagnostics;
    SequenceTable table(options);
    ASSERT_TRUE(table.Open("s", PresetOptions(16, 8)).ok());
    int measured = 0;
    EvictionDecision d;
    for (int64_t t = 1; t <= 6; ++t) {
      // The first step scores the prefill and the new token, later ones the budget + 1.
      DenseScores scores(::kvcm::testing::RandomLayers(rng, 2, t == 1 ? 17 : 9, false));
      ASSERT_TRUE(table.Step("s", t, &scores.matrix, &d).ok());
      measured += d.diagnostics.measured ? 1 : 0;
    }
    EXPECT_EQ(measured, diagnostics.every == 1 && diagnostics.sample == 1.0 ? 5 : 0);
  }
}

TEST(SequenceDiagnosticsTest, SingleStepMomentumIsTheRawScoreSoBothTopSetsAgree) {
  // tova: the momentum is the step's raw score and the evicted token its lowest, so the
  // raw top-k of the candidates is the momentum top-k of the cache.
  auto s = *Sequence::Create("tova", PresetOptions(64, 30, "tova"));
  s->EnableDiagnostics(1);
  std::mt19937_64 rng(5);
  EvictionDecision d;
  int measured = 0;
  for (int64_t t = 1; t <= 20; ++t) {
    const Layers layers = ::kvcm::testing::RandomLayers(rng, 3, s->next_score_length(), false);
    ASSERT_TRUE(StepWith(*s, t, layers, &d).ok());
    if (!d.diagnostics.measured) continue;
    ++measured;
    EXPECT_DOUBLE_EQ(d.diagnostics.raw_momentum_jaccard, 1.0);
    EXPECT_DOUBLE_EQ(d.diagnostics.raw_topk_churn, d.diagnostics.momentum_topk_churn);
    EXPECT_EQ(d.diagnostics.evicted_relevant, 0);
  }
  EXPECT_EQ(measured, 19);
}

TEST(SequenceDiagnosticsTest, NotEnabledOrNonScoringPoliciesMeasureNothing) {
  std::mt19937_64 rng(6);
  auto plain = *Sequence::Create("plain", PresetOptions(32, 8));
  auto recency = *Sequence::Create("recency", PresetOptions(32, 8, "streaming_llm"));
  recency->EnableDiagnostics(1);  // never scores: no diagnostics are attached
  EvictionDecision d;
  for (int64_t t = 1; t <= 5; ++t) {
    const Layers layers = ::kvcm::testing::RandomLayers(rng, 2, plain->next_score_length(), false);
    ASSERT_TRUE(StepWith(*plain, t, layers, &d).ok());
    EXPECT_FALSE(d.diagnostics.measured);
    ASSERT_TRUE(StepWith(*recency, t, {}, &d).ok());
    EXPECT_FALSE(d.diagnostics.measured);
  }
}

TEST(SequenceDiagnosticsTest, SteadyStepsAllocateNothing) {
  const int64_t prefill = 4096, budget = 410;
  auto s = *Sequence::Create("steady", PresetOptions(prefill, budget));
  s->EnableDiagnostics(1);
  std::mt19937_64 rng(7);
  EvictionDecision d;
  const Layers first = ::kvcm::testing::RandomLayers(rng, 4, prefill + 1, false);
  ASSERT_TRUE(StepWith(*s, 1, first, &d).ok());
  const Layers steady = ::kvcm::testing::RandomLayers(rng, 4, budget + 1, false);
  DenseScores scores(steady);
  ASSERT_TRUE(s->Step(2, &scores.matrix, &d).ok());  // warm up: the first measured step
  const int64_t before = ::kvcm::testing::AllocationCount();
  int measured = 0;
  for (int64_t t = 3; t < 103; ++t) {
    ASSERT_TRUE(s->Step(t, &scores.matrix, &d).ok());
    measured += d.diagnostics.measured ? 1 : 0;
  }
  EXPECT_EQ(::kvcm::testing::AllocationCount() - before, 0);
  EXPECT_EQ(measured, 100);
}

// ---- The golden traces against an offline reference ----------------------------------

// The evicted positions of each line of NAME.decisions.jsonl.
std::vector<std::vector<int64_t>> GoldenEvictions(const std::string& path) {
  std::vector<std::vector<int64_t>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t open = line.find("\"evicted\":[") + 11;
    const std::string list = line.substr(open, line.find(']', open) - open);
    std::vector<int64_t> evicted;
    for (size_t pos = 0; pos < list.size();) {
      size_t comma = list.find(',', pos);
      if (comma == std::string::npos) comma = list.size();
      evicted.push_back(std::stoll(list.substr(pos, comma - pos)));
      pos = comma + 1;
    }
    out.push_back(std::move(evicted));
  }
  return out;
}

// The positions of the `k` highest `values` (ties: the higher position), by a full sort.
std::set<int64_t> RefTop(const std::vector<float>& values, const std::vector<int64_t>& positions,
                         int64_t k) {
  std::vector<size_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return values[a] != values[b] ? values[a] > values[b] : a > b;
  });
  std::set<int64_t> top;
  for (size_t j = 0; j < std::min(order.size(), static_cast<size_t>(k)); ++j) {
    top.insert(positions[order[j]]);
  }
  return top;
}

double RefJaccard(const std::set<int64_t>& a, const std::set<int64_t>& b) {
  std::vector<int64_t> common;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
  const size_t united = a.size() + b.size() - common.size();
  return united == 0 ? 1.0 : static_cast<double>(common.size()) / static_cast<double>(united);
}

class DiagnosticsGoldenTest : public ::testing::TestWithParam<std::string> {};

// The engine with diagnostics on every scoring step, against figures computed from the
// trace by tests/cache_manager/reference_engine.h (a plain model of SPEC.md, whose
// evictions must equal the golden decisions) and full sorts.
TEST_P(DiagnosticsGoldenTest, LiveFiguresEqualTheOfflineReference) {
  const std::string name = GetParam();
  auto reader = *replay::TraceReader::Open(GoldenDir() + "/" + name + ".trace.jsonl");
  const auto golden = GoldenEvictions(GoldenDir() + "/" + name + ".decisions.jsonl");
  auto seq = *Sequence::Create(name, reader->header().ToSequenceOptions());
  seq->EnableDiagnostics(1);
  const int64_t k = DiagnosticsTopK(seq->budget());
  ::kvcm::testing::ReferenceEngine ref(seq->prefill_len(), seq->budget(), seq->policy());

  std::set<int64_t> prev_raw, prev_momentum;
  int64_t scoring_steps = 0, measured = 0;
  replay::TraceStep step;
  EvictionDecision d;
  while (*reader->Next(&step)) {
    const std::string where = absl::StrCat(name, " step ", step.step);
    const kernels::ScoreMatrix m = step.Matrix();
    ASSERT_TRUE(seq->Step(step.step, step.layers > 0 ? &m : nullptr, &d).ok()) << where;
    const std::vector<int64_t>& evicted = golden[static_cast<size_t>(step.step - 1)];
    ASSERT_EQ(d.evicted, evicted) << where;

    std::vector<int64_t> candidates = ref.positions();
    candidates.push_back(seq->prefill_len() + step.step - 1);
    Layers layers(static_cast<size_t>(step.layers));
    for (int64_t l = 0; l < step.layers; ++l) {
      layers[static_cast<size_t>(l)].assign(step.scores.begin() + l * step.tokens,
                                            step.scores.begin() + (l + 1) * step.tokens);
    }
    ASSERT_EQ(ref.Step(step.step, layers).evicted, evicted) << where;
    if (!seq->policy().IsScoringStep(step.step)) {
      EXPECT_FALSE(d.diagnostics.measured) << where;
      continue;
    }
    ++scoring_steps;
    std::vector<float> raw(candidates.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      float sum = 0.0f;
      for (const auto& row : layers) sum += row[i];
      raw[i] = sum / static_cast<float>(layers.size());
    }
    std::set<int64_t> top_raw = RefTop(raw, candidates, k);
    std::set<int64_t> top_momentum = RefTop(ref.momentum(), ref.positions(), k);
    ASSERT_EQ(d.diagnostics.measured, scoring_steps > 1) << where;
    if (scoring_steps > 1) {
      ++measured;
      const StepDiagnostics& q = d.diagnostics;
      EXPECT_DOUBLE_EQ(q.raw_topk_churn, 1.0 - RefJaccard(top_raw, prev_raw)) << where;
      EXPECT_DOUBLE_EQ(q.momentum_topk_churn, 1.0 - RefJaccard(top_momentum, prev_momentum))
          << where;
      EXPECT_DOUBLE_EQ(q.raw_momentum_jaccard, RefJaccard(top_raw, top_momentum)) << where;
      size_t entered = 0;
      for (int64_t p : top_momentum) entered += prev_momentum.count(p) == 0 ? 1 : 0;
      EXPECT_EQ(q.small_change, entered <= 1) << where;
      EXPECT_EQ(q.evicted, static_cast<int64_t>(evicted.size())) << where;
      int64_t relevant = 0;
      for (int64_t p : evicted) relevant += top_raw.count(p) != 0 ? 1 : 0;
      EXPECT_EQ(q.evicted_relevant, relevant) << where;
    }
    prev_raw = std::move(top_raw);
    prev_momentum = std::move(top_momentum);
  }
  EXPECT_EQ(measured, std::max<int64_t>(0, scoring_steps - 1)) << name;
}

INSTANTIATE_TEST_SUITE_P(AllGoldenVectors, DiagnosticsGoldenTest,
                         ::testing::ValuesIn(GoldenNames()),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           return param_info.param;
                         });

}  // namespace
}  // namespace kvcm

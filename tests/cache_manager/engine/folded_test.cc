// Folded reports (docs/SPEC.md, "Folded reports"): the fold weights, the folded Sequence,
// the float64 check of its decisions on every golden trace, and tensor-parallel ranks
// folding their head sums.
#include "cache_manager/policy/fold.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/tp/tensor_parallel_join.h"
#include "clients/replay/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/half_float.h"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/clients/golden.h"

namespace kvcm {
namespace {

using ::kvcm::testing::DenseScores;
using ::kvcm::testing::GoldenDir;
using ::kvcm::testing::GoldenNames;
using ::kvcm::testing::Layers;
using ::kvcm::testing::StepWith;
using ::testing::HasSubstr;

Policy WithAggregation(Aggregation aggregation, double alpha = 0.8) {
  Policy p;
  p.aggregation = aggregation;
  p.alpha = alpha;
  return p;
}

FoldWeights WeightsOrDie(const Policy& policy, int64_t layers) {
  absl::StatusOr<FoldWeights> w = FoldWeightsFor(policy, layers);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *w : FoldWeights{};
}

// ---------------------------------------------------------------------------------------
// The weights.

TEST(FoldWeightsTest, EmaWeighsLayerLByOneMinusAlphaTimesAlphaToTheKMinusOneMinusL) {
  const FoldWeights w = WeightsOrDie(WithAggregation(Aggregation::kEma, 0.8), 4);
  ASSERT_EQ(w.layer_weights.size(), 4u);
  EXPECT_DOUBLE_EQ(w.layer_weights[0], 0.2 * 0.512);
  EXPECT_DOUBLE_EQ(w.layer_weights[1], 0.2 * 0.64);
  EXPECT_DOUBLE_EQ(w.layer_weights[2], 0.2 * 0.8);
  EXPECT_DOUBLE_EQ(w.layer_weights[3], 0.2);
  EXPECT_DOUBLE_EQ(w.decay, 0.4096);
  // An ema step is a convex combination: the weights and the decay sum to 1.
  double total = w.decay;
  for (double x : w.layer_weights) total += x;
  EXPECT_NEAR(total, 1.0, 1e-15);
}

TEST(FoldWeightsTest, EmaWithAlphaZeroKeepsOnlyTheLastLayer) {
  const FoldWeights w = WeightsOrDie(WithAggregation(Aggregation::kEma, 0.0), 3);
  EXPECT_EQ(w.layer_weights, (std::vector<double>{0.0, 0.0, 1.0}));
  EXPECT_EQ(w.decay, 0.0);
}

TEST(FoldWeightsTest, CumulativeSumsAndKeepsThePast) {
  const FoldWeights w = WeightsOrDie(WithAggregation(Aggregation::kCumulative), 5);
  EXPECT_EQ(w.layer_weights, std::vector<double>(5, 1.0));
  EXPECT_EQ(w.decay, 1.0);
}

TEST(FoldWeightsTest, SingleStepAveragesAndDropsThePast) {
  const FoldWeights w = WeightsOrDie(WithAggregation(Aggregation::kSingleStep), 3);
  EXPECT_EQ(w.layer_weights, std::vector<double>(3, 1.0 / 3.0));
  EXPECT_EQ(w.decay, 0.0);
}

TEST(FoldWeightsTest, PoliciesThatReadNoScoresHaveNoWeights) {
  for (Aggregation a : {Aggregation::kRecency, Aggregation::kRandom}) {
    const FoldWeights w = WeightsOrDie(WithAggregation(a), 7);
    EXPECT_TRUE(w.layer_weights.empty());
    EXPECT_EQ(w.decay, 1.0);
  }
}

TEST(FoldWeightsTest, LayersMustBeOneTo4096) {
  for (int64_t bad : {int64_t{0}, int64_t{-1}, kMaxFoldLayers + 1}) {
    const absl::StatusOr<FoldWeights> w = FoldWeightsFor(Policy{}, bad);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(w.status().message(), HasSubstr("1 to 4096 layers"));
  }
  EXPECT_EQ(WeightsOrDie(Policy{}, 1).layer_weights, std::vector<double>{1.0 - 0.8});
  EXPECT_EQ(WeightsOrDie(Policy{}, kMaxFoldLayers).layer_weights.size(), 4096u);
}

TEST(ScoreLayoutTest, NamesRoundTrip) {
  for (ScoreLayout l : {ScoreLayout::kPerLayer, ScoreLayout::kFolded}) {
    EXPECT_EQ(*ParseScoreLayout(ScoreLayoutName(l)), l);
  }
  EXPECT_EQ(ScoreLayoutName(ScoreLayout::kFolded), "folded");
  EXPECT_EQ(ParseScoreLayout("FOLDED").status().code(), absl::StatusCode::kInvalidArgument);
}

// The closed form: one step of the per-layer rule, in double, equals decay * m + fold.
TEST(FoldRowsTest, ClosedFormIsThePerLayerRuleInDouble) {
  std::mt19937_64 rng(5);
  constexpr int64_t kLayers = 32;
  constexpr int64_t kTokens = 1500;  // more than one of FoldRows' blocks
  const Layers rows = testing::RandomLayers(rng, kLayers, kTokens, /*ties=*/false);
  DenseScores dense(rows);
  std::vector<double> m0(kTokens);
  for (double& x : m0) x = static_cast<double>(rng() % 1000) / 997.0;
  for (Aggregation a : {Aggregation::kEma, Aggregation::kCumulative, Aggregation::kSingleStep}) {
    const Policy policy = WithAggregation(a, 0.8);
    const FoldWeights w = WeightsOrDie(policy, kLayers);
    std::vector<double> folded(kTokens);
    FoldRows(dense.matrix, w, folded.data());
    std::vector<float> folded32(kTokens);
    FoldRows(dense.matrix, w, folded32.data());
    for (int64_t i = 0; i < kTokens; ++i) {
      double m = a == Aggregation::kSingleStep ? 0.0 : m0[i];
      for (const auto& row : rows) {
        const double s = row[static_cast<size_t>(i)];
        if (a == Aggregation::kEma) m = 0.8 * m + 0.2 * s;
        if (a == Aggregation::kCumulative || a == Aggregation::kSingleStep) m += s;
      }
      if (a == Aggregation::kSingleStep) m /= kLayers;
      const double closed = w.decay * m0[i] + folded[i];
      ASSERT_NEAR(closed, m, 1e-13 * std::max(1.0, std::abs(m))) << AggregationName(a) << " " << i;
      ASSERT_EQ(folded32[i], static_cast<float>(folded[i]));  // rounded once
    }
  }
}

TEST(FoldRowsTest, ReadsHalfPrecisionAndStridedRows) {
  // 2 layers x 3 tokens, stride 4, float16; cumulative weights sum the rows.
  std::vector<uint16_t> h(8, 0xbc00);  // padding: -1
  const float values[2][3] = {{0.5f, 0.25f, 1.0f}, {0.125f, 2.0f, 0.0f}};
  for (int l = 0; l < 2; ++l) {
    for (int i = 0; i < 3; ++i) h[l * 4 + i] = kernels::FloatToFloat16(values[l][i]);
  }
  const kernels::ScoreMatrix rows{h.data(), kernels::ScoreDtype::kFloat16, 2, 3, 4};
  std::vector<float> out(3);
  FoldRows(rows, WeightsOrDie(WithAggregation(Aggregation::kCumulative), 2), out.data());
  EXPECT_EQ(out, (std::vector<float>{0.625f, 2.25f, 1.0f}));
}

// ---------------------------------------------------------------------------------------
// The folded Sequence.

SequenceOptions FoldedOptions(Policy policy, int64_t layers, int64_t prefill = 8,
                              int64_t budget = 6) {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget.budget_tokens = budget;
  o.policy = std::move(policy);
  o.score_layout = ScoreLayout::kFolded;
  o.layers = layers;
  return o;
}

TEST(FoldedSequenceTest, CreateChecksTheLayoutsLayers) {
  for (int64_t bad : {int64_t{0}, int64_t{4097}}) {
    auto s = Sequence::Create("f", FoldedOptions(Policy{}, bad));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr("sequence 'f'"));
    EXPECT_THAT(s.status().message(), HasSubstr("layers"));
  }
  SequenceOptions per_layer = FoldedOptions(Policy{}, 32);
  per_layer.score_layout = ScoreLayout::kPerLayer;
  auto s = Sequence::Create("p", per_layer);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("per_layer"));
  per_layer.layers = 0;
  ASSERT_TRUE(Sequence::Create("p", per_layer).ok());
  EXPECT_EQ((*Sequence::Create("p", per_layer))->layers(), 0);
  EXPECT_EQ((*Sequence::Create("p", per_layer))->score_layout(), ScoreLayout::kPerLayer);
  // A policy that reads no scores may still be opened folded (it ignores scores).
  EXPECT_TRUE(Sequence::Create("r", FoldedOptions(WithAggregation(Aggregation::kRecency), 1)).ok());
}

TEST(FoldedSequenceTest, ExposesItsLayoutLayersAndWeights) {
  auto s = Sequence::Create("f", FoldedOptions(WithAggregation(Aggregation::kEma, 0.5), 3));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->score_layout(), ScoreLayout::kFolded);
  EXPECT_EQ((*s)->layers(), 3);
  EXPECT_EQ((*s)->fold_weights().layer_weights, (std::vector<double>{0.125, 0.25, 0.5}));
  EXPECT_EQ((*s)->fold_weights().decay, 0.125);
}

TEST(FoldedSequenceTest, AppliesDecayTimesMomentumPlusTheRow) {
  auto s = Sequence::Create("f", FoldedOptions(WithAggregation(Aggregation::kEma, 0.8), 4, 3, 10));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->next_score_length(), 4);
  EvictionDecision d;
  ASSERT_TRUE(StepWith(**s, 1, {{0.5f, 0.25f, 0.125f, 1.0f}}, &d).ok());
  EXPECT_EQ(std::vector<float>((*s)->state().momentum().begin(), (*s)->state().momentum().end()),
            (std::vector<float>{0.5f, 0.25f, 0.125f, 1.0f}));
  ASSERT_TRUE(StepWith(**s, 2, {{0.1f, 0.2f, 0.3f, 0.4f, 0.5f}}, &d).ok());
  const float decay = static_cast<float>(std::pow(0.8, 4));
  const std::vector<float> want = {decay * 0.5f + 0.1f, decay * 0.25f + 0.2f,
                                   decay * 0.125f + 0.3f, decay * 1.0f + 0.4f, 0.5f};
  EXPECT_EQ(std::vector<float>((*s)->state().momentum().begin(), (*s)->state().momentum().end()),
            want);
}

TEST(FoldedSequenceTest, AScoringStepWithZeroOrTwoRowsIsRejectedAndChangesNothing) {
  auto s = Sequence::Create("f", FoldedOptions(WithAggregation(Aggregation::kEma, 0.8), 4));
  ASSERT_TRUE(s.ok()) << s.status();
  EvictionDecision d;
  std::mt19937_64 rng(1);
  ASSERT_TRUE(StepWith(**s, 1, testing::RandomLayers(rng, 1, 9, false), &d).ok());
  const std::vector<float> before((*s)->state().momentum().begin(), (*s)->state().momentum().end());
  const std::vector<int64_t> positions((*s)->state().positions().begin(),
                                       (*s)->state().positions().end());

  for (int64_t rows : {0, 2}) {
    const absl::Status st = StepWith(**s, 2, testing::RandomLayers(rng, rows, 7, false), &d);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << rows;
    EXPECT_THAT(st.message(), HasSubstr("sequence 'f' step 2"));
    EXPECT_THAT(st.message(), HasSubstr("exactly 1 score row"));
    EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("this step has ", rows, " rows")));
    EXPECT_EQ((*s)->last_step(), 1);
    EXPECT_EQ(std::vector<float>((*s)->state().momentum().begin(), (*s)->state().momentum().end()),
              before);
    EXPECT_EQ(std::vector<int64_t>((*s)->state().positions().begin(),
                                   (*s)->state().positions().end()),
              positions);
  }
  EXPECT_TRUE(StepWith(**s, 2, testing::RandomLayers(rng, 1, 7, false), &d).ok());
}

TEST(FoldedSequenceTest, ABadFoldedScoreIsNamedByItsIndex) {
  auto s = Sequence::Create("f", FoldedOptions(Policy{}, 2, 3, 10));
  ASSERT_TRUE(s.ok());
  EvictionDecision d;
  const absl::Status st = StepWith(**s, 1, {{0.5f, -1.0f, 0.0f, 0.0f}}, &d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("folded row score 1 (position 1)"));
  EXPECT_EQ((*s)->last_step(), 0);
}

TEST(FoldedSequenceTest, NonScoringStepsIgnoreAnyRows) {
  Policy lazy = WithAggregation(Aggregation::kEma, 0.8);
  lazy.refresh = Refresh::kLazy;
  lazy.refresh_interval = 2;
  auto s = Sequence::Create("f", FoldedOptions(lazy, 4));
  ASSERT_TRUE(s.ok());
  EvictionDecision d;
  std::mt19937_64 rng(2);
  ASSERT_TRUE(StepWith(**s, 1, testing::RandomLayers(rng, 1, 9, false), &d).ok());
  EXPECT_FALSE(d.next_needs_scores);
  ASSERT_TRUE(StepWith(**s, 2, testing::RandomLayers(rng, 3, 7, false), &d).ok());
  EXPECT_TRUE(d.scores_ignored);
  EXPECT_EQ((*s)->stats().ignored_score_reports, 1);
}

// ---------------------------------------------------------------------------------------
// The float64 check on every golden trace.
//
// Each scoring step's K layer rows are folded (FoldRows, float32) and a folded Sequence
// takes the row. Beside it runs a float64 model of the PER-LAYER rule of SPEC.md over the
// cache the folded engine holds: the same tokens, the folded engine's evictions applied to
// it, each scoring step applied layer by layer in double to the trace's float32 scores,
// and a non-scoring step's new token starting at the double mean of the model's cached
// momentum (recency: its position). After each step, with M the model's momentum after
// the update and before eviction, and U the tokens the engine kept that were eligible for
// eviction (not a protected sink, not among the protect_recent newest):
//
//     for every evicted e and every u in U:   M(e) - M(u) <= 2e-4 * max(M(e), M(u))
//
// i.e. no evicted token's exact momentum is above a kept eligible one's by more than a
// relative 2e-4. (It is checked on the pair max_e M(e), min_u M(u), which is equivalent.)

// What one run found.
struct CheckResult {
  std::vector<EvictionDecision> decisions;
  int64_t steps_checked = 0;  // steps that evicted with eligible tokens kept
  double worst = 0;           // largest (M(e) - M(u)) / max(M(e), M(u)) seen, or <= 0
  int64_t violations = 0;     // steps where it exceeded 2e-4
  std::string first_violation;
};

// The float64 model of the per-layer rule over the engine's cache (see above). With span
// pooling (SPEC.md, "Span pooling") it pools in double what the engine pools: each layer
// row, or for a folded sequence (`fold` given) the row folded with `fold`'s weights.
class PerLayerFloat64Model {
 public:
  PerLayerFloat64Model(const Policy& policy, int64_t prefill_len,
                       const FoldWeights* fold = nullptr)
      : policy_(policy), prefill_len_(prefill_len),
        fold_(fold != nullptr && policy.PoolsSpans() ? *fold : FoldWeights{}) {
    for (int64_t p = 0; p < prefill_len; ++p) {
      tokens_.push_back({p, policy.aggregation == Aggregation::kRecency ? static_cast<double>(p) : 0});
    }
  }

  // Step `step`, whose K layer rows are `rows` ([K, |C| + 1] dense f32; read only when
  // `scoring`), and which the engine decided as `d`: checks the evictions, applies them.
  void Step(int64_t step, bool scoring, const std::vector<float>& rows, int64_t layers,
            const EvictionDecision& d, CheckResult* result) {
    const int64_t position = prefill_len_ + step - 1;
    double initial = 0.0;
    if (policy_.aggregation == Aggregation::kRecency) {
      initial = static_cast<double>(position);
    } else if (!scoring && !tokens_.empty()) {
      for (const Token& t : tokens_) initial += t.momentum;
      initial /= static_cast<double>(tokens_.size());
    }
    tokens_.push_back({position, initial});
    if (scoring) Apply(rows, layers);

    const int64_t n = static_cast<int64_t>(tokens_.size());
    double max_evicted = -1.0, min_kept = std::numeric_limits<double>::infinity();
    std::vector<Token> kept;
    for (int64_t i = 0; i < n; ++i) {
      const Token& t = tokens_[static_cast<size_t>(i)];
      const bool evicted = std::binary_search(d.evicted.begin(), d.evicted.end(), t.position);
      const bool eligible = t.position >= policy_.protect_sinks && i < n - policy_.protect_recent;
      if (evicted) {
        EXPECT_TRUE(eligible) << "step " << step << " evicted protected position " << t.position;
        max_evicted = std::max(max_evicted, t.momentum);
      } else {
        if (eligible) min_kept = std::min(min_kept, t.momentum);
        kept.push_back(t);
      }
    }
    tokens_ = std::move(kept);
    if (d.evicted.empty() || !std::isfinite(min_kept) ||
        policy_.aggregation == Aggregation::kRandom) {
      return;
    }
    ++result->steps_checked;
    const double scale = std::max(max_evicted, min_kept);
    result->worst = std::max(result->worst, scale > 0 ? (max_evicted - min_kept) / scale : 0.0);
    if (max_evicted - min_kept > 2e-4 * scale && result->violations++ == 0) {
      result->first_violation =
          absl::StrCat("step ", step, ": an evicted token's float64 momentum ", max_evicted,
                       " is above a kept eligible token's ", min_kept);
    }
  }

  // The model's cache must be the engine's.
  void ExpectSameCache(const Sequence& seq) const {
    std::vector<int64_t> positions;
    for (const Token& t : tokens_) positions.push_back(t.position);
    EXPECT_EQ(positions, std::vector<int64_t>(seq.state().positions().begin(),
                                              seq.state().positions().end()));
  }

 private:
  struct Token {
    int64_t position;
    double momentum;
  };

  // `row` ([tokens_.size()] double) max-pooled over span_pool positions, in place.
  void Pool(std::vector<double>* row) const {
    const int64_t half = (policy_.span_pool - 1) / 2;
    const std::vector<double> in = *row;
    for (size_t i = 0; i < in.size(); ++i) {
      for (size_t j = 0; j < in.size(); ++j) {
        if (std::llabs(tokens_[j].position - tokens_[i].position) <= half) {
          (*row)[i] = std::max((*row)[i], in[j]);
        }
      }
    }
  }

  // The layer rows as double, each pooled when the policy pools and the layout is per-layer.
  std::vector<double> Rows(const std::vector<float>& rows, int64_t layers) const {
    const size_t n = tokens_.size();
    std::vector<double> out(rows.begin(), rows.begin() + static_cast<int64_t>(n) * layers);
    if (!policy_.PoolsSpans()) return out;
    for (int64_t l = 0; l < layers; ++l) {
      std::vector<double> row(out.begin() + l * static_cast<int64_t>(n),
                              out.begin() + (l + 1) * static_cast<int64_t>(n));
      Pool(&row);
      std::copy(row.begin(), row.end(), out.begin() + l * static_cast<int64_t>(n));
    }
    return out;
  }

  // A folded span-pooled step: the fold in double, pooled, then decay * m + row'.
  void ApplyFolded(const std::vector<float>& rows, int64_t layers) {
    const size_t n = tokens_.size();
    std::vector<double> row(n, 0.0);
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t i = 0; i < n; ++i) {
        row[i] += fold_.layer_weights[static_cast<size_t>(l)] *
                  static_cast<double>(rows[static_cast<size_t>(l) * n + i]);
      }
    }
    Pool(&row);
    for (size_t i = 0; i < n; ++i) tokens_[i].momentum = fold_.decay * tokens_[i].momentum + row[i];
  }

  void Apply(const std::vector<float>& raw, int64_t layers) {
    if (!fold_.layer_weights.empty()) return ApplyFolded(raw, layers);
    const std::vector<double> rows = Rows(raw, layers);
    const size_t n = tokens_.size();
    const bool single = policy_.aggregation == Aggregation::kSingleStep;
    for (Token& t : tokens_) t.momentum = single ? 0.0 : t.momentum;
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t i = 0; i < n; ++i) {
        const double s = rows[static_cast<size_t>(l) * n + i];
        double& m = tokens_[i].momentum;
        m = policy_.aggregation == Aggregation::kEma ? policy_.alpha * m + (1.0 - policy_.alpha) * s
                                                     : m + s;
      }
    }
    if (single) {
      for (Token& t : tokens_) t.momentum /= static_cast<double>(layers);
    }
  }

  const Policy policy_;
  const int64_t prefill_len_;
  const FoldWeights fold_;  // empty unless a folded sequence pools spans
  std::vector<Token> tokens_;
};

// How a run steps the engine: per-layer rows, folded rows, or (to show that the check can
// fail) rows folded with a plausible mistake: ema layers weighted uniformly,
// (1 - alpha^K) / K each, the decay right.
enum class Mode { kPerLayer, kFolded, kFoldedUniformly };

// Steps `seq` with the K rows of one step (dense f32, [K, tokens], K == 0 for none) as
// `mode` says, folding into `row` when it folds.
absl::Status StepAs(Mode mode, Sequence& seq, const FoldWeights& weights, int64_t step,
                    const std::vector<float>& rows, int64_t layers, int64_t tokens,
                    std::vector<float>* row, EvictionDecision* d) {
  kernels::ScoreMatrix scores =
      kernels::ScoreMatrix::Dense(rows.data(), kernels::ScoreDtype::kFloat32, layers, tokens);
  if (mode != Mode::kPerLayer && layers > 0 && seq.next_needs_scores()) {
    row->resize(static_cast<size_t>(tokens));
    FoldRows(scores, weights, row->data());
    scores = kernels::ScoreMatrix::Dense(row->data(), kernels::ScoreDtype::kFloat32, 1, tokens);
  }
  return seq.Step(step, layers > 0 ? &scores : nullptr, d);
}

// Opens `options` in `mode` (folded: `layers` = K) and returns it with the weights to fold
// with (uniform ones for kFoldedUniformly).
std::unique_ptr<Sequence> OpenAs(Mode mode, SequenceOptions options, int64_t layers,
                                 FoldWeights* weights) {
  if (mode != Mode::kPerLayer) {
    options.score_layout = ScoreLayout::kFolded;
    options.layers = layers;
  }
  absl::StatusOr<std::unique_ptr<Sequence>> created = Sequence::Create("check", options);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return nullptr;
  *weights = (*created)->fold_weights();
  if (mode == Mode::kFoldedUniformly) {
    for (double& w : weights->layer_weights) {
      w = (1.0 - weights->decay) / static_cast<double>(weights->layer_weights.size());
    }
  }
  return *std::move(created);
}

// Layer count of the first step line that carries scores (1 when none does).
int64_t TraceLayers(const std::string& path) {
  auto reader = *replay::TraceReader::Open(path);
  replay::TraceStep step;
  while (*reader->Next(&step)) {
    if (step.layers > 0) return step.layers;
  }
  return 1;
}

// Replays golden trace `name` as `mode` says, checking against the float64 model after
// every step (the result's check is meaningful for the folded modes).
CheckResult RunGolden(const std::string& name, Mode mode, const std::string& dir = GoldenDir()) {
  CheckResult result;
  const std::string path = dir + "/" + name + ".trace.jsonl";
  absl::StatusOr<std::unique_ptr<replay::TraceReader>> reader = replay::TraceReader::Open(path);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return result;
  FoldWeights weights;
  std::unique_ptr<Sequence> seq =
      OpenAs(mode, (*reader)->header().ToSequenceOptions(), TraceLayers(path), &weights);
  if (seq == nullptr) return result;
  PerLayerFloat64Model model(seq->policy(), seq->prefill_len(),
                             mode == Mode::kPerLayer ? nullptr : &weights);
  replay::TraceStep step;
  std::vector<float> row;
  EvictionDecision d;
  while (true) {
    absl::StatusOr<bool> more = (*reader)->Next(&step);
    EXPECT_TRUE(more.ok()) << more.status();
    if (!more.ok() || !*more) break;
    SCOPED_TRACE(absl::StrCat(name, " step ", step.step));
    const bool scoring = seq->next_needs_scores();
    const absl::Status stepped =
        StepAs(mode, *seq, weights, step.step, step.scores, step.layers, step.tokens, &row, &d);
    EXPECT_TRUE(stepped.ok()) << stepped;
    if (!stepped.ok()) break;
    result.decisions.push_back(d);
    model.Step(step.step, scoring, step.scores, step.layers, d, &result);
    model.ExpectSameCache(*seq);
  }
  return result;
}

bool SameDecisions(const std::vector<EvictionDecision>& a, const std::vector<EvictionDecision>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].evicted != b[i].evicted || a[i].cache_size != b[i].cache_size ||
        a[i].next_needs_scores != b[i].next_needs_scores) {
      return false;
    }
  }
  return true;
}

class FoldedGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FoldedGoldenTest, EvictsNoTokenAboveAKeptOneInFloat64WithinRelative2em4) {
  const CheckResult run = RunGolden(GetParam(), Mode::kFolded);
  EXPECT_FALSE(run.decisions.empty());
  EXPECT_EQ(run.violations, 0) << run.first_violation;
  RecordProperty("steps_checked", static_cast<int>(run.steps_checked));
  std::cout << GetParam() << ": " << run.decisions.size() << " steps, " << run.steps_checked
            << " checked, worst relative excess " << run.worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(AllGoldenVectors, FoldedGoldenTest, ::testing::ValuesIn(GoldenNames()),
                         [](const auto& test_param) { return test_param.param; });

// Span pooling (SPEC.md, "Span pooling"): a folded sequence pools its folded row, which is
// not the fold of the pooled layer rows, so the model pools the folded row in double; a
// per-layer sequence is held to the model pooling each layer row.
class FoldedSpanPoolGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FoldedSpanPoolGoldenTest, EvictsNoTokenAboveAKeptOneOfTheModelPoolingTheFoldedRow) {
  for (Mode mode : {Mode::kFolded, Mode::kPerLayer}) {
    const CheckResult run = RunGolden(GetParam(), mode, testing::SpanPoolGoldenDir());
    EXPECT_FALSE(run.decisions.empty());
    EXPECT_GT(run.steps_checked, 0);
    EXPECT_EQ(run.violations, 0) << (mode == Mode::kFolded ? "folded: " : "per-layer: ")
                                 << run.first_violation;
    std::cout << GetParam() << (mode == Mode::kFolded ? " folded: " : " per-layer: ")
              << run.steps_checked << " checked, worst relative excess " << run.worst << "\n";
  }
}

// The folded model is not the per-layer one: folding the pooled layer rows instead fails
// the check somewhere (the check has teeth for span pooling too).
TEST(FoldedSpanPoolGoldenSummaryTest, PoolingTheFoldedRowDiffersFromFoldingPooledRows) {
  int64_t differing = 0;
  for (const std::string& name : GoldenNames(testing::SpanPoolGoldenDir())) {
    const CheckResult folded = RunGolden(name, Mode::kFolded, testing::SpanPoolGoldenDir());
    const CheckResult per_layer = RunGolden(name, Mode::kPerLayer, testing::SpanPoolGoldenDir());
    differing += SameDecisions(folded.decisions, per_layer.decisions) ? 0 : 1;
  }
  std::cout << differing << " span-pooled golden traces decide differently folded\n";
  EXPECT_GT(differing, 0);
}

INSTANTIATE_TEST_SUITE_P(AllSpanPoolVectors, FoldedSpanPoolGoldenTest,
                         ::testing::ValuesIn(GoldenNames(testing::SpanPoolGoldenDir())),
                         [](const auto& test_param) { return test_param.param; });

// Not required to match: the fold rounds differently from the per-layer rule. Exact by
// construction where no rounding differs: a trace without scores (recency_sinks), and ema
// with alpha 0 (the folded row is the last layer's, bit for bit).
TEST(FoldedGoldenSummaryTest, ReportsWhichTracesMatchThePerLayerDecisionsExactly) {
  int matching = 0;
  std::vector<std::string> names = GoldenNames();
  for (const std::string& name : names) {
    const bool same = SameDecisions(RunGolden(name, Mode::kFolded).decisions,
                                    RunGolden(name, Mode::kPerLayer).decisions);
    matching += same ? 1 : 0;
    std::cout << name << ": folded decisions " << (same ? "match" : "differ from")
              << " the per-layer ones\n";
    if (name == "recency_sinks" || name == "ema_alpha0") {
      EXPECT_TRUE(same) << name;
    }
  }
  std::cout << matching << " of " << names.size() << " golden traces match exactly\n";
  RecordProperty("matching", matching);
}

// The check has teeth: folding ema layers uniformly (the mistake SPEC.md warns about)
// evicts tokens the per-layer rule would keep.
TEST(FoldedGoldenSummaryTest, TheFloat64CheckCatchesUniformlyWeightedLayers) {
  int64_t violations = 0;
  for (const char* name : {"ema_every_step", "ema_lazy1", "shift_protected"}) {
    const CheckResult run = RunGolden(name, Mode::kFoldedUniformly);
    std::cout << name << " folded uniformly: " << run.violations << " steps fail the check, "
              << "worst relative excess " << run.worst << "\n";
    violations += run.violations;
  }
  EXPECT_GT(violations, 0);
}

// Beyond the golden traces (which are far from ties): 32 layers of attention-like rows,
// some quantized, some permuted across layers (equal sums, different float32 rounding),
// so that exact and near ties are common. Folded decisions may then differ
// from the per-layer ones, but never by more than the check allows.
TEST(FoldedRandomTest, PassesTheFloat64CheckWhereTiesAreCommon) {
  constexpr int64_t kLayers = 32;
  int64_t differing = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SequenceOptions options;
    options.prefill_len = 96;
    options.budget.budget_tokens = 40;
    options.policy.aggregation = seed % 3 == 0   ? Aggregation::kCumulative
                                 : seed % 3 == 1 ? Aggregation::kEma
                                                 : Aggregation::kSingleStep;
    options.policy.alpha = 0.9;
    options.policy.protect_sinks = 2;
    options.policy.protect_recent = 3;
    FoldWeights weights, unused;
    std::unique_ptr<Sequence> folded = OpenAs(Mode::kFolded, options, kLayers, &weights);
    std::unique_ptr<Sequence> per_layer = OpenAs(Mode::kPerLayer, options, kLayers, &unused);
    ASSERT_NE(folded, nullptr);
    ASSERT_NE(per_layer, nullptr);
    PerLayerFloat64Model model(folded->policy(), options.prefill_len);
    CheckResult result;
    std::mt19937_64 rng(seed);
    std::vector<float> rows, row;
    EvictionDecision d, per_layer_decision;
    bool same = true;
    for (int64_t t = 1; t <= 120; ++t) {
      const int64_t tokens = folded->next_score_length();
      rows.clear();
      for (const auto& r : testing::RandomLayers(rng, kLayers, tokens, /*ties=*/t % 2 == 0)) {
        rows.insert(rows.end(), r.begin(), r.end());
      }
      if (t % 4 == 1) {  // (an unquantized step)
        // Every token's K scores are a permutation of the same K values: the sums are
        // exactly equal, the per-layer float32 sums differ by their rounding order.
        std::vector<float> values(rows.begin(), rows.begin() + kLayers);
        for (int64_t i = 0; i < tokens; ++i) {
          for (size_t j = values.size() - 1; j > 0; --j) std::swap(values[j], values[rng() % (j + 1)]);
          for (int64_t l = 0; l < kLayers; ++l) rows[static_cast<size_t>(l * tokens + i)] = values[l];
        }
      }
      ASSERT_TRUE(StepAs(Mode::kFolded, *folded, weights, t, rows, kLayers, tokens, &row, &d).ok());
      model.Step(t, true, rows, kLayers, d, &result);
      if (same) {  // until the first difference both hold the same cache
        ASSERT_TRUE(StepAs(Mode::kPerLayer, *per_layer, unused, t, rows, kLayers, tokens, &row,
                           &per_layer_decision)
                        .ok());
        same = per_layer_decision.evicted == d.evicted;

      }
    }
    model.ExpectSameCache(*folded);
    EXPECT_EQ(result.violations, 0) << "seed " << seed << ": " << result.first_violation;
    EXPECT_GT(result.steps_checked, 100);
    differing += same ? 0 : 1;
  }
  std::cout << differing << " of 6 random runs left the per-layer decisions\n";
  EXPECT_GT(differing, 0) << "the runs should exercise decisions the rounding changes";
}

// ---------------------------------------------------------------------------------------
// Tensor-parallel ranks fold their head sums with the sequence's weights; the join (sum
// over ranks, divided by the total head count) gives the pooled folded row.

struct RankRows {
  int64_t heads;
  std::vector<float> sums;  // [K, tokens]: the sum of this rank's heads' rows
};

// Per-head rows drawn by `draw`; returns each rank's head sums and the pooled rows
// (sum over all heads / total heads, as float32: what a single worker would fold).
std::vector<RankRows> MakeRanks(const std::vector<int64_t>& heads, int64_t layers,
                                int64_t tokens, const std::function<float()>& draw,
                                std::vector<float>* pooled) {
  std::vector<RankRows> ranks;
  std::vector<double> total(static_cast<size_t>(layers * tokens), 0.0);
  int64_t total_heads = 0;
  for (int64_t h : heads) {
    RankRows r{h, std::vector<float>(total.size(), 0.0f)};
    std::vector<double> sum(total.size(), 0.0);
    for (int64_t head = 0; head < h; ++head) {
      for (size_t i = 0; i < total.size(); ++i) sum[i] += draw();
    }
    for (size_t i = 0; i < total.size(); ++i) {
      r.sums[i] = static_cast<float>(sum[i]);
      total[i] += r.sums[i];
    }
    total_heads += h;
    ranks.push_back(std::move(r));
  }
  pooled->resize(total.size());
  for (size_t i = 0; i < total.size(); ++i) {
    (*pooled)[i] = static_cast<float>(total[i] / static_cast<double>(total_heads));
  }
  return ranks;
}

// Each rank folds its sums, the join joins the folded rows; returns the joined row.
std::vector<float> JoinFolded(const std::vector<RankRows>& ranks, const FoldWeights& w,
                              int64_t layers, int64_t tokens) {
  TensorParallelJoin join(static_cast<int32_t>(ranks.size()));
  std::vector<std::vector<float>> folded(ranks.size(), std::vector<float>(tokens));
  for (size_t p = ranks.size(); p-- > 0;) {  // arrival order: last rank first
    FoldRows(kernels::ScoreMatrix::Dense(ranks[p].sums.data(), kernels::ScoreDtype::kFloat32,
                                         layers, tokens),
             w, folded[p].data());
    RankReport report;
    report.rank = static_cast<int32_t>(p);
    report.step = 1;
    report.partial_sums = kernels::ScoreMatrix::Dense(folded[p].data(),
                                                      kernels::ScoreDtype::kFloat32, 1, tokens);
    report.head_count = ranks[p].heads;
    const absl::Status added = join.Add(report, JoinExpectation{"tp", 1, tokens, true});
    EXPECT_TRUE(added.ok()) << added;
  }
  EXPECT_TRUE(join.complete());
  const kernels::ScoreMatrix joined = join.Join();
  EXPECT_EQ(joined.layers, 1);
  const float* v = static_cast<const float*>(joined.data);
  return std::vector<float>(v, v + tokens);
}

TEST(FoldedTensorParallelTest, RanksFoldingHeadSumsJoinToThePooledFoldedRowExactly) {
  // Dyadic values (multiples of 1/64), power-of-two head total and alpha 0.5: every sum,
  // product and quotient is exact, so the two orders of fold and join agree bit for bit.
  constexpr int64_t kLayers = 4, kTokens = 37;
  std::mt19937_64 rng(3);
  std::vector<float> pooled;
  const auto ranks = MakeRanks({1, 2, 1}, kLayers, kTokens,
                               [&rng] { return static_cast<float>(rng() % 64) / 64.0f; }, &pooled);
  for (Aggregation a : {Aggregation::kEma, Aggregation::kCumulative}) {
    const FoldWeights w = WeightsOrDie(WithAggregation(a, 0.5), kLayers);
    std::vector<float> want(kTokens);
    FoldRows(kernels::ScoreMatrix::Dense(pooled.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                         kTokens),
             w, want.data());
    EXPECT_EQ(JoinFolded(ranks, w, kLayers, kTokens), want) << AggregationName(a);
  }
}

TEST(FoldedTensorParallelTest, RanksFoldingHeadSumsJoinToThePooledFoldedRowWithinRounding) {
  // General values: the orders differ only by float32 roundings of the rank folds and of
  // the pooled rows, a few units in the last place.
  constexpr int64_t kLayers = 32, kTokens = 1111;
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> pooled;
  const auto ranks = MakeRanks({3, 5, 4, 4}, kLayers, kTokens, [&] { return u(rng) * 0.01f; },
                               &pooled);
  for (Aggregation a : {Aggregation::kEma, Aggregation::kCumulative, Aggregation::kSingleStep}) {
    const FoldWeights w = WeightsOrDie(WithAggregation(a, 0.8), kLayers);
    std::vector<float> want(kTokens);
    FoldRows(kernels::ScoreMatrix::Dense(pooled.data(), kernels::ScoreDtype::kFloat32, kLayers,
                                         kTokens),
             w, want.data());
    const std::vector<float> got = JoinFolded(ranks, w, kLayers, kTokens);
    for (int64_t i = 0; i < kTokens; ++i) {
      ASSERT_NEAR(got[i], want[i], 4e-7 * want[i]) << AggregationName(a) << " token " << i;
    }
  }
}

}  // namespace
}  // namespace kvcm

// A tensor-parallel step as the workers would produce it: per-head attention rows for
// every layer, split among P ranks that each sum their heads (the partial sums of
// SPEC.md, "Tensor-parallel ranks"). Rows are multiples of 1/256 in [0, 1], so every
// partial sum of up to 8 heads is exact in float32 and float16, and the join gives the same
// layer scores whatever the split: the decisions of 1, 2, 4 and 8 ranks must be identical.
#ifndef KVCM_TESTS_GPU_RANK_JOIN_FIXTURE_H_
#define KVCM_TESTS_GPU_RANK_JOIN_FIXTURE_H_

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/policy/policy.h"
#include "cache_manager/table/sequence_table.h"
#include "gtest/gtest.h"
#include "kernels/score_matrix.h"

namespace kvcm::testing {

constexpr int64_t kTotalHeads = 8;
constexpr int64_t kJoinLayers = 4;

// [heads][layers][tokens] attention of the newest query, per head.
struct HeadRows {
  int64_t heads = 0;
  int64_t layers = 0;
  int64_t tokens = 0;
  std::vector<float> values;

  float At(int64_t head, int64_t layer, int64_t token) const {
    return values[static_cast<size_t>((head * layers + layer) * tokens + token)];
  }
};

inline HeadRows RandomHeadRows(std::mt19937_64& rng, int64_t heads, int64_t layers,
                               int64_t tokens) {
  HeadRows rows{heads, layers, tokens, std::vector<float>(static_cast<size_t>(heads * layers * tokens))};
  for (float& v : rows.values) v = static_cast<float>(rng() % 257) / 256.0f;
  return rows;
}

// [layers, tokens] float32: the sum of heads [first, first + count), in head order.
inline std::vector<float> PartialSums(const HeadRows& rows, int64_t first, int64_t count) {
  std::vector<float> sums(static_cast<size_t>(rows.layers * rows.tokens), 0.0f);
  for (int64_t h = first; h < first + count; ++h) {
    for (int64_t l = 0; l < rows.layers; ++l) {
      for (int64_t t = 0; t < rows.tokens; ++t) {
        sums[static_cast<size_t>(l * rows.tokens + t)] += rows.At(h, l, t);
      }
    }
  }
  return sums;
}

// [layers, tokens] float32: the layer scores a single rank would send, sum / total heads.
inline std::vector<float> PooledScores(const HeadRows& rows) {
  std::vector<float> pooled = PartialSums(rows, 0, rows.heads);
  for (float& v : pooled) v = static_cast<float>(static_cast<double>(v) / static_cast<double>(rows.heads));
  return pooled;
}

// The sequence every join test runs: a 90% policy over a 300-token prefill, so step 1
// evicts hundreds of tokens at once and later steps one each.
inline SequenceOptions JoinTestSequence(const char* preset) {
  SequenceOptions options;
  options.prefill_len = 300;
  options.budget = BudgetSpec::Ratio(0.9);
  options.preset = preset;
  return options;
}

inline constexpr const char* kJoinPresets[] = {"inertia", "inertia_lazy4", "tova", "h2o"};

// One step of the sequence under test: `rows` is the step's per-head attention (nullptr
// on a non-scoring step); the step's decision goes to `decision`.
using JoinStep =
    std::function<absl::Status(int64_t step, const HeadRows* rows, EvictionDecision* decision)>;

// Drives `steps` steps of JoinTestSequence(preset) through `run_step` with seeded head
// rows sized to the cache, and returns the decisions.
inline std::vector<EvictionDecision> RunJoinedSteps(const char* preset, int64_t steps,
                                                    uint64_t seed, const JoinStep& run_step) {
  std::mt19937_64 rng(seed);
  std::vector<EvictionDecision> decisions;
  int64_t cache = JoinTestSequence(preset).prefill_len;
  bool scoring = Policy::FromPreset(preset, 30)->IsScoringStep(1);
  for (int64_t step = 1; step <= steps; ++step) {
    EvictionDecision decision;
    absl::Status status;
    if (scoring) {
      const HeadRows rows = RandomHeadRows(rng, kTotalHeads, kJoinLayers, cache + 1);
      status = run_step(step, &rows, &decision);
    } else {
      status = run_step(step, nullptr, &decision);
    }
    EXPECT_TRUE(status.ok()) << "step " << step << ": " << status;
    if (!status.ok()) break;
    cache = decision.cache_size;
    scoring = decision.next_needs_scores;
    decisions.push_back(std::move(decision));
  }
  return decisions;
}

// One step of single-rank sequence `id` with already joined [layers, tokens] f32 scores
// (ignored when `rows` is nullptr: a non-scoring step).
inline absl::Status StepWithScores(SequenceTable& table, const char* id, int64_t step,
                                   const HeadRows* rows, const std::vector<float>& scores,
                                   EvictionDecision* decision) {
  if (rows == nullptr) return table.Step(id, step, nullptr, decision);
  const kernels::ScoreMatrix matrix = kernels::ScoreMatrix::Dense(
      scores.data(), kernels::ScoreDtype::kFloat32, rows->layers, rows->tokens);
  return table.Step(id, step, &matrix, decision);
}

// The decisions of a single-rank sequence sent the pooled scores: what every split must give.
inline std::vector<EvictionDecision> ReferenceDecisions(const char* preset, int64_t steps,
                                                        uint64_t seed) {
  SequenceTable table;
  EXPECT_TRUE(table.Open("reference", JoinTestSequence(preset)).ok());
  return RunJoinedSteps(preset, steps, seed,
                        [&](int64_t step, const HeadRows* rows, EvictionDecision* decision) {
                          const std::vector<float> pooled =
                              rows == nullptr ? std::vector<float>() : PooledScores(*rows);
                          return StepWithScores(table, "reference", step, rows, pooled, decision);
                        });
}

// Expects `got` to decide exactly like `want`, step by step.
inline void ExpectSameDecisions(const std::vector<EvictionDecision>& got,
                                const std::vector<EvictionDecision>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t t = 0; t < want.size(); ++t) {
    EXPECT_EQ(got[t].step, want[t].step);
    EXPECT_EQ(got[t].evicted, want[t].evicted) << "step " << want[t].step;
    EXPECT_EQ(got[t].cache_size, want[t].cache_size) << "step " << want[t].step;
    EXPECT_EQ(got[t].next_needs_scores, want[t].next_needs_scores) << "step " << want[t].step;
  }
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_GPU_RANK_JOIN_FIXTURE_H_

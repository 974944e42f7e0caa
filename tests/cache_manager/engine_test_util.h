// Helpers shared by the engine tests: score generation and stepping a Sequence with
// nested vectors.
#ifndef KVCM_TESTS_CACHE_MANAGER_ENGINE_TEST_UTIL_H_
#define KVCM_TESTS_CACHE_MANAGER_ENGINE_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "cache_manager/base/check.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/kv/kv_pools.h"
#include "kernels/score_matrix.h"

namespace kvcm::testing {

using Layers = std::vector<std::vector<float>>;

// Flattens per-layer rows into a dense [layers, tokens] float32 block.
struct DenseScores {
  std::vector<float> data;
  kernels::ScoreMatrix matrix;

  explicit DenseScores(const Layers& layers) {
    const int64_t tokens = layers.empty() ? 0 : static_cast<int64_t>(layers[0].size());
    for (const auto& l : layers) data.insert(data.end(), l.begin(), l.end());
    matrix = kernels::ScoreMatrix::Dense(data.data(), kernels::ScoreDtype::kFloat32,
                                         static_cast<int64_t>(layers.size()), tokens);
  }
};

// A sequence of `prefill` tokens with a budget of `budget` tokens under a named preset.
inline SequenceOptions PresetOptions(int64_t prefill, int64_t budget,
                                     const char* preset = "inertia") {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = BudgetSpec::Tokens(budget);
  o.preset = preset;
  return o;
}

inline absl::Status StepWith(Sequence& s, int64_t step, const Layers& layers,
                             EvictionDecision* d) {
  DenseScores dense(layers);
  return s.Step(step, layers.empty() ? nullptr : &dense.matrix, d);
}

// Random attention-like rows: a few heavy hitters, the rest small; `ties` quantizes values
// to multiples of 1/8 so that exact ties are common.
inline Layers RandomLayers(std::mt19937_64& rng, int64_t layers, int64_t tokens, bool ties) {
  Layers out(static_cast<size_t>(layers), std::vector<float>(static_cast<size_t>(tokens)));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& row : out) {
    for (float& v : row) {
      if (ties) {
        v = static_cast<float>(rng() % 8) / 8.0f;
      } else {
        const float x = u(rng);
        v = x > 0.97f ? x : x * x * x * 0.01f;
      }
    }
  }
  return out;
}

// Host KV pools for engine tests: `ranks` pools of `blocks` blocks, each 4 tokens of 2
// layers, one head of 4 float16 values.
inline kernels::KvBlockLayout SmallKvLayout() {
  kernels::KvBlockLayout l;
  l.tokens_per_block = 4;
  l.layers = 2;
  l.kv_heads = 1;
  l.head_dim = 4;
  l.dtype = kernels::KvDtype::kFloat16;
  return l;
}
inline std::unique_ptr<KvPools> SmallHostKvPools(int32_t ranks, int64_t blocks) {
  auto pools = KvPools::Create(ranks, SmallKvLayout(), blocks * SmallKvLayout().BlockBytes(),
                               [](const BlockPoolOptions& o) { return BlockPool::CreateHost(o); });
  KVCM_CHECK(pools.ok());
  return *std::move(pools);
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_CACHE_MANAGER_ENGINE_TEST_UTIL_H_

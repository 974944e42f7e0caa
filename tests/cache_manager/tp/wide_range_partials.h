// Partial head sums whose joins tell summation orders apart. Full float mantissas from
// about 1e-30 to 1e30; but sums of non-negative floats in double round to the same float
// in almost any order, so every 7th element cancels: rank 0 holds +B and rank 1 -B (B
// about 1e30) beside the other ranks' small values, and only an order that adds ranks 0
// and 1 first keeps the small ones (real partial sums are never negative; the join's
// arithmetic does not care). Shared by the CPU joiner's test and the NCCL joiner's
// (tests/gpu/nccl_join_test.cc). REQUIRES: ranks >= 3.
#ifndef KVCM_TESTS_CACHE_MANAGER_TP_WIDE_RANGE_PARTIALS_H_
#define KVCM_TESTS_CACHE_MANAGER_TP_WIDE_RANGE_PARTIALS_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvcm::testing {

// [ranks][n] floats.
inline std::vector<std::vector<float>> WideRangePartials(uint64_t seed, int32_t ranks,
                                                         int64_t n) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mantissa(1.0, 10.0);
  std::uniform_int_distribution<int> decade(-30, 30);
  std::vector<std::vector<float>> partials(static_cast<size_t>(ranks));
  for (std::vector<float>& p : partials) {
    p.resize(static_cast<size_t>(n));
    for (float& x : p) x = static_cast<float>(mantissa(rng) * std::pow(10.0, decade(rng)));
  }
  for (size_t i = 0; i < static_cast<size_t>(n); i += 7) {
    const float big = static_cast<float>(mantissa(rng) * 1e30);
    partials[0][i] = big;
    partials[1][i] = -big;
    for (size_t r = 2; r < partials.size(); ++r) {
      partials[r][i] = static_cast<float>(mantissa(rng) * std::pow(10.0, decade(rng) / 3));
    }
  }
  return partials;
}

// The join's definition, written out: for each element, a left fold in float64 over the
// ranks in `order`, divided by the heads and rounded to float32 once.
inline std::vector<float> FoldInOrder(const std::vector<std::vector<float>>& partials,
                                      const std::vector<int32_t>& order, int64_t total_heads) {
  std::vector<float> out(partials.front().size());
  for (size_t i = 0; i < out.size(); ++i) {
    double acc = 0.0;
    for (int32_t r : order) acc += static_cast<double>(partials[static_cast<size_t>(r)][i]);
    out[i] = static_cast<float>(acc / static_cast<double>(total_heads));
  }
  return out;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_CACHE_MANAGER_TP_WIDE_RANGE_PARTIALS_H_

#include "kernels/selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm::kernels {
namespace {

// Reference: sort (value, index) pairs over the range, take k, return indices ascending.
std::vector<int64_t> ReferenceLowest(const std::vector<float>& v, int64_t begin, int64_t end,
                                     int64_t k) {
  std::vector<int64_t> idx(static_cast<size_t>(end - begin));
  std::iota(idx.begin(), idx.end(), begin);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] < v[b]; });
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int64_t> Select(const std::vector<float>& v, int64_t begin, int64_t end, int64_t k) {
  std::vector<int64_t> out(static_cast<size_t>(k), -1);
  std::vector<uint64_t> scratch(static_cast<size_t>(end - begin));
  cpu::SelectLowest(v.data(), begin, end, k, out.data(), scratch.data(), nullptr);
  return out;
}

TEST(SelectLowestTest, EqualValuesGoLowestIndexFirst) {
  const std::vector<float> v = {0.5f, 0.2f, 0.2f, 0.9f, 0.2f, 0.1f};
  EXPECT_EQ(Select(v, 0, 6, 1), (std::vector<int64_t>{5}));
  EXPECT_EQ(Select(v, 0, 6, 2), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(Select(v, 0, 6, 3), (std::vector<int64_t>{1, 2, 5}));
  EXPECT_EQ(Select(v, 0, 5, 1), (std::vector<int64_t>{1}));
}

TEST(SelectLowestTest, NegativeZeroTiesWithZero) {
  const std::vector<float> v = {0.3f, 0.0f, -0.0f, 0.0f};
  EXPECT_EQ(Select(v, 0, 4, 1), (std::vector<int64_t>{1}));
  EXPECT_EQ(Select(v, 0, 4, 2), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(Select(v, 2, 4, 1), (std::vector<int64_t>{2}));
}

TEST(SelectLowestTest, RespectsTheRange) {
  const std::vector<float> v = {0.0f, 0.0f, 0.5f, 0.4f, 0.3f, 0.0f};
  EXPECT_EQ(Select(v, 2, 5, 1), (std::vector<int64_t>{4}));
  EXPECT_EQ(Select(v, 2, 5, 2), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(Select(v, 2, 5, 3), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_TRUE(Select(v, 2, 5, 0).empty());
}

TEST(SelectLowestTest, MatchesSortingOnRandomInputsWithManyTies) {
  std::mt19937_64 rng(1234);
  for (int round = 0; round < 300; ++round) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    std::vector<float> v(static_cast<size_t>(n));
    const bool coarse = round % 2 == 0;  // quantized values: lots of exact ties
    for (float& x : v) {
      x = coarse ? static_cast<float>(rng() % 8) / 8.0f
                 : std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    }
    const int64_t begin = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
    const int64_t end = begin + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - begin));
    const int64_t k = static_cast<int64_t>(rng() % static_cast<uint64_t>(end - begin + 1));
    ASSERT_EQ(Select(v, begin, end, k), ReferenceLowest(v, begin, end, k))
        << "n=" << n << " range=[" << begin << "," << end << ") k=" << k;
  }
}

std::vector<int64_t> Highest(const std::vector<float>& v, int64_t k) {
  std::vector<int64_t> out(static_cast<size_t>(k), -1);
  std::vector<uint64_t> scratch(v.size());
  cpu::SelectHighest(v.data(), static_cast<int64_t>(v.size()), k, out.data(), scratch.data(),
                     nullptr);
  return out;
}

// The complement of the count - k lowest (SelectLowest's order), ascending.
std::vector<int64_t> ComplementOfLowest(const std::vector<float>& v, int64_t k) {
  const auto n = static_cast<int64_t>(v.size());
  const std::vector<int64_t> low = ReferenceLowest(v, 0, n, n - k);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::binary_search(low.begin(), low.end(), i)) out.push_back(i);
  }
  return out;
}

TEST(SelectHighestTest, EqualValuesGoHighestIndexFirst) {
  const std::vector<float> v = {0.5f, 0.2f, 0.2f, 0.9f, 0.2f, 0.1f};
  EXPECT_EQ(Highest(v, 1), (std::vector<int64_t>{3}));
  EXPECT_EQ(Highest(v, 3), (std::vector<int64_t>{0, 3, 4}));
  EXPECT_EQ(Highest(v, 4), (std::vector<int64_t>{0, 2, 3, 4}));
  EXPECT_EQ(Highest(v, 6), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(Highest(v, 0).empty());
  const std::vector<float> zeros = {0.0f, -0.0f, 0.0f, -0.0f};
  EXPECT_EQ(Highest(zeros, 2), (std::vector<int64_t>{2, 3}));
}

TEST(SelectHighestTest, IsTheComplementOfSelectLowestOnOddSizesAndWideRanges) {
  std::mt19937_64 rng(99);
  for (int64_t n : {1, 2, 7, 111, 1000, 6401}) {
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<float> v(static_cast<size_t>(n));
      for (float& x : v) {
        const float u = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
        switch (kind) {
          case 0: x = static_cast<float>(rng() % 8) / 8.0f; break;  // many exact ties
          case 1: x = u * u * u * 1e-3f; break;                     // attention-like
          case 2: x = std::ldexp(u, static_cast<int>(rng() % 200) - 100); break;  // exponents
          default: x = 0.25f; break;                                // one bucket, all equal
        }
      }
      if (n > 3) v[1] = std::numeric_limits<float>::infinity();
      for (int64_t k : {int64_t{0}, int64_t{1}, n / 10 + 1, n / 2, n - 1, n}) {
        if (k < 0 || k > n) continue;
        ASSERT_EQ(Highest(v, k), ComplementOfLowest(v, k)) << "n=" << n << " kind=" << kind
                                                           << " k=" << k;
      }
    }
  }
}

TEST(RemoveEntriesTest, KeepsSurvivorsInOrder) {
  std::vector<float> m = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int64_t> p = {10, 11, 12, 13, 14, 15, 16, 17};
  const std::vector<int64_t> remove = {0, 3, 4, 7};
  cpu::RemoveEntries(m.data(), p.data(), 8, remove.data(), 4, nullptr);
  m.resize(4);
  p.resize(4);
  EXPECT_EQ(m, (std::vector<float>{1, 2, 5, 6}));
  EXPECT_EQ(p, (std::vector<int64_t>{11, 12, 15, 16}));
}

TEST(RemoveEntriesTest, RemovingNothingChangesNothing) {
  std::vector<float> m = {1, 2, 3};
  std::vector<int64_t> p = {4, 5, 6};
  cpu::RemoveEntries(m.data(), p.data(), 3, nullptr, 0, nullptr);
  EXPECT_EQ(m, (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(p, (std::vector<int64_t>{4, 5, 6}));
}

TEST(RemoveEntriesTest, RemovingEverythingOrTheEndsWritesNothingPastTheEntries) {
  // Three entries followed by guards in the same allocation, where AddressSanitizer would
  // not see a stray write.
  const std::vector<float> m_guard = {-7, -7};
  const std::vector<int64_t> p_guard = {-9, -9};
  const auto run = [&](const std::vector<int64_t>& remove, std::vector<float> m_want,
                       std::vector<int64_t> p_want) {
    std::vector<float> m = {1, 2, 3, m_guard[0], m_guard[1]};
    std::vector<int64_t> p = {4, 5, 6, p_guard[0], p_guard[1]};
    cpu::RemoveEntries(m.data(), p.data(), 3, remove.data(), static_cast<int64_t>(remove.size()),
                       nullptr);
    const size_t kept = 3 - remove.size();
    EXPECT_EQ(std::vector<float>(m.begin(), m.begin() + static_cast<long>(kept)), m_want);
    EXPECT_EQ(std::vector<int64_t>(p.begin(), p.begin() + static_cast<long>(kept)), p_want);
    EXPECT_EQ(std::vector<float>(m.begin() + 3, m.end()), m_guard);
    EXPECT_EQ(std::vector<int64_t>(p.begin() + 3, p.end()), p_guard);
  };
  run({0, 1, 2}, {}, {});
  run({0}, {2, 3}, {5, 6});
  run({2}, {1, 2}, {4, 5});
  run({0, 2}, {2}, {5});
}

}  // namespace
}  // namespace kvcm::kernels

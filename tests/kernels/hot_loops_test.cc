// The per-instruction-set builds of the hot loops must agree bit for bit: the choice made
// at run time may change speed, never a decision.
#include "kernels/cpu/hot_loops.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/half_float.h"

namespace kvcm::kernels::cpu {
namespace {

// Whether this CPU and its OS can run the AVX2 table (AVX2 and F16C, and the OS saving
// the YMM registers), asked of cpuid and xgetbv directly rather than through the code
// under test.
bool CpuRunsAvx2Table() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool f16c = (ecx & bit_F16C) != 0;
  const bool avx = (ecx & bit_AVX) != 0;
  if (!f16c || !avx || (ecx & bit_OSXSAVE) == 0) return false;
  uint32_t xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & 0x6) != 0x6) return false;  // XMM and YMM state enabled by the OS
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ebx & bit_AVX2) != 0;
#else
  return false;
#endif
}

std::vector<const HotLoops*> Tables() {
  std::vector<const HotLoops*> tables = {&BaselineHotLoops()};
#if defined(__x86_64__)
  if (CpuRunsAvx2Table()) tables.push_back(&Avx2HotLoops());
#endif
  return tables;
}

// The tests comparing tables compare nothing on a CPU without AVX2: they say so.
#define SKIP_WITHOUT_A_SECOND_TABLE()                                              \
  if (Tables().size() < 2) GTEST_SKIP() << "only the baseline table runs on this CPU"

TEST(HotLoopsTest, TheAvx2TableIsChosenExactlyWhereTheCpuRunsIt) {
#if defined(__x86_64__)
  const HotLoops& want = CpuRunsAvx2Table() ? Avx2HotLoops() : BaselineHotLoops();
#else
  const HotLoops& want = BaselineHotLoops();
#endif
  EXPECT_EQ(&SelectedHotLoops(), &want);
  EXPECT_STREQ(SelectedHotLoops().isa, want.isa);
}

TEST(HotLoopsTest, UpdateAgreesAcrossInstructionSets) {
  SKIP_WITHOUT_A_SECOND_TABLE();
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (ScoreDtype dtype : {ScoreDtype::kFloat32, ScoreDtype::kFloat16, ScoreDtype::kBFloat16}) {
    for (ScoreAggregation agg : {ScoreAggregation::kEma, ScoreAggregation::kCumulative,
                                 ScoreAggregation::kSingleStep}) {
      for (int64_t layers : {1, 3, 4, 5, 8, 32}) {
        for (int64_t tokens : {1, 7, 111, 1024, 1031, 4096}) {
          const int64_t stride = tokens + 5;
          std::vector<float> f(static_cast<size_t>(layers * stride));
          std::vector<uint16_t> h(f.size());
          for (size_t i = 0; i < f.size(); ++i) {
            f[i] = u(rng) * (i % 13 == 0 ? 1e-6f : 1.0f);
            h[i] = dtype == ScoreDtype::kFloat16 ? FloatToFloat16(f[i]) : FloatToBFloat16(f[i]);
          }
          const void* data = dtype == ScoreDtype::kFloat32 ? static_cast<const void*>(f.data())
                                                           : static_cast<const void*>(h.data());
          const ScoreMatrix m{data, dtype, layers, tokens, stride};
          std::vector<float> in(static_cast<size_t>(tokens));
          for (float& v : in) v = u(rng);
          std::vector<std::vector<float>> outs;
          std::vector<bool> flagged;
          for (const HotLoops* t : Tables()) {
            std::vector<float> out(in.size());
            const uint32_t screen = t->update_momentum(in.data(), out.data(), tokens, m, agg, 0.8);
            outs.push_back(out);
            flagged.push_back(screen > kLargestFiniteBits);
          }
          for (size_t t = 1; t < outs.size(); ++t) {
            ASSERT_EQ(0, std::memcmp(outs[t].data(), outs[0].data(), in.size() * 4))
                << "dtype " << ScoreDtypeName(dtype) << " layers " << layers << " tokens " << tokens;
            EXPECT_EQ(flagged[t], flagged[0]);
          }
          EXPECT_FALSE(flagged[0]);
        }
      }
    }
  }
}

TEST(HotLoopsTest, ScreenTripsOnEveryKindOfBadScoreInEveryTable) {
  for (const HotLoops* t : Tables()) {
    for (float bad : {-1.0f, -0.0f, std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      for (int64_t at : {0, 5, 1023, 1024, 2999}) {
        std::vector<float> s(5 * 3000, 0.5f);
        s[static_cast<size_t>(4 * 3000 + at)] = bad;  // in the last layer (the single-layer tail)
        std::vector<float> in(3000, 0.0f), out(3000);
        const uint32_t screen = t->update_momentum(
            in.data(), out.data(), 3000, ScoreMatrix::Dense(s.data(), ScoreDtype::kFloat32, 5, 3000),
            ScoreAggregation::kEma, 0.8);
        EXPECT_GT(screen, kLargestFiniteBits) << t->isa << " value " << bad << " at " << at;
      }
    }
  }
}

TEST(HotLoopsTest, ArgMinAndSumAgreeAcrossInstructionSets) {
  std::mt19937_64 rng(3);
  for (int round = 0; round < 200; ++round) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 7000);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(rng() % 50) / 16.0f;  // many ties
    const int64_t begin = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
    int64_t want = begin;
    for (int64_t i = begin; i < n; ++i) {
      if (v[static_cast<size_t>(i)] < v[static_cast<size_t>(want)]) want = i;
    }
    for (const HotLoops* t : Tables()) {
      EXPECT_EQ(t->arg_min(v.data(), begin, n), want) << t->isa;
      EXPECT_EQ(t->exact_sum(v.data(), n), Tables()[0]->exact_sum(v.data(), n)) << t->isa;
    }
  }
}

TEST(HotLoopsTest, ExactSumsOverTheWholeFloatRangeAgreeAcrossInstructionSets) {
  SKIP_WITHOUT_A_SECOND_TABLE();
  std::mt19937_64 rng(21);
  for (int round = 0; round < 100; ++round) {
    std::vector<float> v(1 + rng() % 5000);
    for (float& x : v) {
      x = std::ldexp(static_cast<float>(rng() % 0xffffff), static_cast<int>(rng() % 200) - 160);
    }
    const double want = Tables()[0]->exact_sum(v.data(), static_cast<int64_t>(v.size()));
    for (const HotLoops* t : Tables()) {
      const double got = t->exact_sum(v.data(), static_cast<int64_t>(v.size()));
      EXPECT_EQ(std::memcmp(&got, &want, sizeof(double)), 0) << t->isa;
    }
  }
}

}  // namespace
}  // namespace kvcm::kernels::cpu

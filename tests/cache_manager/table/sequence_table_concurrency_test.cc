// SequenceTable under concurrent use: many threads opening, stepping, inspecting, listing,
// closing and reclaiming, plus tensor-parallel ranks reporting from different threads.
// Run under ThreadSanitizer by scripts/test.sh (label concurrency).
#include <atomic>
#include <condition_variable>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/table/sequence_table.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

SequenceOptions Options(const char* preset) {
  SequenceOptions o;
  o.prefill_len = 64;
  o.budget = BudgetSpec::Ratio(0.75);
  o.preset = preset;
  return o;
}

TEST(SequenceTableConcurrencyTest, ManyThreadsOnManySequences) {
  SequenceTable table;
  constexpr int kThreads = 8;
  constexpr int kSequencesPerThread = 6;
  constexpr int kSteps = 40;
  std::atomic<int64_t> decided{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kThreads; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(static_cast<uint64_t>(w));
      EvictionDecision d;
      for (int s = 0; s < kSequencesPerThread; ++s) {
        const std::string id = absl::StrCat("w", w, "-s", s);
        const char* preset = s % 2 == 0 ? "inertia" : "inertia_lazy4";
        ASSERT_TRUE(table.Open(id, Options(preset)).ok());
        int64_t cache = 64;
        for (int64_t t = 1; t <= kSteps; ++t) {
          const bool scoring = Policy::FromPreset(preset, 16)->IsScoringStep(t);
          testing::DenseScores scores(scoring ? testing::RandomLayers(rng, 2, cache + 1, false)
                                              : testing::Layers{});
          ASSERT_TRUE(table.Step(id, t, scoring ? &scores.matrix : nullptr, &d).ok());
          cache = d.cache_size;
          ++decided;
          if (t % 10 == 0) {
            (void)table.Inspect(id, true);
            (void)table.List();
            (void)table.Totals();
          }
        }
        if (s % 3 != 0) {
          ASSERT_TRUE(table.Close(id).ok());

        }
      }
    });
  }
  // A reclaimer running alongside with a timeout nobody reaches.
  std::atomic<bool> stop{false};
  std::thread reclaimer([&] {
    while (!stop.load()) {
      EXPECT_TRUE(table.ReclaimIdle(absl::Hours(1)).empty());
      std::this_thread::yield();
    }
  });
  for (auto& t : threads) t.join();
  stop = true;
  reclaimer.join();
  EXPECT_EQ(decided.load(), kThreads * kSequencesPerThread * kSteps);
  EXPECT_EQ(table.Totals().open_sequences, kThreads * 2);
}

TEST(SequenceTableConcurrencyTest, RanksReportingFromTheirOwnThreadsAllGetTheSameDecision) {
  constexpr int32_t kRanks = 4;
  constexpr int64_t kSteps = 60;
  // What the ranks share. A rank that fails sets `failed` and wakes every other: a rank
  // waiting for a decision that will never come (its peer gave up) then stops too, so a
  // failure fails the test instead of hanging it. Declared before the table, which may
  // still call a pending step's callbacks (abandoned) when it is destroyed.
  struct Shared {
    Mutex mu;
    std::condition_variable_any changed;
    bool failed ABSL_GUARDED_BY(mu) = false;
    std::vector<std::optional<absl::StatusOr<EvictionDecision>>> decided ABSL_GUARDED_BY(mu);
  } shared;
  {
    MutexLock lock(&shared.mu);
    shared.decided.resize(kRanks);
  }
  SequenceTable table;
  ASSERT_TRUE(table.Open("tp", Options("inertia"), kRanks).ok());
  // Every rank knows the cache size only from the decisions it received, as a worker does.
  std::vector<std::vector<EvictionDecision>> received(kRanks);
  std::vector<std::thread> ranks;
  for (int32_t rank = 0; rank < kRanks; ++rank) {
    ranks.emplace_back([&, rank] {
      const auto fail = [&](const std::string& why) {
        ADD_FAILURE() << "rank " << rank << ": " << why;
        MutexLock lock(&shared.mu);
        shared.failed = true;
        shared.changed.notify_all();
      };
      std::mt19937_64 rng(42);  // same stream on every rank: the same pooled rows
      int64_t cache = 64;
      for (int64_t t = 1; t <= kSteps; ++t) {
        testing::DenseScores scores(testing::RandomLayers(rng, 2, cache + 1, false));
        RankReport r;
        r.rank = rank;
        r.step = t;
        r.head_count = 1;
        r.partial_sums = scores.matrix;
        // The callback only records: an assertion there would return before waking the
        // rank's thread. The thread checks what it got.
        const absl::Status submitted = table.SubmitRankReport(
            "tp", r, [&shared, rank](const absl::StatusOr<EvictionDecision>& d) {
              MutexLock lock(&shared.mu);
              shared.decided[static_cast<size_t>(rank)] = d;
              shared.changed.notify_all();
            });
        if (!submitted.ok()) return fail(absl::StrCat("step ", t, ": ", submitted.ToString()));
        absl::StatusOr<EvictionDecision> got;
        {
          MutexLock lock(&shared.mu);
          auto& mine = shared.decided[static_cast<size_t>(rank)];
          while (!mine.has_value() && !shared.failed) shared.mu.Wait(&shared.changed);
          if (!mine.has_value()) return;  // another rank failed: this step will not complete
          got = *std::move(mine);
          mine.reset();
        }
        if (!got.ok()) return fail(absl::StrCat("step ", t, ": ", got.status().ToString()));
        received[static_cast<size_t>(rank)].push_back(*got);
        cache = got->cache_size;
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int32_t rank = 0; rank < kRanks; ++rank) {
    ASSERT_EQ(received[static_cast<size_t>(rank)].size(), static_cast<size_t>(kSteps));
  }
  for (int32_t rank = 1; rank < kRanks; ++rank) {
    for (int64_t t = 0; t < kSteps; ++t) {
      EXPECT_EQ(received[static_cast<size_t>(rank)][static_cast<size_t>(t)].evicted,
                received[0][static_cast<size_t>(t)].evicted);
    }
  }
  EXPECT_EQ(table.Inspect("tp", false)->last_step, kSteps);
}

}  // namespace
}  // namespace kvcm

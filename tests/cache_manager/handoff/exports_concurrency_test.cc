// The hand-off's source side under threads (run under ThreadSanitizer by the test command):
// peers reading an export's blocks while it is committed, aborted or expires, steps refused
// meanwhile, and exports begun and finished from many threads at once.
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/handoff/exports.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

SequenceOptions Options() {
  SequenceOptions o;
  o.prefill_len = 40;
  o.budget = BudgetSpec::Tokens(10);
  o.preset = "inertia";
  return o;
}

TEST(ExportConcurrencyTest, ReadsStepsAndFinishesRaceWithoutHarm) {
  auto pools = testing::SmallHostKvPools(2, 512);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ExportTable exports(&table, pools.get(), ExportOptions{.max_exports = 64});
  constexpr int kSequences = 16;
  for (int i = 0; i < kSequences; ++i) ASSERT_TRUE(table.Open(absl::StrCat("s", i), Options()).ok());

  std::atomic<bool> stop{false};
  std::atomic<int64_t> reads{0}, committed{0};
  std::vector<std::thread> threads;
  // Two "peers": export, read every block, then commit or abort.
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kSequences; i += 2) {
        absl::StatusOr<ExportTicket> ticket = exports.Begin("", absl::StrCat("s", i));
        if (!ticket.ok()) continue;
        std::string out;
        for (int32_t r = 0; r < 2; ++r) {
          if (exports.CopyBlocks(ticket->export_id, r, 0,
                                 static_cast<int64_t>(ticket->blocks[static_cast<size_t>(r)].size()),
                                 &out)
                  .ok()) {
            ++reads;
          }
        }
        absl::StatusOr<ExportEnd> end = exports.Finish(ticket->export_id, i % 4 != 0);
        if (end.ok() && end->committed) ++committed;
      }
    });
  }
  // A worker stepping every sequence (refused while exported, NOT_FOUND once committed).
  threads.emplace_back([&] {
    std::mt19937_64 rng(3);
    std::vector<int64_t> next(kSequences, 1);
    while (!stop.load()) {
      for (int i = 0; i < kSequences; ++i) {
        const std::string id = absl::StrCat("s", i);
        absl::StatusOr<SequenceInfo> info = table.Inspect(id, false);
        if (!info.ok()) continue;
        testing::DenseScores s(testing::RandomLayers(rng, 2, info->cache_size + 1, false));
        EvictionDecision d;
        if (table.Step(id, next[static_cast<size_t>(i)], &s.matrix, &d).ok()) {
          ++next[static_cast<size_t>(i)];
        }
      }
    }
  });
  // The housekeeping loop.
  threads.emplace_back([&] {
    while (!stop.load()) exports.AbortExpired();
  });
  threads[0].join();
  threads[1].join();
  stop.store(true);
  threads[2].join();
  threads[3].join();
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(exports.in_progress(), 0);
  // Committed ones are gone; aborted ones are open and unfrozen.
  EXPECT_EQ(static_cast<int64_t>(table.List().size()) + committed.load(), kSequences);
}

}  // namespace
}  // namespace kvcm

// The step executor and the sequence table under concurrency (also run under TSan):
// steps posted for many sequences run on their pinned threads, in order, while other
// threads inspect, list and close.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

constexpr int kSequences = 8;
constexpr int kSteps = 150;
constexpr int64_t kPrefill = 16;
constexpr int64_t kBudget = 8;

struct StepTask;

struct Shared {
  SequenceTable* table = nullptr;
  std::vector<float> scores;  // [1, kBudget + 1]: every steady step's
  std::vector<float> first;   // [1, kPrefill + 1]
  std::atomic<int> failures{0};
};

struct StepTask final : DecisionSink {
  Shared* shared = nullptr;
  std::string id;
  int64_t step = 0;
  std::atomic<bool> decided{false};

  void OnDecided(int64_t, const absl::Status& status, const EvictionDecision& d) override {
    if (!status.ok() || d.step != step) shared->failures.fetch_add(1);
    decided.store(true);
  }
  static void Run(void* context, int32_t) {
    auto* t = static_cast<StepTask*>(context);
    const std::vector<float>& s = t->step == 1 ? t->shared->first : t->shared->scores;
    RankReport r;
    r.step = t->step;
    r.partial_sums = kernels::ScoreMatrix::Dense(s.data(), kernels::ScoreDtype::kFloat32, 1,
                                                 static_cast<int64_t>(s.size()));
    if (!t->shared->table->SubmitRankReport(t->id, r, {t, 0}).ok()) t->shared->failures.fetch_add(1);
  }
};

TEST(StepExecutorConcurrencyTest, PinnedStepsStayInOrderWhileOthersInspect) {
  SequenceTable table;
  Shared shared;
  shared.table = &table;
  shared.first.assign(kPrefill + 1, 0.01f);
  for (size_t i = 0; i < shared.first.size(); ++i) shared.first[i] += 0.001f * static_cast<float>(i);
  shared.scores.assign(kBudget + 1, 0.02f);
  std::vector<std::string> ids;
  for (int i = 0; i < kSequences; ++i) {
    ids.push_back("seq-" + std::to_string(i));
    SequenceOptions o;
    o.prefill_len = kPrefill;
    o.budget = BudgetSpec::Tokens(kBudget);
    o.preset = "inertia";
    ASSERT_TRUE(table.Open(ids.back(), o).ok());
  }
  std::vector<std::unique_ptr<StepTask>> tasks;
  for (int t = 1; t <= kSteps; ++t) {
    for (const std::string& id : ids) {
      auto task = std::make_unique<StepTask>();
      task->shared = &shared;
      task->id = id;
      task->step = t;
      tasks.push_back(std::move(task));
    }
  }
  std::atomic<bool> stop{false};
  std::thread inspector([&] {
    while (!stop.load()) {
      for (const std::string& id : ids) (void)table.Inspect(id, /*with_cache=*/true);
      (void)table.List();
      (void)table.Totals();
    }
  });
  {
    StepExecutor executor(3, static_cast<int64_t>(tasks.size()));
    for (auto& task : tasks) {
      ASSERT_TRUE(executor.Post(executor.ShardOf(task->id), {&StepTask::Run, task.get()}));
    }
  }  // runs every task
  stop.store(true);
  inspector.join();
  EXPECT_EQ(shared.failures.load(), 0);
  for (const auto& task : tasks) EXPECT_TRUE(task->decided.load());
  for (const std::string& id : ids) EXPECT_EQ(table.Inspect(id, false)->last_step, kSteps);
}

}  // namespace
}  // namespace kvcm

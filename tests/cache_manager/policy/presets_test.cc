// The presets of cache_manager/policy/presets.txt: every line resolves, in the file's
// order, and expands exactly as before the list moved into the file (every golden vector
// depends on these expansions).
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cache_manager/policy/policy.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

// The first column of every line of the file that is not blank or a comment.
std::vector<std::string> NamesInFile() {
  std::ifstream in(KVCM_PRESETS_FILE);
  EXPECT_TRUE(in.good()) << "cannot read " << KVCM_PRESETS_FILE;
  std::vector<std::string> names;
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view text = line;
    text = text.substr(0, text.find('#'));
    std::vector<absl::string_view> columns =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (!columns.empty()) names.emplace_back(columns[0]);
  }
  return names;
}

TEST(PresetsTest, EveryPresetOfTheFileResolvesInTheFilesOrder) {
  const std::vector<std::string> names = NamesInFile();
  ASSERT_FALSE(names.empty());
  ASSERT_EQ(Policy::PresetNames().size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(Policy::PresetNames()[i], names[i]);
    // Budgets that hold streaming_llm's 4 sinks: a smaller one is refused by Validate,
    // as it was before the list moved into the file.
    for (int64_t budget : {4, 8, 1000}) {
      absl::StatusOr<Policy> policy = Policy::FromPreset(names[i], budget);
      ASSERT_TRUE(policy.ok()) << names[i] << ": " << policy.status();
      EXPECT_EQ(policy->preset, names[i]);
      EXPECT_TRUE(policy->Validate(budget).ok()) << names[i] << " at budget " << budget;
    }
  }
}

// Today's expansion, field by field, written out here rather than read from the file.
Policy Expected(absl::string_view name, int64_t budget) {
  Policy p;  // alpha 0.8, every_step, interval 4, no protections unless set below
  if (name == "inertia_lazy4") {
    p.refresh = Refresh::kLazy;
  } else if (name == "score_free") {
    p.refresh = Refresh::kScoreFree;
  } else if (name == "tova") {
    p.aggregation = Aggregation::kSingleStep;
  } else if (name == "h2o") {
    p.aggregation = Aggregation::kCumulative;
    p.protect_recent = budget / 2;
  } else if (name == "streaming_llm") {
    p.aggregation = Aggregation::kRecency;
    p.protect_sinks = 4;
  } else if (name == "random") {
    p.aggregation = Aggregation::kRandom;
  }
  return p;
}

TEST(PresetsTest, ExpansionIsUnchanged) {
  const std::vector<absl::string_view> expected_names = {
      "inertia", "inertia_lazy4", "score_free", "tova", "h2o", "streaming_llm", "random"};
  EXPECT_EQ(Policy::PresetNames(), expected_names);
  for (absl::string_view name : expected_names) {
    for (int64_t budget : {1, 2, 3, 100, 101}) {
      absl::StatusOr<Policy> policy = Policy::FromPreset(name, budget);
      ASSERT_TRUE(policy.ok()) << name << ": " << policy.status();
      const Policy want = Expected(name, budget);
      EXPECT_EQ(*policy, want) << name << " at budget " << budget << ": got "
                               << policy->DebugString() << ", want " << want.DebugString();
      EXPECT_EQ(policy->alpha, 0.8) << name;
      EXPECT_EQ(policy->refresh_interval, 4) << name;
    }
  }
  EXPECT_EQ(Policy::FromPreset("h2o", 101)->protect_recent, 50);  // integer division
  EXPECT_EQ(Policy::FromPreset("h2o", 1)->protect_recent, 0);
}

TEST(PresetsTest, AnUnknownNameListsThePresets) {
  absl::StatusOr<Policy> policy = Policy::FromPreset("inertia2", 100);
  ASSERT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(policy.status().message().find("inertia, inertia_lazy4, score_free"),
            absl::string_view::npos)
      << policy.status();
}

}  // namespace
}  // namespace kvcm

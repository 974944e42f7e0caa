// The snapshot format (cache_manager/persist/snapshot.h) and the restart of an engine from it
// (cache_manager/persist/restart.h): every preset, per-layer and folded, with KV pools, restores
// to a state whose bits and next decisions are the original's; damaged files are errors;
// a worker's resume is validated as strictly as an open.
#include "cache_manager/persist/snapshot.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/persist/restart.h"
#include "cache_manager/table/sequence_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kPrefill = 40;
constexpr int64_t kBudget = 12;
constexpr int64_t kFoldedLayers = 3;

SequenceOptions Options(absl::string_view preset, bool folded) {
  SequenceOptions o;
  o.prefill_len = kPrefill;
  o.budget = BudgetSpec::Tokens(kBudget);
  o.preset = std::string(preset);
  o.policy.seed = 7;  // random only
  if (folded) {
    o.score_layout = ScoreLayout::kFolded;
    o.layers = kFoldedLayers;
  }
  return o;
}

// Scores for the next step of `id` in `table` (none when it does not need them), drawn
// from `rng`; a folded sequence gets one row.
testing::DenseScores NextScores(const SequenceTable& table, const std::string& id,
                                std::mt19937_64& rng) {
  absl::StatusOr<SequenceInfo> info = table.Inspect(id, false);
  KVCM_CHECK(info.ok());
  if (!info->next_needs_scores) return testing::DenseScores(testing::Layers{});
  const int64_t rows = info->score_layout == ScoreLayout::kFolded ? 1 : 2;
  return testing::DenseScores(testing::RandomLayers(rng, rows, info->cache_size + 1, false));
}

void ExpectSameDecision(const EvictionDecision& a, const EvictionDecision& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.evicted, b.evicted);
  EXPECT_EQ(a.cache_size, b.cache_size);
  EXPECT_EQ(a.next_needs_scores, b.next_needs_scores);
  ASSERT_EQ(a.kv.size(), b.kv.size());
  for (size_t r = 0; r < a.kv.size(); ++r) {
    EXPECT_EQ(a.kv[r].new_token_slot, b.kv[r].new_token_slot) << "rank " << r;
    EXPECT_EQ(a.kv[r].released_blocks, b.kv[r].released_blocks) << "rank " << r;
    ASSERT_EQ(a.kv[r].moves.size(), b.kv[r].moves.size()) << "rank " << r;
    for (size_t i = 0; i < a.kv[r].moves.size(); ++i) {
      EXPECT_EQ(a.kv[r].moves[i].src_slot, b.kv[r].moves[i].src_slot);
      EXPECT_EQ(a.kv[r].moves[i].dst_slot, b.kv[r].moves[i].dst_slot);
    }
  }
}

// Positions, momentum bit for bit, KV slots, step and statistics.
void ExpectSameState(const SequenceTable& a, const SequenceTable& b, const std::string& id) {
  absl::StatusOr<SequenceInfo> x = a.Inspect(id, true);
  absl::StatusOr<SequenceInfo> y = b.Inspect(id, true);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(x->last_step, y->last_step);
  EXPECT_EQ(x->positions, y->positions);
  ASSERT_EQ(x->momentum.size(), y->momentum.size());
  EXPECT_EQ(std::memcmp(x->momentum.data(), y->momentum.data(), x->momentum.size() * sizeof(float)), 0)
      << id << ": momentum bits differ";
  EXPECT_EQ(x->kv_slots, y->kv_slots);
  EXPECT_EQ(x->stats.steps, y->stats.steps);
  EXPECT_EQ(x->stats.scoring_steps, y->stats.scoring_steps);
  EXPECT_EQ(x->stats.tokens_evicted, y->stats.tokens_evicted);
  EXPECT_EQ(x->policy, y->policy);
  EXPECT_EQ(x->budget, y->budget);
  EXPECT_EQ(x->score_layout, y->score_layout);
  EXPECT_EQ(x->layers, y->layers);
  EXPECT_EQ(x->tp_world_size, y->tp_world_size);
  EXPECT_EQ(x->score_dtype, y->score_dtype);
}

TEST(SnapshotTest, Crc32cMatchesTheStandardCheckValue) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
}

// `engine`: the kernel backend of both tables (nullptr: the CPU; the emulated device
// backend runs the device path: the snapshot downloads its state, the restore uploads it).
void ExpectEveryPresetRestoresExactly(const kernels::KernelBackend* engine) {
  for (absl::string_view preset : Policy::PresetNames()) {
    for (bool folded : {false, true}) {
      SequenceOptions options = Options(preset, folded);
      if (folded && !Sequence::ResolvePolicy(options)->UsesScores()) continue;
      SCOPED_TRACE(std::string(preset) + (folded ? " folded" : " per-layer"));
      auto pools_a = testing::SmallHostKvPools(2, 64);
      SequenceTable a(SequenceTableOptions{.kv_pools = pools_a.get(), .engine_backend = engine});
      ASSERT_TRUE(a.Open("s", options, 1, kernels::ScoreDtype::kFloat16).ok());
      ASSERT_TRUE(a.Open("other", Options("inertia", false), 2).ok());
      std::mt19937_64 rng(11);
      EvictionDecision d;
      for (int64_t step = 1; step <= 7; ++step) {
        testing::DenseScores s = NextScores(a, "s", rng);
        ASSERT_TRUE(a.Step("s", step, &s.matrix, &d).ok()) << step;
      }
      // "other" is tensor-parallel: opened and never stepped (its cache is the prefill).

      const EngineSnapshot captured = CaptureEngine(a, pools_a.get(), 1234);
      const std::string bytes = EncodeSnapshot(captured);
      absl::StatusOr<EngineSnapshot> decoded = DecodeSnapshot(bytes);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_EQ(EncodeSnapshot(*decoded), bytes) << "a decoded snapshot encodes to other bytes";
      EXPECT_EQ(decoded->pid, 1234);
      ASSERT_EQ(decoded->sequences.size(), 2u);
      for (const SequenceRecord& record : decoded->sequences) EXPECT_EQ(record.tenant, "");

      auto pools_b = testing::SmallHostKvPools(2, 64);
      SequenceTable b(SequenceTableOptions{.kv_pools = pools_b.get(), .engine_backend = engine});
      const RestoreReport report = RestoreEngine(*decoded, &b, pools_b.get());
      EXPECT_EQ(report.restored, 2);
      EXPECT_THAT(report.failures, ::testing::IsEmpty());
      for (const char* id : {"s", "other"}) ExpectSameState(a, b, id);
      for (int32_t r = 0; r < 2; ++r) {
        EXPECT_EQ(pools_a->pool(r).FreeBlocks(), pools_b->pool(r).FreeBlocks()) << "rank " << r;
      }

      EvictionDecision da, db;
      for (int64_t step = 8; step <= 16; ++step) {
        testing::DenseScores s = NextScores(a, "s", rng);
        ASSERT_TRUE(a.Step("s", step, &s.matrix, &da).ok()) << step;
        ASSERT_TRUE(b.Step("s", step, &s.matrix, &db).ok()) << step;
        ExpectSameDecision(da, db);
      }
      ExpectSameState(a, b, "s");
    }
  }
}

TEST(SnapshotTest, EveryPresetRestoresBitForBitAndDecidesOnExactly) {
  ExpectEveryPresetRestoresExactly(nullptr);
}

TEST(SnapshotTest, ADeviceEngineRestoresBitForBitAndDecidesOnExactly) {
  ExpectEveryPresetRestoresExactly(&kernels::EmulatedDeviceBackend());
}

TEST(SnapshotTest, EveryTruncationAndEveryDamagedByteIsDataLoss) {
  auto pools = testing::SmallHostKvPools(1, 16);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("s", Options("random", false)).ok());
  const std::string bytes = EncodeSnapshot(CaptureEngine(table, pools.get(), 1));
  ASSERT_TRUE(DecodeSnapshot(bytes).ok());
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<EngineSnapshot> cut = DecodeSnapshot(absl::string_view(bytes).substr(0, n));
    EXPECT_TRUE(absl::IsDataLoss(cut.status())) << n << " bytes: " << cut.status();
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string damaged = bytes;
    damaged[i] = static_cast<char>(damaged[i] ^ 0x20);
    absl::StatusOr<EngineSnapshot> decoded = DecodeSnapshot(damaged);
    EXPECT_TRUE(absl::IsDataLoss(decoded.status())) << "byte " << i << ": " << decoded.status();
  }
  std::string other_version = bytes;
  other_version[8] = static_cast<char>(kSnapshotVersion + 1);
  EXPECT_THAT(DecodeSnapshot(other_version).status().message(),
              HasSubstr(absl::StrCat("version ", kSnapshotVersion + 1, ";")));
  EXPECT_THAT(DecodeSnapshot(bytes + "x").status().message(), HasSubstr("payload bytes"));
}

// Span pooling (SPEC.md, "Span pooling") survives a restart and a hand-off: the policy's
// span_pool is in the record, and the restored sequence decides on as the original.
TEST(SnapshotTest, SpanPoolIsKeptAcrossARestartAndAHandOffRecord) {
  SequenceOptions options = Options("inertia", false);
  options.policy.span_pool = 7;
  SequenceTable a;
  ASSERT_TRUE(a.Open("s", options).ok());
  std::mt19937_64 rng(3);
  EvictionDecision da, db;
  for (int64_t step = 1; step <= 4; ++step) {
    testing::DenseScores s = NextScores(a, "s", rng);
    ASSERT_TRUE(a.Step("s", step, &s.matrix, &da).ok());
  }
  absl::StatusOr<EngineSnapshot> decoded = DecodeSnapshot(EncodeSnapshot(CaptureEngine(a, nullptr, 1)));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->sequences.size(), 1u);
  EXPECT_EQ(decoded->sequences[0].options.policy.span_pool, 7);
  absl::StatusOr<SequenceRecord> handed = DecodeSequenceRecord(EncodeSequenceRecord(a.Records()[0]));
  ASSERT_TRUE(handed.ok()) << handed.status();
  EXPECT_EQ(handed->options.policy.span_pool, 7);
  SequenceTable b;
  ASSERT_TRUE(b.Restore(decoded->sequences[0]).ok());
  for (int64_t step = 5; step <= 12; ++step) {
    testing::DenseScores s = NextScores(a, "s", rng);
    ASSERT_TRUE(a.Step("s", step, &s.matrix, &da).ok());
    ASSERT_TRUE(b.Step("s", step, &s.matrix, &db).ok());
    ExpectSameDecision(da, db);
  }
  ExpectSameState(a, b, "s");
}

// A version 1 record (before span_pool) is still read, its policy with span_pool 0: the
// same record written now, less the 8 bytes of span_pool after the seed.
TEST(SnapshotTest, AVersion1RecordReadsWithSpanPoolOff) {
  SequenceOptions options = Options("inertia", false);
  options.policy.seed = 0x5eed5eed5eed5eedULL;  // marks where the policy's seed lies
  SequenceTable table;
  ASSERT_TRUE(table.Open("s", options).ok());
  const SequenceRecord record = table.Records()[0];
  const std::string v2 = EncodeSequenceRecord(record);
  const uint64_t seed = options.policy.seed;
  const size_t at = v2.find(std::string(reinterpret_cast<const char*>(&seed), sizeof(seed)));
  ASSERT_NE(at, std::string::npos);
  std::string body = v2.substr(16);  // magic, version, CRC32C
  body.erase(at + sizeof(seed) - 16, sizeof(int64_t));
  std::string v1 = v2.substr(0, 8);
  const uint32_t header[2] = {1, Crc32c(body)};
  v1.append(reinterpret_cast<const char*>(header), sizeof(header));
  v1 += body;
  absl::StatusOr<SequenceRecord> decoded = DecodeSequenceRecord(v1);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->options.policy, record.options.policy);
  EXPECT_EQ(decoded->options.policy.span_pool, 0);
  EXPECT_EQ(EncodeSequenceRecord(*decoded), v2);
}

TEST(SnapshotTest, ASnapshotWhosePoolsDifferFromTheFlagsIsNamed) {
  auto pools = testing::SmallHostKvPools(2, 16);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  const EngineSnapshot snapshot = CaptureEngine(table, pools.get(), 1);
  const kernels::KvBlockLayout layout = testing::SmallKvLayout();
  // Private memory cannot be re-attached.
  EXPECT_THAT(CheckPoolsMatch(snapshot, 2, layout, 16 * layout.BlockBytes()).message(),
              HasSubstr("private memory"));
  EXPECT_THAT(CheckPoolsMatch(snapshot, 1, layout, 16 * layout.BlockBytes()).message(),
              HasSubstr("2 KV pools, this configuration 1"));
  EXPECT_THAT(CheckPoolsMatch(snapshot, 2, layout, 8 * layout.BlockBytes()).message(),
              HasSubstr("--pool_memory_bytes"));
  kernels::KvBlockLayout other = layout;
  other.head_dim *= 2;
  EXPECT_THAT(CheckPoolsMatch(snapshot, 2, other, 16 * other.BlockBytes()).message(),
              HasSubstr("block layout"));
}

// Resume (a worker re-creating a sequence after a crash).
SequenceOptions Resumed(int64_t last_step, std::vector<int64_t> positions,
                        absl::string_view preset = "inertia") {
  SequenceOptions o;
  o.prefill_len = 6;
  o.budget = BudgetSpec::Tokens(4);
  o.preset = std::string(preset);
  o.resume.emplace();
  o.resume->last_step = last_step;
  o.resume->positions = std::move(positions);
  return o;
}

TEST(ResumeTest, BadResumeStatesAreRefusedNamingWhatIsWrongAndChangeNothing) {
  struct Bad {
    SequenceOptions options;
    const char* message;
  };
  SequenceOptions mismatch = Resumed(3, {0, 1, 2});
  mismatch.resume->momentum = {0.5f};
  SequenceOptions not_finite = Resumed(3, {0, 1});
  not_finite.resume->momentum = {0.5f, std::numeric_limits<float>::infinity()};
  SequenceOptions rng_not_random = Resumed(3, {0, 1});
  rng_not_random.resume->rng_state = "1 2 3";
  const std::vector<Bad> bad = {
      {Resumed(3, {0, 2, 2}), "strictly above"},
      {Resumed(3, {3, 1}), "strictly above"},
      {Resumed(3, {-1, 2}), "must be 0 to 8"},
      {Resumed(3, {0, 9}), "must be 0 to 8"},  // 6 prefill + 3 steps: the newest is 8
      {Resumed(3, {0, 1, 2, 3, 4}), "1 to the budget of 4"},
      {Resumed(3, {}), "1 to the budget of 4"},
      {Resumed(0, {0, 1, 2}), "the prefill 0 .. 5"},
      {Resumed(-1, {0}), "last_step is -1"},
      {mismatch, "1 momentum values for 3 positions"},
      {not_finite, "not finite"},
      {rng_not_random, "not random"},
  };
  auto pools = testing::SmallHostKvPools(1, 16);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  for (const Bad& b : bad) {
    absl::StatusOr<SequenceInfo> opened = table.Open("r", b.options);
    EXPECT_TRUE(absl::IsInvalidArgument(opened.status())) << b.message << ": " << opened.status();
    EXPECT_THAT(opened.status().message(), HasSubstr(b.message));
    EXPECT_EQ(table.Totals().open_sequences, 0);
    EXPECT_EQ(pools->Usage()[0].used_blocks, 0);
    EXPECT_EQ(table.memory_bytes(), 0);
  }
}

TEST(ResumeTest, ALastStepThatWouldOverflowIsRefusedByTheEngine) {
  // The table refuses it earlier, for its token limit; the engine on its own too.
  absl::StatusOr<std::unique_ptr<Sequence>> s =
      Sequence::Create("r", Resumed(std::numeric_limits<int64_t>::max(), {0}));
  EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("fit in 64 bits"));
}

TEST(ResumeTest, AResumePastTheSequenceTokenLimitIsRefused) {
  SequenceTable table(SequenceTableOptions{.max_sequence_tokens = 10});
  EXPECT_TRUE(table.Open("r", Resumed(4, {0, 9})).ok());  // 6 + 4 = 10: at the limit
  absl::StatusOr<SequenceInfo> past = table.Open("q", Resumed(5, {0, 10}));
  EXPECT_TRUE(absl::IsResourceExhausted(past.status())) << past.status();
  EXPECT_THAT(past.status().message(), HasSubstr("--max_sequence_tokens=10"));
}

TEST(ResumeTest, AResumedSequenceStartsFromAFreshPrefillsMomentumAtTheNextStep) {
  auto pools = testing::SmallHostKvPools(1, 16);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  absl::StatusOr<SequenceInfo> opened = table.Open("r", Resumed(5, {0, 3, 7, 10}));
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->last_step, 5);
  EXPECT_EQ(opened->cache_size, 4);
  EXPECT_EQ(pools->Usage()[0].used_blocks, 1);  // 4 tokens, 4 per block
  absl::StatusOr<SequenceInfo> cache = table.Inspect("r", true);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->positions, (std::vector<int64_t>{0, 3, 7, 10}));
  EXPECT_EQ(cache->momentum, (std::vector<float>{0, 0, 0, 0}));

  EvictionDecision d;
  // Step 5 was decided before the crash: out of order now.
  testing::DenseScores five(testing::Layers{{0.1f, 0.2f, 0.3f, 0.4f, 0.5f}});
  EXPECT_TRUE(absl::IsFailedPrecondition(table.Step("r", 5, &five.matrix, &d)));
  // Step 6 adds position 6 + 6 - 1 = 11; ema from zeros: m = 0.2 s, the lowest goes.
  testing::DenseScores six(testing::Layers{{0.4f, 0.3f, 0.05f, 0.6f, 0.2f}});
  ASSERT_TRUE(table.Step("r", 6, &six.matrix, &d).ok());
  EXPECT_EQ(d.evicted, (std::vector<int64_t>{7}));
  EXPECT_EQ(d.cache_size, 4);

  // Recency: each token's momentum is its position, as at open.
  absl::StatusOr<SequenceInfo> recency = table.Open("q", Resumed(5, {1, 4, 8}, "streaming_llm"));
  ASSERT_TRUE(recency.ok()) << recency.status();
  EXPECT_EQ(table.Inspect("q", true)->momentum, (std::vector<float>{1, 4, 8}));
}

}  // namespace
}  // namespace kvcm

// The hand-off's engine side: a source's ExportTable (freeze, describe, read blocks,
// commit, abort, expiry, bounds) and a target's SequenceTable::PrepareImport and
// CommitImport, between two tables in this process: the imported sequence decides on
// exactly as the one that stayed, with its K/V blocks copied block for block.
#include "cache_manager/handoff/exports.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_manager/persist/snapshot.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

SequenceOptions Options(int64_t prefill, int64_t budget) {
  SequenceOptions o;
  o.prefill_len = prefill;
  o.budget = BudgetSpec::Tokens(budget);
  o.preset = "inertia";
  return o;
}

testing::DenseScores ScoresFor(const SequenceTable& table, const std::string& id,
                               std::mt19937_64& rng) {
  absl::StatusOr<SequenceInfo> info = table.Inspect(id, false);
  KVCM_CHECK(info.ok());
  return testing::DenseScores(testing::RandomLayers(rng, 2, info->cache_size + 1, false));
}

// Writes distinct bytes into every block the pools hand out (the whole storage).
void FillPools(KvPools& pools, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int32_t r = 0; r < pools.ranks(); ++r) {
    std::string bytes(static_cast<size_t>(pools.pool(r).storage().bytes()), '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    ASSERT_TRUE(pools.pool(r).mutable_storage().CopyIn(0, bytes.data(), bytes.size()).ok());
  }
}

class ExportTest : public ::testing::Test {
 protected:
  ExportTest()
      : pools_(testing::SmallHostKvPools(2, 64)),
        table_(SequenceTableOptions{.kv_pools = pools_.get()}),
        exports_(&table_, pools_.get(), ExportOptions{.max_exports = 2, .lease = absl::Seconds(30),
                                                      .clock = &clock_}) {}

  void OpenAndStep(const std::string& id, int64_t steps) {
    ASSERT_TRUE(table_.Open(id, Options(40, 10)).ok());
    EvictionDecision d;
    for (int64_t step = 1; step <= steps; ++step) {
      testing::DenseScores s = ScoresFor(table_, id, rng_);
      ASSERT_TRUE(table_.Step(id, step, &s.matrix, &d).ok());
    }
  }

  ManualClock clock_;
  std::unique_ptr<KvPools> pools_;
  SequenceTable table_;
  ExportTable exports_;
  std::mt19937_64 rng_{5};
};

TEST_F(ExportTest, AnExportFreezesDescribesAndCommitsOrAborts) {
  OpenAndStep("s", 1);
  const std::vector<SequenceRecord> before = table_.Records();
  absl::StatusOr<ExportTicket> ticket = exports_.Begin("", "s");
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<SequenceRecord> record = DecodeSequenceRecord(ticket->record);
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(EncodeSequenceRecord(*record), EncodeSequenceRecord(before.front()));
  ASSERT_EQ(ticket->blocks.size(), 2u);
  EXPECT_EQ(ticket->blocks[0], record->kv[0].blocks);
  // Frozen: a step is refused and changes nothing; a second export too.
  testing::DenseScores s = ScoresFor(table_, "s", rng_);
  EvictionDecision d;
  const absl::Status refused = table_.Step("s", 2, &s.matrix, &d);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("being handed off"));
  EXPECT_TRUE(absl::IsFailedPrecondition(exports_.Begin("", "s").status()));
  EXPECT_EQ(EncodeSequenceRecord(table_.Records().front()), EncodeSequenceRecord(before.front()));
  // Aborted: served again; a repeated abort answers the same; a late commit is refused.
  absl::StatusOr<ExportEnd> aborted = exports_.Finish(ticket->export_id, false);
  ASSERT_TRUE(aborted.ok());
  EXPECT_FALSE(aborted->committed);
  EXPECT_TRUE(aborted->now);
  EXPECT_FALSE(exports_.Finish(ticket->export_id, false)->now);
  EXPECT_TRUE(absl::IsFailedPrecondition(exports_.Finish(ticket->export_id, true).status()));
  EXPECT_TRUE(table_.Step("s", 2, &s.matrix, &d).ok());
  // Committed: closed here, blocks given back; the commit is remembered.
  absl::StatusOr<ExportTicket> again = exports_.Begin("", "s");
  ASSERT_TRUE(again.ok());
  absl::StatusOr<ExportEnd> committed = exports_.Finish(again->export_id, true);
  ASSERT_TRUE(committed.ok());
  EXPECT_TRUE(committed->committed);
  EXPECT_EQ(committed->policy_preset, "inertia");
  EXPECT_TRUE(absl::IsNotFound(table_.Inspect("s", false).status()));
  EXPECT_EQ(pools_->pool(0).Usage().used_blocks, 0);
  absl::StatusOr<ExportEnd> repeated = exports_.Finish(again->export_id, true);
  ASSERT_TRUE(repeated.ok());
  EXPECT_TRUE(repeated->committed);
  EXPECT_FALSE(repeated->now);
  EXPECT_TRUE(absl::IsNotFound(exports_.Finish(999, true).status()));
}

TEST_F(ExportTest, BlocksAreReadWholeAndOnlyInsideTheExport) {
  OpenAndStep("s", 0);
  FillPools(*pools_, 3);
  absl::StatusOr<ExportTicket> ticket = exports_.Begin("", "s");
  ASSERT_TRUE(ticket.ok());
  const int64_t block_bytes = pools_->pool(1).layout().BlockBytes();
  std::string out = "x";
  ASSERT_TRUE(exports_.CopyBlocks(ticket->export_id, 1, 2, 3, &out).ok());
  ASSERT_EQ(out.size(), 1 + 3 * static_cast<size_t>(block_bytes));
  for (int64_t i = 0; i < 3; ++i) {
    const int32_t block = ticket->blocks[1][static_cast<size_t>(2 + i)];
    EXPECT_EQ(std::memcmp(out.data() + 1 + i * block_bytes, pools_->pool(1).BlockData(block),
                          static_cast<size_t>(block_bytes)),
              0)
        << "block " << i;
  }
  const int64_t held = static_cast<int64_t>(ticket->blocks[1].size());
  EXPECT_TRUE(absl::IsInvalidArgument(exports_.CopyBlocks(ticket->export_id, 1, held, 1, &out)));
  EXPECT_TRUE(absl::IsInvalidArgument(exports_.CopyBlocks(ticket->export_id, 1, -1, 1, &out)));
  EXPECT_TRUE(absl::IsInvalidArgument(exports_.CopyBlocks(ticket->export_id, 2, 0, 1, &out)));
  EXPECT_TRUE(absl::IsNotFound(exports_.CopyBlocks(ticket->export_id + 1, 0, 0, 1, &out)));
  ASSERT_TRUE(exports_.Finish(ticket->export_id, true).ok());
  EXPECT_TRUE(absl::IsNotFound(exports_.CopyBlocks(ticket->export_id, 0, 0, 1, &out)));
}

// A client's close wins over an export in progress, but the blocks stay the sequence's
// until the export ends: a peer reading them never reads another sequence's K/V.
TEST_F(ExportTest, ACloseDuringAnExportKeepsItsBlocksUntilTheExportEnds) {
  OpenAndStep("s", 1);
  absl::StatusOr<ExportTicket> ticket = exports_.Begin("", "s");
  ASSERT_TRUE(ticket.ok());
  const int64_t held = pools_->pool(0).Usage().used_blocks;
  ASSERT_GT(held, 0);
  ASSERT_TRUE(table_.Close("s").ok());
  EXPECT_EQ(pools_->pool(0).Usage().used_blocks, held) << "the export pins them";
  ASSERT_TRUE(table_.Open("other", Options(40, 10)).ok());  // takes other blocks meanwhile
  std::string out;
  EXPECT_TRUE(exports_.CopyBlocks(ticket->export_id, 0, 0, 1, &out).ok());
  const absl::Status commit = exports_.Finish(ticket->export_id, true).status();
  EXPECT_TRUE(absl::IsNotFound(commit)) << commit;
  EXPECT_THAT(commit.message(), HasSubstr("closed at the source"));
  ASSERT_TRUE(table_.Close("other").ok());
  EXPECT_EQ(pools_->pool(0).Usage().used_blocks, 0);
}

TEST_F(ExportTest, ExportsAreBoundedAndExpireIntoServingAgain) {
  OpenAndStep("a", 0);
  OpenAndStep("b", 0);
  OpenAndStep("c", 0);
  EXPECT_TRUE(absl::IsNotFound(exports_.Begin("", "nobody").status()));
  EXPECT_TRUE(absl::IsNotFound(exports_.Begin("another tenant", "c").status()));
  ASSERT_TRUE(exports_.Begin("", "a").ok());
  ASSERT_TRUE(exports_.Begin("", "b").ok());
  const absl::Status third = exports_.Begin("", "c").status();
  EXPECT_TRUE(absl::IsResourceExhausted(third)) << third;
  EXPECT_THAT(third.message(), HasSubstr("--max_exports"));
  EXPECT_EQ(exports_.AbortExpired(), 0);
  clock_.Advance(absl::Seconds(31));
  EXPECT_EQ(exports_.AbortExpired(), 2);
  EXPECT_EQ(exports_.in_progress(), 0);
  testing::DenseScores s = ScoresFor(table_, "a", rng_);
  EvictionDecision d;
  EXPECT_TRUE(table_.Step("a", 1, &s.matrix, &d).ok());
}

TEST_F(ExportTest, ASequenceWithAPendingTensorParallelStepIsNotExported) {
  ASSERT_TRUE(table_.Open("tp", Options(40, 10), 2).ok());
  testing::DenseScores s = ScoresFor(table_, "tp", rng_);
  RankReport report;
  report.step = 1;
  report.rank = 0;
  report.head_count = 1;
  report.partial_sums = s.matrix;
  bool decided = false;
  ASSERT_TRUE(table_.SubmitRankReport("tp", report, [&](const absl::StatusOr<EvictionDecision>&) {
                                        decided = true;
                                      }).ok());
  const absl::Status refused = exports_.Begin("", "tp").status();
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("pending tensor-parallel step"));
  EXPECT_FALSE(decided);
}

// The target's side: a record prepared into another table holds its id, memory and blocks
// but is not findable until committed; dropped, it gives everything back; committed with
// its blocks copied, it decides on exactly as the sequence that never moved.
TEST(ImportTest, APreparedImportIsInvisibleUntilCommittedAndDecidesOnExactly) {
  auto source_pools = testing::SmallHostKvPools(2, 64);
  auto target_pools = testing::SmallHostKvPools(2, 64);
  auto twin_pools = testing::SmallHostKvPools(2, 64);
  SequenceTable source(SequenceTableOptions{.kv_pools = source_pools.get()});
  SequenceTable target(SequenceTableOptions{.kv_pools = target_pools.get()});
  SequenceTable twin(SequenceTableOptions{.kv_pools = twin_pools.get()});
  std::mt19937_64 rng(9);
  EvictionDecision d, dt;
  for (SequenceTable* t : {&source, &twin}) ASSERT_TRUE(t->Open("s", Options(40, 10)).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    testing::DenseScores s = ScoresFor(source, "s", rng);
    ASSERT_TRUE(source.Step("s", step, &s.matrix, &d).ok());
    ASSERT_TRUE(twin.Step("s", step, &s.matrix, &dt).ok());
  }
  FillPools(*source_pools, 4);
  const SequenceRecord record = source.Records().front();
  {
    absl::StatusOr<SequenceTable::PendingImport> dropped = target.PrepareImport(record);
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    EXPECT_TRUE(absl::IsNotFound(target.Inspect("s", false).status()));
    EXPECT_TRUE(absl::IsAlreadyExists(target.Open("s", Options(40, 10)).status()));
    EXPECT_GT(target_pools->pool(0).Usage().used_blocks, 0);
  }
  EXPECT_EQ(target_pools->pool(0).Usage().used_blocks, 0);
  EXPECT_EQ(target.memory_bytes(), 0);
  EXPECT_TRUE(target.List().empty());

  absl::StatusOr<SequenceTable::PendingImport> pending = target.PrepareImport(record);
  ASSERT_TRUE(pending.ok()) << pending.status();
  ASSERT_EQ(pending->kv().size(), 2u);
  const int64_t block_bytes = target_pools->pool(0).layout().BlockBytes();
  for (int32_t r = 0; r < 2; ++r) {
    const std::vector<int32_t>& from = record.kv[static_cast<size_t>(r)].blocks;
    const std::vector<int32_t>& to = pending->kv()[static_cast<size_t>(r)].blocks;
    ASSERT_EQ(from.size(), to.size());
    for (size_t i = 0; i < from.size(); ++i) {
      ASSERT_TRUE(target_pools->pool(r)
                      .mutable_storage()
                      .CopyIn(to[i] * block_bytes, source_pools->pool(r).BlockData(from[i]),
                              block_bytes)
                      .ok());
    }
  }
  target.CommitImport(*std::move(pending));
  absl::StatusOr<SequenceInfo> here = target.Inspect("s", true);
  absl::StatusOr<SequenceInfo> there = source.Inspect("s", true);
  ASSERT_TRUE(here.ok() && there.ok());
  EXPECT_EQ(here->positions, there->positions);
  EXPECT_EQ(std::memcmp(here->momentum.data(), there->momentum.data(),
                        here->momentum.size() * sizeof(float)),
            0);
  // Token by token, the K/V at the target's slots is the source's.
  const kernels::KvBlockLayout layout = target_pools->pool(0).layout();
  for (int32_t r = 0; r < 2; ++r) {
    for (size_t i = 0; i < here->positions.size(); ++i) {
      const int64_t at_target = here->kv_slots[static_cast<size_t>(r)][i];
      const int64_t at_source = there->kv_slots[static_cast<size_t>(r)][i];
      for (int64_t layer = 0; layer < layout.layers; ++layer) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          EXPECT_EQ(std::memcmp(static_cast<const char*>(target_pools->pool(r).storage().data()) +
                                    layout.Offset(at_target, layer, kv),
                                static_cast<const char*>(source_pools->pool(r).storage().data()) +
                                    layout.Offset(at_source, layer, kv),
                                static_cast<size_t>(layout.TokenBytes())),
                    0);
        }
      }
    }
  }
  for (int64_t step = 4; step <= 12; ++step) {
    testing::DenseScores s = ScoresFor(target, "s", rng);
    ASSERT_TRUE(target.Step("s", step, &s.matrix, &d).ok());
    ASSERT_TRUE(twin.Step("s", step, &s.matrix, &dt).ok());
    EXPECT_EQ(d.evicted, dt.evicted) << step;
    EXPECT_EQ(d.cache_size, dt.cache_size) << step;
  }
}

TEST(ImportTest, ARecordThatDoesNotFitIsRefusedAndTakesNothing) {
  auto source_pools = testing::SmallHostKvPools(1, 64);
  SequenceTable source(SequenceTableOptions{.kv_pools = source_pools.get()});
  ASSERT_TRUE(source.Open("s", Options(40, 10)).ok());
  const SequenceRecord record = source.Records().front();

  SequenceTable no_pools;
  EXPECT_TRUE(absl::IsInvalidArgument(no_pools.PrepareImport(record).status()));
  auto small = testing::SmallHostKvPools(1, 4);
  SequenceTable full(SequenceTableOptions{.kv_pools = small.get()});
  EXPECT_TRUE(absl::IsResourceExhausted(full.PrepareImport(record).status()));
  SequenceRecord twice = record;
  twice.kv[0].slots[1] = twice.kv[0].slots[0];
  auto pools = testing::SmallHostKvPools(1, 64);
  SequenceTable target(SequenceTableOptions{.kv_pools = pools.get()});
  EXPECT_TRUE(absl::IsInvalidArgument(target.PrepareImport(twice).status()));
  EXPECT_EQ(pools->pool(0).Usage().used_blocks, 0);
  ASSERT_TRUE(target.Open("s", Options(40, 10)).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(target.PrepareImport(record).status()));
}

TEST(SequenceRecordTest, ARecordRoundTripsAndEveryDamageIsDataLoss) {
  auto pools = testing::SmallHostKvPools(2, 64);
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get()});
  ASSERT_TRUE(table.Open("s", Options(40, 10), 1, kernels::ScoreDtype::kFloat16, "t").ok());
  const std::string bytes = EncodeSequenceRecord(table.Records().front());
  absl::StatusOr<SequenceRecord> decoded = DecodeSequenceRecord(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->tenant, "t");
  EXPECT_EQ(EncodeSequenceRecord(*decoded), bytes);
  for (size_t n = 0; n < bytes.size(); n += 7) {
    EXPECT_TRUE(absl::IsDataLoss(DecodeSequenceRecord(bytes.substr(0, n)).status())) << n;
    std::string damaged = bytes;
    damaged[n] = static_cast<char>(damaged[n] ^ 0x5a);
    EXPECT_TRUE(absl::IsDataLoss(DecodeSequenceRecord(damaged).status())) << n;
  }
}

}  // namespace
}  // namespace kvcm

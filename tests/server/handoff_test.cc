// The disaggregated hand-off (docs/DISAGGREGATION.md) between two real kvcached on
// loopback: every golden vector handed off at steps 1, 2, the middle and the last but one,
// alone and across two ranks, per layer and folded, with and without KV pools, over UCX
// and over gRPC, decides exactly as one daemon would (momentum included); the target's K/V
// equals what the worker wrote at the source; and the faults (source or target killed
// mid-transfer, a sequence already being handed off, forged or mismatched exports, another
// tenant, the in-flight bound) leave nothing lost and nothing half done.
#include <signal.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/persist/snapshot.h"
#include "clients/replay/grpc_backend.h"
#include "clients/replay/replay_run.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kv_compaction.h"
#include "tests/clients/golden.h"
#include "tests/server/daemon_process.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;
using ::testing::HasSubstr;

// Two host pools in POSIX shared memory: 4 tokens a block, 2 layers, 2 heads of 4 f16.
const std::vector<std::string> kPools = {
    "--backend=host",  "--tp_ranks=2",     "--pool_memory_bytes=4194304", "--kv_layers=2",
    "--kv_heads=2",    "--kv_head_dim=4",  "--kv_tokens_per_block=4",     "--kv_dtype=float16",
    "--kv_shared_memory"};
const kernels::KvBlockLayout kLayout{4, 2, 2, 4, kernels::KvDtype::kFloat16};

// Faults. Large sequences (32 KiB of K/V a token and rank; the pools hold two) so that a
// transfer takes long enough to be interrupted.
const std::vector<std::string> kBigPools = {
    "--backend=host",  "--tp_ranks=2",      "--pool_memory_bytes=805306368", "--kv_layers=8",
    "--kv_heads=8",    "--kv_head_dim=128", "--kv_tokens_per_block=16",      "--kv_dtype=float16",
    "--kv_shared_memory"};
constexpr int64_t kBigPrefill = 12280;  // 384 MiB of K/V a rank, and room for a step

std::vector<std::string> With(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

std::unique_ptr<DaemonProcess> StartDaemon(const std::vector<std::string>& flags) {
  auto started = DaemonProcess::Start(flags);
  KVCM_CHECK(started.ok());
  return *std::move(started);
}

// A replay backend that steps a sequence on `source` up to step `import_before - 1`, then
// has `target` import it (ImportSequence) and steps it there from then on.
class HandingOffBackend final : public replay::ReplayBackend {
 public:
  HandingOffBackend(const DaemonProcess& source, const DaemonProcess& target, int64_t import_before)
      : source_(source), target_(target), import_before_(import_before) {}

  absl::Status Open(const std::string& id, const SequenceOptions& options,
                    int32_t tp_ranks) override {
    id_ = id;
    options_ = options;
    tp_ranks_ = tp_ranks;
    ASSIGN_OR_RETURN(inner_, replay::NewGrpcBackend({.address = source_.grpc_address()}));
    return inner_->Open(id, options, tp_ranks);
  }
  absl::Status Step(const std::string& id, const replay::TraceStep& step,
                    EvictionDecision* decision) override {
    if (step.step == import_before_) {
      inner_.reset();  // the prefill worker's streams end
      std::unique_ptr<client::KvCacheClient> target = target_.Connect();
      ASSIGN_OR_RETURN(imported_, target->ImportSequence(id_, source_.grpc_address()));
      if (imported_.state().last_step() != import_before_ - 1) {
        return absl::InternalError(absl::StrCat("imported at step ", imported_.state().last_step()));
      }
      ASSIGN_OR_RETURN(inner_, replay::NewGrpcBackend({.address = target_.grpc_address(),
                                                      .adopt_open_sequences = true}));
      RETURN_IF_ERROR(inner_->Open(id_, options_, tp_ranks_));
    }
    return inner_->Step(id, step, decision);
  }
  absl::StatusOr<SequenceInfo> Inspect(const std::string& id) override { return inner_->Inspect(id); }
  absl::Status Close(const std::string& id) override { return inner_->Close(id); }
  const v1::ImportSequenceResponse& imported() const { return imported_; }

 private:
  const DaemonProcess& source_;
  const DaemonProcess& target_;
  const int64_t import_before_;
  std::unique_ptr<replay::ReplayBackend> inner_;
  std::string id_;
  SequenceOptions options_;
  int32_t tp_ranks_ = 1;
  v1::ImportSequenceResponse imported_;
};

// Stops both daemons (each must drain and exit 0): the clients first, then the target,
// whose importer's connection to the source would otherwise hold the source's drain.
void StopBoth(std::unique_ptr<DaemonProcess> source, std::unique_ptr<DaemonProcess> target,
              std::unique_ptr<client::KvCacheClient>* client_a = nullptr,
              std::unique_ptr<client::KvCacheClient>* client_b = nullptr) {
  if (client_a != nullptr) client_a->reset();
  if (client_b != nullptr) client_b->reset();
  EXPECT_EQ(target->SignalAndWait(SIGTERM, absl::Seconds(20)), 0) << target->Log();
  EXPECT_EQ(source->SignalAndWait(SIGTERM, absl::Seconds(20)), 0) << source->Log();
}

int64_t StepCount(const std::string& golden) {
  std::istringstream in(testing::ReadFile(testing::GoldenDir() + "/" + golden + ".trace.jsonl"));
  int64_t lines = 0;
  for (std::string line; std::getline(in, line);) lines += line.empty() ? 0 : 1;
  return lines - 1;
}

absl::StatusOr<std::string> Replay(const std::string& golden, const std::string& id, int32_t tp,
                                   bool folded, bool momentum, replay::ReplayBackend& backend) {
  replay::ReplayOptions options;
  options.trace_path = testing::GoldenDir() + "/" + golden + ".trace.jsonl";
  options.sequence_id = id;
  options.tp_ranks = tp;
  options.folded = folded;
  options.with_momentum = momentum;
  std::ostringstream out;
  options.decisions = &out;
  RETURN_IF_ERROR(replay::RunReplay(options, backend).status());
  return out.str();
}

// The steps before which a trace of `steps` steps is handed off: after step 1, 2, the
// middle one and the last but one (each once, inside the trace).
std::vector<int64_t> ImportPoints(int64_t steps) {
  std::vector<int64_t> points;
  for (int64_t after : {int64_t{1}, int64_t{2}, steps / 2, steps - 1}) {
    if (after >= 1 && after < steps &&
        std::find(points.begin(), points.end(), after + 1) == points.end()) {
      points.push_back(after + 1);
    }
  }
  return points;
}

struct Pair {
  std::string name;
  std::vector<std::string> flags;
  std::string transport;  // what the imports must report
};

void PrintTo(const Pair& pair, std::ostream* os) { *os << pair.name; }

class GoldenHandoffTest : public ::testing::TestWithParam<Pair> {};

TEST_P(GoldenHandoffTest, EveryGoldenVectorDecidesExactlyAcrossAHandOff) {
  const Pair& pair = GetParam();
  std::unique_ptr<DaemonProcess> source = StartDaemon(pair.flags);
  std::unique_ptr<DaemonProcess> target = StartDaemon(pair.flags);
  int handoffs = 0;
  for (const std::string& golden : testing::GoldenNames()) {
    const std::string golden_decisions =
        testing::ReadFile(testing::GoldenDir() + "/" + golden + ".decisions.jsonl");
    for (const int64_t import_before : ImportPoints(StepCount(golden))) {
      for (int32_t tp : {1, 2}) {
        for (bool folded : {false, true}) {
          const std::string id = absl::StrCat(golden, "-tp", tp, folded ? "-folded" : "",
                                              "-at", import_before);
          SCOPED_TRACE(absl::StrCat(id, " (", pair.name, ")"));
          std::unique_ptr<replay::ReplayBackend> embedded = replay::NewEmbeddedBackend();
          absl::StatusOr<std::string> want = Replay(golden, id, tp, folded, true, *embedded);
          ASSERT_TRUE(want.ok()) << want.status();
          HandingOffBackend backend(*source, *target, import_before);
          absl::StatusOr<std::string> got = Replay(golden, id, tp, folded, true, backend);
          ASSERT_TRUE(got.ok()) << got.status() << "\n" << source->Log() << target->Log();
          EXPECT_EQ(*got, *want) << "momentum and decisions against one in-process engine";
          EXPECT_EQ(backend.imported().transport(), pair.transport);
          ++handoffs;
          if (folded) continue;
          // Per layer, the decisions alone are the golden file's.
          HandingOffBackend again(*source, *target, import_before);
          absl::StatusOr<std::string> decisions =
              Replay(golden, id + "-again", tp, folded, false, again);
          ASSERT_TRUE(decisions.ok()) << decisions.status();
          EXPECT_EQ(*decisions, golden_decisions);
        }
      }
    }
  }
  EXPECT_GE(handoffs, 100);
  // Every sequence was closed by its replay at the target; none is left at the source.
  EXPECT_TRUE(source->Connect()->List()->empty());
  EXPECT_TRUE(target->Connect()->List()->empty());
  StopBoth(std::move(source), std::move(target));
}

INSTANTIATE_TEST_SUITE_P(
    Transports, GoldenHandoffTest,
    ::testing::Values(Pair{"ucx", With(kPools, {"--kv_transfer=ucx"}), "ucx"},
                      Pair{"grpc", With(kPools, {"--kv_transfer=grpc"}), "grpc"},
                      Pair{"no_pools", {}, "none"}),
    [](const ::testing::TestParamInfo<Pair>& param) { return param.param.name; });

// A worker's mapping of one rank's pool (shared memory, as DescribeKvPools names it).
class PoolMapping {
 public:
  explicit PoolMapping(const v1::KvPool& pool)
      : layout_{pool.tokens_per_block(), pool.layers(), pool.kv_heads(), pool.head_dim(),
                kernels::KvDtype::kFloat16},
        bytes_(pool.bytes()) {
    const int fd = shm_open(pool.shm_name().c_str(), O_RDWR, 0);
    KVCM_CHECK(fd >= 0);
    data_ = static_cast<uint8_t*>(
        mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    KVCM_CHECK(data_ != MAP_FAILED);
  }
  ~PoolMapping() { munmap(data_, static_cast<size_t>(bytes_)); }
  // Every layer's K and V of the token in `slot`, concatenated.
  std::string Token(int64_t slot) const {
    std::string out;
    for (int64_t layer = 0; layer < layout_.layers; ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        out.append(reinterpret_cast<const char*>(data_ + layout_.Offset(slot, layer, kv)),
                   static_cast<size_t>(layout_.TokenBytes()));
      }
    }
    return out;
  }
  void Write(int64_t slot, const std::string& bytes) {
    size_t at = 0;
    for (int64_t layer = 0; layer < layout_.layers; ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        std::memcpy(data_ + layout_.Offset(slot, layer, kv), bytes.data() + at,
                    static_cast<size_t>(layout_.TokenBytes()));
        at += static_cast<size_t>(layout_.TokenBytes());
      }
    }
  }
  const kernels::KvBlockLayout& layout() const { return layout_; }

 private:
  const kernels::KvBlockLayout layout_;  // the pools of these tests are float16
  uint8_t* data_ = nullptr;
  int64_t bytes_ = 0;
};

std::vector<std::unique_ptr<PoolMapping>> MapPools(client::KvCacheClient& client) {
  grpc::ClientContext context;
  v1::DescribeKvPoolsResponse pools;
  KVCM_CHECK(client.stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools).ok());
  std::vector<std::unique_ptr<PoolMapping>> out;
  for (const v1::KvPool& pool : pools.pools()) out.push_back(std::make_unique<PoolMapping>(pool));
  return out;
}

int64_t UsedBlocks(client::KvCacheClient& client) {
  grpc::ClientContext context;
  v1::DescribeKvPoolsResponse pools;
  KVCM_CHECK(client.stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools).ok());
  int64_t used = 0;
  for (const v1::KvPool& pool : pools.pools()) used += pool.used_blocks();
  return used;
}

v1::StepBatch OneStep(const std::string& id, int64_t step, int64_t cache, uint32_t seed) {
  std::mt19937 random(seed);
  std::uniform_real_distribution<float> score(0.0f, 1.0f);
  std::vector<float> scores(static_cast<size_t>(2 * (cache + 1)));
  for (float& s : scores) s = score(random);
  v1::StepBatch batch;
  batch.set_batch_id(static_cast<uint64_t>(step));
  client::SetFloat32Scores(client::AddReport(&batch, id, step), scores, 2, 0);
  return batch;
}

// Opens `id` on `client` (prefill `prefill`, budget 10), writes distinct bytes for every
// token of every rank into the pools, and takes step 1 (which evicts down to the budget).
void PrefillAndStepOnce(client::KvCacheClient& client, const std::string& id, int64_t prefill) {
  v1::OpenSequenceRequest open = client::OpenRequest(id, prefill, -1, "inertia");
  open.set_budget_tokens(10);
  absl::StatusOr<v1::SequenceState> opened = client.Open(open);
  ASSERT_TRUE(opened.ok()) << opened.status();
  absl::StatusOr<v1::SequenceState> state = client.Inspect(id, true);
  ASSERT_TRUE(state.ok()) << state.status();
  std::vector<std::unique_ptr<PoolMapping>> pools = MapPools(client);
  std::mt19937 random(static_cast<uint32_t>(prefill));
  for (const v1::KvSlots& rank : state->kv_slots()) {
    for (int64_t slot : rank.slots()) {
      std::string bytes(
          static_cast<size_t>(pools[static_cast<size_t>(rank.rank())]->layout().TokenFootprintBytes()),
          '\0');
      for (char& c : bytes) c = static_cast<char>(random());
      pools[static_cast<size_t>(rank.rank())]->Write(slot, bytes);
    }
  }
  absl::StatusOr<v1::DecisionBatch> step = client.Step(OneStep(id, 1, prefill, 7));
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->decisions(0).code(), 0) << step->decisions(0).message();
}

// The K/V of every cached token, rank by rank, in cache order.
std::vector<std::string> CachedKv(client::KvCacheClient& client, const v1::SequenceState& state) {
  std::vector<std::unique_ptr<PoolMapping>> pools = MapPools(client);
  std::vector<std::string> tokens;
  for (const v1::KvSlots& rank : state.kv_slots()) {
    for (int64_t slot : rank.slots()) {
      tokens.push_back(pools[static_cast<size_t>(rank.rank())]->Token(slot));
    }
  }
  return tokens;
}

class KvHandoffTest : public ::testing::TestWithParam<std::string> {};

TEST_P(KvHandoffTest, TheTargetsKvEqualsWhatTheWorkerWroteAtTheSource) {
  const std::vector<std::string> flags = With(kPools, {"--kv_transfer=" + GetParam()});
  std::unique_ptr<DaemonProcess> source = StartDaemon(flags);
  std::unique_ptr<DaemonProcess> target = StartDaemon(flags);
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  PrefillAndStepOnce(*at_source, "kv", 300);
  absl::StatusOr<v1::SequenceState> before = at_source->Inspect("kv", true);
  ASSERT_TRUE(before.ok()) << before.status();
  const std::vector<std::string> written = CachedKv(*at_source, *before);
  const int64_t source_blocks = UsedBlocks(*at_source);

  absl::StatusOr<v1::ImportSequenceResponse> imported =
      at_target->ImportSequence("kv", source->grpc_address());
  ASSERT_TRUE(imported.ok()) << imported.status() << target->Log();
  EXPECT_EQ(imported->transport(), GetParam());
  EXPECT_EQ(imported->state().last_step(), 1);
  EXPECT_EQ(imported->state().cache_size(), 10);
  EXPECT_EQ(std::vector<int64_t>(imported->state().positions().begin(),
                                 imported->state().positions().end()),
            std::vector<int64_t>(before->positions().begin(), before->positions().end()));
  // Only the blocks the sequence holds moved (after step 1: its budget's, compacted).
  EXPECT_EQ(imported->kv_bytes(), source_blocks * kLayout.BlockBytes());
  EXPECT_LE(imported->kv_bytes(), 2 * 4 * kLayout.BlockBytes());
  EXPECT_EQ(CachedKv(*at_target, imported->state()), written);
  // The source let it go and gave its blocks back; the target holds as many.
  EXPECT_EQ(at_source->Inspect("kv", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(UsedBlocks(*at_source), 0);
  EXPECT_EQ(UsedBlocks(*at_target), source_blocks);
  // And it steps on at the target.
  absl::StatusOr<v1::DecisionBatch> step2 = at_target->Step(OneStep("kv", 2, 10, 9));
  ASSERT_TRUE(step2.ok()) << step2.status();
  EXPECT_EQ(step2->decisions(0).code(), 0) << step2->decisions(0).message();
  absl::StatusOr<std::string> metrics = testing::HttpGet(target->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(testing::MetricValue(*metrics, R"(kvcache_imports_total{result="ok"})"), 1);
  EXPECT_EQ(testing::MetricValue(
                *metrics, absl::StrCat(R"(kvcache_import_kv_bytes_total{transport=")", GetParam(), R"("})")),
            static_cast<double>(imported->kv_bytes()));
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

// A sequence whose blocks take many ReadExportedKv messages (4 MiB each) and UCX reads.
TEST_P(KvHandoffTest, ALongSequencesKvArrivesWhole) {
  const std::vector<std::string> flags = With(kBigPools, {"--kv_transfer=" + GetParam()});
  std::unique_ptr<DaemonProcess> source = StartDaemon(flags);
  std::unique_ptr<DaemonProcess> target = StartDaemon(flags);
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  PrefillAndStepOnce(*at_source, "long", 2000);  // budget 10: step 1 keeps 10
  // Import before any step would be the whole prefill: open a second one and move that.
  v1::OpenSequenceRequest open = client::OpenRequest("whole", 2000, -1, "inertia");
  open.set_budget_tokens(200);
  ASSERT_TRUE(at_source->Open(open).ok());
  absl::StatusOr<v1::SequenceState> before = at_source->Inspect("whole", true);
  ASSERT_TRUE(before.ok());
  {
    std::vector<std::unique_ptr<PoolMapping>> pools = MapPools(*at_source);
    std::mt19937 random(11);
    for (const v1::KvSlots& rank : before->kv_slots()) {
      for (int64_t slot : rank.slots()) {
        std::string bytes(static_cast<size_t>(pools[0]->layout().TokenFootprintBytes()), '\0');
        for (char& c : bytes) c = static_cast<char>(random());
        pools[static_cast<size_t>(rank.rank())]->Write(slot, bytes);
      }
    }
  }
  const std::vector<std::string> written = CachedKv(*at_source, *before);
  absl::StatusOr<v1::ImportSequenceResponse> imported =
      at_target->ImportSequence("whole", source->grpc_address());
  ASSERT_TRUE(imported.ok()) << imported.status() << source->Log();
  EXPECT_EQ(imported->transport(), GetParam());
  EXPECT_GT(imported->kv_bytes(), 16 << 20) << "several 4 MiB messages";
  EXPECT_TRUE(CachedKv(*at_target, imported->state()) == written) << "K/V differs";
  // The source is alive and well: its other sequence still steps.
  absl::StatusOr<v1::DecisionBatch> step2 = at_source->Step(OneStep("long", 2, 10, 5));
  ASSERT_TRUE(step2.ok()) << step2.status();
  EXPECT_EQ(step2->decisions(0).code(), 0) << step2->decisions(0).message();
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

INSTANTIATE_TEST_SUITE_P(Transports, KvHandoffTest, ::testing::Values("ucx", "grpc"));

double Metric(const DaemonProcess& daemon, const std::string& series) {
  absl::StatusOr<std::string> text = testing::HttpGet(daemon.metrics_address(), "/metrics");
  return text.ok() ? testing::MetricValue(*text, series) : -1;
}

v1::OpenSequenceRequest Open(const std::string& id, int64_t prefill) {
  v1::OpenSequenceRequest open = client::OpenRequest(id, prefill, -1, "inertia");
  open.set_budget_tokens(std::max<int64_t>(1, prefill / 10));
  return open;
}

// Starts importing `id` into `target` from `source` on another thread; stops `victim`
// (SIGSTOP) once the source has served the export, so that the transfer is cut while in
// progress, and returns the import's outcome after `kill` (SIGKILL) of the victim. False in
// `cut` when the import had finished before the victim was stopped (then nothing was cut).
absl::Status ImportAndKill(const DaemonProcess& source, const DaemonProcess& target,
                           DaemonProcess& victim, const std::string& id, bool* cut) {
  std::unique_ptr<client::KvCacheClient> client = target.Connect();
  std::future<absl::Status> done = std::async(std::launch::async, [&] {
    return client->ImportSequence(id, source.grpc_address(), absl::Seconds(60)).status();
  });
  const std::string exported = R"(kvcache_requests_total{rpc="ExportSequence"})";
  const double before = Metric(source, exported);
  testing::PollUntil([&] { return Metric(source, exported) > before; },
                     absl::Now() + absl::Seconds(20));
  kill(victim.pid(), SIGSTOP);
  *cut = done.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  kill(victim.pid(), SIGKILL);
  return done.get();
}

class FaultTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FaultTest, ASourceKilledMidTransferLeavesTheTargetHoldingNothing) {
  const std::vector<std::string> flags = With(kBigPools, {"--kv_transfer=" + GetParam()});
  std::unique_ptr<DaemonProcess> target = StartDaemon(flags);
  auto at_target = target->Connect();
  bool cut = false;
  for (int attempt = 0; attempt < 3 && !cut; ++attempt) {
    std::unique_ptr<DaemonProcess> source = StartDaemon(flags);
    ASSERT_TRUE(source->Connect()->Open(Open("big", kBigPrefill)).ok());
    const absl::Status imported = ImportAndKill(*source, *target, *source, "big", &cut);
    if (!cut) {  // finished first: give it back and try again
      ASSERT_TRUE(imported.ok()) << imported;
      ASSERT_TRUE(at_target->Close("big").ok());
      continue;
    }
    EXPECT_EQ(imported.code(), absl::StatusCode::kUnavailable) << imported;
    EXPECT_THAT(imported.message(), HasSubstr(source->grpc_address()));
  }
  ASSERT_TRUE(cut) << "every import finished before the source could be stopped";
  EXPECT_TRUE(at_target->List()->empty());
  EXPECT_EQ(UsedBlocks(*at_target), 0);
  EXPECT_EQ(Metric(*target, R"(kvcache_imports_total{result="failed"})"), 1);
  at_target.reset();
  EXPECT_EQ(target->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
}

TEST_P(FaultTest, ATargetKilledMidTransferLeavesTheSourceServingItExactly) {
  const std::vector<std::string> flags =
      With(kBigPools, {"--kv_transfer=" + GetParam(), "--export_lease=6s"});
  std::unique_ptr<DaemonProcess> source = StartDaemon(flags);
  auto at_source = source->Connect();
  const std::string kExpired = R"(kvcache_exports_total{result="expired"})";
  double expired_before = 0;
  bool cut = false;
  std::string id;
  for (int attempt = 0; attempt < 3 && !cut; ++attempt) {
    id = absl::StrCat("big", attempt);
    ASSERT_TRUE(at_source->Open(Open(id, kBigPrefill)).ok());
    ASSERT_TRUE(at_source->Open(Open(id + "-twin", kBigPrefill)).ok());
    std::unique_ptr<DaemonProcess> target = StartDaemon(flags);
    expired_before = Metric(*source, kExpired);
    const absl::Status imported = ImportAndKill(*source, *target, *target, id, &cut);
    // Not cut: the import either finished, or (on a loaded machine, 384 MiB a rank) ran past
    // the lease, after which the source serves the sequence again; both leave nothing to
    // test here, so the next attempt tries with another sequence.
    if (!cut && !imported.ok()) {
      ASSERT_EQ(imported.code(), absl::StatusCode::kFailedPrecondition) << imported;
      ASSERT_THAT(imported.message(), HasSubstr("lease ran out")) << imported;
      ASSERT_TRUE(at_source->Close(id).ok());
    }
    if (!cut) {  // the pools hold two such sequences: make room for the next attempt
      ASSERT_TRUE(at_source->Close(id + "-twin").ok());
    }
  }
  ASSERT_TRUE(cut) << "every import finished before the target could be stopped";
  // Frozen while the export's lease runs: its steps are refused, nothing changes.
  const v1::StepBatch step1 = OneStep(id, 1, kBigPrefill, 3);
  absl::StatusOr<v1::DecisionBatch> refused = at_source->Step(step1);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->decisions(0).code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(refused->decisions(0).message(), HasSubstr("being handed off"));
  ASSERT_TRUE(testing::WaitFor([&] { return Metric(*source, kExpired) > expired_before; },
                      absl::Seconds(20), "the export's lease ran out"));
  // Then served again, exactly as the twin that never moved.
  v1::StepBatch twin1 = OneStep(id + "-twin", 1, kBigPrefill, 3);
  absl::StatusOr<v1::DecisionBatch> stepped = at_source->Step(step1);
  absl::StatusOr<v1::DecisionBatch> twin = at_source->Step(twin1);
  ASSERT_TRUE(stepped.ok() && twin.ok());
  ASSERT_EQ(stepped->decisions(0).code(), 0) << stepped->decisions(0).message();
  EXPECT_EQ(std::vector<int64_t>(stepped->decisions(0).evicted().begin(), stepped->decisions(0).evicted().end()),
            std::vector<int64_t>(twin->decisions(0).evicted().begin(), twin->decisions(0).evicted().end()));
  absl::StatusOr<v1::SequenceState> moved = at_source->Inspect(id, true);
  absl::StatusOr<v1::SequenceState> stayed = at_source->Inspect(id + "-twin", true);
  ASSERT_TRUE(moved.ok() && stayed.ok());
  EXPECT_EQ(std::vector<float>(moved->momentum().begin(), moved->momentum().end()),
            std::vector<float>(stayed->momentum().begin(), stayed->momentum().end()));
  at_source.reset();
  EXPECT_EQ(source->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, FaultTest, ::testing::Values("ucx", "grpc"));

// The UCX sidecar of `daemon` (server/ucx_sidecar.h): its child process; -1 when none.
pid_t SidecarOf(const DaemonProcess& daemon) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // pid (comm) state ppid ...: the command may hold spaces; fields follow the last ')'.
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string state;
    pid_t ppid = -1;
    rest >> state >> ppid;
    if (ppid == daemon.pid() && state != "Z") return static_cast<pid_t>(std::stoi(line));
  }
  return -1;
}

// UCX runs in a sidecar process, so whatever UCX does to that process (UCX 1.13 can abort
// it when a reader dies mid-read) leaves the daemon and its sequences alone: a killed
// sidecar fails at most the read in progress, and the next hand-off starts another.
TEST(HandoffTest, AKilledUcxSidecarIsReplacedAndTheDaemonsServeOn) {
  const std::vector<std::string> flags = With(kPools, {"--kv_transfer=ucx"});
  std::unique_ptr<DaemonProcess> source = StartDaemon(flags);
  std::unique_ptr<DaemonProcess> target = StartDaemon(flags);
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  for (const DaemonProcess* daemon : {source.get(), target.get()}) {
    const pid_t sidecar = SidecarOf(*daemon);
    ASSERT_GT(sidecar, 0) << "no UCX sidecar: " << daemon->Log();
    ASSERT_EQ(kill(sidecar, SIGKILL), 0);
    ASSERT_TRUE(testing::WaitFor([&] { return SidecarOf(*daemon) != sidecar; }, absl::Seconds(10),
                                 "the killed sidecar is gone"));
    const std::string id = absl::StrCat("s", daemon == source.get() ? "-source" : "-target");
    PrefillAndStepOnce(*at_source, id, 60);
    absl::StatusOr<v1::SequenceState> before = at_source->Inspect(id, true);
    ASSERT_TRUE(before.ok());
    const std::vector<std::string> written = CachedKv(*at_source, *before);
    absl::StatusOr<v1::ImportSequenceResponse> imported =
        at_target->ImportSequence(id, source->grpc_address());
    ASSERT_TRUE(imported.ok()) << imported.status() << daemon->Log();
    EXPECT_EQ(imported->transport(), "ucx");
    EXPECT_EQ(CachedKv(*at_target, imported->state()), written);
    EXPECT_GT(SidecarOf(*daemon), 0) << "another sidecar started";
  }
  EXPECT_THAT(source->Log() + target->Log(), HasSubstr("starting another"));
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

// The test as a peer of `daemon` (no authentication configured: every caller is trusted).
std::unique_ptr<v1::KvPeer::Stub> PeerStub(const DaemonProcess& daemon) {
  return v1::KvPeer::NewStub(
      grpc::CreateChannel(daemon.grpc_address(), grpc::InsecureChannelCredentials()));
}

absl::StatusOr<v1::ExportSequenceResponse> Export(v1::KvPeer::Stub& peer, const std::string& id) {
  grpc::ClientContext context;
  v1::ExportSequenceRequest request;
  request.set_sequence_id(id);
  v1::ExportSequenceResponse response;
  RETURN_IF_ERROR(client::FromGrpc(peer.ExportSequence(&context, request, &response)));
  return response;
}

absl::StatusOr<bool> Finish(v1::KvPeer::Stub& peer, uint64_t export_id, bool commit) {
  grpc::ClientContext context;
  v1::FinishExportRequest request;
  request.set_export_id(export_id);
  request.set_commit(commit);
  v1::FinishExportResponse response;
  RETURN_IF_ERROR(client::FromGrpc(peer.FinishExport(&context, request, &response)));
  return response.committed();
}

TEST(HandoffTest, ASequenceBeingHandedOffIsRefusedToAnotherImportAndToSteps) {
  std::unique_ptr<DaemonProcess> source = StartDaemon(kPools);
  std::unique_ptr<DaemonProcess> target = StartDaemon(kPools);
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  ASSERT_TRUE(at_source->Open(Open("s", 40)).ok());
  std::unique_ptr<v1::KvPeer::Stub> peer = PeerStub(*source);
  absl::StatusOr<v1::ExportSequenceResponse> exported = Export(*peer, "s");
  ASSERT_TRUE(exported.ok()) << exported.status();
  absl::StatusOr<v1::ImportSequenceResponse> second =
      at_target->ImportSequence("s", source->grpc_address());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("already being handed off"));
  absl::StatusOr<v1::DecisionBatch> refused = at_source->Step(OneStep("s", 1, 40, 1));
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->decisions(0).code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(at_target->List()->empty());
  EXPECT_EQ(UsedBlocks(*at_target), 0);
  // Aborted: served again; the abort is remembered, and a late commit of it refused.
  absl::StatusOr<bool> aborted = Finish(*peer, exported->export_id(), false);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_FALSE(*aborted);
  EXPECT_EQ(Finish(*peer, exported->export_id(), true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::DecisionBatch> stepped = at_source->Step(OneStep("s", 1, 40, 1));
  ASSERT_TRUE(stepped.ok());
  EXPECT_EQ(stepped->decisions(0).code(), 0) << stepped->decisions(0).message();
  peer.reset();
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

// A fake source: a KvPeer that answers every export with `answer` and records aborts. Its
// FinishExport answers a commit with `commit` (OK: committed) and an abort with `abort`
// (OK: "not committed"; ALREADY_EXISTS stands for "committed before").
class FakeSource final : public v1::KvPeer::Service {
 public:
  explicit FakeSource(v1::ExportSequenceResponse answer, grpc::Status commit = grpc::Status::OK,
                      grpc::Status abort = grpc::Status::OK)
      : answer_(std::move(answer)), commit_(std::move(commit)), abort_(std::move(abort)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeSource() override { server_->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int aborts() const { return aborts_.load(); }

  grpc::Status ExportSequence(grpc::ServerContext*, const v1::ExportSequenceRequest*,
                              v1::ExportSequenceResponse* response) override {
    *response = answer_;
    return grpc::Status::OK;
  }
  grpc::Status FinishExport(grpc::ServerContext*, const v1::FinishExportRequest* request,
                            v1::FinishExportResponse* response) override {
    if (request->commit()) {
      ++commits_;
      response->set_committed(true);
      return commit_;
    }
    ++aborts_;
    if (abort_.error_code() == grpc::StatusCode::ALREADY_EXISTS) {
      response->set_committed(true);
      return grpc::Status::OK;
    }
    response->set_committed(false);
    return abort_;
  }
  int commits() const { return commits_.load(); }

 private:
  const v1::ExportSequenceResponse answer_;
  const grpc::Status commit_;
  const grpc::Status abort_;
  std::atomic<int> commits_{0};
  int port_ = 0;
  std::atomic<int> aborts_{0};
  std::unique_ptr<grpc::Server> server_;
};

TEST(HandoffTest, ForgedOversizedAndMismatchedExportsAreRefusedAndAborted) {
  std::unique_ptr<DaemonProcess> source = StartDaemon(kPools);
  std::unique_ptr<DaemonProcess> target = StartDaemon(kPools);
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  ASSERT_TRUE(at_source->Open(Open("s", 40)).ok());
  std::unique_ptr<v1::KvPeer::Stub> peer = PeerStub(*source);
  absl::StatusOr<v1::ExportSequenceResponse> genuine = Export(*peer, "s");
  ASSERT_TRUE(genuine.ok()) << genuine.status();
  ASSERT_TRUE(Finish(*peer, genuine->export_id(), false).ok());
  absl::StatusOr<SequenceRecord> record = DecodeSequenceRecord(genuine->record());
  ASSERT_TRUE(record.ok()) << record.status();

  struct Case {
    std::string name;
    v1::ExportSequenceResponse answer;
    absl::StatusCode code;
  };
  std::vector<Case> cases;
  cases.push_back({"garbage record", *genuine, absl::StatusCode::kDataLoss});
  cases.back().answer.set_record("KVCMSREC and then nothing that decodes");
  cases.push_back({"another sequence's record", *genuine, absl::StatusCode::kFailedPrecondition});
  SequenceRecord other = *record;
  other.id = "t";
  cases.back().answer.set_record(EncodeSequenceRecord(other));
  cases.push_back({"another block geometry", *genuine, absl::StatusCode::kFailedPrecondition});
  cases.back().answer.mutable_geometry()->set_head_dim(128);
  cases.push_back({"fewer pools", *genuine, absl::StatusCode::kFailedPrecondition});
  cases.back().answer.set_pool_ranks(1);
  SequenceRecord huge = *record;
  for (BlockLeaseState& lease : huge.kv) {
    lease.blocks.resize(1 << 20);
    for (size_t b = 0; b < lease.blocks.size(); ++b) lease.blocks[b] = static_cast<int32_t>(b);
  }
  cases.push_back({"more blocks than the pool", *genuine, absl::StatusCode::kResourceExhausted});
  cases.back().answer.set_record(EncodeSequenceRecord(huge));
  SequenceRecord twice = *record;
  twice.kv[0].blocks.push_back(twice.kv[0].blocks.front());
  cases.push_back({"a block listed twice", *genuine, absl::StatusCode::kInvalidArgument});
  cases.back().answer.set_record(EncodeSequenceRecord(twice));

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FakeSource fake(c.answer);
    absl::StatusOr<v1::ImportSequenceResponse> imported =
        at_target->ImportSequence("s", fake.address());
    EXPECT_EQ(imported.status().code(), c.code) << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(fake.address()));
    EXPECT_EQ(fake.aborts(), 1) << "the export was not given back";
    EXPECT_TRUE(at_target->List()->empty());
    EXPECT_EQ(UsedBlocks(*at_target), 0);
  }
  peer.reset();
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

// A commit whose answer is lost is retried, then asked about: a source that says it took
// it, or that answers nothing at all, leaves the sequence at the target (never lost); one
// that answers "not committed" leaves it at the source.
TEST(HandoffTest, ALostCommitAnswerNeverLosesTheSequence) {
  std::unique_ptr<DaemonProcess> source = StartDaemon({});
  std::unique_ptr<DaemonProcess> target = StartDaemon({});
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  ASSERT_TRUE(at_source->Open(Open("s", 40)).ok());
  std::unique_ptr<v1::KvPeer::Stub> peer = PeerStub(*source);
  absl::StatusOr<v1::ExportSequenceResponse> genuine = Export(*peer, "s");
  ASSERT_TRUE(genuine.ok()) << genuine.status();
  ASSERT_TRUE(Finish(*peer, genuine->export_id(), false).ok());
  const grpc::Status lost(grpc::StatusCode::UNAVAILABLE, "the reply was lost");
  struct Case {
    std::string name;
    grpc::Status abort;
    bool kept;
  };
  for (const Case& c : {Case{"the abort says committed", grpc::Status(grpc::StatusCode::ALREADY_EXISTS, ""), true},
                        Case{"nothing answers", lost, true},
                        Case{"the abort says not committed", grpc::Status::OK, false}}) {
    SCOPED_TRACE(c.name);
    FakeSource fake(*genuine, lost, c.abort);
    absl::StatusOr<v1::ImportSequenceResponse> imported =
        at_target->ImportSequence("s", fake.address());
    EXPECT_EQ(fake.commits(), 3) << "the commit is tried three times";
    EXPECT_EQ(imported.ok(), c.kept) << imported.status();
    EXPECT_EQ(at_target->Inspect("s", false).ok(), c.kept);
    if (c.kept) {
      ASSERT_TRUE(at_target->Close("s").ok());
    }
  }
  peer.reset();
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

TEST(HandoffTest, PastTheInFlightBoundTheImportIsRefusedAndTheSourceKeepsServing) {
  std::unique_ptr<DaemonProcess> source = StartDaemon(kPools);
  std::unique_ptr<DaemonProcess> target =
      StartDaemon(With(kPools, {"--max_import_bytes_in_flight=1024"}));
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  ASSERT_TRUE(at_source->Open(Open("s", 400)).ok());
  absl::StatusOr<v1::ImportSequenceResponse> imported =
      at_target->ImportSequence("s", source->grpc_address());
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kResourceExhausted) << imported.status();
  EXPECT_THAT(imported.status().message(), HasSubstr("--max_import_bytes_in_flight"));
  EXPECT_TRUE(at_target->List()->empty());
  EXPECT_EQ(UsedBlocks(*at_target), 0);
  absl::StatusOr<v1::DecisionBatch> stepped = at_source->Step(OneStep("s", 1, 400, 1));
  ASSERT_TRUE(stepped.ok());
  EXPECT_EQ(stepped->decisions(0).code(), 0) << stepped->decisions(0).message();
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

// The import queue: with one import thread busy and no room to wait, the next import is
// refused at once, and the busy one completes.
TEST(HandoffTest, PastTheImportQueueTheImportIsRefused) {
  std::unique_ptr<DaemonProcess> source = StartDaemon({});
  std::unique_ptr<DaemonProcess> target =
      StartDaemon({"--import_threads=1", "--max_queued_imports=0", "--import_timeout=20s"});
  auto at_source = source->Connect();
  auto at_target = target->Connect();
  ASSERT_TRUE(at_source->Open(Open("s1", 40)).ok());
  ASSERT_TRUE(at_source->Open(Open("s2", 40)).ok());
  kill(source->pid(), SIGSTOP);  // the first import's export waits for it
  std::future<absl::Status> first = std::async(std::launch::async, [&] {
    return target->Connect()->ImportSequence("s1", source->grpc_address()).status();
  });
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Metric(*target, R"(kvcache_requests_total{rpc="ImportSequence"})") >= 1; },
      absl::Seconds(10), "the first import arrived"));
  absl::StatusOr<v1::ImportSequenceResponse> second =
      at_target->ImportSequence("s2", source->grpc_address());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("--max_queued_imports"));
  kill(source->pid(), SIGCONT);
  EXPECT_TRUE(first.get().ok());
  EXPECT_TRUE(at_target->Inspect("s1", false).ok());
  EXPECT_TRUE(at_source->Inspect("s2", false).ok());
  StopBoth(std::move(source), std::move(target), &at_source, &at_target);
}

// Tenants and peers: a daemon serves KvPeer only to peers, and an import runs as the
// caller's tenant: another tenant's sequence is NOT_FOUND exactly as an unknown id.
TEST(HandoffTest, AnImportRunsAsTheCallersTenantAndKvPeerServesOnlyPeers) {
  const std::string dir = ::testing::TempDir();
  const std::string tokens = dir + "/handoff-tokens";
  const std::string peer_token = dir + "/handoff-peer-token";
  std::ofstream(tokens) << "tok-alice alice\ntok-bob bob\ntok-peer peers peer\n";
  std::ofstream(peer_token) << "tok-peer\n";
  const std::vector<std::string> flags = {"--auth_tokens_file=" + tokens,
                                          "--peer_token_file=" + peer_token};
  std::unique_ptr<DaemonProcess> source = StartDaemon(flags);
  std::unique_ptr<DaemonProcess> target = StartDaemon(flags);
  const auto as = [](const DaemonProcess& daemon, const std::string& token) {
    client::ClientOptions options;
    options.address = daemon.grpc_address();
    options.auth_token = token;
    return *client::KvCacheClient::Connect(options);
  };
  ASSERT_TRUE(as(*source, "tok-alice")->Open(Open("s", 40)).ok());
  absl::StatusOr<v1::ImportSequenceResponse> bobs =
      as(*target, "tok-bob")->ImportSequence("s", source->grpc_address());
  EXPECT_EQ(bobs.status().code(), absl::StatusCode::kNotFound) << bobs.status();
  absl::StatusOr<v1::ImportSequenceResponse> unknown =
      as(*target, "tok-alice")->ImportSequence("s-unknown", source->grpc_address());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(bobs.status().message()),
            absl::StrReplaceAll(unknown.status().message(), {{"s-unknown", "s"}}));
  // KvPeer itself: a worker's token is refused, no token is unauthenticated.
  for (const std::string& token : {std::string("tok-alice"), std::string()}) {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::ExportSequenceRequest request;
    request.set_sequence_id("s");
    request.set_tenant("alice");
    v1::ExportSequenceResponse response;
    const grpc::Status status = PeerStub(*source)->ExportSequence(&context, request, &response);
    EXPECT_EQ(status.error_code(), token.empty() ? grpc::StatusCode::UNAUTHENTICATED
                                                 : grpc::StatusCode::PERMISSION_DENIED);
  }
  absl::StatusOr<v1::ImportSequenceResponse> alices =
      as(*target, "tok-alice")->ImportSequence("s", source->grpc_address());
  ASSERT_TRUE(alices.ok()) << alices.status();
  EXPECT_TRUE(as(*target, "tok-alice")->Inspect("s", false).ok());
  EXPECT_EQ(as(*target, "tok-bob")->Inspect("s", false).status().code(),
            absl::StatusCode::kNotFound);
  StopBoth(std::move(source), std::move(target));
}

}  // namespace
}  // namespace kvcm

// Restart without loss (docs/RELIABILITY.md): a kvcached with --state_dir that is stopped
// (SIGTERM) and started again gives every open sequence exactly the decisions it would
// have got without the restart, keeps its shared-memory KV pools and their slot tables,
// sets an unusable snapshot aside, and after a SIGKILL lets a worker resume its sequence.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/persist/snapshot.h"
#include "cache_manager/table/sequence_table.h"
#include "clients/replay/grpc_backend.h"
#include "clients/replay/replay_run.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/clients/golden.h"
#include "tests/server/daemon_process.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;
using ::testing::HasSubstr;

// A fresh directory for --state_dir, removed with the object.
class StateDir {
 public:
  StateDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvcm-state-XXXXXX").string();
    KVCM_CHECK(mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~StateDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string snapshot() const { return path_ + "/" + kSnapshotFileName; }
  std::string Flag() const { return "--state_dir=" + path_; }

 private:
  std::string path_;
};

// Stops `daemon` with SIGTERM (it must exit 0) and starts a new one with `flags` in its
// place.
absl::Status Restart(std::unique_ptr<DaemonProcess>* daemon, const std::vector<std::string>& flags) {
  const int exit_code = (*daemon)->SignalAndWait(SIGTERM, absl::Seconds(20));
  if (exit_code != 0) {
    return absl::InternalError(absl::StrCat("the drain exited ", exit_code, ": ", (*daemon)->Log()));
  }
  ASSIGN_OR_RETURN(*daemon, DaemonProcess::Start(flags));
  return absl::OkStatus();
}

// A replay backend over the daemon of `*daemon` that restarts it (SIGTERM, start) just
// before step `restart_at`, then goes on with the sequence the new daemon restored.
class RestartingBackend final : public replay::ReplayBackend {
 public:
  RestartingBackend(std::unique_ptr<DaemonProcess>* daemon, std::vector<std::string> flags,
                    int64_t restart_at)
      : daemon_(daemon), flags_(std::move(flags)), restart_at_(restart_at) {}

  absl::Status Open(const std::string& id, const SequenceOptions& options,
                    int32_t tp_ranks) override {
    id_ = id;
    options_ = options;
    tp_ranks_ = tp_ranks;
    return Connect();
  }
  absl::Status Step(const std::string& id, const replay::TraceStep& step,
                    EvictionDecision* decision) override {
    if (step.step == restart_at_) {
      inner_.reset();  // the worker's streams end; its sequence stays open
      RETURN_IF_ERROR(Restart(daemon_, flags_));
      RETURN_IF_ERROR(Connect());  // adopts the restored sequence
      ++restarts_;
    }
    return inner_->Step(id, step, decision);
  }
  absl::StatusOr<SequenceInfo> Inspect(const std::string& id) override { return inner_->Inspect(id); }
  absl::Status Close(const std::string& id) override { return inner_->Close(id); }
  int restarts() const { return restarts_; }

 private:
  absl::Status Connect() {
    ASSIGN_OR_RETURN(inner_, replay::NewGrpcBackend({.address = (*daemon_)->grpc_address(),
                                                    .adopt_open_sequences = true}));
    return inner_->Open(id_, options_, tp_ranks_);
  }

  std::unique_ptr<DaemonProcess>* const daemon_;
  const std::vector<std::string> flags_;
  const int64_t restart_at_;
  std::unique_ptr<replay::ReplayBackend> inner_;
  std::string id_;
  SequenceOptions options_;
  int32_t tp_ranks_ = 1;
  int restarts_ = 0;
};

// The steps of a golden trace (its lines less the header).
int64_t StepCount(const std::string& golden) {
  std::istringstream in(testing::ReadFile(testing::GoldenDir() + "/" + golden + ".trace.jsonl"));
  int64_t lines = 0;
  for (std::string line; std::getline(in, line);) lines += line.empty() ? 0 : 1;
  return lines - 1;
}

absl::StatusOr<std::string> Replay(const std::string& golden, int32_t tp, bool folded,
                                   replay::ReplayBackend& backend) {
  replay::ReplayOptions options;
  options.trace_path = testing::GoldenDir() + "/" + golden + ".trace.jsonl";
  options.sequence_id = absl::StrCat(golden, "-tp", tp, folded ? "-folded" : "");
  options.tp_ranks = tp;
  options.folded = folded;
  options.with_momentum = folded;  // folded: compared with the embedded engine, momentum too
  std::ostringstream out;
  options.decisions = &out;
  RETURN_IF_ERROR(replay::RunReplay(options, backend).status());
  return out.str();
}

// (a) Every golden vector, per layer against its golden decisions and folded against the
// embedded engine (momentum included), alone and across two ranks, with the daemon
// restarted halfway through.
TEST(RestartTest, EveryGoldenVectorDecidesExactlyAcrossARestart) {
  StateDir state;
  const std::vector<std::string> flags = {state.Flag(), "--drain_deadline=5s"};
  auto started = DaemonProcess::Start(flags);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<DaemonProcess> daemon = *std::move(started);
  for (const std::string& golden : testing::GoldenNames()) {
    const int64_t restart_at = std::max<int64_t>(1, StepCount(golden) / 2 + 1);
    for (int32_t tp : {1, 2}) {
      for (bool folded : {false, true}) {
        SCOPED_TRACE(absl::StrCat(golden, " tp=", tp, folded ? " folded" : " per-layer",
                                  " restarted before step ", restart_at));
        std::string want;
        if (folded) {
          std::unique_ptr<replay::ReplayBackend> embedded = replay::NewEmbeddedBackend();
          absl::StatusOr<std::string> reference = Replay(golden, tp, folded, *embedded);
          ASSERT_TRUE(reference.ok()) << reference.status();
          want = *reference;
        } else {
          want = testing::ReadFile(testing::GoldenDir() + "/" + golden + ".decisions.jsonl");
        }
        RestartingBackend backend(&daemon, flags, restart_at);
        absl::StatusOr<std::string> got = Replay(golden, tp, folded, backend);
        ASSERT_TRUE(got.ok()) << got.status() << "\n" << daemon->Log();
        EXPECT_EQ(backend.restarts(), 1);
        EXPECT_EQ(*got, want);
        EXPECT_FALSE(std::filesystem::exists(state.snapshot()))
            << "the restored snapshot was not removed";
      }
    }
  }
  EXPECT_EQ(daemon->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
}

// Two host pools of 64 KiB in POSIX shared memory (4 tokens of 32 bytes a block).
constexpr int64_t kTokensPerBlock = 4, kTokenBytes = 2 * 2 * 1 * 4 * 2;  // K,V x 2 layers x 4 f16
const std::vector<std::string> kTwoSharedPools = {
    "--backend=host",   "--tp_ranks=2",    "--pool_memory_bytes=65536", "--kv_layers=2",
    "--kv_heads=1",     "--kv_head_dim=4", "--kv_tokens_per_block=4",   "--kv_dtype=float16",
    "--kv_shared_memory"};

std::vector<std::string> With(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

// A worker's mapping of one rank's pool.
class PoolMapping {
 public:
  PoolMapping(const std::string& name, int64_t bytes) : bytes_(bytes) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    KVCM_CHECK(fd >= 0);
    data_ = static_cast<uint8_t*>(
        mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    KVCM_CHECK(data_ != MAP_FAILED);
  }
  ~PoolMapping() { munmap(data_, static_cast<size_t>(bytes_)); }
  // The bytes of slot `slot` (every layer's K and V lie in its block; this covers the
  // token's first row, enough to tell tokens apart).
  uint8_t* Slot(int64_t slot) {
    const int64_t block = slot / kTokensPerBlock;
    return data_ + block * kTokensPerBlock * kTokenBytes + (slot % kTokensPerBlock) * 8;
  }

 private:
  uint8_t* data_ = nullptr;
  int64_t bytes_ = 0;
};

v1::StepBatch OneReport(const std::string& id, int64_t step, const std::vector<float>& scores,
                        int32_t layers, int32_t rank = 0, int32_t head_count = 0) {
  v1::StepBatch batch;
  batch.set_rank(rank);
  batch.set_batch_id(static_cast<uint64_t>(step));
  v1::StepReport* report = client::AddReport(&batch, id, step);
  if (!scores.empty()) client::SetFloat32Scores(report, scores, layers, head_count);
  return batch;
}

v1::DescribeKvPoolsResponse DescribePools(client::KvCacheClient& client) {
  grpc::ClientContext context;  // holds the channel: kept no longer than the call
  v1::DescribeKvPoolsResponse pools;
  KVCM_CHECK(client.stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools).ok());
  return pools;
}

// (b) The pools survive the restart: a worker's mapping made before it reads the same
// bytes after, the pools keep their names, and every slot table is the one before.
TEST(RestartTest, SharedMemoryPoolsAndTheirSlotTablesSurviveARestart) {
  StateDir state;
  const std::vector<std::string> flags = With(kTwoSharedPools, {state.Flag()});
  auto started = DaemonProcess::Start(flags);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<DaemonProcess> daemon = *std::move(started);
  auto client = daemon->Connect();
  v1::OpenSequenceRequest open = client::OpenRequest("kv", 30, -1, "inertia");
  open.set_budget_tokens(10);
  ASSERT_TRUE(client->Open(open).ok());
  auto stream = client->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  for (int64_t step = 1; step <= 5; ++step) {
    absl::StatusOr<v1::SequenceState> s = client->Inspect("kv", false);
    ASSERT_TRUE(s.ok());
    auto reply = (*stream)->Step(OneReport("kv", step, testing::Scores(2, s->cache_size() + 1, step), 2));
    ASSERT_TRUE(reply.ok() && client::DecisionStatus(reply->decisions(0)).ok());
  }
  ASSERT_TRUE((*stream)->Close().ok());
  stream->reset();
  const v1::DescribeKvPoolsResponse pools = DescribePools(*client);
  ASSERT_EQ(pools.pools_size(), 2);
  absl::StatusOr<v1::SequenceState> before = client->Inspect("kv", true);
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(before->kv_slots_size(), 2);
  std::vector<std::unique_ptr<PoolMapping>> maps;
  for (int r = 0; r < 2; ++r) {
    maps.push_back(std::make_unique<PoolMapping>(pools.pools(r).shm_name(), 65536));
    for (int i = 0; i < before->positions_size(); ++i) {
      const int64_t tag = before->positions(i) * 2 + r + 1;
      std::memcpy(maps[r]->Slot(before->kv_slots(r).slots(i)), &tag, sizeof(tag));
    }
  }
  client.reset();
  // A pool a SIGKILLed kvcached left behind: the restoring start still sweeps it.
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const std::string stale = absl::StrCat("/kvcached-", dead, "-rank0");
  const int stale_fd = shm_open(stale.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(stale_fd, 0);
  close(stale_fd);

  ASSERT_TRUE(Restart(&daemon, flags).ok());
  EXPECT_THAT(daemon->Log(), HasSubstr("restored 1 of 1 sequence(s) and 2 KV pool(s)"));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + stale)) << daemon->Log();
  EXPECT_FALSE(std::filesystem::exists(state.snapshot()));
  client = daemon->Connect();
  absl::StatusOr<v1::SequenceState> after = client->Inspect("kv", true);
  ASSERT_TRUE(after.ok()) << after.status() << daemon->Log();
  EXPECT_EQ(after->last_step(), 5);
  EXPECT_THAT(after->positions(), ::testing::ElementsAreArray(before->positions()));
  EXPECT_THAT(after->momentum(), ::testing::ElementsAreArray(before->momentum()));
  const v1::DescribeKvPoolsResponse pools_after = DescribePools(*client);
  ASSERT_EQ(pools_after.pools_size(), 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(pools_after.pools(r).shm_name(), pools.pools(r).shm_name()) << "rank " << r;
    EXPECT_EQ(pools_after.pools(r).used_blocks(), pools.pools(r).used_blocks()) << "rank " << r;
    EXPECT_THAT(after->kv_slots(r).slots(), ::testing::ElementsAreArray(before->kv_slots(r).slots()));
    // The mapping made before the restart and a fresh one both read the worker's bytes.
    PoolMapping fresh(pools_after.pools(r).shm_name(), 65536);
    for (int i = 0; i < after->positions_size(); ++i) {
      const int64_t tag = after->positions(i) * 2 + r + 1;
      int64_t old_map = 0, new_map = 0;
      std::memcpy(&old_map, maps[r]->Slot(after->kv_slots(r).slots(i)), sizeof(old_map));
      std::memcpy(&new_map, fresh.Slot(after->kv_slots(r).slots(i)), sizeof(new_map));
      EXPECT_EQ(old_map, tag) << "rank " << r << " position " << after->positions(i);
      EXPECT_EQ(new_map, tag) << "rank " << r << " position " << after->positions(i);
    }
  }
  // The restored sequence steps on, in the re-attached pools.
  auto stream2 = client->OpenStepStream();
  ASSERT_TRUE(stream2.ok());
  auto reply = (*stream2)->Step(OneReport("kv", 6, testing::Scores(2, after->cache_size() + 1, 6), 2));
  ASSERT_TRUE(reply.ok());
  EXPECT_TRUE(client::DecisionStatus(reply->decisions(0)).ok()) << reply->decisions(0).DebugString();
  ASSERT_TRUE((*stream2)->Close().ok());
  stream2->reset();
  ASSERT_TRUE(client->Close("kv").ok());
  client.reset();
  // Stopped without a snapshot to keep them for, the pools are unlinked.
  std::filesystem::remove(state.snapshot());
  EXPECT_EQ(daemon->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
  std::filesystem::remove(state.snapshot());
  for (int r = 0; r < 2; ++r) shm_unlink(pools.pools(r).shm_name().c_str());
}

// (c) A damaged snapshot is moved aside as *.corrupt, logged, and kvcached starts empty;
// the pools it named are removed by the start-up sweep.
TEST(RestartTest, ADamagedSnapshotIsSetAsideAndTheDaemonStartsEmpty) {
  struct Damage {
    const char* name;
    const char* logged;
    void (*apply)(std::string* bytes);
  };
  const std::vector<Damage> damages = {
      {"a flipped payload byte", "checksum mismatch",
       [](std::string* b) { (*b)[b->size() - 3] = static_cast<char>((*b)[b->size() - 3] ^ 1); }},
      {"a truncated file", "payload bytes", [](std::string* b) { b->resize(b->size() / 2); }},
      {"another version", "version 9", [](std::string* b) { (*b)[8] = 9; }},
      {"no magic", "magic", [](std::string* b) { (*b)[0] = 'X'; }},
  };
  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.name);
    StateDir state;
    const std::vector<std::string> flags = With(kTwoSharedPools, {state.Flag()});
    auto started = DaemonProcess::Start(flags);
    ASSERT_TRUE(started.ok()) << started.status();
    std::unique_ptr<DaemonProcess> daemon = *std::move(started);
    const pid_t old_pid = daemon->pid();
    ASSERT_TRUE(daemon->Connect()->Open(client::OpenRequest("s", 16, 0.5, "inertia")).ok());
    ASSERT_EQ(daemon->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
    const std::string old_pool = absl::StrCat("/dev/shm/kvcached-", old_pid, "-rank0");
    ASSERT_TRUE(std::filesystem::exists(old_pool)) << "the drain did not keep the pools";
    std::string bytes = testing::ReadFile(state.snapshot());
    damage.apply(&bytes);
    std::ofstream(state.snapshot(), std::ios::binary | std::ios::trunc) << bytes;

    auto restarted = DaemonProcess::Start(flags);
    ASSERT_TRUE(restarted.ok()) << restarted.status();
    daemon = *std::move(restarted);
    EXPECT_THAT(daemon->Log(), HasSubstr("ERROR: the snapshot"));
    EXPECT_THAT(daemon->Log(), HasSubstr(damage.logged));
    EXPECT_FALSE(std::filesystem::exists(state.snapshot()));
    EXPECT_EQ(testing::ReadFile(state.snapshot() + ".corrupt"), bytes);
    EXPECT_FALSE(std::filesystem::exists(old_pool)) << "the old pools were not swept";
    auto client = daemon->Connect();
    EXPECT_EQ(client->Inspect("s", false).status().code(), absl::StatusCode::kNotFound);
    // Empty, and serving: the worker re-opens.
    EXPECT_TRUE(client->Open(client::OpenRequest("s", 16, 0.5, "inertia")).ok());
    const pid_t last_pid = daemon->pid();  // pid() is -1 once it has exited
    EXPECT_EQ(daemon->SignalAndWait(SIGKILL, absl::Seconds(20)), -1);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(shm_unlink(absl::StrCat("/kvcached-", last_pid, "-rank", r).c_str()), 0);
    }
  }
}

TEST(RestartTest, StateDirRefusesPoolsThatCannotBeReattached) {
  StateDir state;
  auto refused = DaemonProcess::Start(With(kTwoSharedPools, {state.Flag(), "--nokv_shared_memory"}));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("--state_dir needs host KV pools in shared memory"));
}

// The engine's options for a sequence the tests open over gRPC with budget_tokens.
SequenceOptions EngineOptions(int64_t prefill_len, int64_t budget_tokens, const char* preset) {
  SequenceOptions options;
  options.prefill_len = prefill_len;
  options.budget = BudgetSpec::Tokens(budget_tokens);
  options.preset = preset;
  return options;
}

// A tensor-parallel step pending at the drain is abandoned, not saved: the rank that
// reported it is told, and both ranks send it again to the restarted daemon, which decides
// it as a daemon that never stopped.
TEST(RestartTest, APendingTensorParallelStepIsAbandonedAndSentAgainAfterTheRestart) {
  StateDir state;
  const std::vector<std::string> flags = {state.Flag(), "--drain_deadline=1s"};
  auto started = DaemonProcess::Start(flags);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<DaemonProcess> daemon = *std::move(started);
  v1::OpenSequenceRequest open = client::OpenRequest("tp", 12, -1, "inertia");
  open.set_budget_tokens(6);
  open.set_tp_world_size(2);
  ASSERT_TRUE(daemon->Connect()->Open(open).ok());
  const std::vector<float> scores = testing::Scores(1, 13, 1);
  {
    auto client = daemon->Connect();
    auto rank0 = client->OpenStepStream();
    ASSERT_TRUE(rank0.ok());
    ASSERT_TRUE((*rank0)->Send(OneReport("tp", 1, scores, 1, 0, 1)).ok());
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          const absl::StatusOr<v1::SequenceState> tp = client->Inspect("tp", false);
          return tp.ok() && tp->ranks_reported() >= 1;
        },
        absl::Seconds(10), "rank 0's report reached the join"));
    ASSERT_EQ(client->Inspect("tp", false)->ranks_reported(), 1);
    ASSERT_EQ(daemon->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
    // The rank that reported got no decision: its stream ended with the daemon.
    absl::StatusOr<v1::DecisionBatch> reply = (*rank0)->Receive();
    EXPECT_TRUE(!reply.ok() || !client::DecisionStatus(reply->decisions(0)).ok());
  }
  auto restarted = DaemonProcess::Start(flags);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  daemon = *std::move(restarted);
  auto client = daemon->Connect();
  absl::StatusOr<v1::SequenceState> state_after = client->Inspect("tp", false);
  ASSERT_TRUE(state_after.ok()) << state_after.status();
  EXPECT_EQ(state_after->last_step(), 0);
  EXPECT_EQ(state_after->ranks_reported(), 0);
  auto rank0 = client->OpenStepStream();
  auto rank1 = client->OpenStepStream();
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  ASSERT_TRUE((*rank0)->Send(OneReport("tp", 1, scores, 1, 0, 1)).ok());
  ASSERT_TRUE((*rank1)->Send(OneReport("tp", 1, scores, 1, 1, 1)).ok());
  auto d0 = (*rank0)->Receive();
  auto d1 = (*rank1)->Receive();
  ASSERT_TRUE(d0.ok() && d1.ok());
  ASSERT_TRUE(client::DecisionStatus(d0->decisions(0)).ok()) << d0->decisions(0).DebugString();

  // The reference: the same step on an engine that never stopped.
  SequenceTable reference;
  ASSERT_TRUE(reference.Open("tp", EngineOptions(12, 6, "inertia")).ok());
  kernels::ScoreMatrix matrix =
      kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, 1, 13);
  EvictionDecision want;
  ASSERT_TRUE(reference.Step("tp", 1, &matrix, &want).ok());
  EXPECT_THAT(d0->decisions(0).evicted(), ::testing::ElementsAreArray(want.evicted));
  EXPECT_THAT(d1->decisions(0).evicted(), ::testing::ElementsAreArray(want.evicted));
  (*rank0)->Close().IgnoreError();
  (*rank1)->Close().IgnoreError();
  EXPECT_EQ(daemon->SignalAndWait(SIGKILL, absl::Seconds(20)), -1);
}

// (d) After a SIGKILL (no snapshot) the worker re-opens its sequence with resume and steps
// on; every decision is the embedded engine's for the same resume (docs/SPEC.md,
// "Resuming a sequence").
TEST(ResumeDaemonTest, AfterASigkillAResumedSequenceDecidesAsTheEngineReference) {
  for (const char* preset : {"inertia", "inertia_lazy4", "h2o", "streaming_llm", "random"}) {
    SCOPED_TRACE(preset);
    auto started = DaemonProcess::Start();
    ASSERT_TRUE(started.ok()) << started.status();
    std::unique_ptr<DaemonProcess> daemon = *std::move(started);
    v1::OpenSequenceRequest open = client::OpenRequest("r", 32, -1, preset);
    open.set_budget_tokens(8);
    open.mutable_policy()->set_seed(5);
    {
      auto client = daemon->Connect();
      ASSERT_TRUE(client->Open(open).ok());
      auto stream = client->OpenStepStream();
      ASSERT_TRUE(stream.ok());
      for (int64_t step = 1; step <= 6; ++step) {
        const int64_t tokens = client->Inspect("r", false)->cache_size() + 1;
        auto reply = (*stream)->Step(OneReport("r", step, testing::Scores(2, tokens, step), 2));
        ASSERT_TRUE(reply.ok() && client::DecisionStatus(reply->decisions(0)).ok());
      }
    }
    // What the worker knows: its cached positions and its last step.
    const absl::StatusOr<v1::SequenceState> known = daemon->Connect()->Inspect("r", true);
    ASSERT_TRUE(known.ok());
    const std::vector<int64_t> positions(known->positions().begin(), known->positions().end());
    ASSERT_EQ(daemon->SignalAndWait(SIGKILL, absl::Seconds(20)), -1);

    started = DaemonProcess::Start();
    ASSERT_TRUE(started.ok()) << started.status();
    daemon = *std::move(started);
    auto client = daemon->Connect();
    ASSERT_EQ(client->Inspect("r", false).status().code(), absl::StatusCode::kNotFound);
    // Validated as an open is: positions out of order are refused, and nothing is opened.
    std::vector<int64_t> unordered = positions;
    std::swap(unordered[0], unordered[1]);
    absl::StatusOr<v1::SequenceState> refused = client->Open(client::WithResume(open, 6, unordered));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("strictly above"));
    EXPECT_EQ(client->Inspect("r", false).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(client->Open(client::WithResume(open, 0, positions)).status().code(),
              absl::StatusCode::kInvalidArgument);

    absl::StatusOr<v1::SequenceState> resumed = client->Open(client::WithResume(open, 6, positions));
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    EXPECT_EQ(resumed->last_step(), 6);
    EXPECT_EQ(resumed->cache_size(), static_cast<int64_t>(positions.size()));

    SequenceTable reference;
    SequenceOptions options = EngineOptions(32, 8, preset);
    options.policy.seed = 5;
    options.resume.emplace();
    options.resume->last_step = 6;
    options.resume->positions = positions;
    ASSERT_TRUE(reference.Open("r", options).ok());

    auto stream = client->OpenStepStream();
    ASSERT_TRUE(stream.ok());
    // Step 6 was decided before the kill.
    auto stale = (*stream)->Step(OneReport("r", 6, {}, 0));
    ASSERT_TRUE(stale.ok());
    EXPECT_EQ(stale->decisions(0).code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
    for (int64_t step = 7; step <= 20; ++step) {
      const int64_t tokens = reference.Inspect("r", false)->cache_size + 1;
      const bool scoring = reference.Inspect("r", false)->next_needs_scores;
      const std::vector<float> scores = scoring ? testing::Scores(2, tokens, 100 + step)
                                                : std::vector<float>{};
      kernels::ScoreMatrix matrix = kernels::ScoreMatrix::Dense(
          scores.data(), kernels::ScoreDtype::kFloat32, scoring ? 2 : 0, tokens);
      EvictionDecision want;
      ASSERT_TRUE(reference.Step("r", step, scoring ? &matrix : nullptr, &want).ok());
      auto reply = (*stream)->Step(OneReport("r", step, scores, 2));
      ASSERT_TRUE(reply.ok());
      const v1::Decision& got = reply->decisions(0);
      ASSERT_TRUE(client::DecisionStatus(got).ok()) << got.DebugString();
      EXPECT_THAT(got.evicted(), ::testing::ElementsAreArray(want.evicted)) << "step " << step;
      EXPECT_EQ(got.cache_size(), want.cache_size) << "step " << step;
      EXPECT_EQ(got.next_needs_scores(), want.next_needs_scores) << "step " << step;
    }
    (*stream)->Close().IgnoreError();
    // A connection still open holds the drain for seconds; this test is not about that.
    stream->reset();
    client.reset();
    EXPECT_EQ(daemon->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
  }
}

}  // namespace
}  // namespace kvcm

// Chaos on loopback (docs/RELIABILITY.md, "Process survival: chaos"): rank 1 of a
// two-rank sequence is a process of its own (chaos_tp_rank), SIGKILLed while the step it
// owes is outstanding. Rank 0's waiting step must end with DEADLINE_EXCEEDED at
// --tp_join_timeout, the daemon must go on, and a restarted rank 1 resends the step: from
// then on both ranks get the decisions of the embedded engine stepped alone with the same
// scores (the join of two one-head ranks that both saw the row is the row itself).
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cache_manager/engine/sequence.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/translate.h"
#include "tests/cache_manager/engine_test_util.h"
#include "tests/chaos/chaos_client.h"
#include "tests/server/daemon_process.h"
#include "tests/server/daemon_test.h"

namespace kvcm::chaos {
namespace {

using ::kvcm::testing::DaemonProcess;
using ::testing::HasSubstr;

constexpr int64_t kLayers = 2;
constexpr uint64_t kSeed = 7;
constexpr int64_t kSteps = 40;
constexpr int64_t kKillAt = 17;

// A child process whose stdout the test reads line by line, each read bounded.
class ChildProcess {
 public:
  static std::unique_ptr<ChildProcess> Start(std::vector<std::string> args) {
    int out[2];
    if (pipe(out) != 0) return nullptr;
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      dup2(out[1], 1);
      close(out[0]);
      close(out[1]);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    return std::unique_ptr<ChildProcess>(new ChildProcess(pid, out[0]));
  }
  ~ChildProcess() {
    if (pid_ > 0) Kill();
    close(fd_);
  }

  // The next line of its stdout (without the newline), or "" at EOF or after `timeout`.
  std::string ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      if (const size_t end = buffer_.find('\n'); end != std::string::npos) {
        std::string line = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return line;
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return "";
      pollfd p = {fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
      char chunk[4096];
      const ssize_t n = read(fd_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }
  // SIGKILL and reap; the wait status.
  int Kill() {
    kill(pid_, SIGKILL);
    return Wait();
  }
  // Waits for the exit (the caller bounds it: the helper exits by itself within 60 s).
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  ChildProcess(pid_t pid, int fd) : pid_(pid), fd_(fd) {}
  pid_t pid_;
  int fd_;
  std::string buffer_;
};

// "decision STEP CODE CACHE_SIZE EVICTED..." from chaos_tp_rank.
bool ParseDecisionLine(const std::string& line, int64_t* step, Outcome* out) {
  const std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (words.size() < 4 || words[0] != "decision") return false;
  if (!absl::SimpleAtoi(words[1], step) || !absl::SimpleAtoi(words[2], &out->code) ||
      !absl::SimpleAtoi(words[3], &out->cache_size)) {
    return false;
  }
  out->evicted.clear();
  for (size_t i = 4; i < words.size(); ++i) {
    int64_t p = 0;
    if (!absl::SimpleAtoi(words[i], &p)) return false;
    out->evicted.push_back(p);
  }
  return true;
}

std::string Describe(const Outcome& o) {
  return absl::StrCat("code ", o.code, ", cache ", o.cache_size, ", evicted [",
                      absl::StrJoin(o.evicted, " "), "]");
}

std::vector<std::string> RankArgs(const std::string& address, int64_t stall_at) {
  return {std::string(KVCM_BIN_DIR) + "/chaos_tp_rank", address, "tp", "1",
          std::to_string(kLayers), std::to_string(kSeed), std::to_string(kSteps),
          std::to_string(stall_at)};
}

// Rank 0's report of step `t` for a cache of `cached` tokens.
v1::StepBatch Rank0Report(int64_t t, int64_t cached) {
  v1::StepBatch batch;
  client::SetFloat32Scores(client::AddReport(&batch, "tp", t),
                           StepScores(kSeed, t, kLayers, cached + 1), kLayers, /*head_count=*/1);
  return batch;
}

TEST(ChaosTest, AKilledTensorParallelRankTimesOutTheStepAndARestartedRankResumesIt) {
  auto daemon = DaemonProcess::Start({"--tp_join_timeout=1s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->grpc_address();
  std::unique_ptr<client::KvCacheClient> c = (*daemon)->Connect();
  ASSERT_NE(c, nullptr);
  v1::OpenSequenceRequest open = client::OpenRequest("tp", 64, 0.5, "inertia");
  open.set_tp_world_size(2);
  ASSERT_TRUE(c->Open(open).ok());

  // The reference: the embedded engine, opened as the daemon opens it, fed the joined row.
  absl::StatusOr<server::OpenParams> params = server::FromProto(open);
  ASSERT_TRUE(params.ok()) << params.status();
  absl::StatusOr<std::unique_ptr<Sequence>> engine = Sequence::Create("tp", params->options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<Outcome> reference(kSteps + 1);
  std::vector<int64_t> cached_before(kSteps + 1);
  for (int64_t t = 1; t <= kSteps; ++t) {
    cached_before[t] = (*engine)->cache_size();
    const std::vector<float> row = StepScores(kSeed, t, kLayers, cached_before[t] + 1);
    const kernels::ScoreMatrix m = kernels::ScoreMatrix::Dense(
        row.data(), kernels::ScoreDtype::kFloat32, kLayers, cached_before[t] + 1);
    EvictionDecision d;
    ASSERT_TRUE((*engine)->Step(t, &m, &d).ok());
    reference[t] = {0, d.cache_size, d.evicted};
  }

  BoundedStream rank0(address, absl::Now() + absl::Seconds(60));
  const auto step_both = [&](int64_t t, ChildProcess& rank1) {
    absl::StatusOr<v1::DecisionBatch> reply = rank0.Step(Rank0Report(t, cached_before[t]));
    ASSERT_TRUE(reply.ok()) << "step " << t << ": " << reply.status() << (*daemon)->Log();
    ASSERT_EQ(reply->decisions_size(), 1);
    EXPECT_EQ(OutcomeOf(reply->decisions(0)), reference[t])
        << "rank 0, step " << t << ": " << reply->decisions(0).message();
    int64_t step = 0;
    Outcome theirs;
    const std::string line = rank1.ReadLine(absl::Seconds(20));
    ASSERT_TRUE(ParseDecisionLine(line, &step, &theirs)) << "rank 1 said '" << line << "'";
    EXPECT_EQ(step, t);
    EXPECT_EQ(theirs, reference[t]) << "rank 1, step " << t << ": " << Describe(theirs);
  };

  std::unique_ptr<ChildProcess> rank1 = ChildProcess::Start(RankArgs(address, kKillAt));
  ASSERT_NE(rank1, nullptr);
  for (int64_t t = 1; t < kKillAt; ++t) {
    step_both(t, *rank1);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Rank 1 is in its step's forward pass; rank 0 reports, then rank 1 dies.
  ASSERT_EQ(rank1->ReadLine(absl::Seconds(20)), absl::StrCat("stalled ", kKillAt));
  ASSERT_TRUE(rank0.Send(Rank0Report(kKillAt, cached_before[kKillAt])));
  int32_t reported = 0;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        const absl::StatusOr<v1::SequenceState> state = c->Inspect("tp", false);
        EXPECT_TRUE(state.ok()) << state.status();
        reported = state.ok() ? state->ranks_reported() : -1;
        return reported != 0;
      },
      absl::Seconds(20), "rank 0's report reached the join"));
  ASSERT_EQ(reported, 1);
  const int killed = rank1->Kill();
  EXPECT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL);

  absl::StatusOr<v1::DecisionBatch> timed_out = rank0.Receive();
  ASSERT_TRUE(timed_out.ok()) << timed_out.status();
  ASSERT_EQ(timed_out->decisions_size(), 1);
  const v1::Decision& d = timed_out->decisions(0);
  EXPECT_EQ(d.code(), static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded)) << d.message();
  EXPECT_THAT(d.message(), HasSubstr("rank(s) 1 did not report"));
  EXPECT_EQ(kill((*daemon)->pid(), 0), 0) << "the daemon died: " << (*daemon)->Log();
  absl::StatusOr<v1::SequenceState> state = c->Inspect("tp", false);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->last_step(), kKillAt - 1) << "the abandoned step changed the sequence";
  EXPECT_EQ(state->ranks_reported(), 0);

  // The restarted rank starts at the abandoned step; rank 0 sends it again.
  rank1 = ChildProcess::Start(RankArgs(address, /*stall_at=*/0));
  ASSERT_NE(rank1, nullptr);
  for (int64_t t = kKillAt; t <= kSteps; ++t) {
    step_both(t, *rank1);
    if (::testing::Test::HasFatalFailure()) return;
  }
  const int done = rank1->Wait();
  EXPECT_TRUE(WIFEXITED(done) && WEXITSTATUS(done) == 0);
}

}  // namespace
}  // namespace kvcm::chaos

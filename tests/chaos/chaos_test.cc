// Chaos on loopback (docs/RELIABILITY.md, "Process survival: chaos"): one real kvcached
// with KV pools, while a stream never reads its replies and 500 connections never speak,
// serves a correct client whose every decision must equal the one the same steps got
// before the chaos; then SIGTERM under that load drains it with status 0 and no pool left.
// Bounded: the chaos phase is a fixed number of steps, every wait has a deadline.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/chaos/chaos_client.h"
#include "tests/server/daemon_process.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
namespace health = ::grpc::health::v1;
using ::kvcm::testing::DaemonProcess;
using ::kvcm::testing::HalfOpenConnection;

constexpr int kSteps = 150;
constexpr int kLayers = 2;
constexpr int kHalfOpen = 500;

// The scores of step `step` for a cache of `tokens`: [layers, tokens] f32.
std::vector<float> StepScores(int64_t step, int64_t tokens) {
  return chaos::StepScores(/*seed=*/0, step, kLayers, tokens);
}

// Steps the sequence "load", `cached` tokens cached before step 1, from step 1 on until
// `stop` is set or the stream ends (the drain); counts the steps decided in `stepped`.
void StepLoadUntil(client::StepStream& stream, int64_t cached, const std::atomic<bool>& stop,
                   std::atomic<int64_t>& stepped) {
  for (int64_t step = 1; !stop.load(); ++step) {
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, "load", step),
                             StepScores(step, cached + 1), kLayers);
    const absl::StatusOr<v1::DecisionBatch> reply = stream.Step(batch);
    if (!reply.ok()) return;
    cached = reply->decisions(0).cache_size();
    ++stepped;
  }
}

using chaos::Outcome;

// Steps sequence `id` (opened fresh) kSteps times over `stream`; the outcome of each step.
std::vector<Outcome> StepAll(client::KvCacheClient& c, client::StepStream& stream,
                         const std::string& id) {
  std::vector<Outcome> out;
  const absl::StatusOr<v1::SequenceState> opened =
      c.Open(client::OpenRequest(id, 64, 0.5, "inertia"));
  EXPECT_TRUE(opened.ok()) << opened.status();
  if (!opened.ok()) return out;
  int64_t cached = opened->cache_size();
  for (int64_t step = 1; step <= kSteps; ++step) {
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, id, step), StepScores(step, cached + 1),
                             kLayers);
    const absl::StatusOr<v1::DecisionBatch> reply = stream.Step(batch);
    if (!reply.ok()) {
      ADD_FAILURE() << id << " step " << step << ": " << reply.status();
      return out;
    }
    out.push_back(chaos::OutcomeOf(reply->decisions(0)));
    cached = reply->decisions(0).cache_size();
  }
  return out;
}

// SERVING over a connection of its own (as a kubelet probe comes), within `timeout`.
bool FreshHealthServing(const std::string& address, absl::Duration timeout) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context.set_wait_for_ready(true);
  health::HealthCheckResponse response;
  const grpc::Status status =
      health::Health::NewStub(channel)->Check(&context, health::HealthCheckRequest(), &response);
  return status.ok() && response.status() == health::HealthCheckResponse::SERVING;
}

TEST(ChaosTest, HostileClientsNeitherStopTheDaemonNorChangeACorrectClientsDecisions) {
  auto daemon = DaemonProcess::Start(
      {"--backend=host", "--pool_memory_bytes=1048576", "--kv_layers=2", "--kv_heads=1",
       "--kv_head_dim=4", "--kv_tokens_per_block=4", "--max_inflight_batches=2",
       "--listener_probe_interval=500ms", "--drain_deadline=5s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->grpc_address();
  const std::string pool = "/dev/shm/kvcached-" + std::to_string((*daemon)->pid()) + "-rank0";
  ASSERT_TRUE(std::filesystem::exists(pool));
  std::unique_ptr<client::KvCacheClient> correct = (*daemon)->Connect();
  ASSERT_NE(correct, nullptr);
  auto stream = correct->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  const std::vector<Outcome> reference = StepAll(*correct, **stream, "reference");
  ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps));

  // A stream that writes batches and never reads a reply: the daemon stops reading it
  // (back-pressure) and must hold nothing more for it.
  grpc::ChannelArguments own;
  own.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto hostile_channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), own);
  auto hostile_stub = v1::KvCache::NewStub(hostile_channel);
  ASSERT_TRUE(correct->Open(client::OpenRequest("hostile", 64, 0.5, "inertia")).ok());
  grpc::ClientContext hostile_context;
  auto hostile = hostile_stub->StepStream(&hostile_context);
  std::atomic<int> hostile_writes{0};
  std::thread never_reads([&] {
    int64_t cached = 32;
    for (int64_t step = 1; step <= 100000; ++step) {
      v1::StepBatch batch;
      client::SetFloat32Scores(client::AddReport(&batch, "hostile", step),
                               StepScores(step, cached + 1), kLayers);
      if (!hostile->Write(batch)) return;  // cancelled at the end
      ++hostile_writes;
    }
  });

  std::vector<int> half_open;
  for (int i = 0; i < kHalfOpen; ++i) {
    const int fd = HalfOpenConnection(address);
    if (fd >= 0) half_open.push_back(fd);
  }
  EXPECT_EQ(half_open.size(), static_cast<size_t>(kHalfOpen));

  auto chaos_stream = correct->OpenStepStream();
  ASSERT_TRUE(chaos_stream.ok());
  const std::vector<Outcome> under_chaos = StepAll(*correct, **chaos_stream, "under-chaos");
  EXPECT_EQ(under_chaos, reference) << "a decision changed under chaos";
  EXPECT_TRUE(FreshHealthServing(address, absl::Seconds(10))) << (*daemon)->Log();
  EXPECT_GT(hostile_writes.load(), 0);

  // SIGTERM with all of it still going on: the drain cancels the never-reading stream at
  // its deadline, exits 0 and unlinks the pool.
  std::atomic<bool> stop_load{false};
  std::atomic<int64_t> load_steps{0};
  std::thread load([&] {
    auto s = correct->OpenStepStream();
    if (!s.ok()) return;
    const absl::StatusOr<v1::SequenceState> opened =
        correct->Open(client::OpenRequest("load", 64, 0.5, "inertia"));
    if (!opened.ok()) return;
    StepLoadUntil(**s, opened->cache_size(), stop_load, load_steps);
  });
  EXPECT_TRUE(testing::WaitFor([&] { return load_steps.load() > 0; }, absl::Seconds(20),
                               "the load stepped before the SIGTERM"));
  EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0) << (*daemon)->Log();
  stop_load = true;
  load.join();
  hostile_context.TryCancel();
  never_reads.join();
  for (const int fd : half_open) close(fd);
  EXPECT_FALSE(std::filesystem::exists(pool));
}

// Restart mid-trace (docs/RELIABILITY.md, "Restart without loss"): a correct client is
// half-way through its trace, another steps under load and a stream never reads its
// replies when kvcached is stopped with --state_dir; once started again, the correct
// client's remaining steps decide exactly as on a daemon that never stopped.
TEST(ChaosTest, ARestartMidTraceUnderLoadChangesNoDecision) {
  std::string state_dir = (std::filesystem::temp_directory_path() / "kvcm-chaos-XXXXXX").string();
  ASSERT_NE(mkdtemp(state_dir.data()), nullptr);
  const std::vector<std::string> flags = {
      "--backend=host", "--pool_memory_bytes=1048576", "--kv_layers=2", "--kv_heads=1",
      "--kv_head_dim=4", "--kv_tokens_per_block=4", "--max_inflight_batches=2",
      "--drain_deadline=2s", "--state_dir=" + state_dir};
  auto daemon = DaemonProcess::Start(flags);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string pool = "/dev/shm/kvcached-" + std::to_string((*daemon)->pid()) + "-rank0";
  std::vector<Outcome> reference, restarted;
  {
    std::unique_ptr<client::KvCacheClient> c = (*daemon)->Connect();
    auto stream = c->OpenStepStream();
    ASSERT_TRUE(stream.ok());
    reference = StepAll(*c, **stream, "reference");
    ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps));
  }

  // The first half, then the stop with load and a stream that never reads.
  constexpr int64_t kHalf = kSteps / 2;
  int64_t cached = 0;
  auto step_range = [&](client::KvCacheClient& c, int64_t from, int64_t to) {
    auto stream = c.OpenStepStream();
    ASSERT_TRUE(stream.ok());
    for (int64_t step = from; step <= to; ++step) {
      v1::StepBatch batch;
      client::SetFloat32Scores(client::AddReport(&batch, "restarted", step),
                               StepScores(step, cached + 1), kLayers);
      const absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
      ASSERT_TRUE(reply.ok()) << "step " << step << ": " << reply.status();
      const v1::Decision& d = reply->decisions(0);
      restarted.push_back({d.code(), d.cache_size(), {d.evicted().begin(), d.evicted().end()}});
      cached = d.cache_size();
    }
  };
  {
    std::unique_ptr<client::KvCacheClient> c = (*daemon)->Connect();
    const absl::StatusOr<v1::SequenceState> opened =
        c->Open(client::OpenRequest("restarted", 64, 0.5, "inertia"));
    ASSERT_TRUE(opened.ok()) << opened.status();
    cached = opened->cache_size();
    step_range(*c, 1, kHalf);
    ASSERT_TRUE(c->Open(client::OpenRequest("hostile", 64, 0.5, "inertia")).ok());
    ASSERT_TRUE(c->Open(client::OpenRequest("load", 64, 0.5, "inertia")).ok());
  }
  grpc::ChannelArguments own;
  own.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto hostile_channel = grpc::CreateCustomChannel((*daemon)->grpc_address(),
                                                   grpc::InsecureChannelCredentials(), own);
  auto hostile_stub = v1::KvCache::NewStub(hostile_channel);
  grpc::ClientContext hostile_context;
  auto hostile = hostile_stub->StepStream(&hostile_context);
  std::thread never_reads([&] {
    for (int64_t step = 1; step <= 100000; ++step) {
      v1::StepBatch batch;
      client::SetFloat32Scores(client::AddReport(&batch, "hostile", step), StepScores(step, 33),
                               kLayers);
      if (!hostile->Write(batch)) return;
    }
  });
  std::atomic<bool> stop_load{false};
  std::atomic<int64_t> load_steps{0};
  std::thread load([&, address = (*daemon)->grpc_address()] {
    client::ClientOptions options;
    options.address = address;
    auto c = client::KvCacheClient::Connect(options);
    if (!c.ok()) return;
    auto s = (*c)->OpenStepStream();
    if (!s.ok()) return;
    StepLoadUntil(**s, /*cached=*/64, stop_load, load_steps);
  });
  EXPECT_TRUE(testing::WaitFor([&] { return load_steps.load() > 0; }, absl::Seconds(20),
                               "the load stepped before the SIGTERM"));
  EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0) << (*daemon)->Log();
  stop_load = true;
  load.join();
  hostile_context.TryCancel();
  never_reads.join();
  EXPECT_TRUE(std::filesystem::exists(pool)) << "the drain did not keep the pool for the restart";

  daemon = DaemonProcess::Start(flags);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  {
    std::unique_ptr<client::KvCacheClient> c = (*daemon)->Connect();
    for (const char* id : {"restarted", "hostile", "load"}) {
      EXPECT_TRUE(c->Inspect(id, false).ok()) << id << " was not restored\n" << (*daemon)->Log();
    }
    step_range(*c, kHalf + 1, kSteps);
  }
  EXPECT_EQ(restarted, reference) << "a decision changed across the restart";
  EXPECT_TRUE(FreshHealthServing((*daemon)->grpc_address(), absl::Seconds(10)));
  // The restarted daemon's drain keeps the pool for a next start: remove both here.
  EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0) << (*daemon)->Log();
  std::filesystem::remove_all(state_dir);
  std::filesystem::remove(pool);
}

}  // namespace
}  // namespace kvcm

// Process-level survival of kvcached (docs/RELIABILITY.md, "Process survival"): the KV
// pools' shared memory never outlives the daemon, idle streams give their slot back, and
// the listener survives running out of file descriptors.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/server/daemon_process.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;
using ::kvcm::testing::DaemonTest;
using ::kvcm::testing::HalfOpenConnection;
using ::kvcm::testing::Scores;
using ::testing::HasSubstr;

// Two host pools of 64 KiB in POSIX shared memory.
const std::vector<std::string> kTwoSharedPools = {
    "--backend=host",    "--tp_ranks=2",       "--pool_memory_bytes=65536", "--kv_layers=2",
    "--kv_heads=1",      "--kv_head_dim=4",    "--kv_tokens_per_block=4",   "--kv_dtype=float16",
    "--kv_shared_memory"};

// The /dev/shm files of the pools of kvcached `pid`, by rank.
std::vector<std::string> PoolFiles(pid_t pid) {
  return {"/dev/shm/kvcached-" + std::to_string(pid) + "-rank0",
          "/dev/shm/kvcached-" + std::to_string(pid) + "-rank1"};
}

int CountExisting(const std::vector<std::string>& files) {
  int n = 0;
  for (const std::string& f : files) n += std::filesystem::exists(f) ? 1 : 0;
  return n;
}

void ExpectPoolsRemovedBy(int signal, int expected_exit) {
  auto daemon = DaemonProcess::Start(kTwoSharedPools);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::vector<std::string> files = PoolFiles((*daemon)->pid());
  ASSERT_EQ(CountExisting(files), 2) << "the pools are not where this test looks";
  EXPECT_EQ((*daemon)->SignalAndWait(signal, absl::Seconds(20)), expected_exit);
  EXPECT_EQ(CountExisting(files), 0) << (*daemon)->Log();
}

TEST(PoolCleanupTest, SigtermUnlinksEverySharedMemoryPool) { ExpectPoolsRemovedBy(SIGTERM, 0); }

TEST(PoolCleanupTest, SigintUnlinksEverySharedMemoryPool) { ExpectPoolsRemovedBy(SIGINT, 0); }

// A fatal signal (a failed CHECK aborts; a bad pointer faults) still removes the names.
TEST(PoolCleanupTest, AFatalSignalUnlinksEverySharedMemoryPool) {
  ExpectPoolsRemovedBy(SIGSEGV, /*killed by a signal=*/-1);
}

// SIGKILL cannot be caught: the next kvcached removes what the killed one left.
TEST(PoolCleanupTest, StartRemovesThePoolsOfAKilledInstance) {
  std::vector<std::string> stale;
  {
    auto killed = DaemonProcess::Start(kTwoSharedPools);
    ASSERT_TRUE(killed.ok()) << killed.status();
    stale = PoolFiles((*killed)->pid());
    EXPECT_EQ((*killed)->SignalAndWait(SIGKILL, absl::Seconds(20)), -1);
  }
  ASSERT_EQ(CountExisting(stale), 2) << "SIGKILL left nothing behind to clean up";
  auto next = DaemonProcess::Start(kTwoSharedPools);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(CountExisting(stale), 0) << (*next)->Log();
  EXPECT_EQ(CountExisting(PoolFiles((*next)->pid())), 2);
  EXPECT_EQ((*next)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
}

// A live kvcached's pools are not stale: a second instance leaves them alone.
TEST(PoolCleanupTest, StartLeavesThePoolsOfALiveInstance) {
  auto first = DaemonProcess::Start(kTwoSharedPools);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = DaemonProcess::Start(kTwoSharedPools);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(CountExisting(PoolFiles((*first)->pid())), 2) << (*second)->Log();
  EXPECT_EQ((*second)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
  EXPECT_EQ((*first)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
}

class StreamIdleTest : public DaemonTest {
 protected:
  // A single-layer step of sequence `id` whose cache holds `cached` tokens before it.
  static v1::StepBatch StepOf(const std::string& id, int64_t step, int64_t cached) {
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, id, step), Scores(1, cached + 1, step), 1);
    return batch;
  }

  // Opens step streams until one is served (at most `within`): the first batch on it is
  // `batch`. Null when every stream was refused.
  std::unique_ptr<client::StepStream> StreamThatGetsASlot(const v1::StepBatch& batch,
                                                          absl::Duration within,
                                                          absl::Status* last_refusal) {
    std::unique_ptr<client::StepStream> served;
    testing::PollUntil(
        [&] {
          absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client_->OpenStepStream();
          if (!stream.ok()) {
            *last_refusal = stream.status();
            return false;
          }
          absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
          if (!reply.ok()) {
            *last_refusal = reply.status();
            return false;
          }
          served = *std::move(stream);
          return true;
        },
        absl::Now() + within);
    return served;
  }
};

// The only slot is held by a stream that stops sending: it is ended, and the next stream
// gets the slot and goes on stepping the same sequence.
TEST_F(StreamIdleTest, AnIdleStreamIsEndedAndANewStreamGetsItsSlot) {
  StartDaemon({"--max_streams=1", "--stream_idle_timeout=1s"});
  ASSERT_TRUE(client_->Open(client::OpenRequest("a", 10, 0.5, "tova")).ok());
  auto idle = client_->OpenStepStream();
  ASSERT_TRUE(idle.ok());
  absl::StatusOr<v1::DecisionBatch> first = (*idle)->Step(StepOf("a", 1, 10));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->decisions(0).code(), 0) << first->decisions(0).message();

  absl::Status refusal;
  std::unique_ptr<client::StepStream> next =
      StreamThatGetsASlot(StepOf("a", 2, first->decisions(0).cache_size()), absl::Seconds(20),
                          &refusal);
  ASSERT_NE(next, nullptr) << "the idle stream still holds the slot: " << refusal;
  // The ended stream says why (it has ended, so this does not wait).
  const absl::StatusOr<v1::DecisionBatch> after = (*idle)->Receive();
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  EXPECT_THAT(after.status().message(), HasSubstr("--stream_idle_timeout"));
  EXPECT_EQ(client_->Inspect("a", false)->last_step(), 2);
}

// Waiting for the daemon is not idleness: a rank whose tensor-parallel step waits for a
// rank that never reports gets its answer from the join timeout, not an ended stream.
TEST_F(StreamIdleTest, AStreamWaitingForItsReplyIsNotIdle) {
  StartDaemon({"--stream_idle_timeout=1s", "--tp_join_timeout=3s"});
  OpenTensorParallel(client::OpenRequest("tp", 40, 0.5, "streaming_llm"), 2);
  auto rank0 = client_->OpenStepStream();
  ASSERT_TRUE(rank0.ok());
  v1::StepBatch batch;
  client::AddReport(&batch, "tp", 1);
  absl::StatusOr<v1::DecisionBatch> reply = (*rank0)->Step(batch);  // rank 1 never reports
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->decisions(0).code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(StreamIdleTest, ANegativeTimeoutIsRefusedAtStart) {
  auto daemon = DaemonProcess::Start({"--stream_idle_timeout=-1s"});
  ASSERT_FALSE(daemon.ok());
  EXPECT_THAT(daemon.status().message(), HasSubstr("--stream_idle_timeout and --listener_probe_interval must be >= 0"));
}

namespace health = ::grpc::health::v1;

// A channel on a connection of its own (channels share connections by default).
std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// Health of the whole server over `channel`, within `timeout`; UNKNOWN when the call fails.
health::HealthCheckResponse::ServingStatus Health(const std::shared_ptr<grpc::Channel>& channel,
                                                  absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context.set_wait_for_ready(true);  // a fresh channel waits for its connection
  health::HealthCheckRequest request;
  health::HealthCheckResponse response;
  const grpc::Status status = health::Health::NewStub(channel)->Check(&context, request, &response);
  return status.ok() ? response.status() : health::HealthCheckResponse::UNKNOWN;
}

// Polls Health over a channel from `channel_for_try` until it says `want` or `within` passes.
bool HealthBecomes(const std::function<std::shared_ptr<grpc::Channel>()>& channel_for_try,
                   health::HealthCheckResponse::ServingStatus want, absl::Duration within) {
  return testing::PollUntil([&] { return Health(channel_for_try(), absl::Seconds(1)) == want; },
                            absl::Now() + within);
}

// A counter or gauge of the daemon's /metrics (-1 when it cannot be read).
double DaemonMetric(const DaemonProcess& daemon, const std::string& series) {
  absl::StatusOr<std::string> text = testing::HttpGet(daemon.metrics_address(), "/metrics");
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? testing::MetricValue(*text, series) : -1;
}

void CloseAll(std::vector<int>* fds) {
  for (const int fd : *fds) close(fd);
  fds->clear();
}

// Past --max_connections a fresh connection is refused; once one closes, one is accepted.
TEST(ListenerTest, ConnectionsPastTheLimitAreRefusedUntilOneCloses) {
  auto daemon = DaemonProcess::Start({"--max_connections=2", "--listener_probe_interval=0"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->grpc_address();
  const std::shared_ptr<grpc::Channel> first = OwnChannel(address);
  ASSERT_EQ(Health(first, absl::Seconds(10)), health::HealthCheckResponse::SERVING);
  EXPECT_EQ(DaemonMetric(**daemon, "kvcache_connections_refused_total"), 0);
  std::vector<int> idle = {HalfOpenConnection(address)};  // the second connection
  ASSERT_GE(idle[0], 0);

  EXPECT_EQ(Health(OwnChannel(address), absl::Seconds(2)), health::HealthCheckResponse::UNKNOWN)
      << "a third connection was served";
  EXPECT_THAT((*daemon)->Log(), HasSubstr("--max_connections=2 reached"));
  // The channel's tries were each refused (it retries with backoff): at least one.
  EXPECT_GE(DaemonMetric(**daemon, "kvcache_connections_refused_total"), 1);
  EXPECT_EQ(DaemonMetric(**daemon, "kvcache_accept_errors_total"), 0);
  CloseAll(&idle);
  EXPECT_TRUE(HealthBecomes([&] { return OwnChannel(address); },
                            health::HealthCheckResponse::SERVING, absl::Seconds(20)))
      << (*daemon)->Log();
  EXPECT_EQ(Health(first, absl::Seconds(10)), health::HealthCheckResponse::SERVING);
}

// A host name is served on every address it resolves to, as gRPC's own listener does:
// "localhost" on 127.0.0.1 whatever getaddrinfo lists first.
TEST(ListenerTest, AHostNameIsServedOnEachOfItsAddresses) {
  auto daemon = DaemonProcess::Start({"--listen=localhost:0"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->grpc_address();
  ASSERT_THAT(address, ::testing::StartsWith("localhost:"));
  const std::string ipv4 = "127.0.0.1" + address.substr(address.rfind(':'));
  EXPECT_EQ(Health(OwnChannel(ipv4), absl::Seconds(10)), health::HealthCheckResponse::SERVING);
}

// With the descriptors exhausted by connections that never speak, health (asked over a
// connection opened before) turns NOT_SERVING; once they close, the listener accepts
// fresh connections again and health is SERVING. gRPC's own listener stopped accepting
// for good after the first EMFILE.
TEST(ListenerTest, AfterRunningOutOfDescriptorsTheListenerAcceptsAgain) {
  auto daemon = DaemonProcess::Start({"--max_connections=1000", "--listener_probe_interval=200ms",
                                      "--listener_probe_timeout=1s"},
                                     /*fd_limit=*/64);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->grpc_address();
  EXPECT_THAT((*daemon)->Log(), HasSubstr("soft limit 64"));
  EXPECT_THAT((*daemon)->Log(), HasSubstr("--max_connections=1000 exceeds"));
  const std::shared_ptr<grpc::Channel> before = OwnChannel(address);
  ASSERT_EQ(Health(before, absl::Seconds(10)), health::HealthCheckResponse::SERVING);
  EXPECT_EQ(DaemonMetric(**daemon, "kvcache_accept_errors_total"), 0);

  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) {
    const int fd = HalfOpenConnection(address);
    if (fd >= 0) idle.push_back(fd);
  }
  ASSERT_GT(idle.size(), 64u) << "the kernel refused the connections, not the daemon";
  EXPECT_TRUE(HealthBecomes([&] { return before; }, health::HealthCheckResponse::NOT_SERVING,
                            absl::Seconds(20)))
      << (*daemon)->Log();

  CloseAll(&idle);
  EXPECT_TRUE(HealthBecomes([&] { return OwnChannel(address); },
                            health::HealthCheckResponse::SERVING, absl::Seconds(30)))
      << (*daemon)->Log();
  EXPECT_EQ(Health(before, absl::Seconds(10)), health::HealthCheckResponse::SERVING);
  EXPECT_THAT((*daemon)->Log(), HasSubstr("out of file descriptors"));
  // Read once descriptors are free again (the metrics port needs one too).
  EXPECT_GE(DaemonMetric(**daemon, "kvcache_accept_errors_total"), 1);
  EXPECT_EQ(DaemonMetric(**daemon, "kvcache_connections_refused_total"), 0);
  EXPECT_EQ((*daemon)->SignalAndWait(SIGTERM, absl::Seconds(20)), 0);
}

}  // namespace
}  // namespace kvcm

// The unary RPCs with table work (Open, Close, Inspect, List) run on the engine threads,
// in order with the steps of their sequence, and never on a gRPC thread.
//
// A KvCacheService served on loopback in this process (not the kvcached binary), over a
// StepExecutor the test holds: the test parks the one engine thread on a task of its own
// and watches the executor's queue, so what is queued behind what, and what is answered
// while the engine is busy, follow from the test's own steps rather than from timing.
// Against the daemon, the same RPCs are covered by kvcached_test and its siblings.
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cache_manager/events/kv_events.h"
#include "cache_manager/table/sequence_table.h"
#include "cache_manager/table/step_executor.h"
#include "clients/cpp/kvcache_client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/kvcache_service.h"
#include "server/metrics.h"
#include "server/server_options.h"
#include "tests/server/daemon_test.h"

namespace kvcm::server {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

constexpr int64_t kQueueCapacity = 4;
constexpr int32_t kLayers = 2;
constexpr int64_t kPrefill = 10;

// Holds the engine thread it runs on until released.
struct EngineGate {
  static void Run(void* context, int32_t /*shard*/) {
    auto* gate = static_cast<EngineGate*>(context);
    gate->entered.Notify();
    gate->release.WaitForNotification();
  }
  absl::Notification entered;
  absl::Notification release;
};

void Nothing(void* /*context*/, int32_t /*shard*/) {}

class EngineThreadRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executor_ = std::make_unique<StepExecutor>(1, kQueueCapacity);
    service_ = std::make_unique<KvCacheService>(ServerOptions(), &table_, nullptr,
                                                executor_.get(), nullptr, &metrics_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    client::ClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", port);
    absl::StatusOr<std::unique_ptr<client::KvCacheClient>> connected =
        client::KvCacheClient::Connect(options);
    ASSERT_TRUE(connected.ok()) << connected.status();
    client_ = *std::move(connected);
  }

  void TearDown() override {
    if (!gate_.release.HasBeenNotified()) gate_.release.Notify();
    server_->Shutdown();
    server_->Wait();
  }

  // Parks the engine thread until gate_.release.
  void HoldEngine() {
    ASSERT_TRUE(executor_->Post(0, {&EngineGate::Run, &gate_}));
    gate_.entered.WaitForNotification();
  }

  // Waits until `tasks` are queued behind the held engine thread. Not a timing assertion:
  // the bound only turns a handler that never posts (one that ran its work on the gRPC
  // thread) into a failure instead of a hang.
  void WaitForQueued(int64_t tasks) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (executor_->QueuedTasks() < tasks && absl::Now() < give_up) std::this_thread::yield();
    ASSERT_EQ(executor_->QueuedTasks(), tasks) << "the RPC was not queued on the engine thread";
  }

  // Opens `id`, holds the engine thread, and queues step 1 of `id` behind it on a new
  // step stream (returned in `stream`).
  void QueueFirstStepBehindHeldEngine(const std::string& id,
                                      std::unique_ptr<client::StepStream>* stream) {
    OpenSequence(id);
    HoldEngine();
    absl::StatusOr<std::unique_ptr<client::StepStream>> opened = client_->OpenStepStream();
    ASSERT_TRUE(opened.ok()) << opened.status();
    *stream = *std::move(opened);
    ASSERT_TRUE((*stream)->Send(FirstStep(id)).ok());
    WaitForQueued(1);
  }

  void OpenSequence(const std::string& id) {
    ASSERT_TRUE(client_->Open(client::OpenRequest(id, kPrefill, 0.5, "inertia")).ok());
  }

  // Step 1 of `id`: the whole prompt and the new token.
  static v1::StepBatch FirstStep(const std::string& id) {
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, id, 1),
                             testing::Scores(kLayers, kPrefill + 1, 7), kLayers);
    return batch;
  }

  static SequenceTableOptions WithEvents(KvEventLog* log) {
    SequenceTableOptions options;
    options.kv_events = log;
    return options;
  }

  KvEventLog events_;
  SequenceTable table_{WithEvents(&events_)};
  ServerMetrics metrics_{BuildInfo{}};
  std::unique_ptr<StepExecutor> executor_;
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<client::KvCacheClient> client_;
  EngineGate gate_;
};

TEST_F(EngineThreadRpcTest, CloseSentAfterAStepIsAnsweredAfterThatStep) {
  std::unique_ptr<client::StepStream> stream;
  ASSERT_NO_FATAL_FAILURE(QueueFirstStepBehindHeldEngine("s", &stream));
  std::future<absl::StatusOr<v1::SequenceStats>> closed =
      std::async(std::launch::async, [this] { return client_->Close("s"); });
  WaitForQueued(2);  // the Close is queued behind the step, its gRPC thread free
  // gRPC's threads answer what needs no engine while the engine is held.
  v1::DescribeKvPoolsResponse pools;
  grpc::ClientContext context;
  EXPECT_TRUE(client_->stub().DescribeKvPools(&context, {}, &pools).ok());

  gate_.release.Notify();
  absl::StatusOr<v1::DecisionBatch> decided = stream->Receive();
  ASSERT_TRUE(decided.ok()) << decided.status();
  ASSERT_EQ(decided->decisions_size(), 1);
  EXPECT_EQ(decided->decisions(0).code(), 0) << decided->decisions(0).message();
  const absl::StatusOr<v1::SequenceStats> stats = closed.get();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->steps(), 1);  // the step ran before the Close
  EXPECT_EQ(client_->Inspect("s", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(stream->Close().ok());
}

TEST_F(EngineThreadRpcTest, InspectSentAfterAStepSeesThatStep) {
  std::unique_ptr<client::StepStream> stream;
  ASSERT_NO_FATAL_FAILURE(QueueFirstStepBehindHeldEngine("s", &stream));
  std::future<absl::StatusOr<v1::SequenceState>> inspected =
      std::async(std::launch::async, [this] { return client_->Inspect("s", true); });
  WaitForQueued(2);
  std::future<absl::StatusOr<std::vector<v1::SequenceState>>> listed =
      std::async(std::launch::async, [this] { return client_->List(); });
  WaitForQueued(3);  // the list too waits on the engine, not on a gRPC thread

  gate_.release.Notify();
  ASSERT_TRUE(stream->Receive().ok());
  const absl::StatusOr<v1::SequenceState> state = inspected.get();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->last_step(), 1);
  const absl::StatusOr<std::vector<v1::SequenceState>> sequences = listed.get();
  ASSERT_TRUE(sequences.ok()) << sequences.status();
  ASSERT_EQ(sequences->size(), 1u);
  EXPECT_EQ((*sequences)[0].last_step(), 1);
  EXPECT_TRUE(stream->Close().ok());
}

TEST_F(EngineThreadRpcTest, KvEventsSnapshotIsTakenAfterTheStepsQueuedBeforeTheWatch) {
  std::unique_ptr<client::StepStream> stream;
  ASSERT_NO_FATAL_FAILURE(QueueFirstStepBehindHeldEngine("s", &stream));
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::KvEvent>> watch =
      client_->stub().WatchKvEvents(&context, v1::WatchKvEventsRequest());
  WaitForQueued(2);  // the subscription waits behind the step

  gate_.release.Notify();
  ASSERT_TRUE(stream->Receive().ok());
  v1::KvEvent event;
  ASSERT_TRUE(watch->Read(&event));
  EXPECT_TRUE(event.has_resync()) << event.DebugString();  // a fresh watch: the snapshot
  ASSERT_TRUE(watch->Read(&event));
  ASSERT_TRUE(event.has_snapshot()) << event.DebugString();
  EXPECT_EQ(event.sequence_id(), "s");
  EXPECT_EQ(event.snapshot().last_step(), 1);  // the step is in the snapshot, not after it
  ASSERT_TRUE(watch->Read(&event));
  EXPECT_TRUE(event.has_snapshot_done()) << event.DebugString();
  context.TryCancel();
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(stream->Close().ok());
}

TEST_F(EngineThreadRpcTest, FullEngineQueueRefusesWithResourceExhaustedNamingIt) {
  HoldEngine();
  for (int64_t i = 0; i < kQueueCapacity; ++i) {
    ASSERT_TRUE(executor_->Post(0, {&Nothing, nullptr}));
  }

  const absl::Status open =
      client_->Open(client::OpenRequest("s", kPrefill, 0.5, "inertia")).status();
  EXPECT_EQ(open.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(open.message(), HasSubstr("OpenSequence"));
  EXPECT_THAT(open.message(), HasSubstr("engine thread 0's queue is full"));
  EXPECT_EQ(client_->Close("s").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client_->Inspect("s", false).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client_->List().status().code(), absl::StatusCode::kResourceExhausted);
  // Counted once each, as every unary failure is.
  EXPECT_EQ(metrics_.ErrorCount(Rpc::kOpenSequence, absl::StatusCode::kResourceExhausted), 1);
  EXPECT_EQ(metrics_.ErrorCount(Rpc::kListSequences, absl::StatusCode::kResourceExhausted), 1);

  gate_.release.Notify();
  // Once the engine thread has taken its queue, the retry is served.
  ASSERT_TRUE(WaitFor([&] { return executor_->QueuedTasks() == 0; }, absl::Seconds(60),
                      "the engine thread took its queue"));
  OpenSequence("s");
}

TEST_F(EngineThreadRpcTest, StoppingEngineAnswersUnavailable) {
  HoldEngine();
  StepExecutor* const executor = executor_.get();
  // The destructor marks the engine stopping, then waits for the held thread.
  std::thread stopper([this] { executor_.reset(); });
  while (executor->TryPost(0, {&Nothing, nullptr}).code() != absl::StatusCode::kUnavailable) {
    std::this_thread::yield();
  }
  const absl::Status open =
      client_->Open(client::OpenRequest("s", kPrefill, 0.5, "inertia")).status();
  EXPECT_EQ(open.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(open.message(), HasSubstr("shutting down"));
  EXPECT_EQ(client_->List().status().code(), absl::StatusCode::kUnavailable);
  gate_.release.Notify();
  stopper.join();
}

}  // namespace
}  // namespace kvcm::server

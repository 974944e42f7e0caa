// kvcached on loopback, driven by the C++ client: every RPC, every rejected input, tensor-
// parallel ranks, disconnects, limits, health, metrics and the SIGTERM drain.
#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache_manager/table/sequence_table.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kernels/half_float.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::MetricValue;
using ::kvcm::testing::Scores;
using ::testing::HasSubstr;

constexpr int kOk = 0;
constexpr int kInvalidArgument = 3;
constexpr int kNotFound = 5;
constexpr int kFailedPrecondition = 9;

class KvcachedTest : public testing::DaemonTest {
 protected:
  void SetUp() override { StartDaemon(); }

  // The value of `series` once it is `want`, or its last value after 30 s. For what the
  // daemon accounts after the client already has its answer (a closed stream is counted
  // out when the server side finishes it): the test then fails instead of depending on a
  // sleep being long enough.
  double EventualMetric(const std::string& series, double want) {
    double value = -1;
    testing::PollUntil([&] { return (value = MetricValue(Metrics(), series)) == want; },
                       absl::Now() + absl::Seconds(30));
    return value;
  }

  // How many ranks reported `step` of `id`, once one has: a report sent on a stream
  // reaches the join when its engine thread gets to it. 0 after 30 s without any; fails
  // the test when the step was decided meanwhile (on too few reports).
  int32_t RanksReported(const std::string& id, int64_t step) {
    int32_t reported = 0;
    testing::PollUntil(
        [&] {
          absl::StatusOr<v1::SequenceState> state = client_->Inspect(id, false);
          EXPECT_TRUE(state.ok()) << state.status();
          if (state.ok()) {
            EXPECT_EQ(state->last_step(), step - 1) << "step " << step << " was decided";
          }
          if (!state.ok() || state->last_step() != step - 1) {
            reported = -1;
            return true;  // failed already: waiting longer shows nothing more
          }
          reported = state->ranks_reported();
          return reported > 0;
        },
        absl::Now() + absl::Seconds(30));
    return reported;
  }
};

TEST_F(KvcachedTest, OpenInspectListAndClose) {
  absl::StatusOr<v1::SequenceState> opened =
      client_->Open(client::OpenRequest("a", 100, 0.9, "inertia_lazy4"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->budget(), 10);
  EXPECT_TRUE(opened->next_needs_scores());
  EXPECT_EQ(opened->policy().preset(), "inertia_lazy4");
  EXPECT_EQ(opened->policy().refresh(), v1::REFRESH_LAZY);
  EXPECT_EQ(opened->policy().refresh_interval(), 4);
  ASSERT_TRUE(client_->Open(client::OpenRequest("b", 50, 0.5, "h2o")).ok());

  absl::StatusOr<v1::SequenceState> inspected = client_->Inspect("a", /*include_cache=*/true);
  ASSERT_TRUE(inspected.ok());
  EXPECT_EQ(inspected->cache_size(), 100);
  EXPECT_EQ(inspected->positions_size(), 100);
  EXPECT_EQ(inspected->momentum_size(), 100);
  EXPECT_EQ(client_->Inspect("a", false)->positions_size(), 0);

  absl::StatusOr<std::vector<v1::SequenceState>> listed = client_->List();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 2u);

  absl::StatusOr<v1::SequenceStats> closed = client_->Close("a");
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(closed->steps(), 0);
  EXPECT_EQ(client_->Close("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Inspect("a", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->List()->size(), 1u);
}

TEST_F(KvcachedTest, OpenRejectsBadRequestsNamingTheField) {
  ASSERT_TRUE(client_->Open(client::OpenRequest("dup", 10, 0.5, "tova")).ok());
  absl::Status dup = client_->Open(client::OpenRequest("dup", 10, 0.5, "tova")).status();
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.message(), HasSubstr("'dup'"));

  v1::OpenSequenceRequest r = client::OpenRequest("x", 10, 0.5, "");
  r.mutable_policy()->set_alpha(1.5);
  absl::Status alpha = client_->Open(r).status();
  EXPECT_EQ(alpha.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(alpha.message(), HasSubstr("alpha"));

  r = client::OpenRequest("x", 10, 0.5, "inertia");
  r.mutable_policy()->set_protect_recent(2);
  EXPECT_THAT(client_->Open(r).status().message(), HasSubstr("together with policy fields"));

  EXPECT_THAT(client_->Open(client::OpenRequest("x", 10, 0.5, "inertia9")).status().message(),
              HasSubstr("unknown policy preset 'inertia9'"));
  r = client::OpenRequest("x", 10, 0.5, "inertia");
  r.clear_compression_ratio();
  EXPECT_THAT(client_->Open(r).status().message(), HasSubstr("exactly one of"));
  r = client::OpenRequest("x", 0, 0.5, "inertia");
  EXPECT_THAT(client_->Open(r).status().message(), HasSubstr("prefill_len"));
  r = client::OpenRequest("x", 10, 0.5, "inertia");
  r.set_score_dtype(static_cast<v1::ScoreDtype>(9));
  EXPECT_THAT(client_->Open(r).status().message(), HasSubstr("unknown score dtype 9"));
  r = client::OpenRequest("x", 10, 0.5, "inertia");
  r.set_tp_world_size(1000);
  EXPECT_THAT(client_->Open(r).status().message(), HasSubstr("tp_world_size"));
  r = client::OpenRequest("x", 10, 0.5, "");
  r.mutable_policy()->set_aggregation(static_cast<v1::Aggregation>(42));
  EXPECT_THAT(client_->Open(r).status().message(), HasSubstr("unknown aggregation 42"));
  EXPECT_EQ(client_->List()->size(), 1u);  // nothing half-opened
}

// The daemon's decisions equal those of the in-process engine on the same inputs.
TEST_F(KvcachedTest, StreamDecidesLikeTheEmbeddedEngine) {
  const std::vector<std::string> presets = {"inertia", "inertia_lazy4", "score_free", "tova",
                                            "h2o", "streaming_llm", "random"};
  SequenceTable local;
  for (const std::string& p : presets) {
    ASSERT_TRUE(client_->Open(client::OpenRequest(p, 300, 0.9, p)).ok());
    SequenceOptions o;
    o.prefill_len = 300;
    o.budget = BudgetSpec::Ratio(0.9);
    o.preset = p;
    ASSERT_TRUE(local.Open(p, o).ok());
  }
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  std::vector<int64_t> cache(presets.size(), 300);
  std::vector<bool> needs(presets.size(), true);
  for (int64_t t = 1; t <= 25; ++t) {
    v1::StepBatch batch;
    batch.set_batch_id(static_cast<uint64_t>(t));
    std::vector<std::vector<float>> scores(presets.size());
    for (size_t i = 0; i < presets.size(); ++i) {
      v1::StepReport* r = client::AddReport(&batch, presets[i], t);
      // Score-using presets always get scores; the others never need any.
      if (needs[i]) {
        scores[i] = Scores(3, cache[i] + 1, t * 100 + i);
        client::SetFloat32Scores(r, scores[i], 3);
      }
    }
    absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->batch_id(), static_cast<uint64_t>(t));
    ASSERT_EQ(reply->decisions_size(), static_cast<int>(presets.size()));
    for (size_t i = 0; i < presets.size(); ++i) {
      const v1::Decision& d = reply->decisions(static_cast<int>(i));
      ASSERT_EQ(d.code(), kOk) << d.message();
      EXPECT_EQ(d.sequence_id(), presets[i]);
      EXPECT_EQ(d.step(), t);
      EvictionDecision want;
      const auto m = kernels::ScoreMatrix::Dense(scores[i].data(), kernels::ScoreDtype::kFloat32,
                                                 needs[i] ? 3 : 0, cache[i] + 1);
      ASSERT_TRUE(local.Step(presets[i], t, &m, &want).ok());
      EXPECT_EQ(std::vector<int64_t>(d.evicted().begin(), d.evicted().end()), want.evicted)
          << presets[i] << " step " << t;
      EXPECT_EQ(d.cache_size(), want.cache_size);
      EXPECT_EQ(d.next_needs_scores(), want.next_needs_scores);
      cache[i] = d.cache_size();
      needs[i] = d.next_needs_scores();
    }
  }
  EXPECT_TRUE((*stream)->Close().ok());
  const std::string metrics = Metrics();
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_steps_total{aggregation="ema",policy="inertia"})"), 25);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_scoring_steps_total{policy="score_free"})"), 1);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_skipped_scoring_steps_total{policy="score_free"})"), 24);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_tokens_retained{policy="tova"})"), 30);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_sequences_open{policy="h2o"})"), 1);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_tokens_seen{policy="h2o"})"), 325);
  EXPECT_GT(MetricValue(metrics, R"(kvcache_batch_duration_seconds_count{rpc="StepStream"})"), 24);
  EXPECT_EQ(EventualMetric("kvcache_streams_open", 0), 0);
  EXPECT_EQ(MetricValue(metrics, "kvcache_serving"), 1);
}

TEST_F(KvcachedTest, UnaryStepAndHalfPrecisionScores) {
  for (const char* id : {"f16", "bf16"}) {
    v1::OpenSequenceRequest r = client::OpenRequest(id, 64, 0.75, "inertia");
    r.set_score_dtype(std::string(id) == "f16" ? v1::SCORE_DTYPE_FLOAT16 : v1::SCORE_DTYPE_BFLOAT16);
    ASSERT_TRUE(client_->Open(r).ok());
  }
  SequenceTable local;
  SequenceOptions o;
  o.prefill_len = 64;
  o.budget = BudgetSpec::Ratio(0.75);
  o.preset = "inertia";
  ASSERT_TRUE(local.Open("f16", o).ok());
  ASSERT_TRUE(local.Open("bf16", o).ok());
  int64_t cache = 64;
  for (int64_t t = 1; t <= 10; ++t) {
    const std::vector<float> s = Scores(2, cache + 1, t);
    v1::StepBatch batch;
    client::SetFloat16Scores(client::AddReport(&batch, "f16", t), s, 2);
    client::SetBFloat16Scores(client::AddReport(&batch, "bf16", t), s, 2);
    batch.mutable_reports(0)->set_dtype(v1::SCORE_DTYPE_UNSPECIFIED);  // the sequence's default
    absl::StatusOr<v1::DecisionBatch> reply = client_->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    for (int i = 0; i < 2; ++i) {
      const v1::Decision& d = reply->decisions(i);
      ASSERT_EQ(d.code(), kOk) << d.message();
      // The engine fed the same half-precision values, widened, decides the same.
      std::vector<uint16_t> half;
      for (float v : s) half.push_back(i == 0 ? kernels::FloatToFloat16(v) : kernels::FloatToBFloat16(v));
      const auto m = kernels::ScoreMatrix::Dense(
          half.data(), i == 0 ? kernels::ScoreDtype::kFloat16 : kernels::ScoreDtype::kBFloat16, 2,
          cache + 1);
      EvictionDecision want;
      ASSERT_TRUE(local.Step(i == 0 ? "f16" : "bf16", t, &m, &want).ok());
      EXPECT_EQ(std::vector<int64_t>(d.evicted().begin(), d.evicted().end()), want.evicted);
    }
    cache = reply->decisions(0).cache_size();
  }
  const std::string metrics = Metrics();
  EXPECT_GT(MetricValue(metrics, R"(kvcache_score_bytes_total{dtype="float16",transport="grpc"})"), 0);
  EXPECT_GT(MetricValue(metrics, R"(kvcache_score_bytes_total{dtype="bfloat16",transport="grpc"})"), 0);
}

TEST_F(KvcachedTest, ABadReportFailsOnlyItsOwnDecision) {
  ASSERT_TRUE(client_->Open(client::OpenRequest("good", 20, 0.5, "inertia")).ok());
  for (const char* id : {"order", "size", "negative", "dtype", "bytes", "layers"}) {
    ASSERT_TRUE(client_->Open(client::OpenRequest(id, 20, 0.5, "inertia")).ok());
  }
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  v1::StepBatch batch;
  const std::vector<float> ok = Scores(2, 21, 1);
  client::SetFloat32Scores(client::AddReport(&batch, "good", 1), ok, 2);
  client::SetFloat32Scores(client::AddReport(&batch, "nobody", 1), ok, 2);
  client::SetFloat32Scores(client::AddReport(&batch, "order", 2), ok, 2);
  client::SetFloat32Scores(client::AddReport(&batch, "size", 1), Scores(2, 20, 1), 2);
  std::vector<float> negative = ok;
  negative[25] = -0.5f;  // layer 1, score 4
  client::SetFloat32Scores(client::AddReport(&batch, "negative", 1), negative, 2);
  v1::StepReport* dtype = client::AddReport(&batch, "dtype", 1);
  client::SetFloat32Scores(dtype, ok, 2);
  dtype->set_dtype(static_cast<v1::ScoreDtype>(7));
  v1::StepReport* bytes = client::AddReport(&batch, "bytes", 1);
  client::SetFloat32Scores(bytes, ok, 2);
  bytes->mutable_scores()->pop_back();
  v1::StepReport* layers = client::AddReport(&batch, "layers", 1);
  client::SetFloat32Scores(layers, ok, 2);
  layers->set_layers(0);

  absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_EQ(reply->decisions_size(), 8);
  auto expect = [&](int i, int code, const std::string& text) {
    const v1::Decision& d = reply->decisions(i);
    EXPECT_EQ(d.code(), code) << d.sequence_id() << ": " << d.message();
    EXPECT_THAT(d.message(), HasSubstr(text)) << d.sequence_id();
  };
  expect(0, kOk, "");
  EXPECT_EQ(reply->decisions(0).cache_size(), 10);
  expect(1, kNotFound, "sequence 'nobody' is not open");
  expect(2, kFailedPrecondition, "step 2 is out of order; expected step 1");
  expect(3, kInvalidArgument, "scores cover 20 tokens per layer, the cache holds 21");
  expect(4, kInvalidArgument, "sequence 'negative' step 1: layer 1 score 4 (position 4) is -0.5");
  expect(5, kInvalidArgument, "sequence 'dtype' step 1: unknown score dtype 7");
  expect(6, kInvalidArgument, "scores has 167 bytes, not a whole number of 2 layers of float32");
  expect(7, kInvalidArgument, "but layers is 0");
  // Nothing changed for the rejected ones; the stream goes on.
  for (const char* id : {"order", "size", "negative", "dtype", "bytes", "layers"}) {
    EXPECT_EQ(client_->Inspect(id, false)->last_step(), 0) << id;
  }
  v1::StepBatch next;
  client::SetFloat32Scores(client::AddReport(&next, "order", 1), ok, 2);
  absl::StatusOr<v1::DecisionBatch> again = (*stream)->Step(next);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->decisions(0).code(), kOk);
  const std::string metrics = Metrics();
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_errors_total{code="INVALID_ARGUMENT",rpc="StepStream"})"), 5);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_errors_total{code="NOT_FOUND",rpc="StepStream"})"), 1);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_errors_total{code="FAILED_PRECONDITION",rpc="StepStream"})"), 1);
}

TEST_F(KvcachedTest, TensorParallelRanksOutOfOrderAllGetTheSameDecision) {
  v1::OpenSequenceRequest r = client::OpenRequest("tp", 128, 0.75, "inertia");
  r.set_tp_world_size(2);
  ASSERT_TRUE(client_->Open(r).ok());
  auto rank0 = client_->OpenStepStream();
  auto rank1 = client_->OpenStepStream();
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  int64_t cache = 128;
  for (int64_t t = 1; t <= 12; ++t) {
    const std::vector<float> pooled = Scores(2, cache + 1, t);
    // Rank p holds 1 + p heads, all of which saw the pooled row.
    std::vector<float> sums1(pooled.size());
    for (size_t k = 0; k < pooled.size(); ++k) sums1[k] = pooled[k] * 2.0f;
    v1::StepBatch b0, b1;
    b0.set_rank(0);
    b1.set_rank(1);
    client::SetFloat32Scores(client::AddReport(&b0, "tp", t), pooled, 2, /*head_count=*/1);
    client::SetFloat32Scores(client::AddReport(&b1, "tp", t), sums1, 2, /*head_count=*/2);
    // Odd steps: rank 1 first; even steps: rank 0 first.
    client::StepStream& first = t % 2 ? **rank1 : **rank0;
    client::StepStream& second = t % 2 ? **rank0 : **rank1;
    ASSERT_TRUE(first.Send(t % 2 ? b1 : b0).ok());
    // The step must still be waiting for the other rank.
    ASSERT_EQ(RanksReported("tp", t), 1) << "step " << t;
    ASSERT_TRUE(second.Send(t % 2 ? b0 : b1).ok());
    absl::StatusOr<v1::DecisionBatch> d0 = (*rank0)->Receive();
    absl::StatusOr<v1::DecisionBatch> d1 = (*rank1)->Receive();
    ASSERT_TRUE(d0.ok() && d1.ok());
    ASSERT_EQ(d0->decisions(0).code(), kOk) << d0->decisions(0).message();
    EXPECT_EQ(d0->decisions(0).SerializeAsString(), d1->decisions(0).SerializeAsString());
    cache = d0->decisions(0).cache_size();
  }
  EXPECT_EQ(client_->Inspect("tp", false)->last_step(), 12);
  // A rank outside the world is rejected on its own.
  v1::StepBatch bad;
  bad.set_rank(5);
  client::AddReport(&bad, "tp", 13);
  absl::StatusOr<v1::DecisionBatch> reply = (*rank0)->Step(bad);
  ASSERT_TRUE(reply.ok());
  EXPECT_THAT(reply->decisions(0).message(), HasSubstr("rank 5: rank is outside the tensor-parallel world of 2"));
}

TEST_F(KvcachedTest, ClientDisconnectingMidStreamLeavesTheDaemonAndOtherRanksWorking) {
  v1::OpenSequenceRequest r = client::OpenRequest("tp", 40, 0.5, "streaming_llm");
  r.set_tp_world_size(2);
  ASSERT_TRUE(client_->Open(r).ok());
  {
    auto rank0 = client_->OpenStepStream();
    ASSERT_TRUE(rank0.ok());
    v1::StepBatch b0;
    client::AddReport(&b0, "tp", 1);
    ASSERT_TRUE((*rank0)->Send(b0).ok());
    ASSERT_EQ(RanksReported("tp", 1), 1);
    // rank0 goes away with its step still waiting for rank 1 (the StepStream is cancelled).
  }
  auto rank1 = client_->OpenStepStream();
  ASSERT_TRUE(rank1.ok());
  v1::StepBatch b1;
  b1.set_rank(1);
  client::AddReport(&b1, "tp", 1);
  absl::StatusOr<v1::DecisionBatch> reply = (*rank1)->Step(b1);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->decisions(0).code(), kOk);
  EXPECT_EQ(reply->decisions(0).cache_size(), 20);
  EXPECT_EQ(client_->Inspect("tp", false)->last_step(), 1);
  EXPECT_TRUE((*rank1)->Close().ok());
  EXPECT_EQ(EventualMetric("kvcache_streams_open", 0), 0);
}

// Health says SERVING for the whole server and for kvcache.v1.KvCache.
void ExpectServing(grpc::health::v1::Health::Stub& health) {
  for (const char* service : {"", "kvcache.v1.KvCache"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health.Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
}

TEST_F(KvcachedTest, HealthIsServingThenNotServingOnSigterm) {
  daemon_.reset();
  StartDaemon({"--drain_deadline=60s"});
  auto channel = grpc::CreateChannel(daemon_->grpc_address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  ExpectServing(*health);
  grpc::ClientContext watch_context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("kvcache.v1.KvCache");
  auto watch = health->Watch(&watch_context, request);
  grpc::health::v1::HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  {
    grpc::ClientContext context;
    request.set_service("no.such.Service");
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_EQ(health->Check(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  kill(daemon_->pid(), SIGTERM);
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // The daemon ends the watch itself: a watcher does not hold the drain to its deadline
  // (60 s here). gRPC's shutdown still waits some seconds for idle client connections.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(watch->Read(&update));
  EXPECT_TRUE(watch->Finish().ok());
  EXPECT_EQ(daemon_->SignalAndWait(0, absl::Seconds(40)), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

// --health_listen: health alone, in plaintext, saying what the health on --listen says,
// so that probes that cannot speak TLS still see a draining daemon.
TEST_F(KvcachedTest, TheHealthPortServesHealthAloneAndFollowsTheDrain) {
  daemon_.reset();
  StartDaemon({"--health_listen=127.0.0.1:0", "--drain_deadline=60s"});
  ASSERT_FALSE(daemon_->health_address().empty()) << "no \"health\" in the port file";
  ASSERT_NE(daemon_->health_address(), daemon_->grpc_address());
  auto channel =
      grpc::CreateChannel(daemon_->health_address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  ExpectServing(*health);
  // Nothing but health: the KvCache service is not there.
  {
    auto kv = kvcache::v1::KvCache::NewStub(channel);
    grpc::ClientContext context;
    kvcache::v1::ListSequencesRequest request;
    kvcache::v1::ListSequencesResponse response;
    EXPECT_EQ(kv->ListSequences(&context, request, &response).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  grpc::ClientContext watch_context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("kvcache.v1.KvCache");
  auto watch = health->Watch(&watch_context, request);
  grpc::health::v1::HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  kill(daemon_->pid(), SIGTERM);
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->Read(&update));
  EXPECT_TRUE(watch->Finish().ok());
  EXPECT_EQ(daemon_->SignalAndWait(0, absl::Seconds(40)), 0);
}

TEST_F(KvcachedTest, AUnixHealthAddressIsRefusedAtStart) {
  daemon_.reset();
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> refused =
      testing::DaemonProcess::Start({"--health_listen=unix:/tmp/kvcached-health.sock"});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("--health_listen"));
}

TEST_F(KvcachedTest, SigtermRefusesNewCallsServesOpenStreamsAndExitsZero) {
  constexpr int kSequences = 16;
  for (int i = 0; i < kSequences; ++i) {
    ASSERT_TRUE(client_->Open(client::OpenRequest(absl::StrCat("s", i), 20000, 0.9, "inertia")).ok());
  }
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  v1::StepBatch batch;  // ~10 MB of scores: the daemon is busy with it for a while
  const std::vector<float> s = Scores(8, 20001, 3);
  for (int i = 0; i < kSequences; ++i) {
    client::SetFloat32Scores(client::AddReport(&batch, absl::StrCat("s", i), 1), s, 8);
  }
  ASSERT_TRUE((*stream)->Send(batch).ok());
  const absl::Time start = absl::Now();
  kill(daemon_->pid(), SIGTERM);
  // The batch sent before the signal is answered in full.
  absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Receive();
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_EQ(reply->decisions_size(), kSequences);
  for (const auto& d : reply->decisions()) EXPECT_EQ(d.code(), kOk) << d.message();
  // Once draining, new calls are refused...
  ASSERT_TRUE(testing::WaitFor([&] { return MetricValue(Metrics(), "kvcache_serving") == 0; },
                               absl::Seconds(20), "kvcache_serving went to 0 after SIGTERM"));
  EXPECT_EQ(client_->Open(client::OpenRequest("late", 10, 0.5, "tova")).status().code(),
            absl::StatusCode::kUnavailable);
  // ...while the open stream keeps deciding the steps of its sequences.
  v1::StepBatch next;
  client::SetFloat32Scores(client::AddReport(&next, "s0", 2), Scores(8, 2001, 4), 8);
  absl::StatusOr<v1::DecisionBatch> second = (*stream)->Step(next);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->decisions(0).code(), kOk) << second->decisions(0).message();
  EXPECT_TRUE((*stream)->Close().ok());
  // With its last call ended the daemon exits at once, well inside the drain deadline.
  EXPECT_EQ(daemon_->SignalAndWait(0, absl::Seconds(20)), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_THAT(daemon_->Log(), HasSubstr("SIGTERM: draining"));
}

TEST_F(KvcachedTest, DrainDeadlineCancelsStreamsThatStayOpen) {
  daemon_.reset();
  StartDaemon({"--drain_deadline=1s"});
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  const absl::Time start = absl::Now();
  EXPECT_EQ(daemon_->SignalAndWait(SIGTERM, absl::Seconds(10)), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  v1::StepBatch batch;
  EXPECT_FALSE((*stream)->Step(batch).ok());
}

class KvcachedLimitsTest : public KvcachedTest {
 protected:
  void SetUp() override {
    StartDaemon({"--max_sequences=2", "--max_streams=1", "--max_message_bytes=65536",
                 "--idle_timeout=1s"});
  }
};

TEST_F(KvcachedLimitsTest, SequenceStreamAndMessageLimits) {
  ASSERT_TRUE(client_->Open(client::OpenRequest("a", 10, 0.5, "tova")).ok());
  ASSERT_TRUE(client_->Open(client::OpenRequest("b", 10, 0.5, "tova")).ok());
  EXPECT_EQ(client_->Open(client::OpenRequest("c", 10, 0.5, "tova")).status().code(),
            absl::StatusCode::kResourceExhausted);

  auto first = client_->OpenStepStream();
  ASSERT_TRUE(first.ok());
  v1::StepBatch small;
  client::SetFloat32Scores(client::AddReport(&small, "a", 1), Scores(1, 11, 1), 1);
  ASSERT_TRUE((*first)->Step(small).ok());
  auto second = client_->OpenStepStream();
  ASSERT_TRUE(second.ok());
  absl::StatusOr<v1::DecisionBatch> refused = (*second)->Step(small);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();

  v1::StepBatch big;  // 80 KB > --max_message_bytes
  client::SetFloat32Scores(client::AddReport(&big, "b", 1), Scores(20, 1000, 1), 20);
  EXPECT_EQ(client_->Step(big).status().code(), absl::StatusCode::kResourceExhausted);
  // The daemon is fine afterwards.
  EXPECT_TRUE(client_->Inspect("b", false).ok());
}

TEST_F(KvcachedTest, ARankThatNeverReportsDoesNotHoldTheOthersForever) {
  daemon_.reset();
  StartDaemon({"--tp_join_timeout=1s"});
  v1::OpenSequenceRequest r = client::OpenRequest("tp", 40, 0.5, "streaming_llm");
  r.set_tp_world_size(2);
  ASSERT_TRUE(client_->Open(r).ok());
  ASSERT_TRUE(client_->Open(client::OpenRequest("solo", 40, 0.5, "streaming_llm")).ok());
  auto rank0 = client_->OpenStepStream();
  ASSERT_TRUE(rank0.ok());
  v1::StepBatch batch;  // one tensor-parallel sequence and one single-rank one
  client::AddReport(&batch, "tp", 1);
  client::AddReport(&batch, "solo", 1);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::DecisionBatch> reply = (*rank0)->Step(batch);  // rank 1 never reports
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(reply->decisions(0).code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(reply->decisions(0).message(), HasSubstr("rank(s) 1 did not report"));
  EXPECT_EQ(reply->decisions(1).code(), kOk);
  EXPECT_EQ(client_->Inspect("tp", false)->last_step(), 0);
}

TEST_F(KvcachedLimitsTest, IdleSequencesAreReclaimed) {
  ASSERT_TRUE(client_->Open(client::OpenRequest("idle", 10, 0.5, "h2o")).ok());
  // Reclaimed by the reclaimer's first pass after --idle_timeout (1 s); the deadline only
  // bounds a daemon that never reclaims. The poll reads the log, written last, and not
  // the sequence: an Inspect would count as activity and keep it alive.
  ASSERT_TRUE(testing::WaitFor(
      [&] { return absl::StrContains(daemon_->Log(), "reclaimed sequence 'idle'"); },
      absl::Seconds(20), "the idle sequence was reclaimed"))
      << daemon_->Log();
  const std::string reclaimed =
      R"(kvcache_sequences_closed_total{policy="h2o",reason="idle_timeout"})";
  EXPECT_EQ(client_->Inspect("idle", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MetricValue(Metrics(), reclaimed), 1);
}

}  // namespace
}  // namespace kvcm

// kvcached on loopback against hostile and faulty requests: values whose sums overflow,
// client-sized allocations, the token and memory limits, and the errors such requests get.
// Every test ends by checking that the daemon still serves.
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "server/translate.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::MetricValue;
using ::kvcm::testing::ResidentBytes;
using ::kvcm::testing::Scores;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int kInvalidArgument = static_cast<int>(absl::StatusCode::kInvalidArgument);
constexpr int kResourceExhausted = static_cast<int>(absl::StatusCode::kResourceExhausted);

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A channel that sends bytes as they are, so that a test can send what no well-behaved
// client would: messages that do not parse.
class RawChannel {
 public:
  explicit RawChannel(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())) {}

  // One unary call of kvcache.v1.KvCache/`method` with `request` as its bytes.
  grpc::Status Unary(const std::string& method, const std::string& request) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    grpc::ByteBuffer response;
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(),
        grpc::internal::RpcMethod(("/kvcache.v1.KvCache/" + method).c_str(),
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &context, Bytes(request), &response);
  }

  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> StepStream(
      grpc::ClientContext* context) {
    return std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel_.get(),
            grpc::internal::RpcMethod("/kvcache.v1.KvCache/StepStream",
                                      grpc::internal::RpcMethod::BIDI_STREAMING),
            context));
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
};

// `message` serialized, with every occurrence of `from` in its bytes replaced by `to`
// (same length): how a test puts bytes a string field may not hold into a message.
template <typename Message>
std::string SerializedWith(const Message& message, const std::string& from,
                           const std::string& to) {
  std::string bytes = message.SerializeAsString();
  for (size_t at = bytes.find(from); at != std::string::npos; at = bytes.find(from, at + 1)) {
    bytes.replace(at, from.size(), to);
  }
  return bytes;
}

class LimitsTest : public testing::DaemonTest {
 protected:
  // The daemon still answers: a fresh sequence opens, steps and closes.
  void ExpectStillServing() {
    const std::string id = absl::StrCat("alive-", ++alive_);
    ASSERT_TRUE(client_->Open(client::OpenRequest(id, 8, 0.5, "tova")).ok());
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, id, 1), Scores(1, 9, 1), 1);
    absl::StatusOr<v1::DecisionBatch> reply = client_->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->decisions(0).code(), 0) << reply->decisions(0).message();
    EXPECT_TRUE(client_->Close(id).ok());
  }
  int alive_ = 0;
};

TEST_F(LimitsTest, ProtectionsWhoseSumOverflowsAreRefusedAndTheDaemonSurvives) {
  StartDaemon();
  for (int aggregation : {v1::AGGREGATION_EMA, v1::AGGREGATION_RANDOM}) {
    const std::string id = absl::StrCat("wrap-", aggregation);
    v1::OpenSequenceRequest r = client::OpenRequest(id, 16, 0.5, "");
    r.mutable_policy()->set_aggregation(static_cast<v1::Aggregation>(aggregation));
    r.mutable_policy()->set_protect_sinks(kMax);
    r.mutable_policy()->set_protect_recent(2);
    absl::Status opened = client_->Open(r).status();
    EXPECT_EQ(opened.code(), absl::StatusCode::kInvalidArgument) << opened;
    EXPECT_THAT(opened.message(), HasSubstr("budget"));
    // Before the fix the Open succeeded and this step killed the daemon.
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, id, 1), Scores(1, 17, 1), 1);
    absl::StatusOr<v1::DecisionBatch> reply = client_->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->decisions(0).code(), static_cast<int>(absl::StatusCode::kNotFound));
  }
  ExpectStillServing();
}

// ---------------------------------------------------------------------------------------
// Client-sized allocations and the limits on them

TEST_F(LimitsTest, AHugeBudgetReservesNothingUpFront) {
  StartDaemon();
  const int64_t before = ResidentBytes(daemon_->pid());
  v1::OpenSequenceRequest r = client::OpenRequest("big-budget", 16, 0.5, "inertia");
  r.set_budget_tokens(50'000'000);  // used to reserve about 1 GB before any step
  ASSERT_TRUE(client_->Open(r).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, "big-budget", step),
                             Scores(1, 16 + step, step), 1);
    absl::StatusOr<v1::DecisionBatch> reply = client_->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->decisions(0).code(), 0) << reply->decisions(0).message();
  }
  const int64_t after = ResidentBytes(daemon_->pid());
  ASSERT_GT(before, 0);
  EXPECT_LT(after - before, int64_t{32} << 20) << "grew by " << ((after - before) >> 20) << " MiB";
  ExpectStillServing();
}

TEST_F(LimitsTest, MaxSequenceTokensBoundsThePrefillAndTheDecode) {
  StartDaemon({"--max_sequence_tokens=1000"});
  absl::Status over = client_->Open(client::OpenRequest("long", 1001, 0.9, "inertia")).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_THAT(over.message(), HasSubstr("1001"));
  EXPECT_THAT(over.message(), HasSubstr("--max_sequence_tokens"));
  v1::OpenSequenceRequest r = client::OpenRequest("edge", 998, 0.5, "streaming_llm");
  r.set_budget_tokens(5000);
  ASSERT_TRUE(client_->Open(r).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    v1::StepBatch batch;
    client::AddReport(&batch, "edge", step);
    absl::StatusOr<v1::DecisionBatch> reply = client_->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    if (step <= 2) {  // 998 + 2 = 1000 tokens: at the limit exactly
      EXPECT_EQ(reply->decisions(0).code(), 0) << reply->decisions(0).message();
    } else {
      EXPECT_EQ(reply->decisions(0).code(), kResourceExhausted);
      EXPECT_THAT(reply->decisions(0).message(), HasSubstr("--max_sequence_tokens"));
    }
  }
  EXPECT_EQ(client_->Inspect("edge", false)->last_step(), 2);
  ExpectStillServing();
}

TEST_F(LimitsTest, MemoryLimitRefusesOpensPastItAndRssStaysBounded) {
  constexpr int64_t kLimit = int64_t{160} << 20;
  StartDaemon({absl::StrCat("--memory_limit_bytes=", kLimit)});
  // The baseline is taken after one open and close, so that it holds what serving itself
  // keeps (gRPC's threads and their malloc arenas, first touched by a request), which
  // under a loaded machine is tens of MiB more than an idle daemon's.
  ASSERT_TRUE(client_->Open(client::OpenRequest("warm-up", 1 << 20, 0.9, "inertia")).ok());
  ASSERT_TRUE(client_->Close("warm-up").ok());
  // The baseline follows the housekeeping loop's trim of the warm-up's freed memory: two
  // more passes, so that one started after the close (the resident memory itself need not
  // fall: on some machines the trim returns nothing).
  const double passes = MetricValue(Metrics(), "kvcache_housekeeping_passes_total");
  ASSERT_GE(passes, 0);
  ASSERT_TRUE(WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_housekeeping_passes_total") >= passes + 2; },
      absl::Seconds(30), "two housekeeping passes after the warm-up's close"));
  const int64_t baseline = ResidentBytes(daemon_->pid());
  ASSERT_GT(baseline, 0);
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_limit_bytes"), kLimit);
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_bytes"), 0);
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_refused_total"), 0);
  // Each needs a little more than 32 MiB of engine state: four fit, the rest are refused.
  int opened = 0;
  absl::Status refused;
  for (int i = 0; i < 8; ++i) {
    absl::Status s =
        client_->Open(client::OpenRequest(absl::StrCat("p", i), 1 << 20, 0.9, "inertia")).status();
    if (s.ok()) {
      ++opened;
    } else {
      refused = s;
    }
  }
  EXPECT_EQ(opened, 4);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("--memory_limit_bytes"));
  EXPECT_THAT(refused.message(), HasSubstr("left"));
  const double counted = MetricValue(Metrics(), "kvcache_memory_bytes");
  EXPECT_GT(counted, 4.0 * (32 << 20));
  EXPECT_LE(counted, kLimit);
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_refused_total"), 4);
  const int64_t peak = ResidentBytes(daemon_->pid());
  EXPECT_LT(peak - baseline, kLimit + (int64_t{16} << 20)) << (peak >> 20) << " MiB";
  for (int i = 0; i < opened; ++i) ASSERT_TRUE(client_->Close(absl::StrCat("p", i)).ok());
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_bytes"), 0);
  // Closed sequences give their memory back, to the limit and (within the reclaimer's
  // next rounds) to the system.
  int64_t closed = -1;
  EXPECT_TRUE(testing::WaitFor(
      [&] { return (closed = ResidentBytes(daemon_->pid())) - baseline < (int64_t{48} << 20); },
      absl::Seconds(10), "the closed sequences' memory went back to the system"))
      << (closed >> 20) << " MiB after closing, baseline " << (baseline >> 20)
      << " MiB; log:\n" << daemon_->Log();
  EXPECT_TRUE(client_->Open(client::OpenRequest("again", 1 << 20, 0.9, "inertia")).ok());
  ExpectStillServing();
}

TEST_F(LimitsTest, RepliesAStreamStillHoldsCountAgainstTheMemoryLimit) {
  // A prefill of 2^20 at 90%: step 1 evicts kEvicted positions, an 8-byte-per-position
  // reply the stream keeps in its batch slot until that slot is reused (8 batches later).
  constexpr int64_t kPrefill = 1 << 20;
  constexpr int64_t kBudget = kPrefill / 10;  // floor(0.1 * 2^20)
  constexpr int64_t kEvicted = kPrefill + 1 - kBudget;
  constexpr int64_t kStateAfterStep1 = 32 * (kBudget + 1);
  constexpr int64_t kReply = 8 * kEvicted;
  // The open, the first step's eviction list in the engine, and a MiB to spare.
  constexpr int64_t kLimit = 32 * (kPrefill + 1) + 16 * kEvicted + (1 << 20);
  StartDaemon({absl::StrCat("--memory_limit_bytes=", kLimit)});
  ASSERT_TRUE(client_->Open(client::OpenRequest("p", kPrefill, 0.9, "streaming_llm")).ok());
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  const auto step = [&](int64_t t) {
    v1::StepBatch batch;
    batch.set_batch_id(static_cast<uint64_t>(t));
    client::AddReport(&batch, "p", t);
    absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_EQ(reply->decisions(0).code(), 0) << reply->decisions(0).message();
  };
  step(1);
  step(2);  // the engine's eviction list of step 1 is given back here
  // A sequence that fits next to "p" only when step 1's reply is not counted.
  constexpr int64_t kOther = (kLimit - kStateAfterStep1 - (64 << 10)) / 32 - 1;
  static_assert(kLimit - kStateAfterStep1 - 32 * (kOther + 1) < kReply);
  const absl::Status refused =
      client_->Open(client::OpenRequest("q", kOther, 0.9, "streaming_llm")).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  for (int64_t t = 3; t <= 9; ++t) step(t);  // batch 9 reuses batch 1's slot
  const absl::Status opened =
      client_->Open(client::OpenRequest("q", kOther, 0.9, "streaming_llm")).status();
  EXPECT_TRUE(opened.ok()) << opened;
  EXPECT_TRUE((*stream)->Close().ok());
}

TEST_F(LimitsTest, AnInspectOfTheCacheIsChargedToTheMemoryLimitWhileItsReplyIsHeld) {
  // A cache of 2^16 tokens (nothing evicted at ratio 0): its InspectSequence reply with
  // the cache holds more than 2 MiB (positions and momentum, in the snapshot, the message
  // and the serialized reply); the limit leaves 1 MiB next to the sequence.
  constexpr int64_t kPrefill = 1 << 16;
  constexpr int64_t kLimit = 32 * (kPrefill + 1) + (1 << 20);
  StartDaemon({absl::StrCat("--memory_limit_bytes=", kLimit)});
  ASSERT_TRUE(client_->Open(client::OpenRequest("big", kPrefill, 0.0, "streaming_llm")).ok());
  ASSERT_TRUE(client_->Open(client::OpenRequest("small", 1000, 0.0, "streaming_llm")).ok());
  const double held = MetricValue(Metrics(), "kvcache_memory_bytes");
  ASSERT_GT(held, 0);

  const absl::StatusOr<v1::SequenceState> refused = client_->Inspect("big", true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("InspectSequence with include_cache"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--memory_limit_bytes"));
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_refused_total"), 1);
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_memory_bytes"), held) << "a refusal took bytes";
  // Without the cache the reply is small; a small cache fits.
  const absl::StatusOr<v1::SequenceState> brief = client_->Inspect("big", false);
  ASSERT_TRUE(brief.ok()) << brief.status();
  EXPECT_EQ(brief->cache_size(), kPrefill);
  const absl::StatusOr<v1::SequenceState> small = client_->Inspect("small", true);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->positions_size(), 1000);
  // Its bytes are given back once gRPC is done with the call (just after the client has
  // the reply).
  double after = -1;
  EXPECT_TRUE(testing::WaitFor(
      [&] { return (after = MetricValue(Metrics(), "kvcache_memory_bytes")) == held; },
      absl::Seconds(10), "the Inspect reply's bytes were given back to the memory limit"))
      << "kvcache_memory_bytes " << after << ", before the Inspect " << held;
  // Once "big" is closed, the room it held takes a cache of half its size.
  ASSERT_TRUE(client_->Close("big").ok());
  ASSERT_TRUE(client_->Open(client::OpenRequest("big2", kPrefill / 2, 0.0, "streaming_llm")).ok());
  const absl::StatusOr<v1::SequenceState> fits = client_->Inspect("big2", true);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->positions_size(), kPrefill / 2);
  ExpectStillServing();
}

// ---------------------------------------------------------------------------------------
// Errors

TEST(EscapeTextTest, ControlBytesAndBadUtf8AreEscapedAndUtf8IsKept) {
  EXPECT_EQ(server::EscapeText("a\nb\r\tc\\d\x01\x7f"), "a\\nb\\r\\tc\\\\d\\x01\\x7f");
  EXPECT_EQ(server::EscapeText("s\xc3\xa9q \xe2\x82\xac"), "s\xc3\xa9q \xe2\x82\xac");  // é, €
  // A lone continuation byte, a truncated sequence, an overlong form, a surrogate.
  EXPECT_EQ(server::EscapeText("\x80|\xc3|\xc0\xaf|\xed\xa0\x80"),
            "\\x80|\\xc3|\\xc0\\xaf|\\xed\\xa0\\x80");
}

TEST(EscapeTextTest, LongTextIsCutAtACharacterWithinTheBound) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "\xe2\x82\xac";  // 6000 bytes of euros
  const std::string cut = server::EscapeText(text, 1024);
  EXPECT_LE(cut.size(), 1024u);
  EXPECT_THAT(cut, ::testing::EndsWith("(cut; 6000 bytes in all)"));
  const size_t euros = cut.find("...");
  ASSERT_NE(euros, std::string::npos);
  EXPECT_EQ(euros % 3, 0u);  // no character split
  EXPECT_EQ(server::EscapeText(std::string(1024, 'x'), 1024), std::string(1024, 'x'));
}

TEST_F(LimitsTest, AnIdThatIsNotUtf8IsAnInvalidArgumentOnEveryRpc) {
  StartDaemon();
  RawChannel raw(daemon_->grpc_address());
  const std::string bad = "\xff\xfe";
  v1::OpenSequenceRequest open = client::OpenRequest("@@", 16, 0.5, "tova");
  grpc::Status s = raw.Unary("OpenSequence", SerializedWith(open, "@@", bad));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("UTF-8"));
  v1::CloseSequenceRequest close;
  close.set_sequence_id("@@");
  s = raw.Unary("CloseSequence", SerializedWith(close, "@@", bad));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  v1::InspectSequenceRequest inspect;
  inspect.set_sequence_id("@@");
  s = raw.Unary("InspectSequence", SerializedWith(inspect, "@@", bad));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  v1::StepBatch batch;
  client::AddReport(&batch, "@@", 1);
  s = raw.Unary("Step", SerializedWith(batch, "@@", bad));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  ExpectStillServing();
}

TEST_F(LimitsTest, BytesThatAreNotTheRequestAreAnInvalidArgumentNamingItsTypeOnEveryRpc) {
  StartDaemon();
  RawChannel raw(daemon_->grpc_address());
  const std::string not_a_message = "\xff";  // a truncated field tag
  for (const auto& [method, type] : std::vector<std::pair<std::string, std::string>>{
           {"ListSequences", "kvcache.v1.ListSequencesRequest"},
           {"DescribeKvPools", "kvcache.v1.DescribeKvPoolsRequest"},
           {"UnregisterScoreRegion", "kvcache.v1.UnregisterScoreRegionRequest"},
           {"WatchKvEvents", "kvcache.v1.WatchKvEventsRequest"}}) {
    const grpc::Status s = raw.Unary(method, not_a_message);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(s.error_message(), HasSubstr("the request does not parse as " + type)) << method;
  }
  ExpectStillServing();
}

TEST_F(LimitsTest, AMegabyteIdGetsABoundedInvalidArgument) {
  StartDaemon();
  const std::string huge(1 << 20, 'x');
  for (const absl::Status& s : {client_->Close(huge).status(),
                                client_->Inspect(huge, false).status(),
                                client_->Open(client::OpenRequest(huge, 8, 0.5, "tova")).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s.ToString().substr(0, 200);
    EXPECT_LE(s.message().size(), 1024u);
    EXPECT_THAT(s.message(), HasSubstr("256"));
  }
  v1::StepBatch batch;
  client::AddReport(&batch, huge, 1);
  absl::StatusOr<v1::DecisionBatch> reply = client_->Step(batch);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString().substr(0, 200);
  EXPECT_EQ(reply->decisions(0).code(), kInvalidArgument);
  EXPECT_LE(reply->decisions(0).message().size(), 1024u);
  ExpectStillServing();
}

TEST_F(LimitsTest, IdsAreEscapedInErrorsAndLogs) {
  StartDaemon({"--idle_timeout=1s"});
  const std::string forged = "evil\nkvcached: forged line\r\x01";
  absl::Status missing = client_->Inspect(forged, false).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("evil\\nkvcached: forged line\\r\\x01"));
  EXPECT_EQ(missing.message().find('\n'), std::string::npos);
  ASSERT_TRUE(client_->Open(client::OpenRequest(forged, 8, 0.5, "tova")).ok());
  // Reclaimed after its idle timeout, which logs its id (List does not count as activity).
  ASSERT_TRUE(testing::WaitFor(
      [&] { return client_->List()->empty() && absl::StrContains(daemon_->Log(), "evil"); },
      absl::Seconds(20), "the sequence was reclaimed and its reclaim logged"));
  const std::string log = daemon_->Log();
  EXPECT_THAT(log, HasSubstr("evil\\nkvcached: forged line"));
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, "kvcached: forged")) << line;
  }
}

TEST_F(LimitsTest, AStreamMessageThatDoesNotParseFailsTheStream) {
  StartDaemon();
  ASSERT_TRUE(client_->Open(client::OpenRequest("s", 8, 0.5, "tova")).ok());
  RawChannel raw(daemon_->grpc_address());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  auto stream = raw.StepStream(&context);
  v1::StepBatch good;
  good.set_batch_id(1);
  client::SetFloat32Scores(client::AddReport(&good, "s", 1), Scores(1, 9, 1), 1);
  ASSERT_TRUE(stream->Write(Bytes(good.SerializeAsString())));
  ASSERT_TRUE(stream->Write(Bytes(std::string("\xff\xff\xff\xff", 4))));  // no message
  grpc::ByteBuffer reply_bytes;
  ASSERT_TRUE(stream->Read(&reply_bytes));  // the batch before it is answered
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply_bytes.Dump(&slices).ok());
  std::string flat;
  for (const grpc::Slice& slice : slices) flat.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  v1::DecisionBatch reply;
  ASSERT_TRUE(reply.ParseFromString(flat));
  EXPECT_EQ(reply.batch_id(), 1u);
  EXPECT_EQ(reply.decisions(0).code(), 0);
  EXPECT_FALSE(stream->Read(&reply_bytes));
  const grpc::Status finished = stream->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << finished.error_message();
  EXPECT_THAT(finished.error_message(), HasSubstr("StepBatch"));
  ExpectStillServing();
}

}  // namespace
}  // namespace kvcm

// The step path of a real kvcached on loopback: shared-memory score regions (every way a
// reference can be wrong), memory that stays bounded against a client that never reads
// and against a tensor-parallel flood, a rejection that reaches every rank, and replies
// written in batch order.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/engine/sequence.h"
#include "clients/cpp/score_region.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/score_matrix.h"
#include "server/translate.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;
using ::kvcm::testing::MetricValue;
using ::kvcm::testing::ResidentBytes;
using ::kvcm::testing::Scores;
using ::testing::HasSubstr;

constexpr int kOk = 0;
constexpr int kInvalidArgument = static_cast<int>(absl::StatusCode::kInvalidArgument);
constexpr int kFailedPrecondition = static_cast<int>(absl::StatusCode::kFailedPrecondition);
constexpr int kResourceExhausted = static_cast<int>(absl::StatusCode::kResourceExhausted);
// How long a test waits for the daemon to account what the client already has an answer
// for; a bound on a daemon that never does, not a delay.
constexpr absl::Duration kWait = absl::Seconds(10);

// [layers, tokens] f32 scores as the packed bytes a report carries.
std::span<const std::byte> Bytes(const std::vector<float>& v) {
  return std::as_bytes(std::span(v));
}

// A POSIX shared-memory object the test makes itself, to control its mode and its size
// behind the daemon's back. Mapped read-write; unlinked when destroyed.
class ShmObject {
 public:
  ShmObject(size_t bytes, mode_t mode) : size_(bytes) {
    name_ = absl::StrCat("/kvcm-step-path-test-", getpid(), "-", std::random_device{}());
    fd_ = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(fchmod(fd_, mode), 0);  // not subject to the umask, unlike shm_open's mode
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    base_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(base_, MAP_FAILED);
  }
  ~ShmObject() {
    munmap(base_, size_);
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  // REQUIRES: the range lies inside the object's current size (else SIGBUS).
  void Write(size_t offset, std::span<const std::byte> bytes) {
    std::memcpy(static_cast<std::byte*>(base_) + offset, bytes.data(), bytes.size());
  }
  // Shrinks (or grows) the object; the mapping keeps its size.
  void Truncate(size_t bytes) { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

 private:
  std::string name_;
  int fd_ = -1;
  void* base_ = MAP_FAILED;
  const size_t size_;
};

// Points `report` at a range of `region` holding float32 rows.
void Reference(v1::StepReport* report, uint64_t region, uint64_t offset, uint64_t byte_size,
               int32_t layers, int32_t head_count = 0) {
  v1::ScoreRef* ref = report->mutable_score_ref();
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(byte_size);
  report->set_layers(layers);
  report->set_dtype(v1::SCORE_DTYPE_FLOAT32);
  report->set_head_count(head_count);
}

// What StepPathTest::Open sends: half the tokens kept, under `preset`.
v1::OpenSequenceRequest OpenRequestFor(const std::string& id, int64_t prefill,
                                       const std::string& preset, int32_t tp_world_size = 1) {
  v1::OpenSequenceRequest r = client::OpenRequest(id, prefill, 0.5, preset);
  r.set_tp_world_size(tp_world_size);
  return r;
}

// The positions the engine alone (the embedded Sequence, opened as the daemon opens
// `open`, one rank) evicts at step 1 given `scores`, [layers, prefill + 1] f32 on the
// host: what every rank of a tensor-parallel step whose joined rows are `scores` must be
// told.
std::vector<int64_t> EvictedAlone(const v1::OpenSequenceRequest& open,
                                  const std::vector<float>& scores, int32_t layers) {
  v1::OpenSequenceRequest alone = open;
  alone.set_tp_world_size(1);
  const absl::StatusOr<server::OpenParams> params = server::FromProto(alone);
  EXPECT_TRUE(params.ok()) << params.status();
  if (!params.ok()) return {};
  absl::StatusOr<std::unique_ptr<Sequence>> engine =
      Sequence::Create(open.sequence_id(), params->options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  const kernels::ScoreMatrix rows =
      kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, layers,
                                  static_cast<int64_t>(scores.size()) / layers);
  EvictionDecision decision;
  const absl::Status stepped = (*engine)->Step(1, &rows, &decision);
  EXPECT_TRUE(stepped.ok()) << stepped;
  return decision.evicted;
}

std::vector<int64_t> Evicted(const v1::Decision& decision) {
  return std::vector<int64_t>(decision.evicted().begin(), decision.evicted().end());
}

class StepPathTest : public testing::DaemonTest {
 protected:
  absl::StatusOr<uint64_t> Register(const std::string& name, uint64_t byte_size) {
    grpc::ClientContext context;
    v1::RegisterScoreRegionRequest request;
    request.set_name(name);
    request.set_byte_size(byte_size);
    v1::RegisterScoreRegionResponse response;
    RETURN_IF_ERROR(
        client::FromGrpc(client_->stub().RegisterScoreRegion(&context, request, &response)));
    return response.region();
  }

  absl::Status Unregister(uint64_t region) {
    grpc::ClientContext context;
    v1::UnregisterScoreRegionRequest request;
    request.set_region(region);
    v1::UnregisterScoreRegionResponse response;
    return client::FromGrpc(client_->stub().UnregisterScoreRegion(&context, request, &response));
  }

  void Open(const std::string& id, int64_t prefill, const std::string& preset,
            int32_t tp_world_size = 1) {
    absl::StatusOr<v1::SequenceState> opened =
        client_->Open(OpenRequestFor(id, prefill, preset, tp_world_size));
    ASSERT_TRUE(opened.ok()) << opened.status();
  }

  v1::SequenceState Inspect(const std::string& id) {
    absl::StatusOr<v1::SequenceState> state = client_->Inspect(id, /*include_cache=*/false);
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *state : v1::SequenceState();
  }

  // One batch on a fresh stream; the stream's own failure fails the test.
  v1::DecisionBatch StepOnce(const v1::StepBatch& batch) {
    absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client_->OpenStepStream();
    EXPECT_TRUE(stream.ok()) << stream.status();
    if (!stream.ok()) return {};
    absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
    EXPECT_TRUE(reply.ok()) << reply.status();
    EXPECT_TRUE((*stream)->Close().ok());
    return reply.ok() ? *reply : v1::DecisionBatch();
  }
};

// ---------------------------------------------------------------------------------------
// Score regions

class ScoreRegionTest : public StepPathTest {
 protected:
  void SetUp() override { StartDaemon({"--allow_shm_scores"}); }
};

TEST_F(ScoreRegionTest, AStepByReferenceDecidesLikeTheSameScoresInline) {
  Open("inline", 64, "inertia");
  Open("by-ref", 64, "inertia");
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::Create(*client_, 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  int64_t cache = 64, shm_bytes = 0;
  for (int64_t t = 1; t <= 6; ++t) {
    const std::vector<float> s = Scores(3, cache + 1, static_cast<uint64_t>(t));
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, "inline", t), s, 3);
    // Each step at another offset: the daemon reads the range it is told, not the start.
    const int64_t offset = 4096 * t + 64;
    ASSERT_TRUE((*region)->Put(client::AddReport(&batch, "by-ref", t), offset, Bytes(s), 3,
                               kernels::ScoreDtype::kFloat32).ok());
    shm_bytes += static_cast<int64_t>(s.size() * sizeof(float));
    absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const v1::Decision& a = reply->decisions(0);
    const v1::Decision& b = reply->decisions(1);
    ASSERT_EQ(a.code(), kOk) << a.message();
    ASSERT_EQ(b.code(), kOk) << b.message();
    EXPECT_EQ(std::vector<int64_t>(a.evicted().begin(), a.evicted().end()),
              std::vector<int64_t>(b.evicted().begin(), b.evicted().end()))
        << "step " << t;
    EXPECT_EQ(a.cache_size(), b.cache_size());
    cache = a.cache_size();
  }
  EXPECT_EQ(client_->Inspect("inline", true)->momentum_size(), cache);
  EXPECT_EQ(Inspect("by-ref").last_step(), 6);
  // The momentum itself is the same bits.
  const auto x = client_->Inspect("inline", true), y = client_->Inspect("by-ref", true);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(std::vector<float>(x->momentum().begin(), x->momentum().end()),
            std::vector<float>(y->momentum().begin(), y->momentum().end()));
  EXPECT_EQ(MetricValue(Metrics(), R"(kvcache_score_bytes_total{dtype="float32",transport="shm"})"),
            static_cast<double>(shm_bytes));
}

TEST_F(ScoreRegionTest, ABadReferenceFailsItsReportNamingTheRegionOffsetAndSizes) {
  constexpr int64_t kRegionBytes = 65536;
  for (const char* id : {"good", "unknown", "past", "misaligned", "short"}) Open(id, 20, "inertia");
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::Create(*client_, kRegionBytes);
  ASSERT_TRUE(region.ok()) << region.status();
  const uint64_t id = (*region)->id();
  const std::vector<float> s = Scores(2, 21, 1);  // 168 bytes
  v1::StepBatch batch;
  ASSERT_TRUE((*region)->Put(client::AddReport(&batch, "good", 1), 0, Bytes(s), 2,
                             kernels::ScoreDtype::kFloat32).ok());
  Reference(client::AddReport(&batch, "unknown", 1), id + 1000, 0, 168, 2);
  Reference(client::AddReport(&batch, "past", 1), id, kRegionBytes - 64, 168, 2);
  ASSERT_TRUE((*region)->Put(client::AddReport(&batch, "misaligned", 1), 1026, Bytes(s), 2,
                             kernels::ScoreDtype::kFloat32).ok());
  Reference(client::AddReport(&batch, "short", 1), id, 0, 164, 2);

  const v1::DecisionBatch reply = StepOnce(batch);
  ASSERT_EQ(reply.decisions_size(), 5);
  auto expect = [&](int i, int code, const std::vector<std::string>& texts) {
    const v1::Decision& d = reply.decisions(i);
    EXPECT_EQ(d.code(), code) << d.sequence_id() << ": " << d.message();
    for (const std::string& text : texts) {
      EXPECT_THAT(d.message(), HasSubstr(text)) << d.sequence_id();
    }
  };
  expect(0, kOk, {});
  expect(1, kInvalidArgument,
         {"sequence 'unknown' step 1",
          absl::StrCat("score region ", id + 1000, " offset 0 byte_size 168"),
          "no such region"});
  expect(2, kInvalidArgument,
         {"sequence 'past' step 1",
          absl::StrCat("score region ", id, " offset ", kRegionBytes - 64, " byte_size 168"),
          absl::StrCat(kRegionBytes, " mapped bytes")});
  expect(3, kInvalidArgument,
         {"sequence 'misaligned' step 1",
          absl::StrCat("score region ", id, " offset 1026 byte_size 168"),
          "not a multiple of 4 (float32)"});
  expect(4, kInvalidArgument, {"sequence 'short' step 1", "164 bytes"});
  for (const char* rejected : {"unknown", "past", "misaligned", "short"}) {
    EXPECT_EQ(Inspect(rejected).last_step(), 0) << rejected;
  }
  EXPECT_EQ(Inspect("good").last_step(), 1);
}

TEST_F(ScoreRegionTest, RegisterRefusesAnObjectOthersCanOpenOrOneTooSmall) {
  ShmObject readable(4096, 0644);
  absl::StatusOr<uint64_t> refused = Register(readable.name(), 4096);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr(readable.name()));
  EXPECT_THAT(refused.status().message(), HasSubstr("mode is 0644"));
  EXPECT_THAT(refused.status().message(), HasSubstr("0600"));

  ShmObject owned(4096, 0600);
  absl::StatusOr<uint64_t> too_small = Register(owned.name(), 8192);
  EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_small.status().message(), HasSubstr("4096 bytes, fewer than byte_size 8192"));
  absl::StatusOr<uint64_t> missing = Register("/kvcm-step-path-test-no-such-object", 4096);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("cannot open"));
  EXPECT_EQ(Register("no-slash", 4096).status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<uint64_t> ok = Register(owned.name(), 4096);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_NE(*ok, 0u);
}

TEST_F(ScoreRegionTest, AnObjectShrunkAfterRegisteringIsRefusedOnTheNextReference) {
  constexpr size_t kBytes = 65536;
  ShmObject object(kBytes, 0600);
  absl::StatusOr<uint64_t> region = Register(object.name(), kBytes);
  ASSERT_TRUE(region.ok()) << region.status();
  Open("s", 20, "inertia");
  const std::vector<float> s1 = Scores(2, 21, 1);
  object.Write(0, Bytes(s1));
  v1::StepBatch first;
  Reference(client::AddReport(&first, "s", 1), *region, 0, 168, 2);
  const v1::DecisionBatch one = StepOnce(first);
  ASSERT_EQ(one.decisions(0).code(), kOk) << one.decisions(0).message();
  const int64_t cache = one.decisions(0).cache_size();

  // Shrunk below the mapping, though the range named still lies inside the object: the
  // daemon would fault on the pages past the new end, so it refuses the region.
  const std::vector<float> s2 = Scores(2, cache + 1, 2);
  object.Write(0, Bytes(s2));
  object.Truncate(4096);
  v1::StepBatch second;
  Reference(client::AddReport(&second, "s", 2), *region, 0, s2.size() * sizeof(float), 2);
  const v1::DecisionBatch two = StepOnce(second);
  EXPECT_EQ(two.decisions(0).code(), kInvalidArgument);
  EXPECT_THAT(two.decisions(0).message(),
              HasSubstr(absl::StrCat("score region ", *region, " offset 0 byte_size ",
                                     s2.size() * sizeof(float))));
  EXPECT_THAT(two.decisions(0).message(), HasSubstr("shrank to 4096 bytes, below the 65536"));
  object.Truncate(0);
  const v1::DecisionBatch three = StepOnce(second);
  EXPECT_EQ(three.decisions(0).code(), kInvalidArgument);
  EXPECT_THAT(three.decisions(0).message(), HasSubstr("shrank to 0 bytes"));

  // The daemon lives on, the step did not happen, and inline scores still step it.
  EXPECT_EQ(Inspect("s").last_step(), 1);
  v1::StepBatch inline_batch;
  client::SetFloat32Scores(client::AddReport(&inline_batch, "s", 2), s2, 2);
  EXPECT_EQ(StepOnce(inline_batch).decisions(0).code(), kOk);
}

TEST_F(ScoreRegionTest, AnUnregisteredRegionIsUnknown) {
  ShmObject object(4096, 0600);
  absl::StatusOr<uint64_t> region = Register(object.name(), 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  Open("s", 20, "inertia");
  const std::vector<float> s = Scores(2, 21, 1);
  object.Write(0, Bytes(s));
  ASSERT_TRUE(Unregister(*region).ok());
  EXPECT_EQ(Unregister(*region).code(), absl::StatusCode::kNotFound);
  v1::StepBatch batch;
  Reference(client::AddReport(&batch, "s", 1), *region, 0, 168, 2);
  const v1::DecisionBatch reply = StepOnce(batch);
  EXPECT_EQ(reply.decisions(0).code(), kInvalidArgument);
  EXPECT_THAT(reply.decisions(0).message(),
              HasSubstr(absl::StrCat("score region ", *region,
                                     " offset 0 byte_size 168: no such region")));
  EXPECT_EQ(Inspect("s").last_step(), 0);
}

// Without tenants every caller is the same (empty) tenant: a region is keyed by its id
// alone and serves every connection. (Regions kept apart by tenant are the hardening
// issue's tests.)
TEST_F(ScoreRegionTest, ATenantlessDaemonServesARegionToEveryConnection) {
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::Create(*client_, 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  Open("s", 20, "inertia");
  std::unique_ptr<client::KvCacheClient> other = daemon_->Connect();
  ASSERT_NE(other, nullptr);
  auto stream = other->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  v1::StepBatch batch;
  ASSERT_TRUE((*region)->Put(client::AddReport(&batch, "s", 1), 0, Bytes(Scores(2, 21, 1)), 2,
                             kernels::ScoreDtype::kFloat32).ok());
  absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->decisions(0).code(), kOk) << reply->decisions(0).message();
}

// ---------------------------------------------------------------------------------------
// Score regions the daemon creates (CreateScoreRegion)

absl::StatusOr<v1::CreateScoreRegionResponse> CreateRegion(client::KvCacheClient& client,
                                                           uint64_t byte_size) {
  grpc::ClientContext context;
  v1::CreateScoreRegionRequest request;
  request.set_byte_size(byte_size);
  v1::CreateScoreRegionResponse response;
  RETURN_IF_ERROR(client::FromGrpc(client.stub().CreateScoreRegion(&context, request, &response)));
  return response;
}

bool ShmExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// A CPU engine's created region is the daemon's own shared-memory object: named for its
// pid, mode 0600, zero-filled, as large as asked; the worker maps it read-write, and a
// step by reference to it decides as the same scores inline. Unregistering removes it.
TEST_F(ScoreRegionTest, ACreatedRegionIsTheDaemonsSharedMemoryAndDecidesLikeInline) {
  absl::StatusOr<v1::CreateScoreRegionResponse> raw = CreateRegion(*client_, 12345);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_NE(raw->region(), 0u);
  EXPECT_EQ(raw->backend(), v1::KV_BACKEND_HOST);
  EXPECT_EQ(raw->bytes(), 12345);
  EXPECT_THAT(raw->shm_name(), ::testing::StartsWith(absl::StrCat("/kvcached-", daemon_->pid(),
                                                                  "-scores")));
  EXPECT_TRUE(raw->cuda_ipc_handle().empty());
  {
    const int fd = shm_open(raw->shm_name().c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    struct stat st {};
    ASSERT_EQ(fstat(fd, &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_GE(st.st_size, 12345);
    close(fd);
  }
  ASSERT_TRUE(Unregister(raw->region()).ok());
  EXPECT_FALSE(ShmExists(raw->shm_name())) << "the daemon frees what it created";
  EXPECT_EQ(Unregister(raw->region()).code(), absl::StatusCode::kNotFound);

  Open("inline", 64, "inertia");
  Open("created", 64, "inertia");
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::CreateInDaemon(*client_, 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::string name = (*region)->name();
  for (std::byte b : (*region)->bytes().subspan(0, 4096)) ASSERT_EQ(b, std::byte{0});
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  int64_t cache = 64;
  for (int64_t t = 1; t <= 6; ++t) {
    const std::vector<float> s = Scores(3, cache + 1, static_cast<uint64_t>(t));
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, "inline", t), s, 3);
    ASSERT_TRUE((*region)->Put(client::AddReport(&batch, "created", t), 8192 * t, Bytes(s), 3,
                               kernels::ScoreDtype::kFloat32).ok());
    absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_EQ(reply->decisions(0).code(), kOk) << reply->decisions(0).message();
    ASSERT_EQ(reply->decisions(1).code(), kOk) << reply->decisions(1).message();
    EXPECT_EQ(std::vector<int64_t>(reply->decisions(0).evicted().begin(),
                                   reply->decisions(0).evicted().end()),
              std::vector<int64_t>(reply->decisions(1).evicted().begin(),
                                   reply->decisions(1).evicted().end()))
        << "step " << t;
    cache = reply->decisions(0).cache_size();
  }
  const auto x = client_->Inspect("inline", true), y = client_->Inspect("created", true);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(std::vector<float>(x->momentum().begin(), x->momentum().end()),
            std::vector<float>(y->momentum().begin(), y->momentum().end()));
  region->reset();  // unregisters; the daemon unlinks
  EXPECT_FALSE(ShmExists(name));
}

// What a daemon creates is bounded: by --max_created_score_region_bytes (all created
// regions together) and --max_score_regions; a refusal says which limit, what is used and
// what is left, and creates nothing. A size of 0 or past the per-region limit is refused.
TEST_F(StepPathTest, CreatedRegionsStopAtTheirLimitsAndSayWhich) {
  StartDaemon({"--allow_shm_scores", "--max_created_score_region_bytes=65536",
               "--max_score_regions=3"});
  absl::StatusOr<v1::CreateScoreRegionResponse> a = CreateRegion(*client_, 40000);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_score_region_created_bytes") == 40000; },
      kWait, "the created region's bytes were counted"));
  absl::StatusOr<v1::CreateScoreRegionResponse> b = CreateRegion(*client_, 30000);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  EXPECT_THAT(b.status().message(), HasSubstr("--max_created_score_region_bytes"));
  EXPECT_THAT(b.status().message(), HasSubstr("30000"));
  EXPECT_THAT(b.status().message(), HasSubstr("25536"));  // left
  EXPECT_EQ(CreateRegion(*client_, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateRegion(*client_, uint64_t{1} << 62).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The refusals took nothing: exactly what was left still fits.
  absl::StatusOr<v1::CreateScoreRegionResponse> rest = CreateRegion(*client_, 25536);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(CreateRegion(*client_, 1).status().code(), absl::StatusCode::kResourceExhausted);

  ASSERT_TRUE(Unregister(a->region()).ok());
  ASSERT_TRUE(Unregister(rest->region()).ok());
  std::vector<uint64_t> made;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::CreateScoreRegionResponse> r = CreateRegion(*client_, 4096);
    ASSERT_TRUE(r.ok()) << r.status();
    made.push_back(r->region());
  }
  absl::StatusOr<v1::CreateScoreRegionResponse> fourth = CreateRegion(*client_, 4096);
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(fourth.status().message(), HasSubstr("--max_score_regions"));
  for (uint64_t r : made) EXPECT_TRUE(Unregister(r).ok());
  EXPECT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_score_region_created_bytes") == 0; }, kWait,
      "the unregistered regions' bytes were given back"));
  EXPECT_TRUE(CreateRegion(*client_, 65536).ok());
}

// A SIGKILLed kvcached cannot unlink what it created; the next one on the node removes
// it at start, as it removes a dead instance's KV pools.
TEST_F(StepPathTest, ASigkilledDaemonsCreatedRegionsAreRemovedByTheNextStart) {
  StartDaemon({"--allow_shm_scores"});
  absl::StatusOr<v1::CreateScoreRegionResponse> r = CreateRegion(*client_, 8192);
  ASSERT_TRUE(r.ok()) << r.status();
  client_.reset();
  EXPECT_EQ(daemon_->SignalAndWait(SIGKILL, absl::Seconds(30)), -1);
  ASSERT_TRUE(ShmExists(r->shm_name()));
  StartDaemon({"--allow_shm_scores"});
  EXPECT_FALSE(ShmExists(r->shm_name()));
  EXPECT_THAT(daemon_->Log(), HasSubstr(absl::StrCat("removed ", r->shm_name())));
}

// On a device engine (the emulated device here) a tensor-parallel step's partial sums in
// a created region are read in place when the last rank arrives, so the step holds the
// region until then: a worker that unregisters it early (breaking the ownership rule)
// cannot pull the memory from under the join. The step decides like the same scores
// inline, and the region is freed once the step is done.
TEST_F(StepPathTest, APendingTensorParallelStepHoldsItsCreatedRegionUntilItIsDecided) {
  StartDaemon({"--engine_backend=emulated", "--allow_shm_scores"});
  Open("by-ref", 30, "inertia", /*tp_world_size=*/2);
  Open("inline", 30, "inertia", /*tp_world_size=*/2);
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::CreateInDaemon(*client_, 1 << 16);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::string name = (*region)->name();
  const uint64_t id = (*region)->id();
  const std::vector<float> r0 = Scores(2, 31, 1), r1 = Scores(2, 31, 2);

  auto rank0 = client_->OpenStepStream();
  ASSERT_TRUE(rank0.ok());
  v1::StepBatch first;
  ASSERT_TRUE((*region)->Put(client::AddReport(&first, "by-ref", 1), 0, Bytes(r0), 2,
                             kernels::ScoreDtype::kFloat32, /*head_count=*/1).ok());
  client::SetFloat32Scores(client::AddReport(&first, "inline", 1), r0, 2, /*head_count=*/1);
  ASSERT_TRUE((*rank0)->Send(first).ok());
  // Counted once the daemon resolved the reference (and so holds the region).
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        return MetricValue(Metrics(),
                           R"(kvcache_score_bytes_total{dtype="float32",transport="shm"})") ==
               static_cast<double>(r0.size() * sizeof(float));
      },
      kWait, "rank 0's scores were read from the region"));
  ASSERT_TRUE(Unregister(id).ok());  // too early: rank 1 has not reported
  EXPECT_TRUE(ShmExists(name)) << "the pending step still holds the region";

  v1::StepBatch second;
  second.set_rank(1);
  client::SetFloat32Scores(client::AddReport(&second, "by-ref", 1), r1, 2, /*head_count=*/1);
  client::SetFloat32Scores(client::AddReport(&second, "inline", 1), r1, 2, /*head_count=*/1);
  const v1::DecisionBatch one = StepOnce(second);
  absl::StatusOr<v1::DecisionBatch> zero = (*rank0)->Receive();
  ASSERT_TRUE(zero.ok()) << zero.status();
  for (const v1::DecisionBatch* reply : {&one, static_cast<const v1::DecisionBatch*>(&*zero)}) {
    ASSERT_EQ(reply->decisions_size(), 2);
    ASSERT_EQ(reply->decisions(0).code(), kOk) << reply->decisions(0).message();
    ASSERT_EQ(reply->decisions(1).code(), kOk) << reply->decisions(1).message();
    EXPECT_EQ(std::vector<int64_t>(reply->decisions(0).evicted().begin(),
                                   reply->decisions(0).evicted().end()),
              std::vector<int64_t>(reply->decisions(1).evicted().begin(),
                                   reply->decisions(1).evicted().end()));
  }
  EXPECT_TRUE(testing::WaitFor([&] { return !ShmExists(name); }, kWait,
                               "the region was freed once the step was done"));
  region->reset();  // unmaps; its unregister finds nothing left, which it ignores
  const auto x = client_->Inspect("inline", true), y = client_->Inspect("by-ref", true);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(std::vector<float>(x->momentum().begin(), x->momentum().end()),
            std::vector<float>(y->momentum().begin(), y->momentum().end()));
}

// The emulated device engine creates its regions in host shared memory, so the client maps
// them as before, with or without CUDA in its build: no device pointer, the mapping as
// bytes(), and the stream overload of Put a plain copy that is done when it returns
// (WaitForWrites has nothing to wait for); the step by reference decides as inline.
TEST_F(StepPathTest, AnEmulatedEnginesCreatedRegionIsHostMemoryWhateverTheClientsBuild) {
  StartDaemon({"--engine_backend=emulated", "--allow_shm_scores"});
  Open("inline", 40, "inertia");
  Open("created", 40, "inertia");
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::CreateInDaemon(*client_, 1 << 16);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_FALSE((*region)->on_device());
  EXPECT_EQ((*region)->device(), -1);
  EXPECT_EQ((*region)->device_pointer(), nullptr);
  EXPECT_EQ(static_cast<int64_t>((*region)->bytes().size()), (*region)->size());
  EXPECT_THAT((*region)->name(), ::testing::StartsWith(absl::StrCat("/kvcached-", daemon_->pid(),
                                                                    "-scores")));
  const std::vector<float> s = Scores(2, 41, 1);
  v1::StepBatch batch;
  client::SetFloat32Scores(client::AddReport(&batch, "inline", 1), s, 2);
  constexpr int64_t kOffset = 1024;
  ASSERT_TRUE((*region)->Put(client::AddReport(&batch, "created", 1), kOffset, Bytes(s), 2,
                             kernels::ScoreDtype::kFloat32, /*head_count=*/0,
                             /*stream=*/nullptr).ok());
  ASSERT_EQ(std::memcmp((*region)->bytes().data() + kOffset, s.data(), s.size() * sizeof(float)),
            0)
      << "a host Put is done when it returns";
  EXPECT_TRUE((*region)->RecordWrites(nullptr).ok());
  EXPECT_TRUE((*region)->WaitForWrites().ok());
  const v1::DecisionBatch reply = StepOnce(batch);
  ASSERT_EQ(reply.decisions_size(), 2);
  ASSERT_EQ(reply.decisions(0).code(), kOk) << reply.decisions(0).message();
  ASSERT_EQ(reply.decisions(1).code(), kOk) << reply.decisions(1).message();
  EXPECT_EQ(Evicted(reply.decisions(0)), Evicted(reply.decisions(1)));
  EXPECT_FALSE(Evicted(reply.decisions(0)).empty()) << "half of 41 tokens kept: some evicted";
  const std::string name = (*region)->name();
  region->reset();
  EXPECT_FALSE(ShmExists(name)) << "unregistered, the daemon frees what it created";
}

// CreateScoreRegion's rank places a device engine's region on that rank's device: a rank
// outside the tensor-parallel world is refused, and a single-rank sequence, which decides
// on the engine's device, refuses scores that sit on another one (a tensor-parallel step's
// across devices is GoldenDeviceEngineTest's created_per_rank transport).
TEST_F(StepPathTest, ARegionsRankMustBeInTheWorldAndServesTensorParallelSteps) {
  StartDaemon({"--engine_backend=emulated", "--allow_shm_scores", "--max_tp_world_size=4"});
  for (int32_t rank : {4, -7}) {
    grpc::ClientContext context;
    v1::CreateScoreRegionRequest request;
    request.set_byte_size(4096);
    request.set_rank(rank);
    v1::CreateScoreRegionResponse response;
    const absl::Status refused =
        client::FromGrpc(client_->stub().CreateScoreRegion(&context, request, &response));
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << rank;
    EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat("rank is ", rank)));
    EXPECT_THAT(refused.message(), HasSubstr("--max_tp_world_size"));
  }
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> on_rank1 =
      client::ScoreRegion::CreateInDaemon(*client_, 1 << 16, /*rank=*/1);
  ASSERT_TRUE(on_rank1.ok()) << on_rank1.status();
  Open("single", 20, "inertia");
  v1::StepBatch batch;
  ASSERT_TRUE((*on_rank1)->Put(client::AddReport(&batch, "single", 1), 0, Bytes(Scores(2, 21, 1)),
                               2, kernels::ScoreDtype::kFloat32).ok());
  const v1::DecisionBatch reply = StepOnce(batch);
  EXPECT_EQ(reply.decisions(0).code(), kInvalidArgument);
  EXPECT_THAT(reply.decisions(0).message(), HasSubstr("on device 1"));
  EXPECT_THAT(reply.decisions(0).message(), HasSubstr("created without a rank"));
  EXPECT_EQ(Inspect("single").last_step(), 0);
}

TEST_F(StepPathTest, WithoutAllowShmScoresRegionsAndReferencesAreRefused) {
  StartDaemon({});
  ShmObject object(4096, 0600);
  absl::StatusOr<uint64_t> region = Register(object.name(), 4096);
  EXPECT_EQ(region.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(region.status().message(), HasSubstr("--allow_shm_scores"));
  EXPECT_EQ(client::ScoreRegion::Create(*client_, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::CreateScoreRegionResponse> created = CreateRegion(*client_, 4096);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(created.status().message(), HasSubstr("--allow_shm_scores"));

  Open("by-ref", 20, "inertia");
  Open("inline", 20, "inertia");
  const std::vector<float> s = Scores(2, 21, 1);
  v1::StepBatch batch;
  Reference(client::AddReport(&batch, "by-ref", 1), 1, 0, 168, 2);
  client::SetFloat32Scores(client::AddReport(&batch, "inline", 1), s, 2);
  const v1::DecisionBatch reply = StepOnce(batch);
  ASSERT_EQ(reply.decisions_size(), 2);
  EXPECT_EQ(reply.decisions(0).code(), kFailedPrecondition);
  EXPECT_THAT(reply.decisions(0).message(), HasSubstr("sequence 'by-ref' step 1"));
  EXPECT_THAT(reply.decisions(0).message(), HasSubstr("--allow_shm_scores"));
  EXPECT_EQ(reply.decisions(1).code(), kOk) << reply.decisions(1).message();
  EXPECT_EQ(Inspect("by-ref").last_step(), 0);
}

// ---------------------------------------------------------------------------------------
// Bounded memory

// What a stream that writes batches and never reads a reply achieved: how many writes
// went through before they stopped (or all did), and the daemon's largest VmRSS seen.
struct Flood {
  int written = 0;
  int64_t max_rss = 0;
};

// Writes `batches` copies of `batch` (batch ids 0, 1, ...) on a StepStream of a channel
// of its own (gRPC's default settings, its own connection) from a writer thread, never
// reading, until the writes stop going through for a second (or all went through; 30 s
// at most), sampling the daemon's VmRSS; then cancels the call.
Flood FloodWithoutReading(const DaemonProcess& daemon, v1::StepBatch batch, int batches) {
  grpc::ChannelArguments args;
  args.SetInt("kvcm.test.flood_channel", 1);  // distinct arguments: not the client's connection
  auto channel =
      grpc::CreateCustomChannel(daemon.grpc_address(), grpc::InsecureChannelCredentials(), args);
  auto stub = v1::KvCache::NewStub(channel);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepBatch, v1::DecisionBatch>> stream =
      stub->StepStream(&context);
  std::atomic<int> written{0};
  std::thread writer([&] {
    for (int i = 0; i < batches; ++i) {
      batch.set_batch_id(static_cast<uint64_t>(i));
      if (!stream->Write(batch)) return;
      written.fetch_add(1);
    }
  });
  Flood flood;
  flood.max_rss = ResidentBytes(daemon.pid());
  int last = -1;
  absl::Time last_progress = absl::Now();
  // A Write held back by flow control announces nothing, so that the writes stopped is
  // judged by a second without progress: the one timed judgement these tests keep (a
  // held-back stream stays held, so a longer wait would only see the same count).
  testing::PollUntil(
      [&] {
        flood.max_rss = std::max(flood.max_rss, ResidentBytes(daemon.pid()));
        const int now = written.load();
        if (now != last) {
          last = now;
          last_progress = absl::Now();
        }
        return now >= batches || absl::Now() - last_progress > absl::Seconds(1);
      },
      absl::Now() + absl::Seconds(30));
  flood.written = written.load();
  context.TryCancel();  // unblocks a Write held back by flow control
  writer.join();
  EXPECT_FALSE(stream->Finish().ok());
  flood.max_rss = std::max(flood.max_rss, ResidentBytes(daemon.pid()));
  // In the test's XML/JSON output, to see the margins on a given machine.
  ::testing::Test::RecordProperty("batches_written", flood.written);
  ::testing::Test::RecordProperty("max_daemon_rss_mib", static_cast<int>(flood.max_rss >> 20));
  return flood;
}

constexpr int kFloodBatches = 1000;
constexpr int64_t kRssLimit = int64_t{200} << 20;

// A stream that sends batches of a megabyte and never reads a reply, and whose first
// batch cannot be answered yet: its report is rank 0's of a tensor-parallel step that
// rank 1 has not sent. The batches after it (the same rank's report again, refused at
// once) are decided, but their replies wait behind the first one's. Once the stream's
// 4 slots (--max_inflight_batches) are taken the daemon stops reading it, and the
// client's writes block when the HTTP/2 windows are spent. What the daemon holds for the
// stream is bounded by the slots (4 requests of 1 MiB, plus rank 0's partial sums copied
// into the join) plus the stream receive window it grants (at most
// GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 MiB, server/daemon.cc) and its read buffers.
TEST_F(StepPathTest, AStreamThatNeverReadsIsHeldBackAndTheDaemonStaysSmall) {
  StartDaemon({"--max_inflight_batches=4"});
  constexpr int32_t kLayers = 4;
  constexpr int64_t kTokens = 65536;  // 4 x 65,536 x 4 bytes: 1 MiB per report
  Open("held", kTokens - 1, "inertia", /*tp_world_size=*/2);
  Open("other", 20, "inertia");
  v1::StepBatch batch;
  client::SetFloat32Scores(client::AddReport(&batch, "held", 1), Scores(kLayers, kTokens, 1),
                           kLayers, /*head_count=*/1);
  const Flood flood = FloodWithoutReading(*daemon_, batch, kFloodBatches);
  EXPECT_GE(flood.written, 4);  // the slots filled: the test did flood
  EXPECT_LT(flood.written, kFloodBatches / 2) << "no back-pressure: the daemon read every batch";
  EXPECT_GT(flood.max_rss, 0);
  EXPECT_LT(flood.max_rss, kRssLimit) << "max VmRSS " << (flood.max_rss >> 20) << " MiB";

  // The daemon serves everyone else; rank 1 completes the step the cancelled stream's
  // first batch still waits in.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_streams_open") == 0; }, kWait,
      "the cancelled flood stream was counted out"));
  v1::StepBatch rank1;
  rank1.set_rank(1);
  client::SetFloat32Scores(client::AddReport(&rank1, "held", 1), Scores(kLayers, kTokens, 2),
                           kLayers, /*head_count=*/1);
  const v1::DecisionBatch released = StepOnce(rank1);
  ASSERT_EQ(released.decisions_size(), 1);
  EXPECT_EQ(released.decisions(0).code(), kOk) << released.decisions(0).message();
  EXPECT_EQ(Inspect("held").last_step(), 1);
  v1::StepBatch other;
  client::SetFloat32Scores(client::AddReport(&other, "other", 1), Scores(1, 21, 1), 1);
  EXPECT_EQ(StepOnce(other).decisions(0).code(), kOk);
  EXPECT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_pending_join_bytes") == 0; }, kWait,
      "the pending partial sums were given back"));
  EXPECT_LT(ResidentBytes(daemon_->pid()), kRssLimit);
}

// The same flood for a sequence that is not open: every batch is refused at once and
// answered. The replies are half a kilobyte, and the client's HTTP/2 windows may well
// take all 1,000 of them (they then sit in the client, not in the daemon), so how many
// writes go through is not the point here: the daemon's memory is. It holds at most the
// 4 slots' requests and replies plus the stream's receive window.
TEST_F(StepPathTest, RepliesNobodyReadsDoNotGrowTheDaemon) {
  StartDaemon({"--max_inflight_batches=4"});
  Open("other", 20, "inertia");
  v1::StepBatch batch;
  v1::StepReport* report = client::AddReport(&batch, std::string(256, 'x'), 1);
  report->set_scores(std::string(size_t{1} << 20, '\0'));
  report->set_layers(1);
  const Flood flood = FloodWithoutReading(*daemon_, batch, kFloodBatches);
  std::printf("flood: %d batches written, daemon VmRSS peaked at %lld MiB\n",
              static_cast<int>(flood.written), static_cast<long long>(flood.max_rss >> 20));
  EXPECT_GT(flood.written, 4);
  EXPECT_GT(flood.max_rss, 0);
  EXPECT_LT(flood.max_rss, kRssLimit) << "max VmRSS " << (flood.max_rss >> 20) << " MiB";
  EXPECT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_streams_open") == 0; }, kWait,
      "the cancelled flood stream was counted out"));
  v1::StepBatch other;
  client::SetFloat32Scores(client::AddReport(&other, "other", 1), Scores(1, 21, 1), 1);
  EXPECT_EQ(StepOnce(other).decisions(0).code(), kOk);
  EXPECT_GE(MetricValue(Metrics(), R"(kvcache_errors_total{code="NOT_FOUND",rpc="StepStream"})"),
            4);
}

// Seven ranks of a world of eight each send ~8 MiB of partial sums for the same step;
// pending partials are capped at 24 MiB. The fourth report does not fit: it is refused,
// and with it the step on every rank; nothing stays held.
TEST_F(StepPathTest, ATensorParallelFloodIsRefusedOnEveryRankNotHeld) {
  constexpr int64_t kCap = int64_t{24} << 20;
  StartDaemon({absl::StrCat("--max_pending_join_bytes=", kCap)});
  constexpr int32_t kWorld = 8;
  constexpr int32_t kLayers = 32;
  constexpr int64_t kTokens = 65000;  // 32 x 65,000 x 4 bytes: 8,320,000 per rank
  constexpr int64_t kRankBytes = kLayers * kTokens * 4;
  static_assert(3 * kRankBytes <= kCap && 4 * kRankBytes > kCap);
  const v1::OpenSequenceRequest open = OpenRequestFor("tp8", kTokens - 1, "inertia", kWorld);
  ASSERT_TRUE(client_->Open(open).ok());
  std::vector<std::unique_ptr<client::StepStream>> ranks;
  for (int32_t r = 0; r < kWorld; ++r) {
    auto stream = client_->OpenStepStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    ranks.push_back(*std::move(stream));
  }
  const std::vector<float> partial = Scores(kLayers, kTokens, 7);
  const auto send = [&](int32_t rank, const std::vector<float>& sums, int32_t layers) {
    v1::StepBatch b;
    b.set_rank(rank);
    b.set_batch_id(static_cast<uint64_t>(rank));
    client::SetFloat32Scores(client::AddReport(&b, "tp8", 1), sums, layers, /*head_count=*/1);
    ASSERT_TRUE(ranks[static_cast<size_t>(rank)]->Send(b).ok());
  };
  const auto receive = [&](int32_t rank) {
    absl::StatusOr<v1::DecisionBatch> reply = ranks[static_cast<size_t>(rank)]->Receive();
    EXPECT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply.ok() ? reply->decisions_size() : 0, 1);
    return reply.ok() && reply->decisions_size() == 1 ? reply->decisions(0) : v1::Decision();
  };

  // Ranks 0 to 2 fit; each waits in the join before the next sends.
  for (int32_t r = 0; r < 3; ++r) {
    send(r, partial, kLayers);
    ASSERT_TRUE(testing::WaitFor([&] { return Inspect("tp8").ranks_reported() == r + 1; },
                                 kWait, "the report reached the join"))
        << "rank " << r;
  }
  ASSERT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_pending_join_bytes") == 3.0 * kRankBytes; },
      kWait, "the gauge showed the three pending partials"));
  send(3, partial, kLayers);
  const v1::Decision refused = receive(3);
  EXPECT_EQ(refused.code(), kResourceExhausted) << refused.message();
  EXPECT_THAT(refused.message(), HasSubstr("sequence 'tp8' step 1"));
  EXPECT_THAT(refused.message(), HasSubstr("--max_pending_join_bytes"));
  // The ranks that waited are told at once, those still to report when they do: all the
  // same code and message.
  for (int32_t r : {0, 1, 2}) {
    const v1::Decision d = receive(r);
    EXPECT_EQ(d.code(), refused.code()) << "rank " << r;
    EXPECT_EQ(d.message(), refused.message()) << "rank " << r;
  }
  for (int32_t r : {4, 5, 6, 7}) {
    send(r, partial, kLayers);
    const v1::Decision d = receive(r);
    EXPECT_EQ(d.code(), refused.code()) << "rank " << r;
    EXPECT_EQ(d.message(), refused.message()) << "rank " << r;
  }
  EXPECT_EQ(Inspect("tp8").last_step(), 0);
  EXPECT_EQ(Inspect("tp8").ranks_reported(), 0);
  EXPECT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_pending_join_bytes") == 0; }, kWait,
      "the refused step's partial sums were given back"));

  // The step sent again with a fold of the rows (one row each: 8 x 260 KB fit) goes
  // through on all eight ranks, identically, and evicts what the engine alone evicts
  // given the joined row (eight equal partial sums of one head each: the row itself).
  const std::vector<float> small = Scores(1, kTokens, 8);
  for (int32_t r = 0; r < kWorld; ++r) send(r, small, 1);
  const v1::Decision first = receive(0);
  ASSERT_EQ(first.code(), kOk) << first.message();
  EXPECT_EQ(first.cache_size(), Inspect("tp8").budget());
  EXPECT_EQ(Evicted(first), EvictedAlone(open, small, 1));
  for (int32_t r = 1; r < kWorld; ++r) {
    EXPECT_EQ(receive(r).SerializeAsString(), first.SerializeAsString()) << "rank " << r;
  }
  EXPECT_EQ(Inspect("tp8").last_step(), 1);
}

// ---------------------------------------------------------------------------------------
// Tensor-parallel rejection and batch order

TEST_F(StepPathTest, ARejectedRankRejectsTheStepOnEveryRankWithTheSameStatus) {
  StartDaemon({});
  const v1::OpenSequenceRequest open = OpenRequestFor("tp", 40, "inertia", 2);
  ASSERT_TRUE(client_->Open(open).ok());
  auto rank0 = client_->OpenStepStream();
  auto rank1 = client_->OpenStepStream();
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  const std::vector<float> valid = Scores(2, 41, 1);
  std::vector<float> negative = Scores(2, 41, 2);
  negative[45] = -1.0f;  // layer 1, score 4
  const auto batch = [](int32_t rank, const std::vector<float>& sums) {
    v1::StepBatch b;
    b.set_rank(rank);
    client::SetFloat32Scores(client::AddReport(&b, "tp", 1), sums, 2, /*head_count=*/1);
    return b;
  };
  ASSERT_TRUE((*rank0)->Send(batch(0, valid)).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return Inspect("tp").ranks_reported() == 1; }, kWait,
                               "rank 0's report reached the join"));
  ASSERT_TRUE((*rank1)->Send(batch(1, negative)).ok());
  absl::StatusOr<v1::DecisionBatch> d0 = (*rank0)->Receive();
  absl::StatusOr<v1::DecisionBatch> d1 = (*rank1)->Receive();
  ASSERT_TRUE(d0.ok() && d1.ok());
  EXPECT_EQ(d1->decisions(0).code(), kInvalidArgument) << d1->decisions(0).message();
  EXPECT_THAT(d1->decisions(0).message(), HasSubstr("sequence 'tp' step 1"));
  EXPECT_THAT(d1->decisions(0).message(), HasSubstr("-1"));
  EXPECT_EQ(d0->decisions(0).code(), d1->decisions(0).code());
  EXPECT_EQ(d0->decisions(0).message(), d1->decisions(0).message());
  EXPECT_EQ(Inspect("tp").last_step(), 0);
  EXPECT_EQ(Inspect("tp").ranks_reported(), 0);

  // Both send the step again, valid: it is decided, the same on both, and as the engine
  // alone decides given the joined rows (two equal partial sums of one head each: `valid`).
  ASSERT_TRUE((*rank1)->Send(batch(1, valid)).ok());
  ASSERT_TRUE((*rank0)->Send(batch(0, valid)).ok());
  d0 = (*rank0)->Receive();
  d1 = (*rank1)->Receive();
  ASSERT_TRUE(d0.ok() && d1.ok());
  ASSERT_EQ(d0->decisions(0).code(), kOk) << d0->decisions(0).message();
  EXPECT_EQ(d0->decisions(0).cache_size(), 20);
  EXPECT_EQ(Evicted(d0->decisions(0)), EvictedAlone(open, valid, 2));
  EXPECT_EQ(d0->decisions(0).SerializeAsString(), d1->decisions(0).SerializeAsString());
  EXPECT_EQ(Inspect("tp").last_step(), 1);
}

TEST_F(StepPathTest, RepliesAreWrittenInBatchOrder) {
  StartDaemon({});
  Open("tp", 40, "streaming_llm", 2);
  Open("solo", 40, "streaming_llm");
  auto rank0 = client_->OpenStepStream();
  auto rank1 = client_->OpenStepStream();
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  v1::StepBatch a, b, a1;
  a.set_batch_id(1);
  client::AddReport(&a, "tp", 1);  // waits for rank 1
  b.set_batch_id(2);
  client::AddReport(&b, "solo", 1);  // decided at once
  a1.set_rank(1);
  a1.set_batch_id(7);
  client::AddReport(&a1, "tp", 1);
  ASSERT_TRUE((*rank0)->Send(a).ok());
  ASSERT_TRUE((*rank0)->Send(b).ok());
  // B is decided while A still waits: its reply is ready first, and must wait for A's.
  ASSERT_TRUE(testing::WaitFor([&] { return Inspect("solo").last_step() == 1; }, kWait,
                               "batch B was decided"));
  EXPECT_EQ(Inspect("tp").ranks_reported(), 1);
  ASSERT_TRUE((*rank1)->Send(a1).ok());
  absl::StatusOr<v1::DecisionBatch> first = (*rank0)->Receive();
  absl::StatusOr<v1::DecisionBatch> second = (*rank0)->Receive();
  absl::StatusOr<v1::DecisionBatch> other = (*rank1)->Receive();
  ASSERT_TRUE(first.ok() && second.ok() && other.ok());
  EXPECT_EQ(first->batch_id(), 1u);
  EXPECT_EQ(first->decisions(0).sequence_id(), "tp");
  EXPECT_EQ(second->batch_id(), 2u);
  EXPECT_EQ(second->decisions(0).sequence_id(), "solo");
  EXPECT_EQ(other->batch_id(), 7u);
  EXPECT_EQ(first->decisions(0).code(), kOk) << first->decisions(0).message();
  EXPECT_EQ(second->decisions(0).code(), kOk) << second->decisions(0).message();
  EXPECT_EQ(first->decisions(0).SerializeAsString(), other->decisions(0).SerializeAsString());
}

}  // namespace
}  // namespace kvcm

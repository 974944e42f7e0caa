// TLS, mTLS, bearer tokens and tenants against a real kvcached, with certificates the
// openssl command makes for the test (a CA, a server certificate for 127.0.0.1 and
// localhost, a client certificate from the CA and one from another CA).
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/kvcache_client.h"
#include "clients/cpp/score_region.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/server/daemon_process.h"
#include "tests/server/daemon_test.h"
#include "server/auth.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;
using ::kvcm::testing::HttpGet;
using ::kvcm::testing::MetricValue;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;
using ::testing::Not;

// The certificates, made once for the whole suite.
class Certificates {
 public:
  static const Certificates& Get() {
    static const Certificates* certs = new Certificates();
    return *certs;
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  bool ok() const { return ok_; }

 private:
  Certificates() {
    char pattern[] = "/tmp/kvcached_tls_XXXXXX";
    dir_ = mkdtemp(pattern);
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    std::ofstream(Path("server.ext")) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    const std::string script = absl::StrCat(
        "cd ", dir_, " && set -e; ",
        "for ca in ca other-ca; do openssl req -x509 ", key, " -keyout $ca.key -out $ca.pem ",
        "-days 2 -subj /CN=$ca; done; ",
        "openssl req ", key, " -keyout server.key -out server.csr -subj /CN=localhost; ",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial ",
        "-out server.pem -days 2 -extfile server.ext; ",
        "openssl req ", key, " -keyout client.key -out client.csr -subj /CN=worker; ",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial ",
        "-out client.pem -days 2; ",
        "openssl req ", key, " -keyout stranger.key -out stranger.csr -subj /CN=stranger; ",
        "openssl x509 -req -in stranger.csr -CA other-ca.pem -CAkey other-ca.key ",
        "-CAcreateserial -out stranger.pem -days 2; ",
        "echo not a certificate > garbage.pem");
    ok_ = std::system(("(" + script + ") >/dev/null 2>&1").c_str()) == 0;
  }
  std::string dir_;
  bool ok_ = false;
};

// The daemon's self-probe period in these tests.
constexpr absl::Duration kProbeInterval = absl::Milliseconds(200);

std::vector<std::string> TlsFlags(bool mtls) {
  const Certificates& c = Certificates::Get();
  std::vector<std::string> flags = {
      "--tls_cert_file=" + c.Path("server.pem"), "--tls_key_file=" + c.Path("server.key"),
      "--listener_probe_interval=" + absl::FormatDuration(kProbeInterval)};
  if (mtls) flags.push_back("--tls_client_ca_file=" + c.Path("ca.pem"));
  return flags;
}

// The daemon's self-probes so far that got an answer (`ok`) or not, from its /metrics.
double SelfProbes(const DaemonProcess& daemon, bool ok) {
  absl::StatusOr<std::string> text = HttpGet(daemon.metrics_address(), "/metrics");
  if (!text.ok()) return -1;
  return MetricValue(*text, ok ? "kvcache_listener_probes_total{result=\"ok\"}"
                               : "kvcache_listener_probes_total{result=\"failed\"}");
}

// Waits until the daemon's self-probe has been answered five times, then checks that none
// failed: the probe speaks the listener's protocol (a probe that does not fails at once).
void ExpectTheSelfProbeAnswered(const DaemonProcess& daemon) {
  EXPECT_TRUE(WaitFor([&] { return SelfProbes(daemon, /*ok=*/true) >= 5; }, absl::Seconds(30),
                      "five answered self-probes"));
  EXPECT_EQ(SelfProbes(daemon, /*ok=*/false), 0);
}

// A client of `daemon` with these TLS files ("" for none) and token.
absl::StatusOr<std::unique_ptr<client::KvCacheClient>> ConnectTo(
    const DaemonProcess& daemon, const std::string& ca, const std::string& cert = "",
    const std::string& token = "") {
  const Certificates& c = Certificates::Get();
  client::ClientOptions options;
  options.address = daemon.grpc_address();
  options.connect_timeout = absl::Seconds(3);
  if (!ca.empty()) options.tls_ca_file = c.Path(ca);
  if (!cert.empty()) {
    options.tls_cert_file = c.Path(cert + ".pem");
    options.tls_key_file = c.Path(cert + ".key");
  }
  options.auth_token = token;
  return client::KvCacheClient::Connect(options);
}

// The health of `service` over `channel`; NOT_SERVING-ish values as strings for messages.
grpc::health::v1::HealthCheckResponse::ServingStatus Health(
    const std::shared_ptr<grpc::Channel>& channel) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  if (!health->Check(&context, request, &response).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return response.status();
}

std::shared_ptr<grpc::Channel> TlsChannel(const DaemonProcess& daemon, bool with_cert) {
  const Certificates& c = Certificates::Get();
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = read(c.Path("ca.pem"));
  if (with_cert) {
    ssl.pem_cert_chain = read(c.Path("client.pem"));
    ssl.pem_private_key = read(c.Path("client.key"));
  }
  return grpc::CreateChannel(daemon.grpc_address(), grpc::SslCredentials(ssl));
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Certificates::Get().ok()) << "openssl could not make the test certificates";
  }
};

TEST_F(TlsTest, ATlsDaemonServesTlsClientsRefusesPlaintextAndStaysServing) {
  auto daemon = DaemonProcess::Start(TlsFlags(/*mtls=*/false));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto tls = ConnectTo(**daemon, "ca.pem");
  ASSERT_TRUE(tls.ok()) << tls.status();
  ASSERT_TRUE((*tls)->Open(client::OpenRequest("s", 16, 0.5, "tova")).ok());
  auto plain = ConnectTo(**daemon, "");
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable);
  // The self-probe speaks TLS: health stays SERVING.
  ExpectTheSelfProbeAnswered(**daemon);
  EXPECT_EQ(Health(TlsChannel(**daemon, false)), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_THAT((*daemon)->Log(), Not(HasSubstr("NOT_SERVING")));
}

TEST_F(TlsTest, MutualTlsRefusesClientsWithoutACertificateOrWithAnotherCasAndStaysServing) {
  auto daemon = DaemonProcess::Start(TlsFlags(/*mtls=*/true));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto good = ConnectTo(**daemon, "ca.pem", "client");
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->List().ok());
  auto no_cert = ConnectTo(**daemon, "ca.pem");
  if (no_cert.ok()) {  // TLS 1.3: the refusal may come with the first call
    EXPECT_EQ((*no_cert)->List().status().code(), absl::StatusCode::kUnavailable);
  }
  auto stranger = ConnectTo(**daemon, "ca.pem", "stranger");
  if (stranger.ok()) {
    EXPECT_EQ((*stranger)->List().status().code(), absl::StatusCode::kUnavailable);
  }
  ExpectTheSelfProbeAnswered(**daemon);
  EXPECT_EQ(Health(TlsChannel(**daemon, true)), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_THAT((*daemon)->Log(), Not(HasSubstr("NOT_SERVING")));
}

TEST_F(TlsTest, TlsFilesThatAreMissingOrNotPemRefuseStartNamingFlagAndFile) {
  const Certificates& c = Certificates::Get();
  auto missing = DaemonProcess::Start(
      {"--tls_cert_file=" + c.Path("nope.pem"), "--tls_key_file=" + c.Path("server.key")});
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(),
              HasSubstr("--tls_cert_file " + c.Path("nope.pem") + ": cannot be read"));
  auto garbage = DaemonProcess::Start(
      {"--tls_cert_file=" + c.Path("server.pem"), "--tls_key_file=" + c.Path("garbage.pem")});
  ASSERT_FALSE(garbage.ok());
  EXPECT_THAT(garbage.status().message(),
              HasSubstr("--tls_key_file " + c.Path("garbage.pem") + ": holds no PEM private key"));
  auto ca = DaemonProcess::Start({"--tls_cert_file=" + c.Path("server.pem"),
                                  "--tls_key_file=" + c.Path("server.key"),
                                  "--tls_client_ca_file=" + c.Path("garbage.pem")});
  ASSERT_FALSE(ca.ok());
  EXPECT_THAT(ca.status().message(), HasSubstr("--tls_client_ca_file " + c.Path("garbage.pem") +
                                               ": holds no PEM certificate"));
  auto half = DaemonProcess::Start({"--tls_cert_file=" + c.Path("server.pem")});
  ASSERT_FALSE(half.ok());
  EXPECT_THAT(half.status().message(), HasSubstr("--tls_cert_file and --tls_key_file go together"));
}

// --- bearer tokens and tenants ------------------------------------------------------

class TenantTest : public TlsTest {
 protected:
  void WriteTokens(const std::string& text) {
    std::ofstream(tokens_path_, std::ios::trunc) << text;
  }
  void StartDaemon(std::vector<std::string> flags = {}) {
    flags.push_back("--auth_tokens_file=" + tokens_path_);
    auto d = DaemonProcess::Start(flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }
  std::unique_ptr<client::KvCacheClient> As(const std::string& token) {
    auto c = ConnectTo(*daemon_, "", "", token);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::string tokens_path_ = Certificates::Get().Path(
      absl::StrCat("tokens-", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  std::unique_ptr<DaemonProcess> daemon_;
};

constexpr char kTwoTenants[] = "# test tokens\n\ntoken-a a\ntoken-b   b\n";

TEST_F(TenantTest, CallsWithoutAKnownTokenAreUnauthenticatedAndHealthStaysOpen) {
  WriteTokens(kTwoTenants);
  StartDaemon();
  for (const std::string token : {"", "token-c", "token-a2"}) {
    std::unique_ptr<client::KvCacheClient> c = As(token);
    ASSERT_NE(c, nullptr);
    for (const absl::Status& s :
         {c->Open(client::OpenRequest("s", 16, 0.5, "tova")).status(), c->List().status(),
          c->Inspect("s", false).status(), c->Close("s").status(),
          c->Step(v1::StepBatch()).status()}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << token << ": " << s;
      EXPECT_THAT(s.message(), Not(HasSubstr("token-")));
    }
    auto stream = c->OpenStepStream();
    ASSERT_TRUE(stream.ok());
    EXPECT_EQ((*stream)->Step(v1::StepBatch()).status().code(),
              absl::StatusCode::kUnauthenticated);
    {
      grpc::ClientContext context;
      v1::DescribeKvPoolsResponse pools;
      EXPECT_EQ(c->stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools)
                    .error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext context;
      v1::UnregisterScoreRegionResponse unregistered;
      EXPECT_EQ(c->stub()
                    .UnregisterScoreRegion(&context, v1::UnregisterScoreRegionRequest(),
                                           &unregistered)
                    .error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext context;
      v1::CreateScoreRegionRequest request;
      request.set_byte_size(4096);
      v1::CreateScoreRegionResponse created;
      EXPECT_EQ(c->stub().CreateScoreRegion(&context, request, &created).error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext context;
      auto reader = c->stub().WatchKvEvents(&context, v1::WatchKvEventsRequest());
      v1::KvEvent event;
      EXPECT_FALSE(reader->Read(&event));
      EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    }
  }
  EXPECT_EQ(Health(grpc::CreateChannel(daemon_->grpc_address(),
                                       grpc::InsecureChannelCredentials())),
            grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_THAT(daemon_->Log(), Not(HasSubstr("token-a")));
}

TEST_F(TenantTest, AnotherTenantsSequenceIsNotFoundOnEveryRpcLikeAnUnknownId) {
  WriteTokens(kTwoTenants);
  StartDaemon();
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  ASSERT_TRUE(a->Open(client::OpenRequest("s1", 16, 0.5, "tova")).ok());
  v1::OpenSequenceRequest tp = client::OpenRequest("tp", 16, 0.5, "tova");
  tp.set_tp_world_size(2);
  ASSERT_TRUE(a->Open(tp).ok());
  const std::string unknown = "sequence 's1' is not open";
  // Exactly what an id nobody opened gets: no existence oracle.
  const absl::Status never = b->Inspect("s1", false).status();
  EXPECT_EQ(never.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(never.message(), unknown);
  EXPECT_EQ(b->Close("s1").status().message(), unknown);
  v1::StepBatch batch;
  client::AddReport(&batch, "s1", 1);
  auto stepped = b->Step(batch);
  ASSERT_TRUE(stepped.ok());
  EXPECT_EQ(stepped->decisions(0).code(), static_cast<int32_t>(absl::StatusCode::kNotFound));
  EXPECT_EQ(stepped->decisions(0).message(), unknown);
  auto stream = b->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  auto streamed = (*stream)->Step(batch);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->decisions(0).message(), unknown);
  v1::StepBatch rank1;
  rank1.set_rank(1);
  client::AddReport(&rank1, "tp", 1);
  auto tp_report = b->Step(rank1);
  ASSERT_TRUE(tp_report.ok());
  EXPECT_EQ(tp_report->decisions(0).message(), "sequence 'tp' is not open");
  EXPECT_TRUE(b->List()->empty());
  EXPECT_EQ(a->List()->size(), 2u);
  // The same id in tenant b is another sequence; a's is untouched.
  ASSERT_TRUE(b->Open(client::OpenRequest("s1", 32, 0.5, "tova")).ok());
  EXPECT_EQ(b->Inspect("s1", false)->prefill_len(), 32);
  EXPECT_EQ(a->Inspect("s1", false)->prefill_len(), 16);
  ASSERT_TRUE(b->Close("s1").ok());
  EXPECT_TRUE(a->Inspect("s1", false).ok());
}

// A snapshot keeps each sequence's tenant: after a SIGTERM and restart with --state_dir,
// each tenant finds its own sequences, the same id stays two sequences, and another
// tenant still gets NOT_FOUND.
TEST_F(TenantTest, SequencesKeepTheirTenantAcrossARestart) {
  WriteTokens(kTwoTenants);
  const std::string state_dir = Certificates::Get().Path("state-tenants");
  std::filesystem::remove_all(state_dir);
  std::filesystem::create_directories(state_dir);
  const std::vector<std::string> flags = {"--state_dir=" + state_dir};
  StartDaemon(flags);
  {
    std::unique_ptr<client::KvCacheClient> a = As("token-a");
    std::unique_ptr<client::KvCacheClient> b = As("token-b");
    ASSERT_TRUE(a->Open(client::OpenRequest("same", 16, 0.5, "tova")).ok());
    ASSERT_TRUE(a->Open(client::OpenRequest("only-a", 16, 0.5, "tova")).ok());
    ASSERT_TRUE(b->Open(client::OpenRequest("same", 32, 0.5, "h2o")).ok());
  }
  ASSERT_EQ(daemon_->SignalAndWait(SIGTERM, absl::Seconds(20)), 0) << daemon_->Log();
  StartDaemon(flags);
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  absl::StatusOr<v1::SequenceState> a_same = a->Inspect("same", false);
  absl::StatusOr<v1::SequenceState> b_same = b->Inspect("same", false);
  ASSERT_TRUE(a_same.ok()) << a_same.status() << daemon_->Log();
  ASSERT_TRUE(b_same.ok()) << b_same.status();
  EXPECT_EQ(a_same->prefill_len(), 16);
  EXPECT_EQ(b_same->prefill_len(), 32);
  EXPECT_EQ(b->Inspect("only-a", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(a->Inspect("only-a", false).ok());
  std::filesystem::remove_all(state_dir);
}

// For a region a registered, and for one the daemon created for a.
TEST_F(TenantTest, AnotherTenantsScoreRegionIsNotRegisteredForIt) {
  WriteTokens(kTwoTenants);
  StartDaemon({"--allow_shm_scores"});
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  ASSERT_TRUE(b->Open(client::OpenRequest("s", 4, 0.5, "tova")).ok());
  for (bool created : {false, true}) {
    SCOPED_TRACE(created ? "created by the daemon" : "registered");
    auto region = created ? client::ScoreRegion::CreateInDaemon(*a, 4096)
                          : client::ScoreRegion::Create(*a, 4096);
    ASSERT_TRUE(region.ok()) << region.status();
    // b names a's region in a report: refused as a region b never registered.
    v1::StepBatch batch;
    (*region)->Reference(client::AddReport(&batch, "s", 1), 0, 20, 1,
                         kernels::ScoreDtype::kFloat32);
    auto stepped = b->Step(batch);
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    EXPECT_EQ(stepped->decisions(0).code(),
              static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(stepped->decisions(0).message(),
                HasSubstr(absl::StrCat("score region ", (*region)->id(),
                                       " offset 0 byte_size 20: no such region is registered")));
    grpc::ClientContext context;
    v1::UnregisterScoreRegionRequest request;
    request.set_region((*region)->id());
    v1::UnregisterScoreRegionResponse response;
    const grpc::Status unregistered = b->stub().UnregisterScoreRegion(&context, request, &response);
    EXPECT_EQ(unregistered.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(unregistered.error_message(),
              absl::StrCat("score region ", (*region)->id(), " is not registered"));
  }
}

// Reads events until (and including) the first whose sequence id is `until`.
std::vector<v1::KvEvent> ReadUntil(grpc::ClientReader<v1::KvEvent>& reader,
                                   const std::string& until) {
  std::vector<v1::KvEvent> events;
  v1::KvEvent event;
  while (reader.Read(&event)) {
    events.push_back(event);
    if (event.sequence_id() == until) break;
  }
  return events;
}

TEST_F(TenantTest, KvEventSubscribersSeeOnlyTheirTenantsSequences) {
  WriteTokens(kTwoTenants);
  StartDaemon();
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  ASSERT_TRUE(a->Open(client::OpenRequest("a-before", 16, 0.5, "tova")).ok());
  ASSERT_TRUE(b->Open(client::OpenRequest("b-before", 16, 0.5, "tova")).ok());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  auto reader = b->stub().WatchKvEvents(&context, v1::WatchKvEventsRequest());
  ASSERT_TRUE(a->Open(client::OpenRequest("a-after", 16, 0.5, "tova")).ok()) << daemon_->Log();
  auto b_after = b->Open(client::OpenRequest("b-after", 16, 0.5, "tova"));
  ASSERT_TRUE(b_after.ok()) << b_after.status() << daemon_->Log();
  std::vector<v1::KvEvent> events = ReadUntil(*reader, "b-after");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().sequence_id(), "b-after");
  bool saw_snapshot_of_b = false;
  for (const v1::KvEvent& e : events) {
    EXPECT_THAT(e.sequence_id(), Not(HasSubstr("a-"))) << e.DebugString();
    if (e.has_snapshot() && e.sequence_id() == "b-before") saw_snapshot_of_b = true;
  }
  EXPECT_TRUE(saw_snapshot_of_b);
  context.TryCancel();
}

TEST_F(TenantTest, SighupAddsAndRemovesTokensAndKeepsThemWhenTheFileDoesNotParse) {
  WriteTokens("token-a a\n");
  StartDaemon();
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  EXPECT_EQ(b->List().status().code(), absl::StatusCode::kUnauthenticated);
  // streaming_llm steps without scores.
  ASSERT_TRUE(a->Open(client::OpenRequest("s", 16, 0.5, "streaming_llm")).ok());
  auto a_stream = a->OpenStepStream();
  ASSERT_TRUE(a_stream.ok());
  v1::StepBatch batch;
  client::AddReport(&batch, "s", 1);
  auto first = (*a_stream)->Step(batch);  // the stream is authenticated now
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->decisions(0).code(), 0) << first->decisions(0).message();

  WriteTokens("token-b b\n");
  kill(daemon_->pid(), SIGHUP);
  ASSERT_TRUE(testing::WaitFor([&] { return b->List().ok(); }, absl::Seconds(10),
                               "SIGHUP's reload let token-b in"));
  // From the next call on, the removed token is refused...
  EXPECT_EQ(a->List().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(a->OpenStepStream().value()->Step(batch).status().code(),
            absl::StatusCode::kUnauthenticated);
  // ...while a stream it opened before the reload keeps its tenant until it ends.
  v1::StepBatch next;
  client::AddReport(&next, "s", 2);
  auto still = (*a_stream)->Step(next);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(still->decisions(0).code(), 0) << still->decisions(0).message();

  WriteTokens("token-b b\nsecret-in-a-bad-line\n");
  kill(daemon_->pid(), SIGHUP);
  EXPECT_TRUE(testing::WaitFor(
      [&] { return absl::StrContains(daemon_->Log(), "kept the tokens in force"); },
      absl::Seconds(10), "SIGHUP's reload of a bad file logged that it kept the tokens"))
      << daemon_->Log();
  EXPECT_THAT(daemon_->Log(), HasSubstr("line 2"));
  EXPECT_THAT(daemon_->Log(), Not(HasSubstr("secret-in-a-bad-line")));
  EXPECT_TRUE(b->List().ok());
}

TEST_F(TenantTest, AMalformedTokensFileRefusesStartNamingTheLineNotTheToken) {
  WriteTokens("# ok\ntoken-a a\nsecret-alone\n");
  auto d = DaemonProcess::Start({"--auth_tokens_file=" + tokens_path_});
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr(tokens_path_ + ": line 3"));
  EXPECT_THAT(d.status().message(), Not(HasSubstr("secret-alone")));
}

TEST_F(TenantTest, PerTenantSequenceLimitHoldsAtItsEdge) {
  WriteTokens(kTwoTenants);
  StartDaemon({"--tenant_max_sequences=2"});
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  ASSERT_TRUE(a->Open(client::OpenRequest("1", 16, 0.5, "tova")).ok());
  ASSERT_TRUE(a->Open(client::OpenRequest("2", 16, 0.5, "tova")).ok());
  const absl::Status refused = a->Open(client::OpenRequest("3", 16, 0.5, "tova")).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(),
              HasSubstr("tenant 'a' already holds its maximum of 2 sequences "
                        "(--tenant_max_sequences): 1 asked, 0 left"));
  EXPECT_EQ(a->List()->size(), 2u);  // the refused open changed nothing
  ASSERT_TRUE(b->Open(client::OpenRequest("1", 16, 0.5, "tova")).ok());
  ASSERT_TRUE(b->Open(client::OpenRequest("2", 16, 0.5, "tova")).ok());
  ASSERT_TRUE(a->Close("1").ok());
  EXPECT_TRUE(a->Open(client::OpenRequest("3", 16, 0.5, "tova")).ok());
}

TEST_F(TenantTest, PerTenantMemoryShareHoldsAtItsByteExactly) {
  WriteTokens(kTwoTenants);
  // Half of 64 KiB per tenant: 32768 bytes, a prefill of 1023 tokens (32 bytes per token
  // of capacity, prefill + 1).
  StartDaemon({"--memory_limit_bytes=65536", "--tenant_memory_share=0.5"});
  std::unique_ptr<client::KvCacheClient> a = As("token-a");
  std::unique_ptr<client::KvCacheClient> b = As("token-b");
  ASSERT_TRUE(a->Open(client::OpenRequest("full", 1023, 0.5, "tova")).ok());
  const absl::Status refused = a->Open(client::OpenRequest("more", 1, 0.5, "tova")).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(),
              HasSubstr("64 bytes asked, 32768 of tenant 'a''s 32768 bytes in use, 0 left "
                        "(--tenant_memory_share)"));
  EXPECT_EQ(a->List()->size(), 1u);
  ASSERT_TRUE(b->Open(client::OpenRequest("full", 1023, 0.5, "tova")).ok());
}

// Runs `command` (stderr with stdout); its exit status and output.
std::pair<int, std::string> RunCommand(const std::string& command) {
  std::string output;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, ""};
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// kvcache-replay, kvcache-loadgen and kvcache-events against a daemon with mTLS and bearer
// tokens: with their TLS and token flags they run; without the token they fail
// UNAUTHENTICATED.
TEST_F(TenantTest, ReplayAndLoadgenRunOverMutualTlsWithATokenFile) {
  const Certificates& c = Certificates::Get();
  WriteTokens(kTwoTenants);
  StartDaemon(TlsFlags(/*mtls=*/true));
  const std::string token_file = c.Path("token-b.txt");
  std::ofstream(token_file) << "token-b\n";
  // The certificate names 127.0.0.1 and localhost: "localhost" checks the name override.
  const std::string tls = absl::StrCat(
      " --server=", daemon_->grpc_address(), " --tls_ca_file=", c.Path("ca.pem"),
      " --tls_cert_file=", c.Path("client.pem"), " --tls_key_file=", c.Path("client.key"),
      " --tls_server_name=localhost");
  const std::string replay = absl::StrCat(
      KVCM_BIN_DIR, "/kvcache-replay --trace=", KVCM_TEST_DATA_DIR,
      "/golden/ema_lazy4.trace.jsonl --summary", tls);
  auto [replay_rc, replay_out] = RunCommand(replay + " --auth_token_file=" + token_file);
  EXPECT_EQ(replay_rc, 0) << replay_out;
  auto [refused_rc, refused_out] = RunCommand(replay);
  EXPECT_NE(refused_rc, 0) << refused_out;
  EXPECT_THAT(refused_out, HasSubstr("bearer token"));
  const std::string loadgen = absl::StrCat(
      KVCM_BIN_DIR, "/kvcache-loadgen --sequences=2 --streams=1 --layers=2 --context=64 "
      "--policy=inertia --duration=200ms --embedded=false", tls);
  auto [loadgen_rc, loadgen_out] = RunCommand(loadgen + " --auth_token_file=" + token_file);
  EXPECT_EQ(loadgen_rc, 0) << loadgen_out;
  auto [missing_rc, missing_out] = RunCommand(loadgen + " --auth_token_file=" + c.Path("nope"));
  EXPECT_EQ(missing_rc, 2) << missing_out;
  EXPECT_THAT(missing_out, HasSubstr("auth token file " + c.Path("nope") + ": cannot be read"));
  // The events of tenant b: its replay's sequence is closed, so a snapshot of nothing.
  const std::string events = absl::StrCat(KVCM_BIN_DIR, "/kvcache-events --max_events=2", tls);
  auto [events_rc, events_out] = RunCommand(events + " --auth_token_file=" + token_file);
  EXPECT_EQ(events_rc, 0) << events_out;
  EXPECT_THAT(events_out, HasSubstr("\"kind\":\"resync\""));
  EXPECT_THAT(events_out, HasSubstr("\"kind\":\"snapshot_done\""));
  auto [unauth_rc, unauth_out] = RunCommand(events);
  EXPECT_NE(unauth_rc, 0) << unauth_out;
  EXPECT_THAT(unauth_out, HasSubstr("UNAUTHENTICATED"));
}

TEST(UnixSocketTest, TheSocketIsMode0660AndAnUnknownGroupRefusesStart) {
  char pattern[] = "/tmp/kvcached_unix_XXXXXX";
  const std::string dir = mkdtemp(pattern);
  const std::string path = dir + "/kvcached.sock";
  auto daemon = DaemonProcess::Start({"--listen=unix:" + path});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  struct stat st{};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  auto c = (*daemon)->Connect();
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(c->List().ok());
  group* mine = getgrgid(getgid());
  ASSERT_NE(mine, nullptr);
  const std::string group_name = mine->gr_name;
  daemon->reset();
  auto grouped = DaemonProcess::Start({"--listen=unix:" + path, "--listen_group=" + group_name});
  ASSERT_TRUE(grouped.ok()) << grouped.status();
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, getgid());
  grouped->reset();
  auto unknown = DaemonProcess::Start({"--listen=unix:" + path,
                                       "--listen_group=no-such-group-kvcm"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("--listen_group no-such-group-kvcm: no such group"));
  std::filesystem::remove_all(dir);
}

TEST_F(TlsTest, AUnixSocketSpeaksTlsTooAndItsProbeStaysServing) {
  char pattern[] = "/tmp/kvcached_unix_XXXXXX";
  const std::string dir = mkdtemp(pattern);
  std::vector<std::string> flags = TlsFlags(/*mtls=*/true);
  flags.push_back("--listen=unix:" + dir + "/kvcached.sock");
  auto daemon = DaemonProcess::Start(flags);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const Certificates& c = Certificates::Get();
  client::ClientOptions options;
  options.address = (*daemon)->grpc_address();
  options.connect_timeout = absl::Seconds(3);
  options.tls_ca_file = c.Path("ca.pem");
  options.tls_cert_file = c.Path("client.pem");
  options.tls_key_file = c.Path("client.key");
  options.tls_server_name = "localhost";  // a unix: target names no host
  auto tls = client::KvCacheClient::Connect(options);
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_TRUE((*tls)->List().ok());
  EXPECT_EQ(ConnectTo(**daemon, "").status().code(), absl::StatusCode::kUnavailable);
  ExpectTheSelfProbeAnswered(**daemon);
  EXPECT_THAT((*daemon)->Log(), Not(HasSubstr("NOT_SERVING")));
  daemon->reset();
  std::filesystem::remove_all(dir);
}

// Peers by certificate (--peer_ca_file): the target imports over TLS, checks the source's
// server certificate against the peers' CA and presents its own as its client certificate,
// which the source finds issued by that CA; a caller without one is no peer.
TEST_F(TlsTest, APeerCertificateHandsASequenceOffOverTls) {
  const Certificates& c = Certificates::Get();
  std::vector<std::string> flags = TlsFlags(/*mtls=*/false);
  flags.push_back("--peer_ca_file=" + c.Path("ca.pem"));
  auto source = DaemonProcess::Start(flags);
  auto target = DaemonProcess::Start(flags);
  ASSERT_TRUE(source.ok() && target.ok());
  auto at_source = ConnectTo(**source, "ca.pem");
  auto at_target = ConnectTo(**target, "ca.pem");
  ASSERT_TRUE(at_source.ok() && at_target.ok());
  v1::OpenSequenceRequest open = client::OpenRequest("s", 40, -1, "inertia");
  open.set_budget_tokens(8);
  ASSERT_TRUE((*at_source)->Open(open).ok());
  // A worker without a certificate is no peer.
  {
    auto peer = v1::KvPeer::NewStub(TlsChannel(**source, /*with_cert=*/false));
    grpc::ClientContext context;
    v1::ExportSequenceRequest request;
    request.set_sequence_id("s");
    v1::ExportSequenceResponse response;
    EXPECT_EQ(peer->ExportSequence(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  absl::StatusOr<v1::ImportSequenceResponse> imported =
      (*at_target)->ImportSequence("s", (*source)->grpc_address());
  ASSERT_TRUE(imported.ok()) << imported.status() << (*target)->Log();
  EXPECT_EQ(imported->state().cache_size(), 40);
  EXPECT_EQ((*at_source)->Inspect("s", false).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*at_target)->Inspect("s", false).ok());
}

TEST(AuthTokensTest, APeerRoleIsTheOptionalThirdField) {
  absl::StatusOr<server::TokenSet> tokens =
      server::ParseTokens("tok-a alice\n# a comment\ntok-p peers peer\n", "tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_FALSE((*tokens)[0].peer);
  EXPECT_TRUE((*tokens)[1].peer);
  server::BearerTokens known(*tokens);
  EXPECT_TRUE(known.HasPeer());
  EXPECT_TRUE(known.Find("Bearer tok-p")->peer);
  EXPECT_EQ(*known.TenantOf("Bearer tok-a"), "alice");
  const absl::Status admin = server::ParseTokens("tok-a alice admin\n", "tokens").status();
  EXPECT_THAT(admin.message(), HasSubstr("line 1: the third field, when given, must be the role 'peer'"));
  EXPECT_THAT(server::ParseTokens("a b peer d\n", "tokens").status().message(),
              HasSubstr("found 4 field(s)"));
}

}  // namespace
}  // namespace kvcm

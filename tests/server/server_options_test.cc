// ServerOptions::Validate and the flag parsers: the defaults pass, and every check refuses
// a bad value with INVALID_ARGUMENT naming the flag and the value.
#include "server/server_options.h"

#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::server {
namespace {

using ::testing::HasSubstr;

TEST(ServerOptionsTest, DefaultsPass) {
  EXPECT_TRUE(ServerOptions().Validate().ok()) << ServerOptions().Validate();
}

struct BadValue {
  std::string flag;   // what the message must name
  std::string value;  // and the value it must quote
  std::function<void(ServerOptions&)> set;
};

std::vector<BadValue> BadValues() {
  return {
      {"--max_sequences", "0", [](ServerOptions& o) { o.max_sequences = 0; }},
      {"--max_streams", "0", [](ServerOptions& o) { o.max_streams = 0; }},
      {"--max_tp_world_size", "0", [](ServerOptions& o) { o.max_tp_world_size = 0; }},
      {"--max_message_bytes", "1023", [](ServerOptions& o) { o.max_message_bytes = 1023; }},
      {"--max_message_bytes", "2147483648",
       [](ServerOptions& o) { o.max_message_bytes = int64_t{1} << 31; }},
      {"--max_sequence_tokens", "0", [](ServerOptions& o) { o.max_sequence_tokens = 0; }},
      {"--max_sequence_tokens", "1099511627777",
       [](ServerOptions& o) { o.max_sequence_tokens = (int64_t{1} << 40) + 1; }},
      {"--memory_limit_bytes", "0", [](ServerOptions& o) { o.memory_limit_bytes = 0; }},
      {"--max_connections", "-1", [](ServerOptions& o) { o.max_connections = -1; }},
      {"--tenant_max_sequences", "-1", [](ServerOptions& o) { o.tenant_max_sequences = -1; }},
      {"--tenant_memory_share", "0", [](ServerOptions& o) { o.tenant_memory_share = 0; }},
      {"--tenant_memory_share", "1.5", [](ServerOptions& o) { o.tenant_memory_share = 1.5; }},
      {"--engine_threads", "-1", [](ServerOptions& o) { o.engine_threads = -1; }},
      {"--engine_threads", "1025", [](ServerOptions& o) { o.engine_threads = 1025; }},
      {"--max_inflight_batches", "0", [](ServerOptions& o) { o.max_inflight_batches = 0; }},
      {"--max_inflight_batches", "1025", [](ServerOptions& o) { o.max_inflight_batches = 1025; }},
      {"--max_pending_join_bytes", "-1",
       [](ServerOptions& o) { o.max_pending_join_bytes = -1; }},
      {"--max_score_regions", "0", [](ServerOptions& o) { o.max_score_regions = 0; }},
      {"--max_created_score_region_bytes", "-1",
       [](ServerOptions& o) { o.max_created_score_region_bytes = -1; }},
      {"--kv_events_ring", "-1", [](ServerOptions& o) { o.kv_events_ring = -1; }},
      {"--kv_events_ring", "16777217",
       [](ServerOptions& o) { o.kv_events_ring = (int64_t{1} << 24) + 1; }},
      {"--kv_events_max_subscribers", "0",
       [](ServerOptions& o) { o.kv_events_max_subscribers = 0; }},
      {"--diagnostics_every", "-1", [](ServerOptions& o) { o.diagnostics_every = -1; }},
      {"--diagnostics_sample", "1.5", [](ServerOptions& o) { o.diagnostics_sample = 1.5; }},
      {"--diagnostics_sample", "-0.5", [](ServerOptions& o) { o.diagnostics_sample = -0.5; }},
      {"--stream_idle_timeout", "-1s",
       [](ServerOptions& o) { o.stream_idle_timeout = absl::Seconds(-1); }},
      {"--listener_probe_interval", "-2s",
       [](ServerOptions& o) { o.listener_probe_interval = absl::Seconds(-2); }},
      {"--listener_probe_timeout", "0",
       [](ServerOptions& o) { o.listener_probe_timeout = absl::ZeroDuration(); }},
      {"--kv_transfer", "'tcp'", [](ServerOptions& o) { o.kv_transfer = "tcp"; }},
      {"--max_import_bytes_in_flight", "0",
       [](ServerOptions& o) { o.max_import_bytes_in_flight = 0; }},
      {"--import_threads", "0", [](ServerOptions& o) { o.import_threads = 0; }},
      {"--import_threads", "65", [](ServerOptions& o) { o.import_threads = 65; }},
      {"--max_queued_imports", "-1", [](ServerOptions& o) { o.max_queued_imports = -1; }},
      {"--import_timeout", "0",
       [](ServerOptions& o) { o.import_timeout = absl::ZeroDuration(); }},
      {"--max_exports", "0", [](ServerOptions& o) { o.max_exports = 0; }},
      {"--export_lease", "-1s", [](ServerOptions& o) { o.export_lease = absl::Seconds(-1); }},
  };
}

TEST(ServerOptionsTest, EveryBadValueIsRefusedNamingFlagAndValue) {
  for (const BadValue& bad : BadValues()) {
    ServerOptions options;
    bad.set(options);
    const absl::Status refused = options.Validate();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << bad.flag;
    EXPECT_THAT(refused.message(), HasSubstr(bad.flag + " is " + bad.value + ";")) << refused;
  }
}

TEST(ServerOptionsTest, BoundsThemselvesPass) {
  ServerOptions options;
  options.max_message_bytes = 1024;
  options.engine_threads = 1024;
  options.max_inflight_batches = 1;
  options.kv_events_ring = 0;
  options.diagnostics_sample = 1;
  options.tenant_memory_share = 1;
  options.stream_idle_timeout = absl::ZeroDuration();
  options.listener_probe_interval = absl::ZeroDuration();
  options.max_sequence_tokens = int64_t{1} << 40;
  EXPECT_TRUE(options.Validate().ok()) << options.Validate();
}

// survival_test.cc's refusal at start reads this wording.
TEST(ServerOptionsTest, NegativeIntervalsKeepTheirRule) {
  ServerOptions options;
  options.stream_idle_timeout = absl::Seconds(-1);
  EXPECT_THAT(options.Validate().message(),
              HasSubstr("--stream_idle_timeout and --listener_probe_interval must be >= 0"));
}

TEST(ServerOptionsTest, StateDirRefusesPoolsThatDieWithTheProcess) {
  ServerOptions options;
  options.state_dir = "state";
  options.pool_memory_bytes = 1 << 20;
  options.kv_shared_memory = false;
  EXPECT_THAT(options.Validate().message(),
              HasSubstr("--state_dir needs host KV pools in shared memory"));
  options.pool_memory_bytes = 0;  // no pools: nothing to re-attach
  EXPECT_TRUE(options.Validate().ok());
}

TEST(ServerOptionsTest, ListenGroupNeedsAUnixListen) {
  ServerOptions options;
  options.listen_group = "kvcache";
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(options.Validate().message(), HasSubstr("--listen_group"));
  options.listen = "unix:/tmp/kvcached.sock";
  EXPECT_TRUE(options.Validate().ok()) << options.Validate();
}

TEST(ServerOptionsTest, PeerCaNeedsTls) {
  ServerOptions options;
  options.peer_ca_file = "peers.pem";
  EXPECT_THAT(options.Validate().message(), HasSubstr("--peer_ca_file needs TLS"));
}

TEST(ServerOptionsTest, HealthListenRefusesAUnixAddress) {
  ServerOptions options;
  options.health_listen = "unix:/tmp/health.sock";
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(options.Validate().message(), HasSubstr("--health_listen=unix:/tmp/health.sock"));
}

TEST(ServerOptionsTest, FlagNamesParseAndUnknownOnesAreRefused) {
  EXPECT_EQ(*KvBackendFromFlag("host"), KvBackend::kHost);
  EXPECT_EQ(*KvBackendFromFlag("cuda"), KvBackend::kCuda);
  EXPECT_EQ(*EngineBackendFromFlag("emulated"), EngineBackend::kEmulated);
  EXPECT_EQ(*EngineBackendFromFlag("auto"), EngineBackend::kAuto);
  EXPECT_EQ(*KvDtypeFromFlag("bfloat16"), kernels::KvDtype::kBFloat16);
  const absl::Status backend = KvBackendFromFlag("disk").status();
  EXPECT_EQ(backend.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.message(), HasSubstr("--backend is 'disk'; it must be host or cuda"));
  EXPECT_THAT(EngineBackendFromFlag("tpu").status().message(),
              HasSubstr("--engine_backend is 'tpu'; it must be auto, cpu, cuda or emulated"));
  EXPECT_THAT(KvDtypeFromFlag("int8").status().message(),
              HasSubstr("--kv_dtype is 'int8'; it must be float16, bfloat16 or float32"));
}

TEST(ServerOptionsTest, AutoEngineFollowsThePools) {
  ServerOptions options;
  EXPECT_EQ(options.ResolvedEngineBackend(), EngineBackend::kCpu);
  options.backend = KvBackend::kCuda;
  EXPECT_EQ(options.ResolvedEngineBackend(), EngineBackend::kCuda);
  options.engine_backend = EngineBackend::kEmulated;
  EXPECT_EQ(options.ResolvedEngineBackend(), EngineBackend::kEmulated);
}

}  // namespace
}  // namespace kvcm::server

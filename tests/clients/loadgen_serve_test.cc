// kvcache-loadgen --serve (clients/loadgen/serve.h) against real kvcached on loopback with
// a small KV pool: admission never leases past the pool and no admitted sequence's step is
// refused, every request finishes, admission follows arrival order, eviction serves more
// sequences at once than the full cache, and the hand-off between two daemons does too.
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "clients/loadgen/serve.h"
#include "tests/server/daemon_process.h"

namespace kvcm {
namespace {

using ::kvcm::loadgen::ServeOptions;
using ::kvcm::loadgen::ServeResult;
using ::kvcm::testing::DaemonProcess;
using ::testing::HasSubstr;

constexpr int64_t kBlocks = 96;
constexpr int64_t kBlockBytes = 16 * 2 * 8 * 2;  // 16 tokens, K and V, head dim 8, f16
constexpr int64_t kRequests = 36;

// A host pool of kBlocks 16-token blocks: the full cache holds about five of the prompts
// below (64..512 tokens, 16 generated).
std::vector<std::string> PoolFlags() {
  return {"--backend=host",      "--pool_memory_bytes=" + std::to_string(kBlocks * kBlockBytes),
          "--kv_layers=1",       "--kv_heads=1",
          "--kv_head_dim=8",     "--kv_tokens_per_block=16",
          "--kv_dtype=float16",  "--kv_transfer=grpc",
          "--allow_shm_scores"};
}

ServeOptions SmallRun(const std::string& server, const std::string& configs) {
  ServeOptions o;
  o.server = server;
  o.configs = *loadgen::ParseServeConfigs(configs);
  o.requests = kRequests;
  o.arrival_rate = 2000;  // all queued at once: the pool, not the arrivals, bounds the run
  o.prompt_min = 64;
  o.prompt_max = 512;
  o.generate = 16;
  o.streams = 2;
  o.layers = 4;
  o.model_step = absl::Milliseconds(1);
  return o;
}

// What every configuration must show, whatever its policy.
void ExpectServedWithinThePool(const ServeResult& r) {
  SCOPED_TRACE(r.config);
  EXPECT_EQ(r.capacity_blocks, kBlocks);
  EXPECT_EQ(r.requests_arrived, kRequests);
  EXPECT_EQ(r.requests_admitted, kRequests);
  EXPECT_EQ(r.requests_finished, kRequests);
  EXPECT_LE(r.max_reserved_blocks, r.capacity_blocks);
  EXPECT_LE(r.max_used_blocks, r.capacity_blocks);
  EXPECT_GT(r.max_used_blocks, 0);
  // The daemon's pool never held more than the ledger admitted against.
  EXPECT_LE(r.max_used_over_reserved, 0);
  EXPECT_TRUE(r.pool_bound);
  EXPECT_GT(r.held + r.refused, 0);
  std::vector<int64_t> arrival_order(kRequests);
  std::iota(arrival_order.begin(), arrival_order.end(), 0);
  EXPECT_EQ(r.admission_order, arrival_order);
  EXPECT_EQ(r.inline_reports, 0);
  EXPECT_FALSE(r.occupancy.empty());
  EXPECT_GT(r.tokens_per_second, 0);
}

TEST(LoadgenServeTest, EvictionServesMoreSequencesAtOnceThanTheFullCacheWithinThePool) {
  auto daemon = DaemonProcess::Start(PoolFlags());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto results = loadgen::RunServe(SmallRun((*daemon)->grpc_address(), "full,inertia@0.9"));
  ASSERT_TRUE(results.ok()) << results.status() << "\n" << (*daemon)->Log();
  ASSERT_EQ(results->size(), 2u);
  const ServeResult& full = (*results)[0];
  const ServeResult& evicting = (*results)[1];
  ExpectServedWithinThePool(full);
  ExpectServedWithinThePool(evicting);
  // The full cache never gives a block back before a close: a sequence's blocks per
  // cached token stay near 1; eviction keeps a tenth of each prompt.
  EXPECT_GT(evicting.decoding_mean, 2 * full.decoding_mean)
      << loadgen::FormatServeTable(*results);
  EXPECT_GT(evicting.decoding_max, full.decoding_max);
  const std::string json = loadgen::ServeJson(SmallRun("x", "full,inertia@0.9"), *results);
  EXPECT_THAT(json, HasSubstr("\"config\": \"inertia@0.9\""));
  EXPECT_THAT(json, HasSubstr("\"occupancy\": [["));
}

TEST(LoadgenServeTest, HandOffFeedsTheDecodeNodeWithinItsPool) {
  auto prefill = DaemonProcess::Start(PoolFlags());
  auto decode = DaemonProcess::Start(PoolFlags());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE(decode.ok()) << decode.status();
  ServeOptions o = SmallRun((*decode)->grpc_address(), "full,handoff@0.9");
  o.prefill_server = (*prefill)->grpc_address();
  o.prefill_peer = (*prefill)->grpc_address();
  auto results = loadgen::RunServe(o);
  ASSERT_TRUE(results.ok()) << results.status() << "\n" << (*decode)->Log();
  ExpectServedWithinThePool((*results)[0]);
  ExpectServedWithinThePool((*results)[1]);
  // The decode node never holds a prompt: only the budgets' blocks.
  EXPECT_GT((*results)[1].decoding_mean, 2 * (*results)[0].decoding_mean)
      << loadgen::FormatServeTable(*results);
}

// With --serve_duration admission stops while requests still queue, some of them already
// prefilled at the prefill node: the run closes those too (it checks that both pools are
// empty at its end, and fails otherwise).
TEST(LoadgenServeTest, ADurationRunLeavesBothPoolsEmptyWithRequestsStillQueued) {
  auto prefill = DaemonProcess::Start(PoolFlags());
  auto decode = DaemonProcess::Start(PoolFlags());
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE(decode.ok()) << decode.status();
  ServeOptions o = SmallRun((*decode)->grpc_address(), "handoff@0.9,inertia_lazy4@0.8");
  o.prefill_server = (*prefill)->grpc_address();
  o.prefill_peer = (*prefill)->grpc_address();
  o.duration = absl::Milliseconds(300);
  auto results = loadgen::RunServe(o);
  ASSERT_TRUE(results.ok()) << results.status() << "\n" << (*decode)->Log();
  for (const ServeResult& r : *results) {
    SCOPED_TRACE(r.config);
    EXPECT_GT(r.requests_arrived, r.requests_admitted);
    EXPECT_GT(r.requests_admitted, 0);
    EXPECT_EQ(r.requests_finished, r.requests_admitted);
    EXPECT_LE(r.max_used_over_reserved, 0);
  }
}

TEST(LoadgenServeTest, RefusesARequestThePoolCanNeverHoldNamingIt) {
  auto daemon = DaemonProcess::Start(PoolFlags());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ServeOptions o = SmallRun((*daemon)->grpc_address(), "full");
  o.prompt_min = o.prompt_max = kBlocks * 16;  // one block short for the generated tokens
  auto results = loadgen::RunServe(o);
  EXPECT_EQ(results.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(results.status().message(), HasSubstr("--prompt_max"));
}

TEST(LoadgenServeTest, ConfigurationsParseAndBadOnesNameTheEntry) {
  auto all = loadgen::ParseServeConfigs("all");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 11u);
  EXPECT_TRUE(all->front().full);
  EXPECT_TRUE(all->back().handoff);
  EXPECT_EQ(all->back().preset, "inertia");
  auto one = loadgen::ParseServeConfigs("handoff:score_free@0.8");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)[0].preset, "score_free");
  EXPECT_DOUBLE_EQ((*one)[0].rho, 0.8);
  for (const char* bad : {"inertia", "inertia@1.5", "@0.9", "handoffx@0.9", "inertia@x"}) {
    auto parsed = loadgen::ParseServeConfigs(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(parsed.status().message(), HasSubstr(bad)) << bad;
  }
  ServeOptions o;
  o.configs = *loadgen::ParseServeConfigs("handoff@0.9");
  o.server = "127.0.0.1:1";
  EXPECT_THAT(loadgen::RunServe(o).status().message(), HasSubstr("--prefill_server"));
}

}  // namespace
}  // namespace kvcm

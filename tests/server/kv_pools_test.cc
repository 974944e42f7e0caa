// kvcached with KV pools in POSIX shared memory. The test plays the worker: it maps each
// rank's pool, writes every token's K and V where the daemon says, and checks after every
// step (compaction included) that each cached token's bytes are where its slot says; and
// that the capacity metrics (docs/METRICS.md) follow the pools: tokens cached, tokens a
// block, requests refused for lack of blocks.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/server/daemon_process.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;
using ::kvcm::testing::HttpGet;
using ::kvcm::testing::MetricValue;

constexpr int64_t kTokensPerBlock = 4, kLayers = 2, kHeads = 1, kHeadDim = 4;
constexpr int64_t kTokenBytes = kHeads * kHeadDim * 2;  // float16
constexpr int64_t kBlockBytes = kTokensPerBlock * 2 * kLayers * kTokenBytes;

// The block layout of kernels/kv_compaction.h: [blocks][layers][K, V][tokens][heads][dim].
int64_t Offset(int64_t slot, int64_t layer, int64_t kv) {
  const int64_t block = slot / kTokensPerBlock, token = slot % kTokensPerBlock;
  return (((block * kLayers + layer) * 2 + kv) * kTokensPerBlock + token) * kTokenBytes;
}

uint16_t Pattern(int64_t position, int64_t layer, int64_t kv) {
  return static_cast<uint16_t>(position * 4 + layer * 2 + kv + 1);
}

class Mapping {
 public:
  Mapping(const std::string& name, int64_t bytes) : bytes_(bytes) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0) << name;
    data_ = static_cast<uint8_t*>(mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                                       MAP_SHARED, fd, 0));
    close(fd);
    EXPECT_NE(data_, MAP_FAILED);
  }
  ~Mapping() { munmap(data_, static_cast<size_t>(bytes_)); }

  void Write(int64_t slot, int64_t position) {
    for (int64_t l = 0; l < kLayers; ++l) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        const uint16_t v = Pattern(position, l, kv);
        for (int64_t e = 0; e < kHeads * kHeadDim; ++e) {
          std::memcpy(data_ + Offset(slot, l, kv) + e * 2, &v, 2);
        }
      }
    }
  }
  bool Holds(int64_t slot, int64_t position) const {
    for (int64_t l = 0; l < kLayers; ++l) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        uint16_t v;
        std::memcpy(&v, data_ + Offset(slot, l, kv), 2);
        if (v != Pattern(position, l, kv)) return false;
      }
    }
    return true;
  }

 private:
  uint8_t* data_;
  int64_t bytes_;
};

// Every rank's pool caches `cache` tokens (the open sequences' cache sizes, summed) in
// blocks of kTokensPerBlock.
void ExpectCachedOnEveryRank(const std::string& metrics, int64_t cache, int ranks) {
  for (int rank = 0; rank < ranks; ++rank) {
    const std::string labels = absl::StrCat(R"({backend="host",rank=")", rank, R"("})");
    EXPECT_EQ(MetricValue(metrics, "kvcache_pool_cached_tokens" + labels), cache) << rank;
    EXPECT_EQ(MetricValue(metrics, "kvcache_pool_block_tokens" + labels), kTokensPerBlock);
  }
}

TEST(KvPoolsDaemonTest, TheWorkersKvFollowsEveryDecisionThroughCompaction) {
  const int64_t capacity = 64;
  auto daemon = DaemonProcess::Start(
      {"--backend=host", "--tp_ranks=2", "--pool_memory_bytes=" + std::to_string(capacity * kBlockBytes),
       "--kv_layers=2", "--kv_heads=1", "--kv_head_dim=4", "--kv_tokens_per_block=4",
       "--kv_dtype=float16"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto client = (*daemon)->Connect();

  grpc::ClientContext context;
  v1::DescribeKvPoolsResponse pools;
  ASSERT_TRUE(client->stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools).ok());
  ASSERT_EQ(pools.pools_size(), 2);
  std::vector<std::unique_ptr<Mapping>> maps;
  for (const v1::KvPool& p : pools.pools()) {
    EXPECT_EQ(p.backend(), v1::KV_BACKEND_HOST);
    EXPECT_EQ(p.block_bytes(), kBlockBytes);
    EXPECT_EQ(p.capacity_blocks(), capacity);
    EXPECT_EQ(p.used_blocks(), 0);
    ASSERT_FALSE(p.shm_name().empty());
    maps.push_back(std::make_unique<Mapping>(p.shm_name(), p.bytes()));
  }

  // The prefill: write every token where the daemon placed it.
  constexpr int64_t kPrefill = 60;
  v1::OpenSequenceRequest open = client::OpenRequest("s", kPrefill, 0, "inertia");
  open.set_budget_tokens(10);
  open.set_tp_world_size(2);
  ASSERT_TRUE(client->Open(open).ok());
  auto state = client->Inspect("s", /*include_cache=*/true);
  ASSERT_TRUE(state.ok());
  ASSERT_EQ(state->kv_slots_size(), 2);
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < kPrefill; ++i) maps[r]->Write(state->kv_slots(r).slots(i), i);
  }

  auto rank0 = client->OpenStepStream();
  auto rank1 = client->OpenStepStream();
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  std::mt19937_64 rng(5);
  int64_t cache = kPrefill;
  int compactions = 0;
  for (int64_t t = 1; t <= 40; ++t) {
    std::vector<float> scores(static_cast<size_t>(2 * (cache + 1)));
    for (float& s : scores) s = std::uniform_real_distribution<float>(0, 1)(rng);
    v1::StepBatch b0, b1;
    b1.set_rank(1);
    client::SetFloat32Scores(client::AddReport(&b0, "s", t), scores, 2, 1);
    client::SetFloat32Scores(client::AddReport(&b1, "s", t), scores, 2, 1);
    ASSERT_TRUE((*rank0)->Send(b0).ok());
    ASSERT_TRUE((*rank1)->Send(b1).ok());
    auto d0 = (*rank0)->Receive();
    auto d1 = (*rank1)->Receive();
    ASSERT_TRUE(d0.ok() && d1.ok());
    const v1::Decision& d = d0->decisions(0);
    ASSERT_EQ(d.code(), 0) << d.message();
    ASSERT_EQ(d.kv_changes_size(), 2);
    EXPECT_EQ(d.SerializeAsString(), d1->decisions(0).SerializeAsString());
    const int64_t new_position = kPrefill + t - 1;
    for (int r = 0; r < 2; ++r) {
      const v1::KvChange& change = d.kv_changes(r);
      compactions += change.moved_from_size() > 0 ? 1 : 0;
      const bool evicted_itself =
          !d.evicted().empty() && d.evicted(d.evicted_size() - 1) == new_position;
      EXPECT_EQ(change.new_token_slot() < 0, evicted_itself);
      if (change.new_token_slot() >= 0) maps[r]->Write(change.new_token_slot(), new_position);
    }
    cache = d.cache_size();
    // Every cached token's K and V is where the daemon's slot table says.
    auto after = client->Inspect("s", true);
    ASSERT_TRUE(after.ok());
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(after->kv_slots(r).slots_size(), after->positions_size());
      for (int i = 0; i < after->positions_size(); ++i) {
        ASSERT_TRUE(maps[r]->Holds(after->kv_slots(r).slots(i), after->positions(i)))
            << "step " << t << " rank " << r << " position " << after->positions(i);
      }
    }
  }
  EXPECT_GE(compactions, 2);  // step 1 compacts on both ranks
  const std::string metrics = *HttpGet((*daemon)->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_pool_capacity_blocks{backend="host",rank="1"})"), 64);
  EXPECT_LE(MetricValue(metrics, R"(kvcache_pool_used_blocks{backend="host",rank="0"})"), 4);
  EXPECT_GE(MetricValue(metrics, R"(kvcache_pool_used_blocks{backend="host",rank="0"})"), 3);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_pool_block_bytes{backend="host",rank="0"})"), kBlockBytes);
  ExpectCachedOnEveryRank(metrics, cache, 2);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_pool_refused_total{rpc="OpenSequence"})"), 0);

  // A pool too small for a prefill: RESOURCE_EXHAUSTED, nothing opened, counted once.
  v1::OpenSequenceRequest huge = client::OpenRequest("huge", 10000, 0.9, "inertia");
  EXPECT_EQ(client->Open(huge).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client->List()->size(), 1u);
  const std::string refused = *HttpGet((*daemon)->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(refused, R"(kvcache_pool_refused_total{rpc="OpenSequence"})"), 1);
  ExpectCachedOnEveryRank(refused, cache, 2);
  EXPECT_TRUE((*rank0)->Close().ok());
  EXPECT_TRUE((*rank1)->Close().ok());
}

// 8 blocks of 4 tokens a rank: two prefills of 16 tokens fill them.
std::vector<std::string> SmallPools(int64_t blocks) {
  return {"--backend=host", "--tp_ranks=1",
          "--pool_memory_bytes=" + std::to_string(blocks * kBlockBytes), "--kv_layers=2",
          "--kv_heads=1", "--kv_head_dim=4", "--kv_tokens_per_block=4", "--kv_dtype=float16"};
}

// One unary step of `id` over a cache of `cache` tokens; the sequence's decision.
absl::StatusOr<v1::Decision> StepOnce(client::KvCacheClient& client, const std::string& id,
                                      int64_t step, int64_t cache) {
  v1::StepBatch batch;
  const std::vector<float> scores(static_cast<size_t>(2 * (cache + 1)), 0.5f);
  client::SetFloat32Scores(client::AddReport(&batch, id, step), scores, 2, 1);
  absl::StatusOr<v1::DecisionBatch> decided = client.Step(batch);
  if (!decided.ok()) return decided.status();
  return decided->decisions(0);
}

double Metric(const DaemonProcess& daemon, const std::string& series) {
  return MetricValue(*HttpGet(daemon.metrics_address(), "/metrics"), series);
}

TEST(KvPoolsDaemonTest, AFullPoolRefusesOpensAndStepsAndEachRefusalCountsOnce) {
  auto daemon = DaemonProcess::Start(SmallPools(8));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto client = (*daemon)->Connect();
  for (const char* id : {"a", "b"}) {
    v1::OpenSequenceRequest open = client::OpenRequest(id, 16, 0, "inertia");
    open.set_budget_tokens(6);
    ASSERT_TRUE(client->Open(open).ok());
  }
  const std::string open_refused = R"(kvcache_pool_refused_total{rpc="OpenSequence"})";
  const std::string step_refused = R"(kvcache_pool_refused_total{rpc="Step"})";
  EXPECT_EQ(Metric(**daemon, open_refused), 0);
  v1::OpenSequenceRequest small = client::OpenRequest("c", 4, 0, "inertia");
  small.set_budget_tokens(2);
  EXPECT_EQ(client->Open(small).status().code(),
            absl::StatusCode::kResourceExhausted);
  const std::string after_open = *HttpGet((*daemon)->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(after_open, open_refused), 1);
  EXPECT_EQ(MetricValue(after_open,
                        R"(kvcache_errors_total{code="RESOURCE_EXHAUSTED",rpc="OpenSequence"})"),
            1);
  EXPECT_EQ(MetricValue(after_open, step_refused), 0);
  EXPECT_EQ(MetricValue(after_open, R"(kvcache_pool_cached_tokens{backend="host",rank="0"})"), 32);

  // a's 16 tokens fill its 4 blocks: the step's token finds no slot.
  absl::StatusOr<v1::Decision> refused = StepOnce(*client, "a", 1, 16);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(Metric(**daemon, step_refused), 1);
  EXPECT_EQ(Metric(**daemon, open_refused), 1);

  // With b closed the step goes through, evicts to the budget and compacts.
  ASSERT_TRUE(client->Close("b").ok());
  absl::StatusOr<v1::Decision> stepped = StepOnce(*client, "a", 1, 16);
  ASSERT_TRUE(stepped.ok() && stepped->code() == 0) << stepped.status();
  const std::string after = *HttpGet((*daemon)->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(after, R"(kvcache_pool_cached_tokens{backend="host",rank="0"})"),
            stepped->cache_size());
  EXPECT_EQ(MetricValue(after, R"(kvcache_pool_used_blocks{backend="host",rank="0"})"),
            (stepped->cache_size() + kTokensPerBlock - 1) / kTokensPerBlock);
  EXPECT_EQ(MetricValue(after, step_refused), 1);
  EXPECT_EQ(MetricValue(after, R"(kvcache_pool_refused_total{rpc="ImportSequence"})"), 0);
}

// An import into a pool too small for the sequence: refused for blocks, counted once on
// the target, and nothing counted on the source.
TEST(KvPoolsDaemonTest, AnImportIntoAFullPoolIsCountedOnTheTarget) {
  auto source = DaemonProcess::Start(SmallPools(64));
  auto target = DaemonProcess::Start(SmallPools(8));
  ASSERT_TRUE(source.ok() && target.ok());
  auto at_source = (*source)->Connect();
  auto at_target = (*target)->Connect();
  ASSERT_TRUE(at_source->Open(client::OpenRequest("s", 100, 0.5, "inertia")).ok());
  const absl::StatusOr<v1::ImportSequenceResponse> imported =
      at_target->ImportSequence("s", (*source)->grpc_address());
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kResourceExhausted) << imported.status();
  const std::string series = R"(kvcache_pool_refused_total{rpc="ImportSequence"})";
  EXPECT_EQ(Metric(**target, series), 1);
  EXPECT_EQ(Metric(**target, R"(kvcache_pool_cached_tokens{backend="host",rank="0"})"), 0);
  EXPECT_EQ(Metric(**source, series), 0);
  EXPECT_EQ(Metric(**source, R"(kvcache_pool_cached_tokens{backend="host",rank="0"})"), 100);
}

TEST(KvPoolsDaemonTest, WithoutPoolsTheGaugesAreZeroAndDescribeIsEmpty) {
  auto daemon = DaemonProcess::Start();
  ASSERT_TRUE(daemon.ok());
  auto client = (*daemon)->Connect();
  grpc::ClientContext context;
  v1::DescribeKvPoolsResponse pools;
  ASSERT_TRUE(client->stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools).ok());
  EXPECT_EQ(pools.pools_size(), 0);
  const std::string metrics = *HttpGet((*daemon)->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_pool_capacity_blocks{backend="host",rank="0"})"), 0);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_pool_cached_tokens{backend="host",rank="0"})"), 0);
  EXPECT_EQ(MetricValue(metrics, R"(kvcache_pool_block_tokens{backend="host",rank="0"})"), 0);
  for (const char* rpc : {"OpenSequence", "ImportSequence", "Step"}) {
    EXPECT_EQ(MetricValue(metrics, absl::StrCat(R"(kvcache_pool_refused_total{rpc=")", rpc, R"("})")),
              0);
  }
}

TEST(KvPoolsDaemonTest, BadBackendFlagsAreRefusedAtStart) {
  EXPECT_FALSE(DaemonProcess::Start({"--backend=tpu"}).ok());
  EXPECT_FALSE(DaemonProcess::Start({"--pool_memory_bytes=1000", "--kv_layers=0"}).ok());
}

}  // namespace
}  // namespace kvcm

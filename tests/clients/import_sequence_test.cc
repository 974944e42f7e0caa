// KvCacheClient::ImportSequence against two real kvcached on loopback (disaggregated
// serving, docs/DISAGGREGATION.md): a sequence stepped once on daemon A is imported by
// daemon B with its slot table, A gives it up, and B decodes on from the next step.
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/server/daemon_process.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::client::AddReport;
using ::kvcm::client::OpenRequest;
using ::kvcm::client::SetFloat32Scores;
using ::kvcm::testing::DaemonProcess;

constexpr int64_t kPrompt = 32, kBudget = 4, kTokensPerBlock = 4;

std::vector<std::string> PoolFlags() {
  return {"--backend=host",        "--pool_memory_bytes=65536", "--kv_layers=2",
          "--kv_heads=1",          "--kv_head_dim=4",           "--kv_tokens_per_block=4",
          "--kv_dtype=float32",    "--kv_transfer=grpc"};
}

// One report of `tokens` scores that differ per token and step.
v1::StepBatch OneStep(const std::string& id, int64_t step, int64_t tokens) {
  v1::StepBatch batch;
  std::vector<float> scores(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) scores[i] = static_cast<float>((i * 7 + step) % 13);
  SetFloat32Scores(AddReport(&batch, id, step), scores, 1);
  return batch;
}

TEST(ImportSequenceTest, MovesASequenceWithItsSlotTableAndDecodesOnAtTheNextStep) {
  auto a = DaemonProcess::Start(PoolFlags());
  auto b = DaemonProcess::Start(PoolFlags());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  auto ca = (*a)->Connect();
  auto cb = (*b)->Connect();
  ASSERT_NE(ca, nullptr);
  ASSERT_NE(cb, nullptr);
  v1::OpenSequenceRequest open = OpenRequest("s", kPrompt, -1, "tova");
  open.set_budget_tokens(kBudget);
  ASSERT_TRUE(ca->Open(open).ok());
  auto first = ca->Step(OneStep("s", 1, kPrompt + 1));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->decisions(0).code(), 0) << first->decisions(0).message();
  auto before = ca->Inspect("s", /*include_cache=*/true);
  ASSERT_TRUE(before.ok()) << before.status();

  auto imported = cb->ImportSequence("s", (*a)->grpc_address(), absl::Seconds(30));
  ASSERT_TRUE(imported.ok()) << imported.status() << "\n" << (*b)->Log();
  const v1::SequenceState& state = imported->state();
  EXPECT_EQ(state.sequence_id(), "s");
  EXPECT_EQ(state.last_step(), 1);
  EXPECT_EQ(state.cache_size(), kBudget);
  EXPECT_EQ(std::vector<int64_t>(state.positions().begin(), state.positions().end()),
            std::vector<int64_t>(before->positions().begin(), before->positions().end()));
  ASSERT_EQ(state.kv_slots_size(), 1);
  EXPECT_EQ(state.kv_slots(0).slots_size(), kBudget);
  EXPECT_EQ(imported->transport(), "grpc");
  const int64_t block_bytes = kTokensPerBlock * 2 * 2 * 1 * 4 * 4;
  EXPECT_GT(imported->kv_bytes(), 0);
  EXPECT_EQ(imported->kv_bytes() % block_bytes, 0);
  EXPECT_LT(imported->kv_bytes(), kPrompt / kTokensPerBlock * block_bytes);
  EXPECT_GT(imported->record_bytes(), 0);

  EXPECT_EQ(ca->Inspect("s", false).status().code(), absl::StatusCode::kNotFound);
  auto second = cb->Step(OneStep("s", 2, kBudget + 1));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->decisions(0).code(), 0) << second->decisions(0).message();
  EXPECT_EQ(second->decisions(0).cache_size(), kBudget);
}

TEST(ImportSequenceTest, FailuresKeepTheirCodesAndLeaveNothingAtTheTarget) {
  auto a = DaemonProcess::Start();
  auto b = DaemonProcess::Start();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  auto ca = (*a)->Connect();
  auto cb = (*b)->Connect();
  ASSERT_NE(ca, nullptr);
  ASSERT_NE(cb, nullptr);
  EXPECT_EQ(cb->ImportSequence("unknown", (*a)->grpc_address()).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(ca->Open(OpenRequest("s", kPrompt, 0.5, "tova")).ok());
  absl::Status unreachable = cb->ImportSequence("s", "127.0.0.1:1").status();
  EXPECT_EQ(unreachable.code(), absl::StatusCode::kUnavailable) << unreachable;
  EXPECT_NE(unreachable.message().find("127.0.0.1:1"), absl::string_view::npos) << unreachable;
  auto listed = cb->List();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_TRUE(ca->Inspect("s", false).ok());
}

}  // namespace
}  // namespace kvcm

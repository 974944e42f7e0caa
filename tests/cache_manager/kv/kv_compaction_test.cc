#include "kernels/kv_compaction.h"

#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "tests/cache_manager/kv/kv_pattern.h"

namespace kvcm {
namespace {

using kernels::KvBlockLayout;
using kernels::KvDtype;
using kernels::KvMove;
using testing::CheckToken;
using testing::WriteToken;

TEST(KvLayoutTest, OffsetsFollowTheDocumentedOrder) {
  const KvBlockLayout layout{4, 3, 2, 8, KvDtype::kFloat16};
  EXPECT_EQ(layout.TokenBytes(), 2 * 8 * 2);
  EXPECT_EQ(layout.TokenFootprintBytes(), 2 * 3 * 32);
  EXPECT_EQ(layout.BlockBytes(), 4 * 2 * 3 * 32);
  // [blocks][layers][2][tokens_per_block][kv_heads][head_dim]
  EXPECT_EQ(layout.Offset(0, 0, 0), 0);
  EXPECT_EQ(layout.Offset(1, 0, 0), 32);             // next token in the block
  EXPECT_EQ(layout.Offset(0, 0, 1), 4 * 32);         // V follows the block's K
  EXPECT_EQ(layout.Offset(0, 1, 0), 2 * 4 * 32);     // next layer
  EXPECT_EQ(layout.Offset(4, 0, 0), layout.BlockBytes());  // slot 4 opens block 1
  EXPECT_EQ(layout.Offset(7, 2, 1), layout.BlockBytes() + ((2 * 2 + 1) * 4 + 3) * 32);
}

class CompactKvCpuTest : public ::testing::TestWithParam<KvDtype> {};

TEST_P(CompactKvCpuTest, CopiesEveryLayerOfKAndVOfEachMovedTokenAndNothingElse) {
  // head_dim 5: rows of 10 or 20 bytes, not a multiple of any vector width.
  const KvBlockLayout layout{4, 3, 2, 5, GetParam()};
  const int64_t blocks = 6;
  const int64_t slots = blocks * layout.tokens_per_block;
  std::vector<uint8_t> storage(static_cast<size_t>(blocks * layout.BlockBytes()));
  for (int64_t slot = 0; slot < slots; ++slot) WriteToken(storage.data(), layout, slot, slot);

  const std::vector<KvMove> moves = {{17, 2}, {22, 5}, {9, 0}, {23, 12}};
  kernels::cpu::CompactKv(storage.data(), layout, moves.data(),
                          static_cast<int64_t>(moves.size()), nullptr);

  std::map<int64_t, int64_t> expected;  // slot -> token it must hold
  for (int64_t slot = 0; slot < slots; ++slot) expected[slot] = slot;
  for (const KvMove& m : moves) expected[m.dst_slot] = m.src_slot;
  for (const auto& [slot, token] : expected) {
    EXPECT_EQ(CheckToken(storage.data(), layout, slot, token), "");
  }
}

TEST_P(CompactKvCpuTest, NoMovesChangeNothing) {
  const KvBlockLayout layout{2, 2, 1, 4, GetParam()};
  std::vector<uint8_t> storage(static_cast<size_t>(3 * layout.BlockBytes()));
  for (int64_t slot = 0; slot < 6; ++slot) WriteToken(storage.data(), layout, slot, slot);
  const std::vector<uint8_t> before = storage;
  kernels::cpu::CompactKv(storage.data(), layout, nullptr, 0, nullptr);
  EXPECT_EQ(storage, before);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CompactKvCpuTest,
                         ::testing::Values(KvDtype::kFloat32, KvDtype::kFloat16,
                                           KvDtype::kBFloat16));

}  // namespace
}  // namespace kvcm

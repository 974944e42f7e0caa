#include "cache_manager/persist/restart.h"

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "kernels/stream_lanes.h"

namespace kvcm {

EngineSnapshot CaptureEngine(const SequenceTable& table, const KvPools* pools, int64_t pid) {
  EngineSnapshot snapshot;
  snapshot.pid = pid;
  if (pools != nullptr) {
    for (int32_t r = 0; r < pools->ranks(); ++r) {
      const BlockPool& pool = pools->pool(r);
      PoolSnapshot record;
      record.rank = r;
      if (pool.memory_export().kind == MemoryExport::Kind::kPosixShm) {
        record.shm_name = pool.memory_export().shm_name;
      }
      record.bytes = pool.storage().bytes();
      record.layout = pool.layout();
      record.free_blocks = pool.FreeBlocks();
      snapshot.pools.push_back(std::move(record));
    }
  }
  snapshot.sequences = table.Records();
  return snapshot;
}

absl::Status CheckPoolsMatch(const EngineSnapshot& snapshot, int32_t ranks,
                             const kernels::KvBlockLayout& layout, int64_t memory_bytes_per_rank) {
  if (static_cast<int32_t>(snapshot.pools.size()) != ranks) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the snapshot has ", snapshot.pools.size(), " KV pools, this configuration ", ranks));
  }
  if (ranks == 0) return absl::OkStatus();
  BlockPoolOptions options;
  options.layout = layout;
  options.memory_bytes = memory_bytes_per_rank;
  ASSIGN_OR_RETURN(const int64_t capacity, BlockPool::CapacityBlocks(options));
  const int64_t bytes = capacity * layout.BlockBytes();
  for (const PoolSnapshot& pool : snapshot.pools) {
    const kernels::KvBlockLayout& l = pool.layout;
    if (l.tokens_per_block != layout.tokens_per_block || l.layers != layout.layers ||
        l.kv_heads != layout.kv_heads || l.head_dim != layout.head_dim || l.dtype != layout.dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the snapshot's rank ", pool.rank, " KV pool has another block layout than the "
          "flags give (--kv_layers, --kv_heads, --kv_head_dim, --kv_tokens_per_block, "
          "--kv_dtype)"));
    }
    if (pool.bytes != bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the snapshot's rank ", pool.rank, " KV pool holds ", pool.bytes,
          " bytes; --pool_memory_bytes gives ", bytes));
    }
    if (pool.shm_name.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the snapshot's rank ", pool.rank, " KV pool was private memory: it cannot be "
          "re-attached"));
    }
  }
  return absl::OkStatus();
}

RestoreReport RestoreEngine(const EngineSnapshot& snapshot, SequenceTable* table, KvPools* pools,
                            const std::function<int(absl::string_view id)>& stream_lane_of) {
  RestoreReport report;
  const int own_lane = kernels::ThreadStreamLane();
  for (const SequenceRecord& record : snapshot.sequences) {
    if (stream_lane_of) kernels::SetThreadStreamLane(stream_lane_of(record.id));
    absl::StatusOr<SequenceInfo> restored = table->Restore(record);
    kernels::SetThreadStreamLane(own_lane);
    if (restored.ok()) {
      ++report.restored;
    } else {
      report.failures.push_back(std::string(restored.status().message()));
    }
  }
  if (pools != nullptr) {
    for (const PoolSnapshot& pool : snapshot.pools) {
      if (pool.rank >= 0 && pool.rank < pools->ranks()) {
        pools->pool(pool.rank).ReorderFreeBlocks(pool.free_blocks);
      }
    }
  }
  return report;
}

}  // namespace kvcm

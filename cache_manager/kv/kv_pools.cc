#include "cache_manager/kv/kv_pools.h"

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm {

absl::StatusOr<std::unique_ptr<KvPools>> KvPools::Create(int32_t ranks,
                                                         const kernels::KvBlockLayout& layout,
                                                         int64_t memory_bytes_per_rank,
                                                         PoolFactory make_pool) {
  if (ranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV pools: ranks is ", ranks, "; need >= 1"));
  }
  auto pools = std::unique_ptr<KvPools>(new KvPools());
  for (int32_t r = 0; r < ranks; ++r) {
    BlockPoolOptions options;
    options.layout = layout;
    options.memory_bytes = memory_bytes_per_rank;
    options.rank = r;
    absl::StatusOr<std::unique_ptr<BlockPool>> pool = make_pool(options);
    if (!pool.ok()) {
      return absl::Status(pool.status().code(),
                          absl::StrCat("KV pool of rank ", r, ": ", pool.status().message()));
    }
    pools->pools_.push_back(*std::move(pool));
  }
  return pools;
}

std::vector<BlockPoolUsage> KvPools::Usage() const {
  std::vector<BlockPoolUsage> usage;
  for (const auto& pool : pools_) usage.push_back(pool->Usage());
  return usage;
}

void KvPools::CountRefusal(Asker asker, const absl::Status& status) {
  // A pool refuses only with RESOURCE_EXHAUSTED, and only for blocks; a lease's other
  // errors (a malformed foreign lease) are INVALID_ARGUMENT.
  if (status.code() != absl::StatusCode::kResourceExhausted) return;
  refused_[static_cast<size_t>(asker)].fetch_add(1, std::memory_order_relaxed);
}

void KvPools::UnlinkSharedMemory() {
  for (const auto& pool : pools_) {
    const MemoryExport& exported = pool->memory_export();
    if (exported.kind == MemoryExport::Kind::kPosixShm) kvcm::UnlinkSharedMemory(exported.shm_name);
  }
}

absl::StatusOr<SequenceKv> SequenceKv::Lease(KvPools& pools, int64_t tokens,
                                             absl::string_view sequence_id) {
  std::vector<BlockLease> leases;
  for (int32_t r = 0; r < pools.ranks(); ++r) {
    absl::StatusOr<BlockLease> lease = pools.pool(r).Lease(tokens);
    if (!lease.ok()) {  // the leases taken so far go back when `leases` is destroyed
      pools.CountRefusal(KvPools::Asker::kOpen, lease.status());
      return absl::Status(lease.status().code(),
                          absl::StrCat("sequence '", sequence_id, "': ", tokens,
                                       " prefill tokens: ", lease.status().message()));
    }
    leases.push_back(*std::move(lease));
  }
  SequenceKv kv(std::move(leases), &pools);
  return kv;
}

namespace {

// Each rank's lease from `states` by `make` (BlockPool::RestoreLease or LeaseLike), all or
// none: the leases made so far go back when the vector is destroyed.
template <typename MakeLease>
absl::StatusOr<std::vector<BlockLease>> LeasesFromStates(KvPools& pools,
                                                         std::span<const BlockLeaseState> states,
                                                         int64_t tokens,
                                                         absl::string_view sequence_id,
                                                         MakeLease make) {
  if (static_cast<int32_t>(states.size()) != pools.ranks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", sequence_id, "': ", states.size(), " KV leases for ", pools.ranks(),
        " pools"));
  }
  std::vector<BlockLease> leases;
  for (int32_t r = 0; r < pools.ranks(); ++r) {
    const BlockLeaseState& state = states[static_cast<size_t>(r)];
    if (static_cast<int64_t>(state.slots.size()) != tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", sequence_id, "': rank ", r, "'s KV lease holds ", state.slots.size(),
          " tokens, its cache ", tokens));
    }
    absl::StatusOr<BlockLease> lease = make(pools.pool(r), state);
    if (!lease.ok()) {
      return absl::Status(lease.status().code(),
                          absl::StrCat("sequence '", sequence_id, "': ", lease.status().message()));
    }
    leases.push_back(*std::move(lease));
  }
  return leases;
}

}  // namespace

absl::StatusOr<SequenceKv> SequenceKv::Restore(KvPools& pools,
                                               std::span<const BlockLeaseState> states,
                                               int64_t tokens, absl::string_view sequence_id) {
  ASSIGN_OR_RETURN(std::vector<BlockLease> leases,
                   LeasesFromStates(pools, states, tokens, sequence_id,
                                    [](BlockPool& pool, const BlockLeaseState& state) {
                                      return pool.RestoreLease(state);
                                    }));
  return SequenceKv(std::move(leases), &pools);
}

absl::StatusOr<SequenceKv> SequenceKv::LeaseLike(KvPools& pools,
                                                 std::span<const BlockLeaseState> foreign,
                                                 int64_t tokens, absl::string_view sequence_id) {
  absl::StatusOr<std::vector<BlockLease>> leases =
      LeasesFromStates(pools, foreign, tokens, sequence_id,
                       [](BlockPool& pool, const BlockLeaseState& state) {
                         return pool.LeaseLike(state);
                       });
  if (!leases.ok()) {
    pools.CountRefusal(KvPools::Asker::kImport, leases.status());
    return leases.status();
  }
  return SequenceKv(*std::move(leases), &pools);
}

std::vector<BlockLeaseState> SequenceKv::State() const {
  std::vector<BlockLeaseState> states;
  for (const BlockLease& lease : leases_) states.push_back(lease.State());
  return states;
}

absl::Status SequenceKv::AppendToken(absl::string_view sequence_id, int64_t step) {
  for (size_t r = 0; r < leases_.size(); ++r) {
    absl::Status appended = leases_[r].Append(1);
    if (!appended.ok()) {
      GiveBackLastSlot(r);  // the ranks that did get one
      pools_->CountRefusal(KvPools::Asker::kStep, appended);
      return absl::Status(appended.code(),
                          absl::StrCat("sequence '", sequence_id, "' step ", step,
                                       ": no KV slot for the new token: ", appended.message()));
    }
  }
  return absl::OkStatus();
}

void SequenceKv::UndoAppend() { GiveBackLastSlot(leases_.size()); }

void SequenceKv::GiveBackLastSlot(size_t ranks) {
  for (size_t r = 0; r < ranks; ++r) {
    const int64_t last = leases_[r].size() - 1;
    (void)leases_[r].Evict(std::span<const int64_t>(&last, 1));
  }
}

void SequenceKv::ApplyEvictions(std::span<const int64_t> evicted_indices,
                                std::vector<KvSlotChanges>* changes_per_rank) {
  changes_per_rank->resize(leases_.size());
  for (size_t r = 0; r < leases_.size(); ++r) {
    BlockLease& lease = leases_[r];
    KvSlotChanges& changes = (*changes_per_rank)[r];
    changes.rank = static_cast<int32_t>(r);
    changes.moves.clear();
    changes.released_blocks.clear();
    // The engine's indices are into the same cache order the lease keeps (ascending
    // positions, which is append order), so they apply as they are.
    (void)lease.Evict(evicted_indices);
    // Compact only when two blocks' worth of slots are free (after a large eviction). With
    // one block's worth, compacting would give back the block the next token needs; a
    // steady decode (one in, one out) keeps at most one spare block and moves nothing.
    if (lease.free_slots() < 2 * tokens_per_block_) continue;
    absl::StatusOr<CompactionPlan> plan = lease.Compact();
    if (!plan.ok()) continue;  // the lease is unchanged; the next step tries again
    changes.moves = std::move(plan->moves);
    changes.released_blocks = std::move(plan->released_blocks);
  }
  // The new token's slot after any compaction (the worker writes its K/V once it has the
  // decision), or -1 when it was evicted in its own step. It is last in cache order.
  const int64_t new_index = leases_.empty() ? 0
                                            : leases_[0].size() +
                                                  static_cast<int64_t>(
                                                      evicted_indices.size()) - 1;
  const bool new_token_evicted = !evicted_indices.empty() &&
                                 evicted_indices.back() == new_index;
  for (size_t r = 0; r < leases_.size(); ++r) {
    (*changes_per_rank)[r].new_token_slot = new_token_evicted ? -1 : leases_[r].slots().back();
  }
}

std::vector<std::vector<int64_t>> SequenceKv::Slots() const {
  std::vector<std::vector<int64_t>> slots;
  for (const BlockLease& lease : leases_) slots.emplace_back(lease.slots().begin(), lease.slots().end());
  return slots;
}

}  // namespace kvcm

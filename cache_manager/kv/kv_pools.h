// KvPools: the KV block pools of a node, one per tensor-parallel rank, and SequenceKv, the
// leases one sequence holds across all of them (every rank keeps the same tokens, each for
// its own heads). The sequence table drives a SequenceKv from each step's decision, so the
// KV memory follows the eviction contract: the new token gets a slot before the step, the
// evicted tokens' slots are freed after it, and once two blocks' worth of slots are free
// the survivors are compacted and the emptied blocks go back to the pool.
//
// KvPools also counts the requests its pools refused for lack of blocks, by what asked, so
// that operators can tell a full pool from the daemon's other refusals.
//
// KvPools is thread-safe (its pools are; its counts are atomic). A SequenceKv is not: its
// owner serializes it.
#ifndef KVCM_CACHE_MANAGER_KV_KV_POOLS_H_
#define KVCM_CACHE_MANAGER_KV_KV_POOLS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/kv/block_pool.h"
#include "cache_manager/kv/kv_slot_changes.h"

namespace kvcm {

class KvPools {
 public:
  // What asked for blocks: a new sequence's prefill (OpenSequence), a sequence handed off
  // to this node (ImportSequence), a decode step's new token.
  enum class Asker : uint8_t { kOpen, kImport, kStep };
  static constexpr int kAskers = 3;

  // Builds the pool of rank r (memory space and export are the factory's business: host,
  // shared memory or CUDA).
  using PoolFactory =
      absl::AnyInvocable<absl::StatusOr<std::unique_ptr<BlockPool>>(const BlockPoolOptions&)>;

  // `ranks` pools of `layout`, each capped at `memory_bytes_per_rank`.
  static absl::StatusOr<std::unique_ptr<KvPools>> Create(int32_t ranks,
                                                         const kernels::KvBlockLayout& layout,
                                                         int64_t memory_bytes_per_rank,
                                                         PoolFactory make_pool);

  int32_t ranks() const { return static_cast<int32_t>(pools_.size()); }
  BlockPool& pool(int32_t rank) { return *pools_[static_cast<size_t>(rank)]; }
  const BlockPool& pool(int32_t rank) const { return *pools_[static_cast<size_t>(rank)]; }
  std::vector<BlockPoolUsage> Usage() const;
  // Requests from `asker` refused RESOURCE_EXHAUSTED because a pool lacked the blocks (one
  // per request, however many ranks were short), since the pools were made.
  int64_t refused(Asker asker) const {
    return refused_[static_cast<size_t>(asker)].load(std::memory_order_relaxed);
  }
  // Removes the names of the pools in POSIX shared memory now (UnlinkSharedMemory of
  // kv_storage.h): for an exit that skips destructors. The memory stays mapped.
  void UnlinkSharedMemory();

 private:
  friend class SequenceKv;  // counts the refusals: it is where every request leases
  // Counts `status` against `asker` when it is a pool's refusal for lack of blocks.
  void CountRefusal(Asker asker, const absl::Status& status);

  std::vector<std::unique_ptr<BlockPool>> pools_;
  std::array<std::atomic<int64_t>, kAskers> refused_{};
};

class SequenceKv {
 public:
  // Leases `tokens` slots on every rank, all or none. RESOURCE_EXHAUSTED names the rank
  // whose pool is full and the blocks it lacks.
  static absl::StatusOr<SequenceKv> Lease(KvPools& pools, int64_t tokens,
                                          absl::string_view sequence_id);

  // The leases `states` describe (one per rank, a snapshot's), all or none.
  // INVALID_ARGUMENT names the rank and what does not fit the pool, or a rank count or
  // token count (`tokens`, the sequence's cache) that differs.
  static absl::StatusOr<SequenceKv> Restore(KvPools& pools, std::span<const BlockLeaseState> states,
                                            int64_t tokens, absl::string_view sequence_id);

  // Leases shaped like `foreign` (another node's leases of a sequence handed off here, one
  // per rank: BlockPool::LeaseLike), all or none. INVALID_ARGUMENT as Restore;
  // RESOURCE_EXHAUSTED naming the rank whose pool lacks the blocks.
  static absl::StatusOr<SequenceKv> LeaseLike(KvPools& pools,
                                              std::span<const BlockLeaseState> foreign,
                                              int64_t tokens, absl::string_view sequence_id);

  SequenceKv(SequenceKv&&) = default;
  SequenceKv& operator=(SequenceKv&&) = default;

  // A slot for one more token on every rank, all or none (RESOURCE_EXHAUSTED otherwise).
  absl::Status AppendToken(absl::string_view sequence_id, int64_t step);
  // Takes back the slot of the last AppendToken (the step was rejected).
  void UndoAppend();
  // Frees the slots of the evicted tokens (`evicted_indices`: ascending indices into the
  // cache before eviction, the new token last), compacts where two blocks' worth of slots
  // are free, and writes per rank the new token's final slot and any moves to `changes`
  // (resized to the ranks; its vectors' capacity is reused).
  void ApplyEvictions(std::span<const int64_t> evicted_indices,
                      std::vector<KvSlotChanges>* changes);

  // Each rank's lease, as Restore takes it.
  std::vector<BlockLeaseState> State() const;
  // [ranks][cached tokens] each token's slot, in cache order.
  std::vector<std::vector<int64_t>> Slots() const;
  int32_t ranks() const { return static_cast<int32_t>(leases_.size()); }
  // Blocks the lease of `rank` holds now.
  int64_t block_count(int32_t rank) const {
    return leases_[static_cast<size_t>(rank)].block_count();
  }

 private:
  // Frees the last slot of the first `ranks` leases.
  void GiveBackLastSlot(size_t ranks);

  SequenceKv(std::vector<BlockLease> leases, KvPools* pools)
      : leases_(std::move(leases)),
        pools_(pools),
        tokens_per_block_(pools->pool(0).layout().tokens_per_block) {}

  std::vector<BlockLease> leases_;  // one per rank
  KvPools* pools_;                  // not owned; outlives the leases
  int64_t tokens_per_block_;
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_KV_POOLS_H_

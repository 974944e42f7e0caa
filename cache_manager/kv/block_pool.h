// BlockPool: one tensor-parallel rank's KV cache memory, cut into fixed-size blocks of
// `tokens_per_block` token slots (layout: kernels/kv_compaction.h), and BlockLease, the
// move-only handle by which one sequence holds some of those blocks.
//
// A lease starts with the prefill's tokens, grows by one token per decode step, frees the
// slots of evicted tokens, and reuses freed slots before it asks the pool for a new block,
// so a steady decode (one token in, one out) holds a constant number of blocks. After a
// large eviction (the first step of a long prefill), Compact() moves the survivors out of
// the emptiest blocks into the holes of the fullest, with the KV compaction kernel of the
// pool's memory space, and returns the emptied blocks to the pool.
//
// A lease names each live token's slot (slots(), in the lease's cache order: the order the
// tokens were appended, less the evicted ones); slot s of block b is b * tokens_per_block
// + (s % tokens_per_block). Slots are not kept in position order: workers address K/V
// through the slot table.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<BlockPool> pool, BlockPool::CreateHost(options));
//   ASSIGN_OR_RETURN(BlockLease lease, pool->Lease(prefill_len));
//   RETURN_IF_ERROR(lease.Append(1));            // decode step: the new token
//   RETURN_IF_ERROR(lease.Evict(evicted_indices));
//   ASSIGN_OR_RETURN(CompactionPlan plan, lease.Compact());
//
// Thread safety: BlockPool is thread-safe. A BlockLease is not (its owner serializes its
// calls), but different leases of one pool may be used from different threads.
// A full pool answers RESOURCE_EXHAUSTED and changes nothing.
#ifndef KVCM_CACHE_MANAGER_KV_BLOCK_POOL_H_
#define KVCM_CACHE_MANAGER_KV_BLOCK_POOL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/kv_storage.h"
#include "kernels/kv_compaction.h"

namespace kvcm {

struct BlockPoolOptions {
  kernels::KvBlockLayout layout;  // tokens_per_block, layers, kv_heads (this rank), head_dim, dtype
  int64_t memory_bytes = 0;       // cap: capacity = floor(memory_bytes / block bytes) blocks
  int32_t rank = 0;               // the tensor-parallel rank the pool serves (for messages, usage)
};

// A snapshot of one pool's occupancy: what a metrics exporter reads per rank.
struct BlockPoolUsage {
  int32_t rank = 0;
  MemorySpace space = MemorySpace::kHost;
  int64_t capacity_blocks = 0;
  int64_t used_blocks = 0;
  int64_t block_bytes = 0;
  int64_t tokens_per_block = 0;
  int64_t leases = 0;  // live leases, empty ones included
  // Slots holding a token, across the leases: at most used_blocks * tokens_per_block; the
  // gap is the free slots leases keep (a spare block, holes that wait for compaction).
  int64_t cached_tokens = 0;

  int64_t free_blocks() const { return capacity_blocks - used_blocks; }
};

// The moves that pack a lease's survivors into as few blocks as possible.
struct CompactionPlan {
  std::vector<kernels::KvMove> moves;    // slots; sources in released blocks, destinations free
  std::vector<int32_t> kept_blocks;      // the lease's blocks afterwards, in lease order
  std::vector<int32_t> released_blocks;  // returned to the pool
};

// What a lease holds, as a snapshot records it: its blocks in lease order and the slot of
// each live token in cache order. Enough to rebuild it exactly (BlockPool::RestoreLease):
// its free slots follow from the two.
struct BlockLeaseState {
  std::vector<int32_t> blocks;
  std::vector<int64_t> slots;
};

class BlockPool;

class BlockLease {
 public:
  BlockLease() = default;  // holds nothing; valid() is false
  BlockLease(BlockLease&& other) noexcept;
  BlockLease& operator=(BlockLease&& other) noexcept;
  ~BlockLease();  // returns every block to the pool

  bool valid() const { return pool_ != nullptr; }
  int64_t size() const { return static_cast<int64_t>(slots_.size()); }  // live tokens
  int64_t block_count() const { return static_cast<int64_t>(blocks_.size()); }
  // Slots of this lease's blocks that hold no token: Append fills them first.
  int64_t free_slots() const { return static_cast<int64_t>(free_.size()); }
  std::span<const int32_t> blocks() const { return blocks_; }
  // [size()] the slot of each live token, in cache order.
  std::span<const int64_t> slots() const { return slots_; }

  // Adds `tokens` (>= 0) tokens after the last; their slots are the last `tokens` entries
  // of slots(). Free slots first (lowest block of the lease first), then new blocks.
  // Errors: RESOURCE_EXHAUSTED (the pool lacks the blocks; the lease is unchanged),
  // INVALID_ARGUMENT (tokens < 0). REQUIRES: valid().
  absl::Status Append(int64_t tokens);

  // Frees the slots of the tokens at `indices` (into slots(): ascending, distinct,
  // < size()), keeping the order of the others. INVALID_ARGUMENT (nothing changes)
  // otherwise. REQUIRES: valid().
  absl::Status Evict(std::span<const int64_t> indices);

  // The plan Compact would carry out now: keep the ceil(size() / tokens_per_block)
  // blocks that hold the most live tokens (ties: earlier in the lease), move the tokens
  // of the other blocks into the kept blocks' free slots (in cache order, into ascending
  // slots), release the other blocks. Moves are minimal for that block count.
  // REQUIRES: valid().
  CompactionPlan PlanCompaction() const;

  // Plans, moves the tokens' K and V in the pool's memory (returning once the copies are
  // complete), updates slots() and returns the released blocks to the pool. Returns the
  // plan it carried out. Errors: INTERNAL from the device (the lease is unchanged).
  // REQUIRES: valid(), and no reader or writer of the moved slots' memory until it returns.
  absl::StatusOr<CompactionPlan> Compact();

  // Returns every block to the pool now; the lease becomes empty (valid() stays true).
  void Release();

  BlockLeaseState State() const { return {blocks_, slots_}; }

 private:
  friend class BlockPool;
  explicit BlockLease(BlockPool* pool);

  int64_t tokens_per_block() const;
  void Reset();
  // Rebuilds free_ from slots_ and blocks_.
  void RebuildFreeSlots();

  BlockPool* pool_ = nullptr;  // not owned; the pool outlives its leases
  std::vector<int32_t> blocks_;                          // pool block ids, lease order
  std::vector<int32_t> live_;                            // [blocks_] live tokens per block
  absl::flat_hash_map<int32_t, int32_t> block_index_;    // pool block id -> index in blocks_
  std::vector<int64_t> slots_;                           // [size()] slot per live token
  // Free slots as lease-relative numbers (index in blocks_ * tokens_per_block + offset),
  // a min-heap so the lease's earliest blocks fill first.
  std::vector<int64_t> free_;
};

class BlockPool {
 public:
  // Makes the pool's memory, given the bytes it must hold.
  using StorageFactory =
      absl::AnyInvocable<absl::StatusOr<std::unique_ptr<KvStorage>>(int64_t bytes)>;

  // A pool of floor(memory_bytes / block bytes) blocks in storage from `make_storage`.
  // Errors: INVALID_ARGUMENT (a layout field < 1 or absurdly large, a cap below one block,
  // more than 2^31 - 1 blocks), and the factory's errors.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const BlockPoolOptions& options,
                                                           StorageFactory make_storage);
  // A pool in host memory (private, or POSIX shared memory: HostStorageOptions).
  static absl::StatusOr<std::unique_ptr<BlockPool>> CreateHost(
      const BlockPoolOptions& options, const HostStorageOptions& host = {});

  // The capacity Create would give, or its INVALID_ARGUMENT.
  static absl::StatusOr<int64_t> CapacityBlocks(const BlockPoolOptions& options);

  // REQUIRES: every lease of this pool has been destroyed (checked).
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A lease holding `tokens` (>= 0) tokens in ceil(tokens / tokens_per_block) fresh
  // blocks. RESOURCE_EXHAUSTED when the pool lacks them.
  absl::StatusOr<BlockLease> Lease(int64_t tokens);

  // The lease `state` describes (a snapshot's), taking its blocks out of the free ones.
  // INVALID_ARGUMENT, nothing taken, unless its blocks are distinct, free and in the
  // pool, and its slots distinct and inside its blocks.
  absl::StatusOr<BlockLease> RestoreLease(const BlockLeaseState& state) ABSL_LOCKS_EXCLUDED(mu_);
  // A lease shaped like `foreign` (another pool's lease, of a sequence handed off to this
  // node): as many fresh blocks, the i-th standing for foreign.blocks[i], each token at the
  // same offset in its block, so that whole blocks can be copied across. INVALID_ARGUMENT,
  // nothing taken, unless foreign's blocks are distinct and its slots distinct and inside
  // them; RESOURCE_EXHAUSTED when the pool lacks the blocks.
  absl::StatusOr<BlockLease> LeaseLike(const BlockLeaseState& foreign) ABSL_LOCKS_EXCLUDED(mu_);
  // The free blocks in the order the pool hands them out, the next one last.
  std::vector<int32_t> FreeBlocks() const ABSL_LOCKS_EXCLUDED(mu_);
  // Hands out the free blocks listed in `order` in that order (the last first), after
  // every free block it does not list. Blocks of `order` that are not free are skipped.
  void ReorderFreeBlocks(std::span<const int32_t> order) ABSL_LOCKS_EXCLUDED(mu_);

  BlockPoolUsage Usage() const ABSL_LOCKS_EXCLUDED(mu_);

  int32_t rank() const { return rank_; }
  const kernels::KvBlockLayout& layout() const { return layout_; }
  int64_t capacity_blocks() const { return capacity_blocks_; }
  // The storage: block b occupies [b * BlockBytes, (b + 1) * BlockBytes) of data().
  const KvStorage& storage() const { return *storage_; }
  // To write blocks from elsewhere (a hand-off's K/V arriving): the caller owns them.
  KvStorage& mutable_storage() { return *storage_; }
  void* BlockData(int32_t block) const;
  // How a worker maps this pool (shared-memory name or CUDA IPC handle bytes).
  const MemoryExport& memory_export() const { return storage_->memory_export(); }

 private:
  friend class BlockLease;
  BlockPool(const BlockPoolOptions& options, int64_t capacity_blocks,
            std::unique_ptr<KvStorage> storage);

  // Appends `count` free blocks to `out`, all or none: RESOURCE_EXHAUSTED when fewer are
  // free (out unchanged).
  absl::Status TakeBlocks(int64_t count, std::vector<int32_t>* out) ABSL_LOCKS_EXCLUDED(mu_);
  void ReturnBlocks(std::span<const int32_t> blocks) ABSL_LOCKS_EXCLUDED(mu_);
  void AddLeases(int64_t delta) ABSL_LOCKS_EXCLUDED(mu_);
  // Leases report each change of their token count, so Usage() reads the pool's total
  // without walking them.
  void AddCachedTokens(int64_t delta) { cached_tokens_.fetch_add(delta, std::memory_order_relaxed); }

  const int32_t rank_;
  const kernels::KvBlockLayout layout_;
  const int64_t capacity_blocks_;
  const std::unique_ptr<KvStorage> storage_;

  mutable Mutex mu_;
  std::vector<int32_t> free_blocks_ ABSL_GUARDED_BY(mu_);  // a stack: lowest id on top
  int64_t leases_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> cached_tokens_{0};
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_BLOCK_POOL_H_

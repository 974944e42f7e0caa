#include "cache_manager/kv/block_pool.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm {
namespace {

// Generous bounds that keep every product of the layout far from int64 overflow.
constexpr int64_t kMaxTokensPerBlock = int64_t{1} << 16;
constexpr int64_t kMaxLayers = int64_t{1} << 12;
constexpr int64_t kMaxKvHeads = int64_t{1} << 12;
constexpr int64_t kMaxHeadDim = int64_t{1} << 16;
constexpr double kMaxBlockBytes = 1099511627776.0;  // 1 TiB

absl::Status CheckField(absl::string_view name, int64_t value, int64_t max) {
  if (value >= 1 && value <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("KV layout: ", name, " is ", value, "; it must be 1 to ", max));
}

absl::Status ValidateLayout(const kernels::KvBlockLayout& layout) {
  RETURN_IF_ERROR(CheckField("tokens_per_block", layout.tokens_per_block, kMaxTokensPerBlock));
  RETURN_IF_ERROR(CheckField("layers", layout.layers, kMaxLayers));
  RETURN_IF_ERROR(CheckField("kv_heads", layout.kv_heads, kMaxKvHeads));
  RETURN_IF_ERROR(CheckField("head_dim", layout.head_dim, kMaxHeadDim));
  if (layout.dtype != kernels::KvDtype::kFloat32 && layout.dtype != kernels::KvDtype::kFloat16 &&
      layout.dtype != kernels::KvDtype::kBFloat16) {
    return absl::InvalidArgumentError("KV layout: unknown dtype");
  }
  const double block_bytes = static_cast<double>(layout.tokens_per_block) * 2.0 *
                             static_cast<double>(layout.layers) *
                             static_cast<double>(layout.kv_heads) *
                             static_cast<double>(layout.head_dim) *
                             static_cast<double>(kernels::KvDtypeSize(layout.dtype));
  if (block_bytes > kMaxBlockBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layout: a block would take ", block_bytes, " bytes; at most 1 TiB"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------- BlockLease

BlockLease::BlockLease(BlockPool* pool) : pool_(pool) { pool_->AddLeases(1); }

BlockLease::BlockLease(BlockLease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      blocks_(std::move(other.blocks_)),
      live_(std::move(other.live_)),
      block_index_(std::move(other.block_index_)),
      slots_(std::move(other.slots_)),
      free_(std::move(other.free_)) {
  other.Reset();
}

BlockLease& BlockLease::operator=(BlockLease&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) {
      Release();
      pool_->AddLeases(-1);
    }
    pool_ = std::exchange(other.pool_, nullptr);
    blocks_ = std::move(other.blocks_);
    live_ = std::move(other.live_);
    block_index_ = std::move(other.block_index_);
    slots_ = std::move(other.slots_);
    free_ = std::move(other.free_);
    other.Reset();
  }
  return *this;
}

BlockLease::~BlockLease() {
  if (pool_ == nullptr) return;
  Release();
  pool_->AddLeases(-1);
}

int64_t BlockLease::tokens_per_block() const { return pool_->layout().tokens_per_block; }

void BlockLease::Reset() {
  blocks_.clear();
  live_.clear();
  block_index_.clear();
  slots_.clear();
  free_.clear();
}

void BlockLease::Release() {
  KVCM_CHECK(valid());
  if (!blocks_.empty()) pool_->ReturnBlocks(blocks_);
  pool_->AddCachedTokens(-size());
  Reset();
}

absl::Status BlockLease::Append(int64_t tokens) {
  KVCM_CHECK(valid());
  if (tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot append ", tokens, " tokens"));
  }
  const int64_t tpb = tokens_per_block();
  const int64_t from_free = std::min(tokens, free_slots());
  const int64_t fresh = tokens - from_free;
  std::vector<int32_t> taken;
  if (fresh > 0) RETURN_IF_ERROR(pool_->TakeBlocks((fresh + tpb - 1) / tpb, &taken));

  slots_.reserve(slots_.size() + static_cast<size_t>(tokens));
  const auto add_token = [&](int64_t relative) {
    const size_t index = static_cast<size_t>(relative / tpb);
    ++live_[index];
    slots_.push_back(int64_t{blocks_[index]} * tpb + relative % tpb);
  };
  for (int64_t i = 0; i < from_free; ++i) {
    std::pop_heap(free_.begin(), free_.end(), std::greater<>());
    add_token(free_.back());
    free_.pop_back();
  }
  pool_->AddCachedTokens(tokens);
  int64_t placed = 0;
  for (int32_t block : taken) {
    const int64_t index = block_count();
    block_index_[block] = static_cast<int32_t>(index);
    blocks_.push_back(block);
    live_.push_back(0);
    for (int64_t offset = 0; offset < tpb; ++offset) {
      if (placed < fresh) {
        add_token(index * tpb + offset);
        ++placed;
      } else {
        free_.push_back(index * tpb + offset);
        std::push_heap(free_.begin(), free_.end(), std::greater<>());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status BlockLease::Evict(std::span<const int64_t> indices) {
  KVCM_CHECK(valid());
  for (size_t j = 0; j < indices.size(); ++j) {
    if (indices[j] < 0 || indices[j] >= size() || (j > 0 && indices[j] <= indices[j - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "evicted index ", indices[j], " (entry ", j, ") must be ascending, distinct and "
          "below the lease's ", size(), " tokens"));
    }
  }
  const int64_t tpb = tokens_per_block();
  for (int64_t index : indices) {
    const int64_t slot = slots_[static_cast<size_t>(index)];
    const int32_t lease_block = block_index_.at(static_cast<int32_t>(slot / tpb));
    --live_[static_cast<size_t>(lease_block)];
    free_.push_back(int64_t{lease_block} * tpb + slot % tpb);
    std::push_heap(free_.begin(), free_.end(), std::greater<>());
  }
  // Stable erase of the evicted entries.
  size_t write = 0;
  size_t next = 0;
  for (size_t read = 0; read < slots_.size(); ++read) {
    if (next < indices.size() && static_cast<int64_t>(read) == indices[next]) {
      ++next;
      continue;
    }
    slots_[write++] = slots_[read];
  }
  slots_.resize(write);
  pool_->AddCachedTokens(-static_cast<int64_t>(indices.size()));
  return absl::OkStatus();
}

CompactionPlan BlockLease::PlanCompaction() const {
  KVCM_CHECK(valid());
  const int64_t tpb = tokens_per_block();
  const size_t count = blocks_.size();
  const size_t keep = static_cast<size_t>((size() + tpb - 1) / tpb);

  std::vector<size_t> by_fullness(count);
  std::iota(by_fullness.begin(), by_fullness.end(), size_t{0});
  std::stable_sort(by_fullness.begin(), by_fullness.end(),
                   [&](size_t a, size_t b) { return live_[a] > live_[b]; });
  std::vector<bool> kept(count, false);
  for (size_t i = 0; i < keep; ++i) kept[by_fullness[i]] = true;

  CompactionPlan plan;
  std::vector<bool> occupied(count * static_cast<size_t>(tpb), false);
  for (int64_t slot : slots_) {
    const size_t index = static_cast<size_t>(block_index_.at(static_cast<int32_t>(slot / tpb)));
    occupied[index * static_cast<size_t>(tpb) + static_cast<size_t>(slot % tpb)] = true;
  }
  std::vector<int64_t> holes;
  for (size_t index = 0; index < count; ++index) {
    if (!kept[index]) {
      plan.released_blocks.push_back(blocks_[index]);
      continue;
    }
    plan.kept_blocks.push_back(blocks_[index]);
    for (int64_t offset = 0; offset < tpb; ++offset) {
      if (!occupied[index * static_cast<size_t>(tpb) + static_cast<size_t>(offset)]) {
        holes.push_back(int64_t{blocks_[index]} * tpb + offset);
      }
    }
  }
  size_t next_hole = 0;
  for (int64_t slot : slots_) {
    if (!kept[static_cast<size_t>(block_index_.at(static_cast<int32_t>(slot / tpb)))]) {
      KVCM_CHECK(next_hole < holes.size());
      plan.moves.push_back(kernels::KvMove{slot, holes[next_hole++]});
    }
  }
  return plan;
}

absl::StatusOr<CompactionPlan> BlockLease::Compact() {
  CompactionPlan plan = PlanCompaction();
  if (!plan.moves.empty()) {
    RETURN_IF_ERROR(pool_->storage_->MoveTokens(pool_->layout(), plan.moves));
  }
  // The plan lists its sources in cache order, so one pass rewrites them.
  size_t next = 0;
  for (int64_t& slot : slots_) {
    if (next < plan.moves.size() && slot == plan.moves[next].src_slot) {
      slot = plan.moves[next++].dst_slot;
    }
  }
  KVCM_CHECK(next == plan.moves.size());
  blocks_ = plan.kept_blocks;
  RebuildFreeSlots();
  if (!plan.released_blocks.empty()) pool_->ReturnBlocks(plan.released_blocks);
  return plan;
}

void BlockLease::RebuildFreeSlots() {
  const int64_t tpb = tokens_per_block();
  block_index_.clear();
  for (size_t index = 0; index < blocks_.size(); ++index) {
    block_index_[blocks_[index]] = static_cast<int32_t>(index);
  }
  live_.assign(blocks_.size(), 0);
  std::vector<bool> occupied(blocks_.size() * static_cast<size_t>(tpb), false);
  for (int64_t slot : slots_) {
    const int32_t index = block_index_.at(static_cast<int32_t>(slot / tpb));
    ++live_[static_cast<size_t>(index)];
    occupied[static_cast<size_t>(int64_t{index} * tpb + slot % tpb)] = true;
  }
  free_.clear();
  // Ascending order is already a valid min-heap.
  for (size_t relative = 0; relative < occupied.size(); ++relative) {
    if (!occupied[relative]) free_.push_back(static_cast<int64_t>(relative));
  }
}

// ----------------------------------------------------------------------------- BlockPool

absl::StatusOr<int64_t> BlockPool::CapacityBlocks(const BlockPoolOptions& options) {
  RETURN_IF_ERROR(ValidateLayout(options.layout));
  const int64_t block_bytes = options.layout.BlockBytes();
  if (options.memory_bytes < block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", options.rank, " KV pool: the memory cap of ", options.memory_bytes,
        " bytes is below one block of ", block_bytes, " bytes (", options.layout.tokens_per_block,
        " tokens x ", options.layout.layers, " layers x 2 x ", options.layout.kv_heads,
        " kv heads x ", options.layout.head_dim, " x ",
        kernels::KvDtypeSize(options.layout.dtype), " bytes)"));
  }
  const int64_t capacity = options.memory_bytes / block_bytes;
  if (capacity > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", options.rank, " KV pool: ",
                                                   capacity, " blocks; at most ", INT32_MAX));
  }
  return capacity;
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockPoolOptions& options,
                                                             StorageFactory make_storage) {
  ASSIGN_OR_RETURN(const int64_t capacity, CapacityBlocks(options));
  const int64_t bytes = capacity * options.layout.BlockBytes();
  ASSIGN_OR_RETURN(std::unique_ptr<KvStorage> storage, make_storage(bytes));
  KVCM_CHECK(storage != nullptr && storage->bytes() >= bytes);
  return std::unique_ptr<BlockPool>(new BlockPool(options, capacity, std::move(storage)));
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::CreateHost(
    const BlockPoolOptions& options, const HostStorageOptions& host) {
  return Create(options, [&host](int64_t bytes) { return NewHostKvStorage(bytes, host); });
}

BlockPool::BlockPool(const BlockPoolOptions& options, int64_t capacity_blocks,
                     std::unique_ptr<KvStorage> storage)
    : rank_(options.rank),
      layout_(options.layout),
      capacity_blocks_(capacity_blocks),
      storage_(std::move(storage)) {
  free_blocks_.reserve(static_cast<size_t>(capacity_blocks));
  for (int64_t block = capacity_blocks - 1; block >= 0; --block) {
    free_blocks_.push_back(static_cast<int32_t>(block));
  }
}

BlockPool::~BlockPool() {
  MutexLock lock(&mu_);
  KVCM_CHECK(leases_ == 0);
  KVCM_CHECK(static_cast<int64_t>(free_blocks_.size()) == capacity_blocks_);
  KVCM_CHECK(cached_tokens_.load() == 0);
}

absl::StatusOr<BlockLease> BlockPool::Lease(int64_t tokens) {
  BlockLease lease(this);
  RETURN_IF_ERROR(lease.Append(tokens));
  return lease;
}

absl::StatusOr<BlockLease> BlockPool::RestoreLease(const BlockLeaseState& state) {
  const int64_t tpb = layout_.tokens_per_block;
  absl::flat_hash_map<int32_t, int32_t> index;
  for (size_t i = 0; i < state.blocks.size(); ++i) {
    const int32_t block = state.blocks[i];
    if (block < 0 || block >= capacity_blocks_ || !index.emplace(block, 0).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " KV pool: block ", block, " (entry ", i, ") of a restored lease is "
          "outside the pool's ", capacity_blocks_, " blocks or listed twice"));
    }
  }
  absl::flat_hash_map<int64_t, int32_t> seen;
  for (size_t i = 0; i < state.slots.size(); ++i) {
    const int64_t slot = state.slots[i];
    if (slot < 0 || slot / tpb >= capacity_blocks_ ||
        !index.contains(static_cast<int32_t>(slot / tpb)) || !seen.emplace(slot, 0).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " KV pool: slot ", slot, " (entry ", i, ") of a restored lease is "
          "not in one of its blocks, or listed twice"));
    }
  }
  {
    MutexLock lock(&mu_);
    size_t found = 0;
    for (int32_t block : free_blocks_) found += index.contains(block) ? 1 : 0;
    if (found != state.blocks.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " KV pool: ", state.blocks.size() - found, " block(s) of a restored "
          "lease are already leased"));
    }
    free_blocks_.erase(std::remove_if(free_blocks_.begin(), free_blocks_.end(),
                                      [&](int32_t block) { return index.contains(block); }),
                       free_blocks_.end());
  }
  BlockLease lease(this);
  lease.blocks_ = state.blocks;
  lease.slots_ = state.slots;
  AddCachedTokens(lease.size());
  lease.RebuildFreeSlots();
  return lease;
}

absl::StatusOr<BlockLease> BlockPool::LeaseLike(const BlockLeaseState& foreign) {
  const int64_t tpb = layout_.tokens_per_block;
  if (static_cast<int64_t>(foreign.blocks.size()) > capacity_blocks_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", rank_, " KV pool: the lease needs ", foreign.blocks.size(),
        " blocks; the pool has ", capacity_blocks_));
  }
  absl::flat_hash_map<int64_t, int32_t> index;  // foreign block -> index in its lease
  for (size_t i = 0; i < foreign.blocks.size(); ++i) {
    if (foreign.blocks[i] < 0 || !index.emplace(foreign.blocks[i], static_cast<int32_t>(i)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " KV lease to copy: block ", foreign.blocks[i], " (entry ", i,
          ") is negative or listed twice"));
    }
  }
  absl::flat_hash_map<int64_t, int32_t> seen;
  for (size_t i = 0; i < foreign.slots.size(); ++i) {
    const int64_t slot = foreign.slots[i];
    if (slot < 0 || !index.contains(slot / tpb) || !seen.emplace(slot, 0).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " KV lease to copy: slot ", slot, " (entry ", i,
          ") is not in one of its blocks, or listed twice"));
    }
  }
  BlockLease lease(this);
  RETURN_IF_ERROR(TakeBlocks(static_cast<int64_t>(foreign.blocks.size()), &lease.blocks_));
  lease.slots_.reserve(foreign.slots.size());
  for (const int64_t slot : foreign.slots) {
    const int32_t block = lease.blocks_[static_cast<size_t>(index.at(slot / tpb))];
    lease.slots_.push_back(block * tpb + slot % tpb);
  }
  AddCachedTokens(lease.size());
  lease.RebuildFreeSlots();
  return lease;
}

std::vector<int32_t> BlockPool::FreeBlocks() const {
  MutexLock lock(&mu_);
  return free_blocks_;
}

void BlockPool::ReorderFreeBlocks(std::span<const int32_t> order) {
  MutexLock lock(&mu_);
  absl::flat_hash_map<int32_t, bool> listed_free;  // block -> placed yet
  for (int32_t block : free_blocks_) listed_free.emplace(block, false);
  std::vector<int32_t> listed;
  for (int32_t block : order) {
    auto it = listed_free.find(block);
    if (it == listed_free.end() || it->second) continue;
    it->second = true;
    listed.push_back(block);
  }
  std::vector<int32_t> reordered;
  reordered.reserve(free_blocks_.size());
  for (int32_t block : free_blocks_) {
    if (!listed_free[block]) reordered.push_back(block);
  }
  reordered.insert(reordered.end(), listed.begin(), listed.end());
  free_blocks_ = std::move(reordered);
}

BlockPoolUsage BlockPool::Usage() const {
  BlockPoolUsage usage;
  usage.rank = rank_;
  usage.space = storage_->space();
  usage.capacity_blocks = capacity_blocks_;
  usage.block_bytes = layout_.BlockBytes();
  usage.tokens_per_block = layout_.tokens_per_block;
  usage.cached_tokens = cached_tokens_.load(std::memory_order_relaxed);
  MutexLock lock(&mu_);
  usage.used_blocks = capacity_blocks_ - static_cast<int64_t>(free_blocks_.size());
  usage.leases = leases_;
  return usage;
}

void* BlockPool::BlockData(int32_t block) const {
  KVCM_CHECK(block >= 0 && block < capacity_blocks_);
  return static_cast<char*>(storage_->data()) + int64_t{block} * layout_.BlockBytes();
}

absl::Status BlockPool::TakeBlocks(int64_t count, std::vector<int32_t>* out) {
  MutexLock lock(&mu_);
  const int64_t available = static_cast<int64_t>(free_blocks_.size());
  if (count > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", rank_, " KV pool is full: ", count, " more blocks of ",
        layout_.tokens_per_block, " tokens needed, ", available, " of ", capacity_blocks_,
        " free"));
  }
  for (int64_t i = 0; i < count; ++i) {
    out->push_back(free_blocks_.back());
    free_blocks_.pop_back();
  }
  return absl::OkStatus();
}

void BlockPool::ReturnBlocks(std::span<const int32_t> blocks) {
  MutexLock lock(&mu_);
  free_blocks_.insert(free_blocks_.end(), blocks.rbegin(), blocks.rend());
}

void BlockPool::AddLeases(int64_t delta) {
  MutexLock lock(&mu_);
  leases_ += delta;
}

}  // namespace kvcm

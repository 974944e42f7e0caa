// SequenceTable: the registry of open sequences: ids, limits, and each id's
// SequenceSlot (which holds the engine state; see sequence_slot.h). Opens, routes rank
// reports to their slot, closes, introspects and reclaims idle sequences.
//
// Thread-safe. Steps of different sequences run in parallel; steps of one sequence are
// serialized by its slot. Lock order: the registry mutex `mu_` before a slot's mutex; the
// registry mutex is never held while a step computes, a sink or an event wakeup runs.
// With a KvEventLog, the slots append their events (kv_events.h has the lock order and the
// snapshot rule).
#ifndef KVCM_CACHE_MANAGER_TABLE_SEQUENCE_TABLE_H_
#define KVCM_CACHE_MANAGER_TABLE_SEQUENCE_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/base/clock.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/engine/diagnostics.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/events/kv_events.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_slot.h"
#include "cache_manager/tp/tensor_parallel_join.h"
#include "kernels/backend.h"

namespace kvcm {

// Sequence ids are 1 to this many bytes, on every call (a longer one is INVALID_ARGUMENT
// and is never echoed back).
inline constexpr size_t kMaxSequenceIdBytes = 256;

// OK when `id` can name a sequence: 1 to kMaxSequenceIdBytes bytes; INVALID_ARGUMENT
// (giving its length, not its bytes) otherwise.
absl::Status CheckSequenceId(absl::string_view id);

struct SequenceTableOptions {
  int64_t max_sequences = 65536;
  // Per tenant (SequenceInfo::tenant): the most sequences one tenant holds open (0: only
  // max_sequences), and the bytes of memory_limit_bytes one tenant's engine state may hold
  // (0: only memory_limit_bytes). Past either, its Open (or growing step) is refused with
  // RESOURCE_EXHAUSTED naming the tenant, and the other tenants are not affected.
  int64_t tenant_max_sequences = 0;
  int64_t tenant_memory_limit_bytes = 0;
  int32_t max_tp_world_size = 64;
  // The most tokens one sequence may hold over its life, prefill plus decode: a longer
  // prefill is refused at Open, a step past it with RESOURCE_EXHAUSTED.
  int64_t max_sequence_tokens = int64_t{1} << 22;
  // Caps the bytes of every sequence's engine state (momentum, positions, their scratch,
  // its decision buffers), the pending tensor-parallel partial sums, and what the
  // server charges to memory_budget() (its reply buffers), all together: an Open or a
  // step that would go past it is refused with RESOURCE_EXHAUSTED.
  int64_t memory_limit_bytes = int64_t{8} << 30;
  const Clock* clock = nullptr;  // nullptr: Clock::Real()
  // The node's KV pools, or nullptr: then sequences hold no KV memory, only decisions.
  // With pools, every sequence leases slots for its cache on every rank. Not owned; must
  // outlive the table.
  KvPools* kv_pools = nullptr;
  // Caps the partial sums held by tensor-parallel steps waiting for ranks (bytes, all
  // sequences together); past it a report is refused with RESOURCE_EXHAUSTED.
  int64_t max_pending_join_bytes = int64_t{1} << 30;
  // Where the sequences' KV events go (opened, stepped, blocks, closed), or nullptr: no
  // events, no cost. Not owned; must outlive the table.
  KvEventLog* kv_events = nullptr;
  // Eviction-quality diagnostics (cache_manager/engine/diagnostics.h): the sequences it samples
  // by id get them at Open; off by default.
  DiagnosticsOptions diagnostics = {};
  // The kernel backend (kernels/backend.h) of every sequence whose SequenceOptions name
  // none, and its device: nullptr is the CPU reference; a device backend keeps each such
  // sequence's momentum and positions on GPU `engine_device` (kvcached --backend=cuda).
  // Not owned; backends are static.
  const kernels::KernelBackend* engine_backend = nullptr;
  int engine_device = 0;
  // Joins tensor-parallel partial sums that sit one per rank on distinct devices (score
  // regions placed on each rank's GPU); null: such steps are gathered onto the sequence's
  // device first. Not owned; must outlive the table.
  CrossDeviceJoiner* cross_device_joiner = nullptr;
};

struct SequenceTableTotals {
  int64_t open_sequences = 0;
  int64_t cached_tokens = 0;
};

// The callback form of a DecisionSink, for tools and tests (it allocates per report; the
// daemon passes DecisionWaiters). Called exactly once, with the sequence's slot locked,
// on the thread of the report that completed the step (or of the Close/ReclaimIdle).
using RankDecisionCallback = absl::AnyInvocable<void(const absl::StatusOr<EvictionDecision>&)>;

// The registry's key of a tenant's sequence: "<tenant size>:<tenant><id>", unambiguous for
// any bytes in either. Built in place, so a step's lookup allocates nothing for ids up to
// kMaxSequenceIdBytes (serving engines' request ids are about 40 bytes) and tenants up to
// 96 bytes (tenants are the tokens file's names).
class SequenceKey {
 public:
  SequenceKey(absl::string_view tenant, absl::string_view id);
  absl::string_view view() const { return absl::string_view(bytes_.data(), bytes_.size()); }
  std::string str() const { return std::string(view()); }

 private:
  absl::InlinedVector<char, 24 + 96 + kMaxSequenceIdBytes> bytes_;
};

// Tenants. Every sequence belongs to the tenant that opened it: ids are unique per tenant,
// and a call naming a sequence finds only the caller's own (another tenant's is NOT_FOUND
// with exactly the message of an id that is not open). The tenant is a name the server
// authenticated; "" when it authenticates nobody.
class SequenceTable {
 private:
  // An Open's hold on its id (a null slot in slots_) and on its engine state's bytes,
  // both given back when it is destroyed unless Install made them the slot's. Move-only.
  class OpenReservation {
   public:
    OpenReservation() = default;
    OpenReservation(OpenReservation&& other) noexcept;
    OpenReservation& operator=(OpenReservation&&) = delete;
    ~OpenReservation();

   private:
    friend class SequenceTable;
    SequenceTable* table_ = nullptr;  // null: nothing to give back
    std::string tenant_;
    std::string key_;
    ByteBudget* budget_ = nullptr;  // the tenant's (or the daemon's) memory budget
    int64_t bytes_ = 0;             // taken from budget_
  };

 public:
  explicit SequenceTable(SequenceTableOptions options = {});
  ~SequenceTable();

  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;

  // Registers a sequence reported by `tp_world_size` ranks, whose reports carry
  // `score_dtype` unless they say otherwise. The id and the limits are checked first
  // (the id is reserved meanwhile), then the engine state is built and the KV leased.
  // With `options.resume` it continues from there: its cache is leased, its taken steps
  // count against max_sequence_tokens (RESOURCE_EXHAUSTED past it).
  // Errors: INVALID_ARGUMENT (options, id, world size), ALREADY_EXISTS,
  // RESOURCE_EXHAUSTED (max_sequences reached, or a KV pool full).
  // RESOURCE_EXHAUSTED also at the tenant's limits (tenant_max_sequences,
  // tenant_memory_limit_bytes); a refused Open changes nothing.
  absl::StatusOr<SequenceInfo> Open(
      std::string id, const SequenceOptions& options, int32_t tp_world_size = 1,
      kernels::ScoreDtype score_dtype = kernels::ScoreDtype::kFloat32,
      absl::string_view tenant = "");

  // Rebuilds a sequence a snapshot recorded (SequenceSlot::Record), through the checks of
  // Open, with its KV leases restored exactly when it has them (the pools must be the
  // snapshot's, its blocks free). Errors: Open's, and INVALID_ARGUMENT when the record
  // does not fit the table (its budget resolves differently, its leases do not fit).
  absl::StatusOr<SequenceInfo> Restore(const SequenceRecord& record);

  // Every open sequence as a snapshot keeps it. Pending tensor-parallel steps are not
  // included: abandon them first (AbandonPendingSteps) so their ranks send them again.
  std::vector<SequenceRecord> Records() const;

  // Hand-off, the source's side (docs/DISAGGREGATION.md). BeginExport freezes the
  // tenant's sequence for export `export_id` (SequenceSlot::BeginExport) and returns its
  // record; NOT_FOUND exactly as for an unknown id. CommitExport closes it (reason
  // "handed_off") when that export still holds it, returning its last snapshot;
  // AbortExport unfreezes it. Both NOT_FOUND
  // when it is no longer open under that export (closed by its client, or reclaimed).
  struct Exported {
    SequenceRecord record;
    // Keeps the sequence's engine state and KV leases alive until the export is finished,
    // even if its client closes it meanwhile: the blocks an export reads are never handed
    // to another sequence while it reads them.
    std::shared_ptr<const SequenceSlot> pin;
  };
  absl::StatusOr<Exported> BeginExport(absl::string_view tenant, absl::string_view id,
                                       uint64_t export_id);
  absl::StatusOr<SequenceInfo> CommitExport(absl::string_view tenant, absl::string_view id,
                                            uint64_t export_id);
  absl::Status AbortExport(absl::string_view tenant, absl::string_view id, uint64_t export_id);

  // Hand-off, the target's side: a sequence built from another daemon's record, holding
  // its id, its memory and (with pools) KV leases shaped like the source's
  // (SequenceKv::LeaseLike), but not findable until CommitImport. Destroying it gives all
  // of that back. Move-only.
  class PendingImport {
   public:
    PendingImport(PendingImport&&) = default;
    PendingImport& operator=(PendingImport&&) = delete;
    ~PendingImport() = default;
    // Each rank's lease here: blocks[i] stands for the record's kv[rank].blocks[i].
    const std::vector<BlockLeaseState>& kv() const { return kv_; }

   private:
    friend class SequenceTable;
    PendingImport(OpenReservation reservation, std::shared_ptr<SequenceSlot> slot)
        : reservation_(std::move(reservation)), slot_(std::move(slot)) {}
    OpenReservation reservation_;  // destroyed last: the id goes once the slot is gone
    std::shared_ptr<SequenceSlot> slot_;
    std::vector<BlockLeaseState> kv_;
  };
  // Errors: Open's (ALREADY_EXISTS for an id open here, the limits), INVALID_ARGUMENT when
  // the record does not fit (its budget resolves differently, its leases are malformed, it
  // has KV leases and this table no pools or the reverse).
  absl::StatusOr<PendingImport> PrepareImport(const SequenceRecord& record);
  // Makes the sequence findable; from here on it steps here.
  SequenceInfo CommitImport(PendingImport pending);

  // Forgets a sequence and returns its last snapshot; a pending tensor-parallel step is
  // abandoned (ABORTED to its waiting ranks). NOT_FOUND when unknown.
  absl::StatusOr<SequenceInfo> Close(absl::string_view id, absl::string_view tenant = "");

  // The score dtype a sequence's reports carry unless they say otherwise.
  absl::StatusOr<kernels::ScoreDtype> DefaultScoreDtype(absl::string_view id,
                                                        absl::string_view tenant = "") const;

  // One step of a single-rank sequence with already pooled scores (see Sequence::Step).
  // `decision` is overwritten and its capacity reused. NOT_FOUND when unknown;
  // FAILED_PRECONDITION when the sequence is tensor-parallel.
  absl::Status Step(absl::string_view id, int64_t step, const kernels::ScoreMatrix* scores,
                    EvictionDecision* decision, absl::string_view tenant = "");

  // One rank's report for a step of a sequence: SequenceSlot::Submit. NOT_FOUND when the
  // id is not open.
  absl::Status SubmitRankReport(absl::string_view id, const RankReport& report,
                                DecisionWaiter waiter, absl::string_view tenant = "");
  absl::Status SubmitRankReport(absl::string_view id, const RankReport& report,
                                RankDecisionCallback on_decided, absl::string_view tenant = "");

  // A snapshot; `with_cache` adds the cached positions and their momentum.
  absl::StatusOr<SequenceInfo> Inspect(absl::string_view id, bool with_cache,
                                       absl::string_view tenant = "") const;
  // The tenant's own sequences.
  std::vector<SequenceInfo> List(absl::string_view tenant = "") const;
  // Every tenant's (the daemon's own gauges).
  std::vector<SequenceInfo> ListEveryTenant() const;
  SequenceTableTotals Totals() const;
  // Bytes of partial sums held by pending tensor-parallel steps.
  int64_t pending_join_bytes() const { return join_budget_.used(); }
  // Bytes counted against memory_limit_bytes, and the budget itself, for the server to
  // charge what it holds for requests (reply buffers).
  int64_t memory_bytes() const { return memory_budget_.used(); }
  // Bytes of it freed so far, in total (a counter).
  int64_t memory_bytes_freed() const { return memory_budget_.freed(); }
  ByteBudget* memory_budget() { return &memory_budget_; }

  // Abandons every tensor-parallel step whose first report arrived more than `timeout`
  // ago and still misses ranks: its waiting ranks get DEADLINE_EXCEEDED naming the
  // missing ones, and the step may be sent again (nothing changed). Returns how many.
  int64_t AbortStaleJoins(absl::Duration timeout);

  // Abandons every pending tensor-parallel step (shutdown): waiting ranks get `why`.
  void AbandonPendingSteps(const absl::Status& why);

  // Closes every sequence not stepped, opened or inspected for `idle_timeout`; returns
  // their last snapshots.
  std::vector<SequenceInfo> ReclaimIdle(absl::Duration idle_timeout);

  // The table's KV events (null without a log).
  KvEventLog* kv_events() const { return options_.kv_events; }
  // Subscribes to them (KvEventLog::Subscribe), taking the snapshot when the subscriber
  // cannot resume: its events, then, are the snapshot and every event after its as_of.
  // FAILED_PRECONDITION without a log; RESOURCE_EXHAUSTED at the log's subscriber limit.
  absl::StatusOr<std::unique_ptr<KvEventSubscription>> SubscribeKvEvents(
      uint64_t after_event_id, absl::string_view daemon_run, std::string tenant)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Where a new sequence's KV leases come from: fresh, the record's exactly (a restart),
  // or shaped like the record's on blocks of this node (a hand-off).
  enum class KvFrom { kFresh, kRecorded, kShapedLike };
  // Open, with each rank's lease taken as `kv_from` says from `kv` (one per pool; null
  // for kFresh).
  absl::StatusOr<SequenceInfo> OpenWithKv(std::string id, const SequenceOptions& options,
                                          int32_t tp_world_size, kernels::ScoreDtype score_dtype,
                                          const std::vector<BlockLeaseState>* kv, KvFrom kv_from,
                                          absl::string_view tenant);
  // OpenWithKv up to the install: the sequence built, holding its reservation and leases.
  absl::StatusOr<PendingImport> Build(std::string id, const SequenceOptions& options,
                                      int32_t tp_world_size, kernels::ScoreDtype score_dtype,
                                      const std::vector<BlockLeaseState>* kv, KvFrom kv_from,
                                      absl::string_view tenant);
  // Restore's and PrepareImport's checks of a record against this table.
  absl::Status CheckRecord(const SequenceRecord& record) const;
  // `options` with the table's engine backend when they name none.
  SequenceOptions WithEngine(const SequenceOptions& options) const;
  // What a tenant's limits count: its open (and opening) sequences, and its engine state
  // (null without tenant_memory_limit_bytes; a child of memory_budget_).
  struct TenantUsage {
    int64_t sequences = 0;
    std::unique_ptr<ByteBudget> memory;
  };
  // Open's checks of the request against the table's limits (nothing reserved yet).
  absl::Status CheckOpen(absl::string_view id, const SequenceOptions& options,
                         int32_t tp_world_size) const;
  // Reserves the id of `tenant`, then `state_bytes` of its memory budget.
  absl::StatusOr<OpenReservation> Reserve(absl::string_view tenant, absl::string_view id,
                                          int64_t state_bytes, int64_t prefill_len)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The engine state (RESOURCE_EXHAUSTED when the machine cannot allocate it).
  absl::StatusOr<std::unique_ptr<Sequence>> BuildSequence(absl::string_view id,
                                                          const SequenceOptions& engine_options,
                                                          int64_t state_bytes) const;
  // The KV leases of a new sequence, as `kv_from` says; none without pools.
  absl::StatusOr<std::optional<SequenceKv>> LeaseKv(
      absl::string_view id, int64_t cache_size, const std::vector<BlockLeaseState>* kv_state,
      KvFrom kv_from) const;
  // Makes `slot` findable in place of the reservation (after its Opened event).
  SequenceInfo Install(OpenReservation reservation, std::shared_ptr<SequenceSlot> slot)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The budget a tenant's sequences take memory from: its own, or memory_budget_.
  ByteBudget* TenantBudgetLocked(absl::string_view tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot of an open id of `tenant`, or null (unknown, or still being opened).
  std::shared_ptr<SequenceSlot> Find(absl::string_view tenant, absl::string_view id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<SequenceSlot>> AllSlots() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status NotFound(absl::string_view id) const;
  // Removes `key` when it still maps to `slot`, and counts it out of `tenant`'s sequences.
  void Erase(absl::string_view tenant, absl::string_view key, const SequenceSlot* slot)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetLocked(absl::string_view tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes slots already taken out of slots_ (with events, listed in in_transit_ until
  // their Closed event is appended) and returns their last snapshots. The strings are the
  // sequences' ids (for messages), not keys.
  std::vector<SequenceInfo> CloseRemoved(
      std::vector<std::pair<std::string, std::shared_ptr<SequenceSlot>>> removed,
      absl::string_view message, absl::string_view reason) ABSL_LOCKS_EXCLUDED(mu_);

  const SequenceTableOptions options_;
  const Clock* const clock_;
  ByteBudget memory_budget_;
  ByteBudget join_budget_;  // its parent is memory_budget_
  mutable Mutex mu_;
  // By SequenceKey(tenant, id). A null slot reserves an id whose Open is still building it.
  absl::flat_hash_map<std::string, std::shared_ptr<SequenceSlot>> slots_ ABSL_GUARDED_BY(mu_);
  // Tenants that hold or held sequences; an entry is kept (its budget may still be
  // referred to by a closing slot) and is small: tenants are the tokens file's names.
  absl::flat_hash_map<std::string, TenantUsage> tenants_ ABSL_GUARDED_BY(mu_);
  // With events, the slots a snapshot must see besides slots_ (kv_events.h): opening ones
  // (Opened appended, or about to be, and not findable yet) and closing ones (removed from
  // slots_, Closed not appended yet).
  std::vector<std::shared_ptr<SequenceSlot>> in_transit_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TABLE_SEQUENCE_TABLE_H_

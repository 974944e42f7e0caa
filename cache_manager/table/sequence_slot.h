// SequenceSlot: everything the engine holds for one open sequence: its mutex, its
// `Sequence`, the tensor-parallel join of its pending step, its KV lease, and the ranks
// waiting for the pending step's decision. `Submit` is the one entry point for a rank's
// report, whether the sequence has one rank or several.
//
// Thread-safe: every method takes the slot's mutex. The step executor runs all reports of
// one sequence on one thread, so in the daemon that mutex is uncontended on the step path;
// Inspect, Close and the reclaimer take it from other threads.
#ifndef KVCM_CACHE_MANAGER_TABLE_SEQUENCE_SLOT_H_
#define KVCM_CACHE_MANAGER_TABLE_SEQUENCE_SLOT_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/base/clock.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/events/kv_events.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/policy/fold.h"
#include "cache_manager/table/sequence_record.h"
#include "cache_manager/tp/tensor_parallel_join.h"

namespace kvcm {

// Receives the decision of a step for one waiting report (tensor-parallel: every rank's),
// or the error that ended the step. Called exactly once per accepted report, with the
// slot's lock held (so the decision is passed by reference, not copied, to every rank):
// an implementation must not block and must not call back into the table.
class DecisionSink {
 public:
  // `decision` is meaningful only when `status` is OK.
  virtual void OnDecided(int64_t tag, const absl::Status& status,
                         const EvictionDecision& decision) = 0;

 protected:
  ~DecisionSink() = default;
};

// Who to tell: a sink and the caller's tag for this report (its index in a batch).
struct DecisionWaiter {
  DecisionSink* sink = nullptr;
  int64_t tag = 0;
};

// The daemon-wide limits a slot answers to. The budgets may be null (no cap) and must
// outlive the slot.
struct SlotLimits {
  ByteBudget* join_budget = nullptr;    // partial sums of pending tensor-parallel steps
  ByteBudget* memory_budget = nullptr;  // the engine state of every sequence
  int64_t max_sequence_tokens = std::numeric_limits<int64_t>::max();  // prefill + decode
  CrossDeviceJoiner* cross_device = nullptr;  // tensor-parallel partial sums on many devices
  const Clock* clock = Clock::Real();         // times the decisions (decide_seconds)
};

// A snapshot of one sequence.
struct SequenceInfo {
  std::string id;
  // The tenant that opened it ("" without authentication): ids are unique per tenant.
  std::string tenant;
  kernels::ScoreDtype score_dtype = kernels::ScoreDtype::kFloat32;
  int64_t prefill_len = 0;
  int64_t budget = 0;
  Policy policy;
  ScoreLayout score_layout = ScoreLayout::kPerLayer;
  int64_t layers = 0;         // folded: K
  FoldWeights fold_weights;   // folded with a score-using aggregation
  DecisionEncoding decision_encoding = DecisionEncoding::kPositions;
  int32_t tp_world_size = 1;
  int64_t last_step = 0;
  int64_t cache_size = 0;
  bool next_needs_scores = false;
  int32_t ranks_reported = 0;  // for the pending step, tensor-parallel only
  int64_t memory_bytes = 0;    // engine state and decision buffers it holds
  SequenceStats stats;
  absl::Time last_active;
  // Only when asked for: the cached positions (ascending) and their momentum, and with
  // KV pools each rank's slot of each cached token ([ranks][cache_size]).
  std::vector<int64_t> positions;
  std::vector<float> momentum;
  std::vector<std::vector<int64_t>> kv_slots;
};

class SequenceSlot {
 public:
  // `kv` is the sequence's lease (nullopt without pools). `charged_bytes`: what was taken
  // from `limits.memory_budget` for the sequence before it was built; the slot owns them
  // from now on, keeps them equal to what it holds, and gives them back when destroyed.
  // `events` (null: no KV events) must outlive the slot. `tenant`: who opened it (its
  // snapshots and events carry it).
  SequenceSlot(std::unique_ptr<Sequence> sequence, int32_t tp_world_size,
               kernels::ScoreDtype score_dtype, std::optional<SequenceKv> kv, SlotLimits limits,
               int64_t charged_bytes, absl::Time now, KvEventLog* events = nullptr,
               std::string tenant = "");
  ~SequenceSlot();

  SequenceSlot(const SequenceSlot&) = delete;
  SequenceSlot& operator=(const SequenceSlot&) = delete;

  kernels::ScoreDtype score_dtype() const { return score_dtype_; }
  int32_t tp_world_size() const { return tp_world_size_; }
  const std::string& tenant() const { return tenant_; }

  // One rank's report for the sequence's next step. A single-rank sequence accepts
  // already pooled scores (head_count 0, stepped in place without a copy) or a head sum
  // with its head count; a tensor-parallel one joins its ranks' reports first (copying
  // each, under the join budget).
  // On error the report is rejected and `waiter` is never called; a rejected report of
  // a tensor-parallel step rejects that step on every rank with the same status (the
  // ranks already waiting are told now, those still to report are told when they do).
  // Otherwise the waiter is called once: before Submit returns if this report completes
  // the step, later otherwise. NOT_FOUND once the slot is closed.
  absl::Status Submit(const RankReport& report, DecisionWaiter waiter, absl::Time now);

  // One step of a single-rank sequence with already pooled scores (see Sequence::Step).
  // `decision` is overwritten and its capacity reused. FAILED_PRECONDITION when the
  // sequence is tensor-parallel.
  absl::Status Step(int64_t step, const kernels::ScoreMatrix* scores, EvictionDecision* decision,
                    absl::Time now);

  // A snapshot; `with_cache` adds the cached positions, momentum and KV slots. `touch`
  // counts it as activity (Inspect) for the idle reclaimer. NOT_FOUND once closed.
  absl::StatusOr<SequenceInfo> Snapshot(bool with_cache, absl::Time touch);
  // The snapshot of a closed or open slot without touching it (List, Totals, Close).
  SequenceInfo Peek() const;
  // What a snapshot file keeps of this sequence (cache_manager/persist/snapshot.h): its options,
  // progress and KV leases. A pending tensor-parallel step is not part of it.
  SequenceRecord Record() const;
  int64_t cache_size() const;
  bool closed() const;

  // Marks the slot closed, abandoning a pending tensor-parallel step: its waiting ranks
  // get `why` (ABORTED). Returns the last snapshot. `reason` is the Closed event's.
  SequenceInfo Close(const absl::Status& why, absl::string_view reason = "client");

  // KV events (no-ops without a log): the Opened event, appended by the table before the
  // slot becomes findable; and this sequence's part of the snapshots in progress
  // (kv_events.h).
  void PublishOpened();
  void ContributeKvSnapshot();

  // When the pending tensor-parallel step's first report came before `cutoff` and ranks
  // are still missing, abandons it (DEADLINE_EXCEEDED naming the missing ranks and
  // `timeout`; the step may be sent again) and returns true.
  bool AbortJoinStartedBefore(absl::Time cutoff, absl::Duration timeout);

  // Abandons a pending tensor-parallel step, if any: its waiting ranks get `why`.
  void AbandonPendingStep(const absl::Status& why);

  // Whether nothing has used the slot since `cutoff`. A slot busy right now (its lock
  // held) or frozen for a hand-off is not idle.
  bool IdleSince(absl::Time cutoff);

  // Hand-off to another daemon (docs/DISAGGREGATION.md). BeginExport freezes the sequence
  // under `export_id` (!= 0) and returns its record: until EndExport, every step is
  // refused with FAILED_PRECONDITION saying it is being handed off, and nothing about it
  // changes (its KV blocks may be read). FAILED_PRECONDITION when a tensor-parallel step
  // is pending (ranks have reported it) or another export holds it; NOT_FOUND once closed.
  absl::StatusOr<SequenceRecord> BeginExport(uint64_t export_id);
  // Unfreezes it when `export_id` still holds it (an abort); returns whether it did.
  bool EndExport(uint64_t export_id);
  // The export holding it, 0 when none.
  uint64_t export_id() const;

 private:
  // A tensor-parallel step that was rejected: every rank that reports it is told once.
  struct Rejection {
    int64_t step = 0;
    absl::Status status;
    std::vector<bool> told;  // by rank
  };

  SequenceInfo SnapshotLocked(bool with_cache) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // One step with the KV slots kept in step (when the sequence has them), and its events.
  absl::Status StepLocked(int64_t step, const kernels::ScoreMatrix* scores,
                          EvictionDecision* decision,
                          MomentumState::ScoreSpace space = MomentumState::ScoreSpace::kHost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StepKvLocked(int64_t step, const kernels::ScoreMatrix* scores,
                            EvictionDecision* decision, MomentumState::ScoreSpace space)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SubmitToJoinLocked(const RankReport& report, DecisionWaiter waiter, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A report of a step already rejected on another rank gets that rejection (once per
  // rank); nullopt when there is none for it.
  std::optional<absl::Status> TakeRejectionLocked(const RankReport& report, bool known_rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `bytes` of partial sums from the join budget (RESOURCE_EXHAUSTED, nothing taken,
  // when they do not fit).
  absl::Status ChargeJoinLocked(const RankReport& report, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Joins a complete step's reports (on the device when any is there), steps, and tells
  // every waiting rank.
  void DecideJoinedLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the pending step: every waiting rank gets `status` (with the slot's decision
  // when OK); the join is reset.
  void FinishJoinLocked(const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records that the pending step failed with `status` for every rank but `rank`, and
  // tells the ranks already waiting.
  void RejectStepLocked(int64_t step, int32_t rank, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseJoinBytesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The limits of an in-order step, checked before it runs: the sequence's tokens, and
  // the memory it may grow by (taken from the memory budget). RESOURCE_EXHAUSTED, with
  // nothing taken, when the step is past one of them.
  absl::Status ReserveStepLocked(int64_t step, const EvictionDecision* decision)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bytes the engine state and the slot's decision buffers hold.
  int64_t HeldBytesLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether `report`'s scores lie in the sequence's device memory (not the host's).
  bool InDeviceMemoryLocked(const RankReport& report) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION when the sequence is frozen for a hand-off; OK otherwise.
  absl::Status CheckNotExportingLocked(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Makes the bytes charged to the memory budget what the slot holds.
  void SettleBytesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const kernels::ScoreDtype score_dtype_;
  const int32_t tp_world_size_;
  const std::string tenant_;
  const SlotLimits limits_;
  mutable Mutex mu_;
  std::unique_ptr<Sequence> sequence_ ABSL_GUARDED_BY(mu_);
  TensorParallelJoin join_ ABSL_GUARDED_BY(mu_);
  std::optional<SequenceKv> kv_ ABSL_GUARDED_BY(mu_);
  const std::unique_ptr<KvSequenceEvents> events_ ABSL_PT_GUARDED_BY(mu_);  // null: no log
  std::vector<DecisionWaiter> waiting_ ABSL_GUARDED_BY(mu_);
  std::optional<Rejection> rejection_ ABSL_GUARDED_BY(mu_);
  int64_t join_bytes_ ABSL_GUARDED_BY(mu_) = 0;       // taken from limits_.join_budget
  int64_t memory_bytes_ ABSL_GUARDED_BY(mu_) = 0;     // taken from limits_.memory_budget
  absl::Time join_started_ ABSL_GUARDED_BY(mu_);      // first report of the pending step
  EvictionDecision decision_ ABSL_GUARDED_BY(mu_);    // reused by every step
  absl::Time last_active_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t export_id_ ABSL_GUARDED_BY(mu_) = 0;  // != 0: frozen for a hand-off
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TABLE_SEQUENCE_SLOT_H_

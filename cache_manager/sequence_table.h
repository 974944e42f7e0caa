// SequenceTable: every open sequence of the daemon, by id. Opens, steps (single rank or
// tensor-parallel rank reports), closes, introspects and reclaims idle sequences.
//
// Thread-safe. Steps of different sequences run in parallel; steps of one sequence are
// serialized by that sequence's mutex. Lock order: the table mutex `mu_` is taken before a
// sequence's `Entry::mu`, and never held while a step computes or a callback runs.
#ifndef KVCM_CACHE_MANAGER_SEQUENCE_TABLE_H_
#define KVCM_CACHE_MANAGER_SEQUENCE_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/clock.h"
#include "cache_manager/eviction_decision.h"
#include "cache_manager/kv_pools.h"
#include "cache_manager/mutex.h"
#include "cache_manager/sequence.h"
#include "cache_manager/tensor_parallel_join.h"

namespace kvcm {

struct SequenceTableOptions {
  int64_t max_sequences = 65536;
  int32_t max_tp_world_size = 64;
  const Clock* clock = nullptr;  // nullptr: Clock::Real()
  // The node's KV pools, or nullptr: then sequences hold no KV memory, only decisions.
  // With pools, every sequence leases slots for its cache on every rank. Not owned; must
  // outlive the table.
  KvPools* kv_pools = nullptr;
};

// A snapshot of one sequence.
struct SequenceInfo {
  std::string id;
  kernels::ScoreDtype score_dtype = kernels::ScoreDtype::kFloat32;
  int64_t prefill_len = 0;
  int64_t budget = 0;
  Policy policy;
  int32_t tp_world_size = 1;
  int64_t last_step = 0;
  int64_t cache_size = 0;
  bool next_needs_scores = false;
  int32_t ranks_reported = 0;  // for the pending step, tensor-parallel only
  SequenceStats stats;
  absl::Time last_active;
  // Only when asked for: the cached positions (ascending) and their momentum, and with
  // KV pools each rank's slot of each cached token ([ranks][cache_size]).
  std::vector<int64_t> positions;
  std::vector<float> momentum;
  std::vector<std::vector<int64_t>> kv_slots;
};

struct SequenceTableTotals {
  int64_t open_sequences = 0;
  int64_t cached_tokens = 0;
};

// Receives the decision of a tensor-parallel step once every rank has reported, or the
// error that ended the step (the step's join failed, or the sequence was closed or
// reclaimed while it waited). Called exactly once, with no table lock held, on the thread
// of the report that completed the step (or of the Close/ReclaimIdle).
using RankDecisionCallback = absl::AnyInvocable<void(const absl::StatusOr<EvictionDecision>&)>;

class SequenceTable {
 public:
  explicit SequenceTable(SequenceTableOptions options = {});
  ~SequenceTable();

  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;

  // Registers a sequence reported by `tp_world_size` ranks, whose reports carry
  // `score_dtype` unless they say otherwise. Errors: INVALID_ARGUMENT (options, id, world
  // size), ALREADY_EXISTS, RESOURCE_EXHAUSTED (max_sequences reached).
  absl::StatusOr<SequenceInfo> Open(
      std::string id, const SequenceOptions& options, int32_t tp_world_size = 1,
      kernels::ScoreDtype score_dtype = kernels::ScoreDtype::kFloat32);

  // Forgets a sequence and returns its last snapshot; a pending tensor-parallel step is
  // abandoned (ABORTED to its waiting ranks). NOT_FOUND when unknown.
  absl::StatusOr<SequenceInfo> Close(absl::string_view id);

  // The score dtype a sequence's reports carry unless they say otherwise.
  absl::StatusOr<kernels::ScoreDtype> DefaultScoreDtype(absl::string_view id) const;

  // One step of a single-rank sequence with already pooled scores (see Sequence::Step).
  // `decision` is overwritten and its capacity reused. NOT_FOUND when unknown;
  // FAILED_PRECONDITION when the sequence is tensor-parallel.
  absl::Status Step(absl::string_view id, int64_t step, const kernels::ScoreMatrix* scores,
                    EvictionDecision* decision);

  // One rank's report for a step of a sequence opened with tp_world_size ranks. A
  // single-rank sequence accepts already pooled scores (head_count 0, stepped in place
  // without a copy) or a head sum with its head count. On error the report is rejected,
  // `on_decided` is not called, and nothing changes. Otherwise `on_decided` is called once:
  // immediately if this report completes the step, later otherwise.
  absl::Status SubmitRankReport(absl::string_view id, const RankReport& report,
                                RankDecisionCallback on_decided);

  // A snapshot; `with_cache` adds the cached positions and their momentum.
  absl::StatusOr<SequenceInfo> Inspect(absl::string_view id, bool with_cache) const;
  std::vector<SequenceInfo> List() const;
  SequenceTableTotals Totals() const;

  // Abandons every tensor-parallel step whose first report arrived more than `timeout`
  // ago and still misses ranks: its waiting ranks get DEADLINE_EXCEEDED naming the
  // missing ones, and the step may be sent again (nothing changed). Returns how many.
  int64_t AbortStaleJoins(absl::Duration timeout);

  // Closes every sequence not stepped, opened or inspected for `idle_timeout`; returns
  // their last snapshots.
  std::vector<SequenceInfo> ReclaimIdle(absl::Duration idle_timeout);

 private:
  struct Entry {
    Entry(std::unique_ptr<Sequence> s, int32_t world_size, kernels::ScoreDtype dtype)
        : sequence(std::move(s)), join(world_size), score_dtype(dtype) {}
    mutable Mutex mu;
    std::unique_ptr<Sequence> sequence ABSL_GUARDED_BY(mu);
    TensorParallelJoin join ABSL_GUARDED_BY(mu);
    const kernels::ScoreDtype score_dtype;
    std::optional<SequenceKv> kv ABSL_GUARDED_BY(mu);  // with KV pools
    std::vector<RankDecisionCallback> waiting ABSL_GUARDED_BY(mu);
    absl::Time join_started ABSL_GUARDED_BY(mu);  // first report of the pending step
    EvictionDecision decision ABSL_GUARDED_BY(mu);  // reused by tensor-parallel steps
    absl::Time last_active ABSL_GUARDED_BY(mu);
    bool closed ABSL_GUARDED_BY(mu) = false;
  };

  std::shared_ptr<Entry> Find(absl::string_view id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status NotFound(absl::string_view id) const;
  static SequenceInfo Snapshot(const Entry& entry, bool with_cache)
      ABSL_SHARED_LOCKS_REQUIRED(entry.mu);
  // One step of the entry's sequence, with its KV slots kept in step (when it has them).
  absl::Status StepEntry(Entry& entry, int64_t step, const kernels::ScoreMatrix* scores,
                         EvictionDecision* decision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(entry.mu);
  // Adds `report` to the entry's pending step. When it completes the step, runs it and
  // moves every waiting callback (this report's included) to `callbacks` with the result.
  absl::Status AddToJoin(Entry& entry, absl::string_view id, const RankReport& report,
                         RankDecisionCallback on_decided,
                         absl::StatusOr<EvictionDecision>* result,
                         std::vector<RankDecisionCallback>* callbacks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(entry.mu);
  // Marks `entry` closed and hands back the callbacks of its pending step.
  static std::vector<RankDecisionCallback> Abandon(Entry& entry) ABSL_LOCKS_EXCLUDED(entry.mu);

  const SequenceTableOptions options_;
  const Clock* const clock_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_SEQUENCE_TABLE_H_

// ExportTable: the source's side of a hand-off (docs/DISAGGREGATION.md). An export freezes
// one sequence (its steps are refused, nothing about it changes), describes it (its record
// in the snapshot format and each rank's KV blocks), lets the target read those blocks,
// and ends in a commit (the sequence is closed here: the target holds it) or an abort
// (it is served here again, unchanged). An export the target does not finish within its
// lease is aborted by AbortExpired, so a target that dies leaves the source serving.
//
// Bounded: at most max_exports in progress (RESOURCE_EXHAUSTED past it), and the outcome
// of the last max_remembered finished ones kept so that a repeated Finish (a lost reply)
// gets the same answer.
//
// Thread-safe. Reads of an export's blocks (CopyBlocks) hold the table's lock shared, and
// Finish and AbortExpired hold it exclusively: once an export is finished no read of its
// blocks is in progress. Until then the export holds the sequence's slot, so its blocks
// stay leased to it even when its client closes it meanwhile (the commit then fails).
#ifndef KVCM_CACHE_MANAGER_HANDOFF_EXPORTS_H_
#define KVCM_CACHE_MANAGER_HANDOFF_EXPORTS_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/base/clock.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"

namespace kvcm {

struct ExportOptions {
  int64_t max_exports = 256;
  absl::Duration lease = absl::Seconds(30);
  int64_t max_remembered = 4096;
  const Clock* clock = nullptr;  // nullptr: Clock::Real()
};

// What a target needs to import the sequence.
struct ExportTicket {
  uint64_t export_id = 0;
  std::string record;  // EncodeSequenceRecord
  // Per rank of the pools: the sequence's blocks in lease order (pool block ids).
  std::vector<std::vector<int32_t>> blocks;
  absl::Time deadline;
};

// How Finish left an export.
struct ExportEnd {
  bool committed = false;
  bool now = false;           // this call ended it (a repeated Finish: false)
  std::string policy_preset;  // committed now: the closed sequence's preset (for metrics)
};

class ExportTable {
 public:
  // `pools` may be null (no KV pools: only the record moves). Neither is owned.
  ExportTable(SequenceTable* table, KvPools* pools, ExportOptions options = {});
  ~ExportTable();

  ExportTable(const ExportTable&) = delete;
  ExportTable& operator=(const ExportTable&) = delete;

  // Freezes the tenant's sequence and describes it. Errors: the table's (NOT_FOUND exactly
  // as an unknown id; FAILED_PRECONDITION for a pending tensor-parallel step or another
  // export in progress), RESOURCE_EXHAUSTED at max_exports.
  absl::StatusOr<ExportTicket> Begin(absl::string_view tenant, absl::string_view id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Appends whole blocks [first, first + count) of rank `rank`'s lease (indices into
  // the ticket's blocks) to `out`. NOT_FOUND for an export not in progress;
  // INVALID_ARGUMENT for a rank or range outside it; the storage's errors.
  absl::Status CopyBlocks(uint64_t export_id, int32_t rank, int64_t first, int64_t count,
                          std::string* out) const ABSL_LOCKS_EXCLUDED(mu_);

  // Commits (closes the sequence: the target holds it) or aborts the export, and answers
  // whether it is committed. Idempotent for the last max_remembered exports. Errors:
  // NOT_FOUND for an export never known (or long forgotten); FAILED_PRECONDITION for a
  // commit of an export already aborted (its lease ran out: the source serves it again);
  // NOT_FOUND for a commit when the sequence was closed here meanwhile (by its client).
  absl::StatusOr<ExportEnd> Finish(uint64_t export_id, bool commit) ABSL_LOCKS_EXCLUDED(mu_);

  // Aborts every export past its lease; returns how many.
  int64_t AbortExpired() ABSL_LOCKS_EXCLUDED(mu_);

  int64_t in_progress() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration lease() const { return options_.lease; }

 private:
  struct Export {
    std::string tenant;
    std::string id;
    std::vector<std::vector<int32_t>> blocks;
    absl::Time deadline;
    // The sequence's slot, so that its blocks stay its own while they may be read.
    std::shared_ptr<const SequenceSlot> pin;
  };
  // Remembers how export `export_id` ended (bounded: the oldest is forgotten).
  void RememberLocked(uint64_t export_id, bool committed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SequenceTable* const table_;
  KvPools* const pools_;
  const ExportOptions options_;
  const Clock* const clock_;
  mutable Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t starting_ ABSL_GUARDED_BY(mu_) = 0;  // Begin calls between their check and insert
  absl::flat_hash_map<uint64_t, Export> exports_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, bool> finished_ ABSL_GUARDED_BY(mu_);  // id -> committed
  std::deque<uint64_t> finished_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_HANDOFF_EXPORTS_H_

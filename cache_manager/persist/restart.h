// Restart: takes a running engine's state as an EngineSnapshot (cache_manager/persist/snapshot.h)
// and puts one back into a fresh engine. The daemon (server/daemon.cc) decides when, and
// where the file lives; this is the part that knows the table and the pools.
// Thread-compatible: call with no step running (the drain, after the engine stopped; the
// start, before serving).
#ifndef KVCM_CACHE_MANAGER_PERSIST_RESTART_H_
#define KVCM_CACHE_MANAGER_PERSIST_RESTART_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/persist/snapshot.h"
#include "cache_manager/table/sequence_table.h"

namespace kvcm {

// Every open sequence of `table` and the state of `pools` (null: none). REQUIRES: no
// pending tensor-parallel step (SequenceTable::AbandonPendingSteps first).
EngineSnapshot CaptureEngine(const SequenceTable& table, const KvPools* pools, int64_t pid);

// OK when the pools `snapshot` records are those a daemon configured with `ranks` pools of
// `layout` under `memory_bytes_per_rank` would make (0 ranks: no pools), in shared memory;
// FAILED_PRECONDITION naming the first difference otherwise.
absl::Status CheckPoolsMatch(const EngineSnapshot& snapshot, int32_t ranks,
                             const kernels::KvBlockLayout& layout, int64_t memory_bytes_per_rank);

struct RestoreReport {
  int64_t restored = 0;
  std::vector<std::string> failures;  // one per sequence not restored, naming why
};

// Restores every sequence of `snapshot` into `table` (whose pools, when it has them, are
// the snapshot's, re-attached and unleased), then gives the pools back the order in which
// they handed out free blocks. A sequence that does not fit (the limits shrank, say) is
// left out and listed in the report; the others are restored.
// `stream_lane_of` (may be empty): the stream lane (kernels/stream_lanes.h) of the engine
// thread that will step a sequence, by its id: its device work is enqueued there for its
// whole life, as if that thread had opened it. Empty: the calling thread's lane.
RestoreReport RestoreEngine(const EngineSnapshot& snapshot, SequenceTable* table, KvPools* pools,
                            const std::function<int(absl::string_view id)>& stream_lane_of = {});

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_PERSIST_RESTART_H_

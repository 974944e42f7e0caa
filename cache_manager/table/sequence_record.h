// SequenceRecord: everything one open sequence's next step depends on, in plain values: what
// SequenceTable::Records gives and SequenceTable::Restore takes. The snapshot file
// (cache_manager/persist/snapshot.h) is a list of them; a hand-off between daemons carries one.
#ifndef KVCM_CACHE_MANAGER_TABLE_SEQUENCE_RECORD_H_
#define KVCM_CACHE_MANAGER_TABLE_SEQUENCE_RECORD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cache_manager/engine/sequence.h"
#include "cache_manager/kv/block_pool.h"
#include "kernels/score_matrix.h"

namespace kvcm {

// One open sequence. `options` are what SequenceTable::Open takes to rebuild it: the
// policy resolved field by field (preset kept as its label), the budget as tokens, and
// `resume` holding the progress.
struct SequenceRecord {
  // The tenant the sequence belongs to (SequenceInfo::tenant; "" without --auth_tokens_file).
  std::string tenant;
  std::string id;
  SequenceOptions options;
  int64_t budget = 0;  // resolved; checked again at restore
  int32_t tp_world_size = 1;
  kernels::ScoreDtype score_dtype = kernels::ScoreDtype::kFloat32;
  std::vector<BlockLeaseState> kv;  // per rank; empty without pools
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_TABLE_SEQUENCE_RECORD_H_

// ReplayBackend: where kvcache-replay sends a trace. The embedded backend steps an
// in-process SequenceTable; the daemon backend (clients/replay/grpc_backend.h) sends the
// same steps to a running kvcached. Both must give the same decisions.
#ifndef KVCM_CLIENTS_REPLAY_REPLAY_BACKEND_H_
#define KVCM_CLIENTS_REPLAY_REPLAY_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/table/sequence_table.h"
#include "clients/replay/trace.h"

namespace kvcm::replay {

class ReplayBackend {
 public:
  virtual ~ReplayBackend() = default;

  // Opens sequence `id` with `tp_ranks` tensor-parallel ranks.
  virtual absl::Status Open(const std::string& id, const SequenceOptions& options,
                            int32_t tp_ranks) = 0;
  // Sends one step (split into tp_ranks rank reports when tp_ranks > 1) and returns the
  // decision, which every rank must have received identically.
  virtual absl::Status Step(const std::string& id, const TraceStep& step,
                            EvictionDecision* decision) = 0;
  // The cache after the last step: positions and momentum.
  virtual absl::StatusOr<SequenceInfo> Inspect(const std::string& id) = 0;
  virtual absl::Status Close(const std::string& id) = 0;
};

// The in-process backend over a SequenceTable.
std::unique_ptr<ReplayBackend> NewEmbeddedBackend();

// How kvcache-replay splits pooled scores into rank reports for --tp N: rank p holds
// h_p = 1 + (p % 2) heads that each saw the pooled row, so its partial sum is s * h_p.
// Multiplying by 1 or 2 is exact in float32, and the join's double sum divided by the
// total head count gives back exactly s: the decisions must not change.
int64_t SimulatedHeadsOfRank(int32_t rank);
void SplitIntoRankPartial(const TraceStep& step, int32_t rank, std::vector<float>* partial);

// The order in which the ranks of step `step` report: rotated every step so that every
// rank is sometimes first and sometimes last.
std::vector<int32_t> RankArrivalOrder(int64_t step, int32_t ranks);

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_REPLAY_BACKEND_H_

// How kvcache-replay's daemon backend sends a report's scores; its own header so that an
// engine-only build (no gRPC) still parses --transport.
#ifndef KVCM_CLIENTS_REPLAY_SCORE_TRANSPORT_H_
#define KVCM_CLIENTS_REPLAY_SCORE_TRANSPORT_H_

#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace kvcm::replay {

// How a report's scores reach the daemon.
enum class ScoreTransport : uint8_t {
  kGrpc,  // inline in the StepReport
  // Written into a shared-memory score region (one per rank stream) that the report
  // references; the daemon must run with --allow_shm_scores on this node.
  kShm,
  // Written into a score region the daemon created (CreateScoreRegion, one per rank
  // stream; host memory: the daemon's engine must not be CUDA); also --allow_shm_scores.
  kCreated,
  // The same, each rank's region placed on that rank's device (CreateScoreRegion with a
  // rank): on a device engine, a tensor-parallel step's partial sums sit one per rank on
  // distinct devices and are joined across them.
  kCreatedPerRank,
};

// "grpc" / "shm" / "created" / "created_per_rank", and back (nullopt for any other name).
inline absl::string_view ScoreTransportName(ScoreTransport transport) {
  switch (transport) {
    case ScoreTransport::kShm: return "shm";
    case ScoreTransport::kCreated: return "created";
    case ScoreTransport::kCreatedPerRank: return "created_per_rank";
    case ScoreTransport::kGrpc: break;
  }
  return "grpc";
}
inline std::optional<ScoreTransport> ParseScoreTransport(absl::string_view name) {
  if (name == "grpc") return ScoreTransport::kGrpc;
  if (name == "shm") return ScoreTransport::kShm;
  if (name == "created") return ScoreTransport::kCreated;
  if (name == "created_per_rank") return ScoreTransport::kCreatedPerRank;
  return std::nullopt;
}

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_SCORE_TRANSPORT_H_

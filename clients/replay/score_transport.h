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
};

// "grpc" / "shm", and back (nullopt for any other name).
inline absl::string_view ScoreTransportName(ScoreTransport transport) {
  return transport == ScoreTransport::kShm ? "shm" : "grpc";
}
inline std::optional<ScoreTransport> ParseScoreTransport(absl::string_view name) {
  if (name == "grpc") return ScoreTransport::kGrpc;
  if (name == "shm") return ScoreTransport::kShm;
  return std::nullopt;
}

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_SCORE_TRANSPORT_H_

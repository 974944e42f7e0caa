// The daemon backend of kvcache-replay: sends the trace's steps to a running kvcached
// over the C++ client, one step stream per tensor-parallel rank, with the scores inline or
// in a shared-memory score region per rank stream (ScoreTransport).
#ifndef KVCM_CLIENTS_REPLAY_GRPC_BACKEND_H_
#define KVCM_CLIENTS_REPLAY_GRPC_BACKEND_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "clients/cpp/kvcache_client.h"
#include "clients/replay/replay_backend.h"

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

struct GrpcBackendOptions {
  std::string address;  // host:port or unix:/path of the kvcached
  ScoreTransport transport = ScoreTransport::kGrpc;
  // TLS and bearer token (its address is ignored: `address` above).
  client::ClientOptions connection = {};
  // Open takes a sequence the daemon already has open (ALREADY_EXISTS: restored from a
  // snapshot) as it is, and steps it from where it is. For restart tests.
  bool adopt_open_sequences = false;
};

absl::StatusOr<std::unique_ptr<ReplayBackend>> NewGrpcBackend(const GrpcBackendOptions& options);

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_GRPC_BACKEND_H_

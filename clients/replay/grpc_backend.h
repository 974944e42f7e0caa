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
#include "clients/replay/score_transport.h"

namespace kvcm::replay {

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

// The daemon backend of kvcache-replay: sends the trace's steps to a running kvcached
// over the C++ client, one step stream per tensor-parallel rank.
#ifndef KVCM_CLIENTS_REPLAY_GRPC_BACKEND_H_
#define KVCM_CLIENTS_REPLAY_GRPC_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "clients/replay/replay_backend.h"

namespace kvcm::replay {

absl::StatusOr<std::unique_ptr<ReplayBackend>> NewGrpcBackend(const std::string& address);

}  // namespace kvcm::replay

#endif  // KVCM_CLIENTS_REPLAY_GRPC_BACKEND_H_

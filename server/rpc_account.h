// RpcAccount: the one accounting of every RPC, unary and streaming (docs/METRICS.md: the
// requests and their failures by code), after Mooncake's single RPC wrapper.
#ifndef KVCM_SERVER_RPC_ACCOUNT_H_
#define KVCM_SERVER_RPC_ACCOUNT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "server/metrics.h"

namespace kvcm::server {

// Every RPC records through one of these (the service's UnaryCall for unary calls) and
// nothing else in server/ calls ServerMetrics::Request or Error. A value; thread-safe (the
// metrics are).
class RpcAccount {
 public:
  RpcAccount(Rpc rpc, ServerMetrics* metrics) : rpc_(rpc), metrics_(metrics) {}

  Rpc rpc() const { return rpc_; }
  // One request of `bytes` arrived.
  void Received(int64_t bytes) const { metrics_->Request(rpc_, bytes); }
  // One failure with `code`.
  void Failed(absl::StatusCode code) const { metrics_->Error(rpc_, code); }
  // Counts `status` when it is a failure; returns it.
  const absl::Status& Record(const absl::Status& status) const {
    if (!status.ok()) Failed(status.code());
    return status;
  }

 private:
  Rpc rpc_;
  ServerMetrics* metrics_;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_RPC_ACCOUNT_H_

// HealthService: grpc.health.v1.Health for "" (the whole server) and
// "kvcache.v1.KvCache". Check answers Kubernetes' gRPC probes; Watch streams every change.
// Both say NOT_SERVING while the daemon's self-probe (ProbeListener, run by the daemon on
// its own thread) finds that the listener no longer accepts fresh connections: answered
// over a connection opened before, that makes the liveness probe fail, so Kubernetes
// restarts a pod whose listener wedged.
// On Shutdown each watcher is sent NOT_SERVING and its call ends, so that watchers never
// hold up a drain (gRPC's built-in health service keeps them open until the deadline).
// Thread-safe. Lock order: HealthService::mu_, then a watcher's own mutex.
#ifndef KVCM_SERVER_HEALTH_SERVICE_H_
#define KVCM_SERVER_HEALTH_SERVICE_H_

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cache_manager/base/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace kvcm::server {

class HealthWatcher;

class HealthService final : public ::grpc::health::v1::Health::CallbackService {
 public:
  using Status = ::grpc::health::v1::HealthCheckResponse::ServingStatus;

  HealthService() = default;
  ~HealthService() override;

  void SetServing(bool serving);
  // What the last self-probe found (true until told otherwise).
  void SetListenerAccepting(bool accepting);
  // NOT_SERVING from now on; every Watch call ends after telling its client so.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const ::grpc::health::v1::HealthCheckRequest* request,
                                  ::grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<::grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const ::grpc::health::v1::HealthCheckRequest* request) override;

  // Called by a watcher when its call is done.
  void WatcherDone(HealthWatcher* watcher);

 private:
  // The status of `service`, or SERVICE_UNKNOWN.
  Status StatusOf(const std::string& service) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool listener_accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<HealthWatcher*> watchers_ ABSL_GUARDED_BY(mu_);
};

// Whether the gRPC server at `address` (host:port, a wildcard host meaning loopback, or
// unix:/path) accepts and answers a fresh connection: connects, sends HTTP/2's client
// preface and an empty SETTINGS frame and waits for the server's SETTINGS frame, all
// within `timeout`. TCP: `bound(local_port)` runs between bind and connect (so that the
// listener can tell the probe's connection from a client's). Blocks: never call it on a
// gRPC thread. UNAVAILABLE or DEADLINE_EXCEEDED with what failed.
// `tls`: the port speaks TLS; the probe then completes a TLS handshake instead (TlsHandshake,
// server/tls.h), which needs no client certificate even under mTLS (a client certificate
// is what an HTTP/2 exchange over it would need, and the daemon holds none of its clients').
absl::Status ProbeListener(const std::string& address, absl::Duration timeout,
                           absl::FunctionRef<void(int local_port)> bound, bool tls = false);

}  // namespace kvcm::server

#endif  // KVCM_SERVER_HEALTH_SERVICE_H_

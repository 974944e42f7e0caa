#include "server/health_service.h"

#include <optional>

namespace kvcm::server {

namespace health = ::grpc::health::v1;

// One Watch call: writes the current status, then each change; the last status wins when
// changes come faster than the client reads.
class HealthWatcher : public grpc::ServerWriteReactor<health::HealthCheckResponse> {
 public:
  HealthWatcher(HealthService* service, std::string name)
      : service_(service), name_(std::move(name)) {}

  const std::string& name() const { return name_; }

  // A new status to send; `last` ends the call once it is written.
  void Update(HealthService::Status status, bool last) {
    bool write = false;
    {
      MutexLock lock(&mu_);
      if (done_) return;
      pending_ = status;
      closing_ = closing_ || last;
      if (!writing_) {
        writing_ = true;
        TakePendingLocked();
        write = true;
      }
    }
    if (write) StartWrite(&out_);
  }

  void OnWriteDone(bool ok) override {
    bool write = false;
    bool finish = false;
    {
      MutexLock lock(&mu_);
      if (!ok) {
        writing_ = false;
        done_ = true;
        finish = true;
      } else if (pending_.has_value()) {
        TakePendingLocked();
        write = true;
      } else {
        writing_ = false;
        if (closing_ && !done_) {
          done_ = true;
          finish = true;
        }
      }
    }
    if (write) StartWrite(&out_);
    if (finish) Finish(grpc::Status::OK);
  }

  void OnCancel() override {
    bool finish = false;
    {
      MutexLock lock(&mu_);
      if (!done_ && !writing_) {
        done_ = true;
        finish = true;
      }
      closing_ = true;
    }
    if (finish) Finish(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    service_->WatcherDone(this);
    delete this;
  }

 private:
  void TakePendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out_.set_status(*pending_);
    pending_.reset();
  }

  HealthService* const service_;
  const std::string name_;
  Mutex mu_;
  health::HealthCheckResponse out_;  // the write in flight
  std::optional<HealthService::Status> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::~HealthService() = default;

HealthService::Status HealthService::StatusOf(const std::string& service) const {
  if (!service.empty() && service != "kvcache.v1.KvCache") {
    return health::HealthCheckResponse::SERVICE_UNKNOWN;
  }
  return serving_ && !shut_down_ ? health::HealthCheckResponse::SERVING
                                 : health::HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  MutexLock lock(&mu_);
  if (shut_down_) return;
  serving_ = serving;
  for (HealthWatcher* w : watchers_) w->Update(StatusOf(w->name()), /*last=*/false);
}

void HealthService::Shutdown() {
  MutexLock lock(&mu_);
  shut_down_ = true;
  for (HealthWatcher* w : watchers_) w->Update(StatusOf(w->name()), /*last=*/true);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const health::HealthCheckRequest* request,
                                               health::HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  ReaderMutexLock lock(&mu_);
  const Status status = StatusOf(request->service());
  if (status == health::HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                 "unknown service '" + request->service() + "'"));
  } else {
    response->set_status(status);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<health::HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* /*context*/, const health::HealthCheckRequest* request) {
  auto* watcher = new HealthWatcher(this, request->service());
  MutexLock lock(&mu_);
  watchers_.insert(watcher);
  watcher->Update(StatusOf(request->service()), /*last=*/shut_down_);
  return watcher;
}

void HealthService::WatcherDone(HealthWatcher* watcher) {
  MutexLock lock(&mu_);
  watchers_.erase(watcher);
}

}  // namespace kvcm::server

#include "server/health_service.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/tls.h"

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
  return serving_ && !shut_down_ && listener_accepting_ ? health::HealthCheckResponse::SERVING
                                                        : health::HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetListenerAccepting(bool accepting) {
  MutexLock lock(&mu_);
  if (shut_down_ || listener_accepting_ == accepting) return;
  listener_accepting_ = accepting;
  for (HealthWatcher* w : watchers_) w->Update(StatusOf(w->name()), /*last=*/false);
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

namespace {

// Waits for `events` on `fd` until `deadline`; false on timeout or error.
bool WaitFor(int fd, int16_t events, absl::Time deadline) {
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return false;
    pollfd p = {fd, events, 0};
    const int ready = poll(&p, 1, static_cast<int>(ms));
    if (ready < 0 && errno == EINTR) continue;
    return ready > 0 && (p.revents & events) != 0;
  }
}

// A connected (or connecting) non-blocking socket to `address`, or -1 with *error set.
int ConnectTo(const std::string& address, absl::FunctionRef<void(int)> bound,
              std::string* error) {
  if (absl::StartsWith(address, "unix:")) {
    const std::string path = address.substr(5);
    sockaddr_un un{};
    if (path.size() >= sizeof(un.sun_path)) {
      *error = "unix socket path too long";
      return -1;
    }
    un.sun_family = AF_UNIX;
    std::memcpy(un.sun_path, path.c_str(), path.size() + 1);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || (connect(fd, reinterpret_cast<sockaddr*>(&un), sizeof(un)) != 0 &&
                   errno != EINPROGRESS && errno != EAGAIN)) {
      *error = absl::StrCat("connect: ", std::strerror(errno));
      if (fd >= 0) close(fd);
      return -1;
    }
    return fd;
  }
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  // A wildcard address listens on loopback too.
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  if (const int e = getaddrinfo(host.c_str(), port.c_str(), &hints, &resolved); e != 0) {
    *error = absl::StrCat("resolve ", host, ": ", gai_strerror(e));
    return -1;
  }
  const int fd = socket(resolved->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  local.ss_family = static_cast<sa_family_t>(resolved->ai_family);
  socklen_t length = resolved->ai_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&local), length) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  if (ok) {
    bound(ntohs(local.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&local)->sin_port));
    ok = connect(fd, resolved->ai_addr, resolved->ai_addrlen) == 0 || errno == EINPROGRESS;
  }
  if (!ok) *error = absl::StrCat("connect: ", std::strerror(errno));
  freeaddrinfo(resolved);
  if (!ok && fd >= 0) close(fd);
  return ok ? fd : -1;
}

}  // namespace

absl::Status ProbeListener(const std::string& address, absl::Duration timeout,
                           absl::FunctionRef<void(int local_port)> bound, bool tls) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string error;
  const int fd = ConnectTo(address, bound, &error);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("probe of ", address, ": ", error));
  if (tls) {
    const absl::Status handshake = TlsHandshake(fd, deadline);
    close(fd);
    if (handshake.ok()) return handshake;
    return absl::Status(handshake.code(),
                        absl::StrCat("probe of ", address, ": ", handshake.message()));
  }
  // HTTP/2's client connection preface, then an empty SETTINGS frame (RFC 9113 3.4).
  static constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
  constexpr size_t kPrefaceBytes = sizeof(kPreface) - 1;
  absl::Status status;
  size_t sent = 0;
  while (status.ok() && sent < kPrefaceBytes) {
    if (!WaitFor(fd, POLLOUT, deadline)) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "probe of ", address, ": not connected within ", absl::FormatDuration(timeout)));
      break;
    }
    const ssize_t n = send(fd, kPreface + sent, kPrefaceBytes - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      status = absl::UnavailableError(
          absl::StrCat("probe of ", address, ": send: ", std::strerror(errno)));
    }
    if (n > 0) sent += static_cast<size_t>(n);
  }
  // The server's preface is a SETTINGS frame: 3 bytes of length, then type 0x4.
  unsigned char header[9];
  size_t got = 0;
  while (status.ok() && got < sizeof(header)) {
    if (!WaitFor(fd, POLLIN, deadline)) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "probe of ", address, ": no HTTP/2 settings within ", absl::FormatDuration(timeout)));
      break;
    }
    const ssize_t n = recv(fd, header + got, sizeof(header) - got, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      status = absl::UnavailableError(absl::StrCat("probe of ", address,
                                                   ": the connection was closed (",
                                                   n == 0 ? "EOF" : std::strerror(errno), ")"));
    }
    if (n > 0) got += static_cast<size_t>(n);
  }
  if (status.ok() && header[3] != 0x4) {
    status = absl::UnavailableError(
        absl::StrCat("probe of ", address, ": the server's first frame is not SETTINGS"));
  }
  close(fd);
  return status;
}

}  // namespace kvcm::server

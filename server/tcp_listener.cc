#include "server/tcp_listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcm::server {
namespace {

// "host:port" or "[v6]:port" -> host and port; false when malformed.
bool SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  int port_number = 0;
  return absl::SimpleAtoi(*port, &port_number) && port_number >= 0 && port_number <= 65535;
}

int OpenSpare() { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

// The peer's port when it is on loopback, else -1.
int LoopbackPeerPort(int fd) {
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return -1;
  if (peer.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&peer);
    if ((ntohl(in->sin_addr.s_addr) >> 24) != 127) return -1;
    return ntohs(in->sin_port);
  }
  if (peer.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&peer);
    if (!IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return -1;
    return ntohs(in6->sin6_port);
  }
  return -1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Bind(const std::string& address,
                                                               int64_t max_connections) {
  std::string host, port;
  if (!SplitHostPort(address, &host, &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address, "' is not host:port"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  if (const int error = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints,
                                    &resolved);
      error != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address, "': ", gai_strerror(error)));
  }
  std::string last_error = "no address";
  std::vector<int> fds;
  int bound_port = 0;
  const bool several = resolved->ai_next != nullptr;
  for (const addrinfo* a = resolved; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // With several addresses, each socket takes only its own family (a dual-stack [::]
    // would collide with 0.0.0.0), and the later ones the first one's port.
    if (a->ai_family == AF_INET6 && several) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    }
    sockaddr_storage address_with_port{};
    std::memcpy(&address_with_port, a->ai_addr, a->ai_addrlen);
    if (!fds.empty()) {
      const uint16_t port_bytes = htons(static_cast<uint16_t>(bound_port));
      if (a->ai_family == AF_INET6) {
        reinterpret_cast<sockaddr_in6*>(&address_with_port)->sin6_port = port_bytes;
      } else {
        reinterpret_cast<sockaddr_in*>(&address_with_port)->sin_port = port_bytes;
      }
    }
    if (bind(fd, reinterpret_cast<const sockaddr*>(&address_with_port), a->ai_addrlen) != 0 ||
        listen(fd, SOMAXCONN) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    if (fds.empty()) {
      sockaddr_storage bound{};
      socklen_t length = sizeof(bound);
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
      bound_port = bound.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                       : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    }
    fds.push_back(fd);
  }
  freeaddrinfo(resolved);
  if (fds.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", last_error));
  }
  auto listener =
      std::unique_ptr<TcpListener>(new TcpListener(std::move(fds), bound_port, max_connections));
  if (listener->wake_fd_ < 0 || listener->spare_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("listener on ", address, ": ",
                                               std::strerror(errno)));
  }
  return listener;
}

TcpListener::TcpListener(std::vector<int> listen_fds, int port, int64_t max_connections)
    : listen_fds_(std::move(listen_fds)),
      port_(port),
      max_connections_(max_connections),
      wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      spare_fd_(OpenSpare()) {}

TcpListener::~TcpListener() {
  Stop();
  for (const int fd : listen_fds_) close(fd);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (spare_fd_ >= 0) close(spare_fd_);
}

void TcpListener::Start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor) {
  acceptor_ = std::move(acceptor);
  thread_ = std::thread([this] { AcceptLoop(); });
}

void TcpListener::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  // Closing the socket makes the kernel refuse new connections at once; what waited in
  // the backlog is reset.
  for (const int fd : listen_fds_) shutdown(fd, SHUT_RDWR);
}

void TcpListener::AcceptLoop() {
  std::vector<pollfd> fds;
  for (const int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({wake_fd_, POLLIN, 0});  // last
  int wait_ms = -1;
  while (!stopped_.load()) {
    for (pollfd& p : fds) p.revents = 0;
    const int ready = poll(fds.data(), fds.size(), wait_ms);
    if (ready < 0 && errno != EINTR) {
      std::fprintf(stderr, "kvcached: listener: poll: %s\n", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if ((fds.back().revents & POLLIN) != 0 || stopped_.load()) break;
    // Out of descriptors with no spare: retry every 100 ms rather than spin on the
    // readable backlog (the waiting connections stay there meanwhile).
    bool all_accepted = true;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents != 0 || wait_ms >= 0) all_accepted &= AcceptPending(fds[i].fd);
    }
    wait_ms = all_accepted ? -1 : 100;
  }
}

bool TcpListener::AcceptPending(int listen_fd) {
  for (;;) {
    const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      switch (errno) {
        case EAGAIN:
          return true;  // the backlog is empty
        case EINTR:
        case ECONNABORTED:
        case EPROTO:
          continue;
        case EMFILE:
        case ENFILE:
        case ENOBUFS:
        case ENOMEM: {
          ++accept_errors_;
          if (spare_fd_ < 0 && (spare_fd_ = OpenSpare()) < 0) return false;
          close(spare_fd_);
          const int shed = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
          if (shed >= 0) close(shed);
          spare_fd_ = OpenSpare();
          if (shed < 0) return spare_fd_ >= 0;
          ++refused_;
          LogRefusal("out of file descriptors (raise RLIMIT_NOFILE or lower --max_connections)");
          continue;
        }
        default:
          ++accept_errors_;
          std::fprintf(stderr, "kvcached: listener: accept4: %s\n", std::strerror(errno));
          return false;
      }
    }
    if (!Admit(fd)) {
      close(fd);
      ++refused_;
      ++refused_at_limit_;
      LogRefusal(absl::StrCat("--max_connections=", max_connections_, " reached").c_str());
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters connection;
    connection.listener_fd = listen_fd;
    connection.fd = fd;
    acceptor_->HandleNewConnection(&connection);  // gRPC owns fd from here
  }
}

bool TcpListener::Admit(int fd) {
  connections_.erase(fd);  // accept4 reused the number: that connection is closed
  if (max_connections_ > 0 && static_cast<int64_t>(connections_.size()) >= max_connections_) {
    Prune();
    if (static_cast<int64_t>(connections_.size()) >= max_connections_) {
      const int probe = probe_port_.load();
      if (probe < 0 || LoopbackPeerPort(fd) != probe) return false;
      probe_port_.store(-1);  // the probe's connection is not counted
      return true;
    }
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return false;
  connections_[fd] = st.st_ino;
  return true;
}

void TcpListener::Prune() {
  absl::erase_if(connections_, [](const auto& entry) {
    struct stat st;
    return fstat(entry.first, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != entry.second;
  });
}

void TcpListener::LogRefusal(const char* why) {
  // At most one line a second: a flood of refusals must not become a flood of logs.
  const absl::Time now = absl::Now();
  if (now - last_refusal_log_ < absl::Seconds(1)) return;
  last_refusal_log_ = now;
  std::fprintf(stderr, "kvcached: refused a connection: %s (%lld refused so far)\n", why,
               static_cast<long long>(refused_.load()));
}

}  // namespace kvcm::server

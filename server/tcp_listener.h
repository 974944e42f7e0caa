// TcpListener: kvcached's own accept loop for its TCP gRPC port, in front of gRPC's
// external connection acceptor. It exists for two things gRPC 1.51 cannot do:
//   - a limit on connections (--max_connections): past it a new connection is accepted
//     and closed at once, so the client fails fast instead of waiting in the backlog;
//   - surviving file-descriptor exhaustion: gRPC's listener stops accepting for good after
//     one EMFILE from accept4. This loop keeps one spare descriptor, and when accept4
//     fails with EMFILE it frees the spare, accepts the waiting connection, closes it and
//     takes the spare back, so the loop neither spins nor stops; it accepts normally again
//     once descriptors are free.
// Connections are counted from their descriptors: once handed to gRPC, a connection is
// open while its descriptor still names the socket accepted (same inode), which is checked
// only when the count reaches the limit.
//
// One accept thread; the public methods are thread-safe.
#ifndef KVCM_SERVER_TCP_LISTENER_H_
#define KVCM_SERVER_TCP_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server_builder.h"

namespace kvcm::server {

class TcpListener {
 public:
  // Binds "host:port" ("[v6]:port"; port 0: a free port) on every address the host
  // resolves to (as gRPC does: "localhost" is 127.0.0.1 and ::1), all on the port the
  // first one got, and listens. `max_connections`:
  // the most connections open at once (0: no limit). One connection whose local port was
  // announced with ExpectProbe is admitted past the limit. INVALID_ARGUMENT for a bad
  // address, UNAVAILABLE when the bind fails.
  static absl::StatusOr<std::unique_ptr<TcpListener>> Bind(const std::string& address,
                                                          int64_t max_connections);
  ~TcpListener();  // Stop()

  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  int port() const { return port_; }

  // Accepts on its own thread from now on and hands each admitted connection to
  // `acceptor` (from ServerBuilder::experimental().AddExternalConnectionAcceptor).
  void Start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor);
  // Stops accepting and closes the listening socket (new connections are refused by the
  // kernel); connections already handed over stay with gRPC. Idempotent.
  void Stop();

  // The next connection from loopback port `local_port` is admitted even at the limit:
  // the self-probe's, so that a full house does not make the daemon look dead.
  void ExpectProbe(int local_port) { probe_port_.store(local_port); }

  // Connections refused so far (at the limit, or for want of a descriptor).
  int64_t refused() const { return refused_.load(); }
  // Of them, those refused at max_connections (counters, for /metrics).
  int64_t refused_at_limit() const { return refused_at_limit_.load(); }
  // accept4 failures other than an empty backlog or a connection the client already
  // dropped: EMFILE, ENFILE, ENOBUFS, ENOMEM and the unexpected (a counter).
  int64_t accept_errors() const { return accept_errors_.load(); }

 private:
  TcpListener(std::vector<int> listen_fds, int port, int64_t max_connections);

  void AcceptLoop();
  // Accepts what the backlog of `listen_fd` holds. False when out of descriptors with no
  // spare to shed with (the caller waits a little before trying again).
  bool AcceptPending(int listen_fd);
  // Whether connection `fd` may be handed to gRPC; records it if so.
  bool Admit(int fd);
  // Forgets the connections whose descriptor gRPC has closed.
  void Prune();
  void LogRefusal(const char* why);

  const std::vector<int> listen_fds_;
  const int port_;
  const int64_t max_connections_;
  int wake_fd_ = -1;   // an eventfd: Stop wakes the accept thread through it
  int spare_fd_ = -1;  // held so that an EMFILE can be answered by closing a connection
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  std::atomic<int> probe_port_{-1};
  std::atomic<int64_t> refused_{0};
  std::atomic<int64_t> refused_at_limit_{0};
  std::atomic<int64_t> accept_errors_{0};
  // Accept thread only: descriptor -> inode of the socket accepted on it.
  absl::flat_hash_map<int, ino_t> connections_;
  absl::Time last_refusal_log_ = absl::InfinitePast();
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_TCP_LISTENER_H_

// DaemonProcess: a real kvcached started on ephemeral loopback ports for a test, and
// helpers to talk to it (a C++ client, plain HTTP for /metrics, signals).
#ifndef KVCM_TESTS_SERVER_DAEMON_PROCESS_H_
#define KVCM_TESTS_SERVER_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "clients/cpp/kvcache_client.h"

namespace kvcm::testing {

class DaemonProcess {
 public:
  // Starts build/bin/kvcached with `extra_flags` and waits until its port file appears.
  // `fd_limit` > 0: the daemon runs with RLIMIT_NOFILE at that, soft and hard.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      const std::vector<std::string>& extra_flags = {}, int64_t fd_limit = 0);
  ~DaemonProcess();  // SIGKILL if still running

  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  // --health_listen's address, "" without it.
  const std::string& health_address() const { return health_address_; }
  pid_t pid() const { return pid_; }

  std::unique_ptr<client::KvCacheClient> Connect() const;

  // Sends `signal` and waits up to `timeout` for the exit; returns the exit code
  // (-1 on timeout or when killed by a signal).
  int SignalAndWait(int signal, absl::Duration timeout);
  // The daemon's stderr so far.
  std::string Log() const;

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  std::string dir_;
  std::string grpc_address_;
  std::string metrics_address_;
  std::string health_address_;
};

// A process's resident memory, from /proc/<pid>/status; -1 when unreadable.
int64_t ResidentBytes(pid_t pid);
// A socket connected to `address` (IPv4 host:port) that the caller never writes to, as a
// half-open client; -1 on failure. The caller closes it.
int HalfOpenConnection(const std::string& address);

// GET http://address/path; the body, or an error.
absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path);

// The value of one series in Prometheus text format, e.g.
// MetricValue(text, "kvcache_errors_total{code=\"NOT_FOUND\",rpc=\"Step\"}"); -1 if absent.
double MetricValue(const std::string& text, const std::string& series);

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_SERVER_DAEMON_PROCESS_H_

#include "tests/server/daemon_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/server/poll.h"

namespace kvcm::testing {

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    const std::vector<std::string>& extra_flags, int64_t fd_limit) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  char pattern[] = "/tmp/kvcached_test_XXXXXX";
  if (mkdtemp(pattern) == nullptr) return absl::InternalError("mkdtemp failed");
  d->dir_ = pattern;
  const std::string port_file = d->dir_ + "/ports.json";
  const std::string log = d->dir_ + "/stderr.log";
  std::vector<std::string> args = {std::string(KVCM_BIN_DIR) + "/kvcached",
                                   "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                   "--port_file=" + port_file};
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  d->pid_ = fork();
  if (d->pid_ == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    if (fd_limit > 0) {
      const rlimit limit = {static_cast<rlim_t>(fd_limit), static_cast<rlim_t>(fd_limit)};
      if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(126);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  // kvcached writes the port file once it serves, and exits at once on a refused start.
  bool exited = false;
  const bool started = PollUntil(
      [&] {
        if (std::filesystem::exists(port_file)) return true;
        int status = 0;
        exited = waitpid(d->pid_, &status, WNOHANG) == d->pid_;
        return exited;
      },
      absl::Now() + absl::Seconds(30));
  if (exited) {
    d->pid_ = -1;
    return absl::InternalError(absl::StrCat("kvcached exited at start: ", d->Log()));
  }
  if (!started) {
    return absl::DeadlineExceededError("kvcached did not write its port file within 30 s");
  }
  std::ifstream in(port_file);
  const nlohmann::json ports = nlohmann::json::parse(in);
  d->grpc_address_ = ports["grpc"].get<std::string>();
  d->metrics_address_ = ports["metrics"].get<std::string>();
  if (ports.contains("health")) d->health_address_ = ports["health"].get<std::string>();
  return d;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::filesystem::remove_all(dir_);
}

std::unique_ptr<client::KvCacheClient> DaemonProcess::Connect() const {
  client::ClientOptions options;
  options.address = grpc_address_;
  auto c = client::KvCacheClient::Connect(options);
  return c.ok() ? *std::move(c) : nullptr;
}

int DaemonProcess::SignalAndWait(int signal, absl::Duration timeout) {
  if (pid_ <= 0) return -1;
  kill(pid_, signal);
  int status = 0;
  if (!PollUntil([&] { return waitpid(pid_, &status, WNOHANG) == pid_; },
                 absl::Now() + timeout)) {
    return -1;
  }
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string DaemonProcess::Log() const {
  std::ifstream in(dir_ + "/stderr.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A process's resident memory, from /proc/<pid>/status; -1 when unreadable.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "VmRSS:")) continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int64_t kib = 0;
    if (fields.size() >= 2 && absl::SimpleAtoi(fields[1], &kib)) return kib * 1024;
  }
  return -1;
}

int HalfOpenConnection(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path) {
  const std::vector<std::string> host_port = absl::StrSplit(address, ':');
  int port = 0;
  if (host_port.size() != 2 || !absl::SimpleAtoi(host_port[1], &port)) {
    return absl::InvalidArgumentError("bad address " + address);
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host_port[0].c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError("cannot connect to " + address);
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("write failed");
  }
  std::string response;
  char buffer[65536];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, static_cast<size_t>(n));
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) return absl::DataLossError("no HTTP body");
  return response.substr(body + 4);
}

double MetricValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series) && line.size() > series.size() && line[series.size()] == ' ') {
      double v = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

}  // namespace kvcm::testing

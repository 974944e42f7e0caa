#include "server/ucx_sidecar.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm::server {
namespace {

// Frames on the control channel: u32 length, then that many bytes.
constexpr uint32_t kMaxFrameBytes = 64u << 20;
// How long the sidecar may take to start (UCX init, mapping the pools), and past a read's
// deadline to answer it (UcxTransport's own cleanup after a deadline takes up to 2 s).
constexpr absl::Duration kStartTimeout = absl::Seconds(20);
constexpr absl::Duration kReplyGrace = absl::Seconds(5);

class Frame {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void PutString(absl::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

class Parse {
 public:
  explicit Parse(absl::string_view in) : in_(in) {}
  template <typename T>
  bool Get(T* value) {
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(value, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n = 0;
    if (!Get(&n) || n > in_.size()) return false;
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }

 private:
  absl::string_view in_;
};

bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

absl::Status SendFrame(int fd, const Frame& frame) {
  const uint32_t length = static_cast<uint32_t>(frame.bytes().size());
  if (!WriteAll(fd, reinterpret_cast<const char*>(&length), sizeof(length)) ||
      !WriteAll(fd, frame.bytes().data(), frame.bytes().size())) {
    return absl::UnavailableError(absl::StrCat("the UCX sidecar's channel: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// Reads exactly `n` bytes by `deadline` (absl::InfiniteFuture(): no limit).
absl::Status ReadAll(int fd, char* data, size_t n, absl::Time deadline) {
  while (n > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("no answer in time");
    pollfd p{fd, POLLIN, 0};
    const int timeout =
        deadline == absl::InfiniteFuture() ? -1 : static_cast<int>(absl::ToInt64Milliseconds(left) + 1);
    const int ready = poll(&p, 1, timeout);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) continue;
    const ssize_t r = read(fd, data, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return absl::UnavailableError("the channel closed");
    data += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReceiveFrame(int fd, absl::Time deadline) {
  uint32_t length = 0;
  RETURN_IF_ERROR(ReadAll(fd, reinterpret_cast<char*>(&length), sizeof(length), deadline));
  if (length > kMaxFrameBytes) return absl::DataLossError("an oversized frame");
  std::string payload(length, '\0');
  RETURN_IF_ERROR(ReadAll(fd, payload.data(), length, deadline));
  return payload;
}

// The sidecar's side: the pools mapped, UCX over them, and the exposure reply.
struct Served {
  std::vector<char*> pools;
  std::vector<int64_t> bytes;
  std::unique_ptr<UcxTransport> ucx;
};

absl::StatusOr<Served> MapAndExpose(Parse& request, Frame* reply) {
  uint32_t ranks = 0;
  if (!request.Get(&ranks) || ranks == 0 || ranks > 4096) {
    return absl::InvalidArgumentError("a bad pool list");
  }
  Served served;
  ASSIGN_OR_RETURN(served.ucx, UcxTransport::Create());
  reply->Put<uint8_t>(1);
  reply->PutString(served.ucx->worker_address());
  for (uint32_t r = 0; r < ranks; ++r) {
    std::string name;
    uint64_t bytes = 0;
    if (!request.GetString(&name) || !request.Get(&bytes)) {
      return absl::InvalidArgumentError("a bad pool entry");
    }
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", std::strerror(errno)));
    void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (data == MAP_FAILED) return absl::UnavailableError(absl::StrCat("mmap ", name, ": ", std::strerror(errno)));
    served.pools.push_back(static_cast<char*>(data));
    served.bytes.push_back(static_cast<int64_t>(bytes));
    ASSIGN_OR_RETURN(const UcxMemoryKey key, served.ucx->Expose(data, static_cast<int64_t>(bytes)));
    RETURN_IF_ERROR(served.ucx->RegisterLocal(data, static_cast<int64_t>(bytes)));
    reply->Put<uint64_t>(key.remote_address);
    reply->Put<int64_t>(key.bytes);
    reply->PutString(key.rkey);
  }
  return served;
}

// One read request, answered with its status.
absl::Status ServeRead(Served& served, Parse& request) {
  int64_t deadline_micros = 0;
  std::string peer;
  uint32_t keys = 0;
  if (!request.Get(&deadline_micros) || !request.GetString(&peer) || !request.Get(&keys) ||
      keys > 4096) {
    return absl::InvalidArgumentError("a bad read request");
  }
  std::vector<std::string> rkeys(keys);
  for (std::string& key : rkeys) {
    if (!request.GetString(&key)) return absl::InvalidArgumentError("a bad read request key");
  }
  uint32_t count = 0;
  if (!request.Get(&count)) return absl::InvalidArgumentError("a bad read count");
  std::vector<UcxRead> reads;
  for (uint32_t i = 0; i < count; ++i) {
    SidecarRead r;
    if (!request.Get(&r.key) || !request.Get(&r.remote_address) || !request.Get(&r.rank) ||
        !request.Get(&r.offset) || !request.Get(&r.bytes)) {
      return absl::InvalidArgumentError("a bad read entry");
    }
    if (r.key >= keys || r.rank < 0 || r.rank >= static_cast<int32_t>(served.pools.size()) ||
        r.offset < 0 || r.bytes < 0 || r.offset > served.bytes[static_cast<size_t>(r.rank)] - r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("read ", i, " lies outside this node's pools"));
    }
    reads.push_back(UcxRead{&rkeys[r.key], r.remote_address,
                            served.pools[static_cast<size_t>(r.rank)] + r.offset, r.bytes});
  }
  return served.ucx->Read(peer, reads, absl::FromUnixMicros(deadline_micros));
}

}  // namespace

int RunUcxSidecar(int fd) {
  // Dies with the daemon that started it (strictly: with the daemon's thread that started
  // it; the main thread at start, an import or engine thread after a restart: they all live
  // as long as the daemon serves).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) return 1;
  absl::StatusOr<std::string> init = ReceiveFrame(fd, absl::InfiniteFuture());
  if (!init.ok()) return 1;
  Parse request(*init);
  Frame reply;
  absl::StatusOr<Served> served = MapAndExpose(request, &reply);
  if (!served.ok()) {
    Frame refused;
    refused.Put<uint8_t>(0);
    refused.PutString(served.status().ToString());
    return SendFrame(fd, refused).ok() ? 1 : 2;
  }
  if (!SendFrame(fd, reply).ok()) return 1;
  while (true) {
    absl::StatusOr<std::string> frame = ReceiveFrame(fd, absl::InfiniteFuture());
    if (!frame.ok()) return 0;  // the daemon closed the channel
    Parse read(*frame);
    const absl::Status status = ServeRead(*served, read);
    Frame answer;
    answer.Put<uint32_t>(static_cast<uint32_t>(status.code()));
    answer.PutString(status.message());
    if (!SendFrame(fd, answer).ok()) return 0;
  }
}

absl::StatusOr<std::unique_ptr<UcxSidecar>> UcxSidecar::Start(const KvPools& pools,
                                                              std::string executable) {
  std::vector<Pool> shared;
  for (int32_t r = 0; r < pools.ranks(); ++r) {
    const MemoryExport& memory = pools.pool(r).memory_export();
    if (memory.kind != MemoryExport::Kind::kPosixShm) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", r, "'s KV pool is not in POSIX shared memory (--kv_shared_memory): the UCX "
          "sidecar cannot map it"));
    }
    shared.push_back({memory.shm_name, pools.pool(r).storage().bytes()});
  }
  std::unique_ptr<UcxSidecar> sidecar(new UcxSidecar(std::move(shared), std::move(executable)));
  MutexLock lock(&sidecar->mu_);
  RETURN_IF_ERROR(sidecar->SpawnLocked());
  return sidecar;
}

UcxSidecar::~UcxSidecar() {
  MutexLock lock(&mu_);
  StopLocked();
}

void UcxSidecar::StopLocked() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

absl::Status UcxSidecar::SpawnLocked() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::UnavailableError(absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  const std::string flag = absl::StrCat("--ucx_sidecar_fd=", fds[1]);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // Only async-signal-safe calls until exec: the parent has threads.
    fcntl(fds[1], F_SETFD, 0);
    execl(executable_.c_str(), "kvcached-ucx-sidecar", flag.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  pid_ = pid;
  fd_ = fds[0];
  ++starts_;
  Frame init;
  init.Put<uint32_t>(static_cast<uint32_t>(pools_.size()));
  for (const Pool& pool : pools_) {
    init.PutString(pool.shm_name);
    init.Put<uint64_t>(static_cast<uint64_t>(pool.bytes));
  }
  absl::StatusOr<std::string> reply = SendFrame(fd_, init).ok()
                                          ? ReceiveFrame(fd_, absl::Now() + kStartTimeout)
                                          : absl::UnavailableError("the sidecar did not start");
  const std::string payload = reply.ok() ? *reply : std::string();
  Parse parse(payload);
  uint8_t ok = 0;
  if (!reply.ok() || !parse.Get(&ok) || ok != 1) {
    std::string why = reply.ok() ? "" : std::string(reply.status().message());
    if (reply.ok()) parse.GetString(&why);
    StopLocked();
    return absl::UnavailableError(absl::StrCat("the UCX sidecar did not start: ", why));
  }
  UcxExposure exposure;
  parse.GetString(&exposure.worker_address);
  for (size_t r = 0; r < pools_.size(); ++r) {
    UcxMemoryKey key;
    if (!parse.Get(&key.remote_address) || !parse.Get(&key.bytes) || !parse.GetString(&key.rkey)) {
      StopLocked();
      return absl::UnavailableError("the UCX sidecar answered a malformed exposure");
    }
    exposure.keys.push_back(std::move(key));
  }
  exposure_ = std::move(exposure);
  return absl::OkStatus();
}

absl::Status UcxSidecar::EnsureRunningLocked() {
  if (pid_ > 0) {
    // An idle channel has nothing to read: a readable or hung-up one means the sidecar is
    // gone (its end closes as it exits, before it can be waited for).
    pollfd p{fd_, POLLIN, 0};
    const bool closed = poll(&p, 1, 0) != 0;
    int status = 0;
    const pid_t exited = waitpid(pid_, &status, WNOHANG);
    if (!closed && exited == 0) return absl::OkStatus();
    if (exited != pid_) {  // not reaped yet: it is exiting
      kill(pid_, SIGKILL);
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    std::fprintf(stderr, "kvcached: the UCX sidecar (pid %d) exited (%s %d); starting another\n",
                 pid_, WIFSIGNALED(status) ? "signal" : "status",
                 WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    pid_ = -1;
    StopLocked();
  }
  return SpawnLocked();
}

absl::StatusOr<UcxExposure> UcxSidecar::Exposure() {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(EnsureRunningLocked());
  return exposure_;
}

absl::Status UcxSidecar::Read(const std::string& peer_worker_address,
                              const std::vector<std::string>& rkeys,
                              const std::vector<SidecarRead>& reads, absl::Time deadline) {
  MutexLock lock(&mu_);
  // The reads only fill blocks the import holds, so one lost with its sidecar is done again,
  // once, by the next sidecar.
  absl::Status status;
  for (int attempt = 0; attempt < 2; ++attempt) {
    RETURN_IF_ERROR(EnsureRunningLocked());
    status = ReadLocked(peer_worker_address, rkeys, reads, deadline);
    if (pid_ > 0 || absl::Now() >= deadline) break;  // answered, or no time to try again
  }
  return status;
}

absl::Status UcxSidecar::ReadLocked(const std::string& peer_worker_address,
                                    const std::vector<std::string>& rkeys,
                                    const std::vector<SidecarRead>& reads, absl::Time deadline) {
  Frame request;
  request.Put<int64_t>(absl::ToUnixMicros(deadline));
  request.PutString(peer_worker_address);
  request.Put<uint32_t>(static_cast<uint32_t>(rkeys.size()));
  for (const std::string& key : rkeys) request.PutString(key);
  request.Put<uint32_t>(static_cast<uint32_t>(reads.size()));
  for (const SidecarRead& r : reads) {
    request.Put(r.key);
    request.Put(r.remote_address);
    request.Put(r.rank);
    request.Put(r.offset);
    request.Put(r.bytes);
  }
  absl::StatusOr<std::string> answer = SendFrame(fd_, request).ok()
                                           ? ReceiveFrame(fd_, deadline + kReplyGrace)
                                           : absl::UnavailableError("the channel closed");
  if (!answer.ok()) {
    // Gone, or stuck in UCX: either way this sidecar is done.
    StopLocked();
    return absl::UnavailableError(absl::StrCat(
        "the UCX sidecar ", answer.status().code() == absl::StatusCode::kDeadlineExceeded
                                ? "did not answer the read"
                                : "exited during the read",
        "; another starts for the next one"));
  }
  Parse parse(*answer);
  uint32_t code = 0;
  std::string message;
  if (!parse.Get(&code) || !parse.GetString(&message) || code > 16) {
    StopLocked();
    return absl::UnavailableError("the UCX sidecar answered a malformed reply");
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

int64_t UcxSidecar::starts() const {
  MutexLock lock(&mu_);
  return starts_;
}

pid_t UcxSidecar::pid() const {
  MutexLock lock(&mu_);
  return pid_;
}

}  // namespace kvcm::server

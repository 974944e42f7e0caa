#include "cache_manager/kv/ucx_transfer.h"

#include <poll.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm {
namespace {

// Transports, as found with UCX 1.13 (Debian; ucx_info is not installed, so from UCX's own
// selection log, UCX_LOG_LEVEL=info) on one node. Every endpoint here uses peer failure
// handling (UCP_ERR_HANDLING_MODE_PEER) so that a dead source fails a Read instead of
// hanging it, and that rules out UCX 1.13's shared-memory transports: posix and sysv have
// "no peer failure handler", cma has "no am bcopy" for the lane UCP needs beside it. Reads
// between two daemons of one node therefore go over tcp on the loopback, emulated by UCP
// with active messages that the source's serving thread answers ("rma_am(tcp/lo)").
// (Without error handling UCX would pick rma(sysv/memory posix/memory); cma is never picked
// for reads, even with UCX_TLS=cma,tcp, so ptrace rules that block it do not matter.)
// Between nodes UCX picks RDMA (rc, dc) where a NIC and a UCX built with it exist, else tcp.
// Nothing in UCX's default set misbehaves, so UcxTransport leaves UCX's default ("all", or
// the environment's UCX_TLS) alone unless UcxTransportOptions::transports says otherwise.
//
// The same-host path. tcp on the loopback moves ~0.2-0.3x of memcpy's bandwidth (2 cores,
// bench/ucx_transfer_bench.cc, two processes); posix/sysv shared memory ~0.9x on an idle
// machine (UCP emulates the gets with active messages through the shared-memory FIFOs, so
// the source's serving thread still answers them; cma is never used for gets). They need
// UCP_ERR_HANDLING_MODE_NONE, which must then never meet a transport that can fail: so a
// second UCP context limited to posix,sysv serves peers of this host, and its endpoints
// reach nothing else. Measured with UCX 1.13 when the source is killed (or stopped) mid-read
// in that mode: nothing is reported and no get ever completes (no abort, no fault: the
// segments stay mapped), ucp_ep_close_nbx with FORCE fails with UCS_ERR_INVALID_PARAM, and
// destroying the worker releases everything (UCX warns about the unflushed gets). Hence the
// Read watches the peer process (a pidfd, checked with its start time against pid reuse)
// and, on any failure, abandons the worker instead of closing the endpoint. The other way
// round is worse: the serving worker's FIFO is one multi-producer ring for all its readers,
// where a sender claims a slot and then fills it, and a reader killed mid-read left the
// source unable to answer any same-host read in ~1 of 3 tries (measured with
// ReaderKilledMidReadLeavesTheSourceServing). So every same-host Read whose gets all stay
// unanswered for same_host_stall_timeout while the peer lives gives up on shared memory and
// reads over the main context, and so does every later Read from that peer: a wedged source
// costs each reader one stall, then tcp speed, not a failed Read (unless the deadline is too
// short for both).
// "This host" means one boot (boot_id) and one PID and IPC namespace: only there does the
// peer's pid name the peer, and can the segments be shared. The peer only ever writes into
// the FIFOs, never into Read's destination memory, so once the worker is gone nothing lands
// there. (UCX_MM_SEG_SIZE above 8 KiB trips an assertion in UCX 1.13's rma_send.c: left
// alone; UCX_MM_FIFO_SIZE changed nothing measurable.)
constexpr char kSameHostTransports[] = "posix,sysv";

// The envelope around UCX's bytes (rkey, worker address): magic, payload length, owner
// (a hash of the exposing worker's address), region base and length, payload, checksum.
// Host byte order: both daemons run on the same architecture.
constexpr uint32_t kKeyMagic = 0x4b52434b;      // "KCRK"
constexpr uint32_t kAddressMagic = 0x4b524341;  // "ACRK"
constexpr size_t kHeaderBytes = 4 + 4 + 8 + 8 + 8;
constexpr size_t kTrailerBytes = 8;

uint64_t Fnv1a(absl::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

struct Envelope {
  uint64_t owner = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  absl::string_view payload;
};

std::string Seal(uint32_t magic, const Envelope& e) {
  std::string out(kHeaderBytes + e.payload.size() + kTrailerBytes, '\0');
  const auto payload_size = static_cast<uint32_t>(e.payload.size());
  char* p = out.data();
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &payload_size, 4);
  std::memcpy(p + 8, &e.owner, 8);
  std::memcpy(p + 16, &e.base, 8);
  std::memcpy(p + 24, &e.length, 8);
  std::memcpy(p + kHeaderBytes, e.payload.data(), e.payload.size());
  const uint64_t sum = Fnv1a(absl::string_view(out.data(), kHeaderBytes + e.payload.size()));
  std::memcpy(p + kHeaderBytes + e.payload.size(), &sum, 8);
  return out;
}

absl::StatusOr<Envelope> Open(uint32_t magic, absl::string_view bytes, absl::string_view what) {
  uint32_t got_magic = 0, payload_size = 0;
  if (bytes.size() >= kHeaderBytes) {
    std::memcpy(&got_magic, bytes.data(), 4);
    std::memcpy(&payload_size, bytes.data() + 4, 4);
  }
  if (bytes.size() < kHeaderBytes + kTrailerBytes || got_magic != magic ||
      bytes.size() != kHeaderBytes + payload_size + kTrailerBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not one UcxTransport made (",
                                                   bytes.size(), " bytes, wrong size or magic)"));
  }
  uint64_t sum = 0;
  std::memcpy(&sum, bytes.data() + kHeaderBytes + payload_size, 8);
  if (sum != Fnv1a(bytes.substr(0, kHeaderBytes + payload_size))) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is damaged (checksum mismatch)"));
  }
  Envelope e;
  std::memcpy(&e.owner, bytes.data() + 8, 8);
  std::memcpy(&e.base, bytes.data() + 16, 8);
  std::memcpy(&e.length, bytes.data() + 24, 8);
  e.payload = bytes.substr(kHeaderBytes, payload_size);
  return e;
}

// Length-prefixed fields inside an envelope's payload.
void PutField(std::string* out, absl::string_view field) {
  const auto size = static_cast<uint32_t>(field.size());
  out->append(reinterpret_cast<const char*>(&size), 4);
  out->append(field.data(), field.size());
}

bool TakeField(absl::string_view* in, absl::string_view* field) {
  uint32_t size = 0;
  if (in->size() < 4) return false;
  std::memcpy(&size, in->data(), 4);
  if (in->size() - 4 < size) return false;
  *field = in->substr(4, size);
  in->remove_prefix(4 + size);
  return true;
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return std::string(absl::StripTrailingAsciiWhitespace(text.str()));
}

// One boot of one host, one PID and IPC namespace; empty when any of it is unknown.
std::string HostIdentity() {
  char ns[2][128] = {};
  const ssize_t pid_ns = readlink("/proc/self/ns/pid", ns[0], sizeof(ns[0]) - 1);
  const ssize_t ipc_ns = readlink("/proc/self/ns/ipc", ns[1], sizeof(ns[1]) - 1);
  const std::string boot = ReadSmallFile("/proc/sys/kernel/random/boot_id");
  if (pid_ns <= 0 || ipc_ns <= 0 || boot.empty()) return "";
  return absl::StrCat(boot, " ", ns[0], " ", ns[1]);
}

// A process's state letter and start time (clock ticks after boot), from /proc/<pid>/stat;
// start time 0 when the process is gone.
struct ProcessStat {
  char state = 'X';
  uint64_t start_time = 0;
};
ProcessStat ReadProcessStat(pid_t pid) {
  const std::string stat = ReadSmallFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t name_end = stat.rfind(')');
  if (name_end == std::string::npos) return {};
  // After the name: state (field 3), ..., starttime (field 22).
  std::istringstream fields(stat.substr(name_end + 1));
  ProcessStat out;
  std::string skip;
  fields >> out.state;
  for (int field = 4; field < 22; ++field) fields >> skip;
  if (!(fields >> out.start_time)) return {};
  return out;
}

// The transports alive in this process, by their address's owner hash. A same-host peer in
// this process has a live pid whether or not its transport still exists; connecting to the
// segments of a destroyed one fails inside UCX, which leaks on that path (UCX 1.13), so
// Read asks here first.
struct LiveTransports {
  Mutex mu;
  std::set<uint64_t> owners ABSL_GUARDED_BY(mu);
};
LiveTransports& Live() {
  static auto* live = new LiveTransports();
  return *live;
}

absl::Status UcxError(absl::string_view what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(status)));
}

ucs_status_t CreateWorker(ucp_context_h context, ucp_worker_h* worker, int* efd) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Serialized: a pooled worker is driven by one Read at a time, not always the same thread.
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucs_status_t status = ucp_worker_create(context, &params, worker);
  if (status != UCS_OK) return status;
  status = ucp_worker_get_efd(*worker, efd);
  if (status != UCS_OK) ucp_worker_destroy(*worker);
  return status;
}

// Drives workers: progresses them, and sleeps on their event fds only once they have been
// idle for a while. Spinning first is not only for latency: UCX 1.13's tcp transport can leave
// received bytes behind an armed worker whose wake-up never comes (measured: 512 KiB reads
// one at a time took 100 ms each, the poll bound, with a plain arm-and-poll loop), so a
// worker that was just busy keeps progressing, and every sleep is bounded (a Read's by 1 ms:
// measured on 2 cores, 5 ms cost a third of the throughput of one-at-a-time reads).
class Progressor {
 public:
  struct Worker {
    ucp_worker_h worker;
    int efd;
  };
  Progressor(std::vector<Worker> workers, absl::Duration max_sleep)
      : workers_(std::move(workers)), max_sleep_(max_sleep) {
    for (const Worker& w : workers_) fds_.push_back(pollfd{w.efd, POLLIN, 0});
  }

  // One pass of progress, or a sleep until an event, `until` or max_sleep.
  void ProgressOrWait(absl::Time until) {
    const absl::Time now = absl::Now();
    unsigned progressed = 0;
    for (const Worker& w : workers_) progressed += ucp_worker_progress(w.worker);
    if (progressed != 0) {
      last_active_ = now;
      return;
    }
    if (now - last_active_ < kSpin) {
      // The peer may be the serving thread of this process, or another daemon, waiting for
      // a core that this spin holds (2 cores measured: without the yield, one-at-a-time
      // reads waited ~4 ms each under load).
      std::this_thread::yield();
      return;
    }
    bool all_armed = true;
    for (const Worker& w : workers_) {
      const ucs_status_t armed = ucp_worker_arm(w.worker);
      if (armed == UCS_ERR_BUSY) return;  // events arrived meanwhile: progress again
      all_armed = all_armed && armed == UCS_OK;
    }
    // A worker that cannot arm (a transport without events) is polled every millisecond.
    const absl::Duration left = std::clamp(until - now, absl::ZeroDuration(),
                                           all_armed ? max_sleep_ : absl::Milliseconds(1));
    ::poll(fds_.data(), fds_.size(),
           static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)))));
  }

 private:
  static constexpr absl::Duration kSpin = absl::Milliseconds(2);
  std::vector<Worker> workers_;
  std::vector<pollfd> fds_;
  absl::Duration max_sleep_;
  absl::Time last_active_ = absl::InfinitePast();
};

}  // namespace

struct UcxTransport::Handles {
  ucp_context_h context = nullptr;
  ucp_worker_h server = nullptr;
  int server_efd = -1;
  // The same-host path (kSameHostTransports); null when off or when UCX could not start it.
  ucp_context_h same_host_context = nullptr;
  ucp_worker_h same_host_server = nullptr;
  int same_host_server_efd = -1;
  std::string host;  // HostIdentity()
  std::atomic<bool> stop{false};
  std::atomic<bool> same_host_stopped{false};  // StopServingSameHostForTesting
  std::atomic<int64_t> same_host_reads{0};
  std::atomic<int64_t> same_host_fallbacks{0};
  std::string transports;  // UCX_TLS in effect
};

struct UcxTransport::ClientWorker {
  ucp_worker_h worker = nullptr;
  int efd = -1;
  bool same_host = false;  // of the same-host context
  ~ClientWorker() {
    if (worker != nullptr) ucp_worker_destroy(worker);
  }
};

namespace {

// A peer's worker address, opened: the main context's address, the same-host one (empty when
// the peer has none) with the peer's host, pid and process start time.
struct PeerAddress {
  uint64_t owner = 0;  // Fnv1a of the envelope's payload; keys carry it too
  absl::string_view address;
  absl::string_view same_host_address;
  absl::string_view host;
  pid_t pid = 0;
  uint64_t start_time = 0;
};

// One key's region and its packed rkeys (main and same-host contexts; the latter may be empty).
struct OpenedKey {
  uint64_t base = 0;
  uint64_t length = 0;
  absl::string_view packed;
  absl::string_view same_host_packed;
};
using KeyMap = absl::flat_hash_map<const std::string*, OpenedKey>;

// The peer process of a same-host Read: a pidfd, readable once the process has exited
// (without pidfd_open, /proc/<pid>/stat). Checked at most once a millisecond.
class PeerWatch {
 public:
  PeerWatch(pid_t pid, uint64_t start_time) : pid_(pid), start_time_(start_time) {}
  ~PeerWatch() {
    if (fd_ >= 0) close(fd_);
  }
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // UNAVAILABLE when the process has exited already (or its pid names another process).
  absl::Status Open() {
    fd_ = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
    // Checked after the pidfd exists: a pid reused before pidfd_open shows another start.
    const ProcessStat stat = ReadProcessStat(pid_);
    if (stat.start_time != start_time_ || stat.state == 'Z' || stat.state == 'X') {
      return absl::UnavailableError(absl::StrCat("the peer process (pid ", pid_, ") has exited"));
    }
    return absl::OkStatus();
  }

  bool Exited() {
    const absl::Time now = absl::Now();
    if (exited_ || now - last_check_ < absl::Milliseconds(1)) return exited_;
    last_check_ = now;
    if (fd_ >= 0) {
      pollfd fd{fd_, POLLIN, 0};
      exited_ = ::poll(&fd, 1, 0) > 0;
    } else {
      const ProcessStat stat = ReadProcessStat(pid_);
      exited_ = stat.start_time != start_time_ || stat.state == 'Z' || stat.state == 'X';
    }
    return exited_;
  }

  absl::Status ExitedError() const {
    return absl::UnavailableError(
        absl::StrCat("the peer process (pid ", pid_, ") exited mid-read"));
  }

 private:
  const pid_t pid_;
  const uint64_t start_time_;
  int fd_ = -1;
  bool exited_ = false;
  absl::Time last_check_ = absl::InfinitePast();
};

// One Read call on a borrowed worker: connect, unpack the keys, keep up to
// max_reads_in_flight gets outstanding until all have landed, then close. With a PeerWatch
// (the same-host context), without UCX's failure handling. Not thread-safe.
class ReadCall {
 public:
  ReadCall(ucp_worker_h worker, int efd, PeerWatch* watch, absl::Duration stall_timeout,
           absl::Time deadline, absl::Duration grace)
      : worker_(worker),
        progressor_({{worker, efd}}, absl::Milliseconds(1)),
        watch_(watch),
        stall_timeout_(stall_timeout),
        deadline_(deadline),
        grace_(grace) {}

  absl::Status Connect(absl::string_view address) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    // A peer that dies fails the endpoint (and its requests) instead of hanging them; over
    // the same-host context (no transport there has failure handling) the watch does that.
    params.err_mode = watch_ != nullptr ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    if (watch_ == nullptr) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = &ReadCall::OnEndpointError;
      params.err_handler.arg = this;
    }
    const ucs_status_t status = ucp_ep_create(worker_, &params, &ep_);
    if (status != UCS_OK) {
      ep_ = nullptr;
      return UcxError("cannot connect to the peer's worker", status);
    }
    return absl::OkStatus();
  }

  // Unpacks `packed` (ucp_rkey_pack bytes); the handle is destroyed by Finish.
  absl::StatusOr<ucp_rkey_h> Unpack(absl::string_view packed) {
    ucp_rkey_h rkey = nullptr;
    const ucs_status_t status = ucp_ep_rkey_unpack(ep_, packed.data(), &rkey);
    if (status != UCS_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("a memory key cannot be used with this peer: ", ucs_status_string(status)));
    }
    rkeys_.push_back(rkey);
    return rkey;
  }

  // Issues one get (or records its failure); REQUIRES: fewer than the limit in flight.
  absl::Status Issue(const UcxRead& read, ucp_rkey_h rkey, void* local_memh) {
    // Checked here too: gets that a transport completes inside ucp_get_nbx never reach Wait.
    if (absl::Now() >= deadline_) return DeadlineExceeded();
    ucp_request_param_t param{};
    if (local_memh != nullptr) {
      param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
      param.memh = static_cast<ucp_mem_h>(local_memh);
    }
    const ucs_status_ptr_t request = ucp_get_nbx(ep_, read.local, static_cast<size_t>(read.bytes),
                                                 read.remote_address, rkey, &param);
    if (UCS_PTR_IS_ERR(request))
      return UcxError("read from the peer failed", UCS_PTR_STATUS(request));
    if (request == nullptr) return absl::OkStatus();
    if (pending_.empty()) last_progress_ = absl::Now();  // the stall clock starts
    pending_.push_back(request);
    return absl::OkStatus();
  }

  int64_t in_flight() const { return static_cast<int64_t>(pending_.size()); }

  // Frees the completed gets; the first failure among them, or the endpoint's, is returned.
  absl::Status Reap() {
    absl::Status result;
    auto done = [&](void* request) {
      const ucs_status_t status = ucp_request_check_status(request);
      if (status == UCS_INPROGRESS) return false;
      ucp_request_free(request);
      if (status != UCS_OK && result.ok()) result = UcxError("read from the peer failed", status);
      return true;
    };
    const size_t before = pending_.size();
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), done), pending_.end());
    if (result.ok() && ep_status_ != UCS_OK) {
      result = UcxError("connection to the peer failed", ep_status_);
    }
    if (watch_ == nullptr || !result.ok()) return result;
    if (watch_->Exited()) return watch_->ExitedError();
    const absl::Time now = absl::Now();
    if (pending_.size() < before) last_progress_ = now;
    if (!pending_.empty() && now - last_progress_ > stall_timeout_) {
      stalled_ = true;
      return absl::UnavailableError(absl::StrCat("same-host reads made no progress for ",
                                                 absl::FormatDuration(now - last_progress_)));
    }
    return result;
  }

  // Whether the Read failed because the peer, alive, stopped answering over shared memory.
  bool stalled() const { return stalled_; }

  // Waits for progress, DEADLINE_EXCEEDED once the deadline has passed.
  absl::Status Wait() {
    if (absl::Now() >= deadline_) return DeadlineExceeded();
    progressor_.ProgressOrWait(deadline_);
    return absl::OkStatus();
  }

  // Closes the endpoint: gracefully after success; by force after a failure, which cancels
  // every outstanding get. Returns whether all gets and the close completed within the
  // grace period (otherwise the worker must be destroyed, which stops them for good; a
  // successful Read does not wait for a peer that stalls its close past the grace either).
  // Without failure handling (a watch) there is no forced close (UCX 1.13 refuses it), and
  // gets of a dead or stopped peer never end: a failed Read abandons the worker at once.
  bool Finish(bool failed) {
    const absl::Time give_up = absl::Now() + grace_;
    const bool abandon = failed && watch_ != nullptr;
    void* close = nullptr;
    if (ep_ != nullptr && !abandon) {
      ucp_request_param_t param{};
      if (failed || ep_status_ != UCS_OK) {
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      }
      const ucs_status_ptr_t request = ucp_ep_close_nbx(ep_, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) close = request;
      ep_ = nullptr;
    }
    while (!abandon) {
      (void)Reap();
      if (close != nullptr && ucp_request_check_status(close) != UCS_INPROGRESS) {
        ucp_request_free(close);
        close = nullptr;
      }
      if (pending_.empty() && close == nullptr) break;
      if (absl::Now() >= give_up) break;  // the requests left die with the worker
      if (watch_ != nullptr && watch_->Exited()) break;
      progressor_.ProgressOrWait(give_up);
    }
    const bool clean = !abandon && pending_.empty() && close == nullptr;
    // Requests still in progress are released now (UCX frees them when they complete, at
    // the latest when the worker is destroyed, which asserts that they were released).
    for (void* request : pending_) ucp_request_free(request);
    pending_.clear();
    if (close != nullptr) ucp_request_free(close);
    // Before the worker goes, in either case: UCX returns rkeys to a pool of the worker.
    for (ucp_rkey_h rkey : rkeys_) ucp_rkey_destroy(rkey);
    rkeys_.clear();
    return clean;
  }

 private:
  absl::Status DeadlineExceeded() const {
    return absl::DeadlineExceededError(
        absl::StrCat("UCX read: deadline passed with ", pending_.size(), " reads in flight"));
  }
  static void OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<ReadCall*>(arg)->ep_status_ = status;
  }

  ucp_worker_h worker_;
  Progressor progressor_;
  PeerWatch* watch_;  // null over the main context
  const absl::Duration stall_timeout_;
  absl::Time last_progress_ = absl::InfinitePast();  // of the gets in flight
  bool stalled_ = false;
  absl::Time deadline_;
  absl::Duration grace_;
  ucp_ep_h ep_ = nullptr;
  // Set by UCX's error callback (from this worker's progress; atomic in case a transport
  // reports from UCX's async thread).
  std::atomic<ucs_status_t> ep_status_{UCS_OK};
  std::vector<ucp_rkey_h> rkeys_;
  std::vector<void*> pending_;  // gets in flight
};

// Opens a key's envelope: its region and its packed rkeys.
absl::StatusOr<OpenedKey> OpenKey(const std::string& bytes, uint64_t owner, size_t i) {
  ASSIGN_OR_RETURN(Envelope key, Open(kKeyMagic, bytes, absl::StrCat("read ", i, "'s key")));
  if (key.owner != owner) {
    return absl::InvalidArgumentError(absl::StrCat(
        "read ", i, ": its key was exposed by another peer than the one addressed"));
  }
  OpenedKey out;
  out.base = key.base;
  out.length = key.length;
  absl::string_view fields = key.payload;
  if (!TakeField(&fields, &out.packed) || !TakeField(&fields, &out.same_host_packed) ||
      out.packed.empty() || !fields.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("read ", i, "'s key has malformed fields"));
  }
  return out;
}

// Checks every read against its key's region and the peer (`owner`: the hash of the peer's
// address); returns the distinct keys, opened.
absl::StatusOr<KeyMap> CheckReads(std::span<const UcxRead> reads, uint64_t owner) {
  KeyMap keys;
  for (size_t i = 0; i < reads.size(); ++i) {
    const UcxRead& read = reads[i];
    if (read.rkey == nullptr || read.bytes < 0 || (read.bytes > 0 && read.local == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "read ", i, ": needs a key, a destination and bytes >= 0 (got ", read.bytes, ")"));
    }
    auto it = keys.find(read.rkey);
    if (it == keys.end()) {
      ASSIGN_OR_RETURN(OpenedKey key, OpenKey(*read.rkey, owner, i));
      it = keys.emplace(read.rkey, key).first;
    }
    const OpenedKey& region = it->second;
    const uint64_t bytes = static_cast<uint64_t>(read.bytes);
    if (read.remote_address < region.base || bytes > region.length ||
        read.remote_address - region.base > region.length - bytes) {
      return absl::InvalidArgumentError(absl::StrCat("read ", i, ": [", read.remote_address, ", +",
                                                     bytes, ") is outside its region [",
                                                     region.base, ", +", region.length, ")"));
    }
  }
  return keys;
}

// Opens a worker address: main address, same-host address, host, pid, start time.
absl::StatusOr<PeerAddress> OpenPeerAddress(absl::string_view bytes) {
  ASSIGN_OR_RETURN(Envelope envelope, Open(kAddressMagic, bytes, "peer worker address"));
  if (envelope.owner != Fnv1a(envelope.payload)) {
    return absl::InvalidArgumentError("peer worker address: owner field does not match");
  }
  PeerAddress peer;
  peer.owner = envelope.owner;
  absl::string_view fields = envelope.payload, pid, start_time;
  if (!TakeField(&fields, &peer.address) || !TakeField(&fields, &peer.same_host_address) ||
      !TakeField(&fields, &peer.host) || !TakeField(&fields, &pid) ||
      !TakeField(&fields, &start_time) || peer.address.empty() || pid.size() != sizeof(pid_t) ||
      start_time.size() != 8 || !fields.empty()) {
    return absl::InvalidArgumentError("peer worker address has malformed fields");
  }
  std::memcpy(&peer.pid, pid.data(), sizeof(pid_t));
  std::memcpy(&peer.start_time, start_time.data(), 8);
  return peer;
}

ucs_status_t StartContext(const char* transports, ucp_context_h* context) {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return status;
  // UCX has read UCX_TLS from the environment; only `transports` overrides it.
  if (transports != nullptr) status = ucp_config_modify(config, "TLS", transports);
  if (status == UCS_OK) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;  // Expose and concurrent Reads use the context from any thread
    status = ucp_init(&params, config, context);
  }
  ucp_config_release(config);
  if (status != UCS_OK) *context = nullptr;
  return status;
}

}  // namespace

struct UcxTransport::Peer : PeerAddress {};
struct UcxTransport::OpenedKeys {
  KeyMap by_name;
};

UcxTransport::UcxTransport(UcxTransportOptions options)
    : options_(options), ucp_(std::make_unique<Handles>()) {}

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(UcxTransportOptions options) {
  if (options.max_reads_in_flight < 1 || options.cleanup_grace < absl::ZeroDuration() ||
      options.same_host_stall_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UcxTransportOptions: max_reads_in_flight must be >= 1 (got ", options.max_reads_in_flight,
        "), cleanup_grace >= 0 and same_host_stall_timeout > 0"));
  }
  std::unique_ptr<UcxTransport> transport(new UcxTransport(options));
  RETURN_IF_ERROR(transport->Start());
  return transport;
}

absl::Status UcxTransport::Start() {
  const char* env_tls = std::getenv("UCX_TLS");
  ucp_->transports = !options_.transports.empty() ? options_.transports
                     : env_tls != nullptr         ? std::string(env_tls)
                                                  : std::string("all");
  ucs_status_t status = StartContext(
      options_.transports.empty() ? nullptr : options_.transports.c_str(), &ucp_->context);
  if (status != UCS_OK) return UcxError("cannot start UCX", status);
  status = CreateWorker(ucp_->context, &ucp_->server, &ucp_->server_efd);
  if (status != UCS_OK) {
    ucp_->server = nullptr;
    return UcxError("cannot create the serving UCX worker", status);
  }
  // An explicit transport choice (the option or UCX_TLS) wins over the same-host path.
  if (options_.same_host_shared_memory && options_.transports.empty() && env_tls == nullptr) {
    RETURN_IF_ERROR(StartSameHost());
  }
  std::string addresses[2];
  for (int i = 0; i < 2; ++i) {
    ucp_worker_h worker = i == 0 ? ucp_->server : ucp_->same_host_server;
    if (worker == nullptr) continue;
    ucp_address_t* address = nullptr;
    size_t address_size = 0;
    status = ucp_worker_get_address(worker, &address, &address_size);
    if (status != UCS_OK) return UcxError("cannot get the serving worker's address", status);
    addresses[i].assign(reinterpret_cast<const char*>(address), address_size);
    ucp_worker_release_address(worker, address);
  }
  const pid_t pid = getpid();
  const uint64_t start_time = ReadProcessStat(pid).start_time;
  std::string payload;
  PutField(&payload, addresses[0]);
  PutField(&payload, addresses[1]);
  PutField(&payload, ucp_->host);
  PutField(&payload, absl::string_view(reinterpret_cast<const char*>(&pid), sizeof(pid)));
  PutField(&payload, absl::string_view(reinterpret_cast<const char*>(&start_time), 8));
  worker_address_ = Seal(kAddressMagic, Envelope{.owner = Fnv1a(payload), .payload = payload});
  {
    MutexLock lock(&Live().mu);
    Live().owners.insert(Fnv1a(payload));
  }
  server_ = std::thread([this] { Serve(); });
  return absl::OkStatus();
}

// The same-host context and its serving worker. Where this host cannot be told (no
// boot_id, say) or UCX cannot start its shared-memory transports (a /dev/shm too small, say),
// the path stays off and every Read takes the main context: not an error.
absl::Status UcxTransport::StartSameHost() {
  ucp_->host = HostIdentity();
  if (ucp_->host.empty() || ReadProcessStat(getpid()).start_time == 0) return absl::OkStatus();
  if (StartContext(kSameHostTransports, &ucp_->same_host_context) != UCS_OK) {
    return absl::OkStatus();
  }
  if (CreateWorker(ucp_->same_host_context, &ucp_->same_host_server,
                   &ucp_->same_host_server_efd) != UCS_OK) {
    ucp_->same_host_server = nullptr;
    ucp_cleanup(ucp_->same_host_context);
    ucp_->same_host_context = nullptr;
    return absl::OkStatus();
  }
  ucp_->transports = absl::StrCat(ucp_->transports, " (same host: ", kSameHostTransports, ")");
  return absl::OkStatus();
}

void UcxTransport::Serve() {
  bool same_host = ucp_->same_host_server != nullptr;
  auto progressor_of = [this](bool with_same_host) {
    std::vector<Progressor::Worker> workers = {{ucp_->server, ucp_->server_efd}};
    if (with_same_host) workers.push_back({ucp_->same_host_server, ucp_->same_host_server_efd});
    return Progressor(std::move(workers), absl::Milliseconds(50));
  };
  Progressor progressor = progressor_of(same_host);
  while (!ucp_->stop.load(std::memory_order_acquire)) {
    if (same_host && ucp_->same_host_stopped.load(std::memory_order_relaxed)) {
      same_host = false;
      progressor = progressor_of(false);
    }
    progressor.ProgressOrWait(absl::InfiniteFuture());
  }
}

void UcxTransport::StopServingSameHostForTesting() {
  ucp_->same_host_stopped.store(true, std::memory_order_relaxed);
}

int64_t UcxTransport::same_host_reads() const { return ucp_->same_host_reads.load(); }
int64_t UcxTransport::same_host_fallbacks() const { return ucp_->same_host_fallbacks.load(); }

UcxTransport::~UcxTransport() {
  if (!worker_address_.empty()) {
    const uint64_t owner = Open(kAddressMagic, worker_address_, "own address").value().owner;
    MutexLock lock(&Live().mu);
    Live().owners.erase(owner);
  }
  if (server_.joinable()) {
    ucp_->stop.store(true, std::memory_order_release);
    ucp_worker_signal(ucp_->server);
    server_.join();
  }
  std::vector<void*> memhs, same_host_memhs;
  {
    MutexLock lock(&mu_);
    idle_workers_.clear();
    idle_same_host_workers_.clear();
    memhs = std::move(exposed_);
    same_host_memhs = std::move(exposed_same_host_);
    for (const auto& [base, region] : local_) memhs.push_back(region.second);
    local_.clear();
  }
  for (void* memh : memhs) ucp_mem_unmap(ucp_->context, static_cast<ucp_mem_h>(memh));
  for (void* memh : same_host_memhs) {
    ucp_mem_unmap(ucp_->same_host_context, static_cast<ucp_mem_h>(memh));
  }
  if (ucp_->same_host_server != nullptr) ucp_worker_destroy(ucp_->same_host_server);
  if (ucp_->same_host_context != nullptr) ucp_cleanup(ucp_->same_host_context);
  if (ucp_->server != nullptr) ucp_worker_destroy(ucp_->server);
  if (ucp_->context != nullptr) ucp_cleanup(ucp_->context);
}

const std::string& UcxTransport::transports() const { return ucp_->transports; }

namespace {

absl::StatusOr<ucp_mem_h> MapMemory(ucp_context_h context, void* base, int64_t bytes) {
  if (base == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX registration needs memory and bytes > 0 (got ", bytes, ")"));
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = base;
  params.length = static_cast<size_t>(bytes);
  ucp_mem_h memh = nullptr;
  const ucs_status_t status = ucp_mem_map(context, &params, &memh);
  if (status != UCS_OK) return UcxError(absl::StrCat("cannot register ", bytes, " bytes"), status);
  return memh;
}

// Registers [base, base + bytes) with `context` and packs its rkey into `packed`.
absl::StatusOr<ucp_mem_h> MapAndPack(ucp_context_h context, void* base, int64_t bytes,
                                     std::string* packed) {
  ASSIGN_OR_RETURN(ucp_mem_h memh, MapMemory(context, base, bytes));
  void* rkey = nullptr;
  size_t rkey_size = 0;
  const ucs_status_t status = ucp_rkey_pack(context, memh, &rkey, &rkey_size);
  if (status != UCS_OK) {
    ucp_mem_unmap(context, memh);
    return UcxError("cannot pack the memory key", status);
  }
  packed->assign(static_cast<char*>(rkey), rkey_size);
  ucp_rkey_buffer_release(rkey);
  return memh;
}

}  // namespace

absl::StatusOr<UcxMemoryKey> UcxTransport::Expose(void* base, int64_t bytes) {
  std::string packed[2];
  ASSIGN_OR_RETURN(ucp_mem_h memh, MapAndPack(ucp_->context, base, bytes, &packed[0]));
  ucp_mem_h same_host_memh = nullptr;
  if (ucp_->same_host_context != nullptr) {
    // Without it, reads of this region take the main context.
    absl::StatusOr<ucp_mem_h> mapped =
        MapAndPack(ucp_->same_host_context, base, bytes, &packed[1]);
    if (mapped.ok()) same_host_memh = *mapped;
  }
  UcxMemoryKey key;
  key.remote_address = reinterpret_cast<uintptr_t>(base);
  key.bytes = bytes;
  std::string payload;
  PutField(&payload, packed[0]);
  PutField(&payload, packed[1]);
  key.rkey = Seal(kKeyMagic, Envelope{.owner = Open(kAddressMagic, worker_address_, "own address")
                                                   .value()
                                                   .owner,
                                      .base = key.remote_address,
                                      .length = static_cast<uint64_t>(bytes),
                                      .payload = payload});
  MutexLock lock(&mu_);
  exposed_.push_back(memh);
  if (same_host_memh != nullptr) exposed_same_host_.push_back(same_host_memh);
  return key;
}

absl::Status UcxTransport::RegisterLocal(void* base, int64_t bytes) {
  // The main context only: same-host reads land through UCP's copies from its FIFOs.
  ASSIGN_OR_RETURN(ucp_mem_h memh, MapMemory(ucp_->context, base, bytes));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base);
  MutexLock lock(&mu_);
  auto [it, inserted] = local_.emplace(begin, std::make_pair(begin + bytes, memh));
  if (!inserted) {
    // The same base again (say, a grown region): keep both mappings, the newer one in use.
    exposed_.push_back(it->second.second);
    it->second = {begin + bytes, memh};
  }
  return absl::OkStatus();
}

void* UcxTransport::FindLocalMemh(const void* local, int64_t bytes) const {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(local);
  ReaderMutexLock lock(&mu_);
  auto it = local_.upper_bound(begin);
  if (it == local_.begin()) return nullptr;
  --it;
  return begin + static_cast<uintptr_t>(bytes) <= it->second.first ? it->second.second : nullptr;
}

absl::StatusOr<std::unique_ptr<UcxTransport::ClientWorker>> UcxTransport::BorrowWorker(
    bool same_host) {
  {
    MutexLock lock(&mu_);
    auto& idle = same_host ? idle_same_host_workers_ : idle_workers_;
    if (!idle.empty()) {
      std::unique_ptr<ClientWorker> worker = std::move(idle.back());
      idle.pop_back();
      return worker;
    }
  }
  auto worker = std::make_unique<ClientWorker>();
  worker->same_host = same_host;
  const ucs_status_t status =
      CreateWorker(same_host ? ucp_->same_host_context : ucp_->context, &worker->worker,
                   &worker->efd);
  if (status != UCS_OK) {
    worker->worker = nullptr;
    return UcxError("cannot create a UCX worker for the read", status);
  }
  return worker;
}

void UcxTransport::ReturnWorker(std::unique_ptr<ClientWorker> worker) {
  MutexLock lock(&mu_);
  (worker->same_host ? idle_same_host_workers_ : idle_workers_).push_back(std::move(worker));
}

absl::Status UcxTransport::Read(absl::string_view peer_worker_address,
                                std::span<const UcxRead> reads, absl::Time deadline) {
  ASSIGN_OR_RETURN(PeerAddress address, OpenPeerAddress(peer_worker_address));
  ASSIGN_OR_RETURN(KeyMap keys, CheckReads(reads, address.owner));
  if (keys.empty()) return absl::OkStatus();
  const Peer peer{address};
  const OpenedKeys opened{std::move(keys)};
  bool same_host = ucp_->same_host_context != nullptr && !peer.same_host_address.empty() &&
                   peer.host == ucp_->host;
  for (const auto& [name, key] : opened.by_name) {
    same_host = same_host && !key.same_host_packed.empty();
  }
  if (same_host) {
    ReaderMutexLock lock(&mu_);
    same_host = !stalled_peers_.contains(peer.owner);
  }
  bool retry_over_main = false;
  if (same_host) {
    absl::Status status =
        ReadOver(peer, opened, /*same_host=*/true, reads, deadline, &retry_over_main);
    if (!retry_over_main) {
      if (status.ok()) ucp_->same_host_reads.fetch_add(1, std::memory_order_relaxed);
      return status;
    }
    // UCX could not connect over shared memory (segments it cannot map, say), or the peer's
    // FIFO wedged: the main context, which reads everything again (what had landed is the
    // same bytes; the abandoned worker is gone, so nothing lands from it any more).
  }
  return ReadOver(peer, opened, /*same_host=*/false, reads, deadline, &retry_over_main);
}

absl::Status UcxTransport::ReadOver(const Peer& peer, const OpenedKeys& keys, bool same_host,
                                    std::span<const UcxRead> reads, absl::Time deadline,
                                    bool* retry_over_main) {
  std::optional<PeerWatch> watch;
  if (same_host) {
    watch.emplace(peer.pid, peer.start_time);
    RETURN_IF_ERROR(watch->Open());
    if (peer.pid == getpid()) {
      MutexLock lock(&Live().mu);
      if (!Live().owners.contains(peer.owner)) {
        return absl::UnavailableError("the peer transport (of this process) has been destroyed");
      }
    }
  }
  absl::StatusOr<std::unique_ptr<ClientWorker>> borrowed = BorrowWorker(same_host);
  if (!borrowed.ok()) {
    *retry_over_main = same_host;  // shared memory used up (a small /dev/shm), say
    return borrowed.status();
  }
  std::unique_ptr<ClientWorker> worker = *std::move(borrowed);
  // A stall must leave time to read everything again over the main context.
  const absl::Duration stall_timeout =
      std::min(options_.same_host_stall_timeout, (deadline - absl::Now()) / 4);
  ReadCall call(worker->worker, worker->efd, watch ? &*watch : nullptr, stall_timeout, deadline,
                options_.cleanup_grace);
  absl::Status result = call.Connect(same_host ? peer.same_host_address : peer.address);
  absl::flat_hash_map<const std::string*, ucp_rkey_h> rkeys;
  for (const auto& [name, key] : keys.by_name) {
    if (!result.ok()) break;
    absl::StatusOr<ucp_rkey_h> rkey = call.Unpack(same_host ? key.same_host_packed : key.packed);
    if (rkey.ok()) rkeys[name] = *rkey;
    result = rkey.status();
  }
  *retry_over_main = same_host && !result.ok();
  size_t next = 0;
  while (result.ok()) {
    for (; next < reads.size() && call.in_flight() < options_.max_reads_in_flight; ++next) {
      const UcxRead& read = reads[next];
      if (read.bytes == 0) continue;
      // A registration of the main context means nothing to the same-host one's workers.
      void* memh = same_host ? nullptr : FindLocalMemh(read.local, read.bytes);
      result = call.Issue(read, rkeys[read.rkey], memh);
      if (!result.ok()) break;
    }
    if (result.ok()) result = call.Reap();
    if (!result.ok() || (next == reads.size() && call.in_flight() == 0)) break;
    result = call.Wait();
  }
  if (call.stalled()) {
    *retry_over_main = true;
    ucp_->same_host_fallbacks.fetch_add(1, std::memory_order_relaxed);
    MutexLock lock(&mu_);
    stalled_peers_.insert(peer.owner);
  }
  if (call.Finish(/*failed=*/!result.ok())) {
    ReturnWorker(std::move(worker));
  } else {
    worker.reset();  // while `call` lives: destroying the endpoint may still call its handler
  }
  return result;
}

}  // namespace kvcm

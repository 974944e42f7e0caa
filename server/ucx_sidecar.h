// UcxSidecar: kvcached's UCX endpoint, in a process of its own. UCX 1.13 (Debian) can abort
// the process it runs in when a peer dies at the wrong moment (an assertion in its TCP
// wire-up, `ucp_request.c:684 ... got REP message`, seen when a reader was killed
// mid-read), so kvcached does not run UCX itself: it starts `kvcached --ucx_sidecar_fd=N`,
// which maps the node's shared-memory KV pools by name, exposes them for peers' reads,
// registers them for this daemon's imports, and performs the reads this daemon asks for
// straight into those pools. If UCX takes the sidecar down, kvcached and its sequences are
// unaffected: the read in progress fails with UNAVAILABLE, and the next use starts a new
// sidecar (a new worker address and keys for the exports from then on).
//
// Only host pools in POSIX shared memory can be shared this way (--kv_shared_memory, the
// default); other pools move over gRPC.
//
// The control channel is a socketpair with length-prefixed frames (server/ucx_sidecar.cc).
// Thread-safe: calls are serialized (one read in flight at a time per daemon).
#ifndef KVCM_SERVER_UCX_SIDECAR_H_
#define KVCM_SERVER_UCX_SIDECAR_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/kv/ucx_transfer.h"

namespace kvcm::server {

// The pools as UCX exposes them: what an export tells a target that reads over UCX.
struct UcxExposure {
  std::string worker_address;
  std::vector<UcxMemoryKey> keys;  // per rank
};

// One read into this node's pool: `bytes` from the peer's `remote_address` (under
// rkeys[key]) to `offset` of rank `rank`'s pool.
struct SidecarRead {
  uint32_t key = 0;
  uint64_t remote_address = 0;
  int32_t rank = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
};

class UcxSidecar {
 public:
  // Starts the sidecar over `pools` (which must all be POSIX shared memory; not owned, must
  // outlive this). `executable`: the kvcached binary to run (/proc/self/exe). UNAVAILABLE
  // naming why when it cannot start (UCX missing, the pools not shareable).
  static absl::StatusOr<std::unique_ptr<UcxSidecar>> Start(const KvPools& pools,
                                                           std::string executable);
  ~UcxSidecar();  // kills the sidecar

  UcxSidecar(const UcxSidecar&) = delete;
  UcxSidecar& operator=(const UcxSidecar&) = delete;

  // The current sidecar's worker address and keys (starting a new sidecar if the last one
  // died). UNAVAILABLE when none can be started.
  absl::StatusOr<UcxExposure> Exposure() ABSL_LOCKS_EXCLUDED(mu_);

  // Reads every entry of `reads` from the peer at `peer_worker_address` into this node's
  // pools by `deadline`. UcxTransport::Read's errors, and UNAVAILABLE when the sidecar dies
  // during the read twice (once, the read is done again by a new sidecar).
  absl::Status Read(const std::string& peer_worker_address, const std::vector<std::string>& rkeys,
                    const std::vector<SidecarRead>& reads, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Sidecars started so far (1 once started; more after restarts), and the current pid.
  int64_t starts() const ABSL_LOCKS_EXCLUDED(mu_);
  pid_t pid() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pool {
    std::string shm_name;
    int64_t bytes = 0;
  };
  UcxSidecar(std::vector<Pool> pools, std::string executable)
      : pools_(std::move(pools)), executable_(std::move(executable)) {}
  // A running sidecar, starting one when there is none (or the last one exited).
  absl::Status EnsureRunningLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SpawnLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One attempt of Read with the sidecar running; on a channel failure the sidecar is
  // stopped (pid_ < 0).
  absl::Status ReadLocked(const std::string& peer_worker_address,
                          const std::vector<std::string>& rkeys,
                          const std::vector<SidecarRead>& reads, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Kills and reaps the sidecar, if any.
  void StopLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<Pool> pools_;
  const std::string executable_;
  mutable Mutex mu_;
  pid_t pid_ ABSL_GUARDED_BY(mu_) = -1;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  UcxExposure exposure_ ABSL_GUARDED_BY(mu_);
  int64_t starts_ ABSL_GUARDED_BY(mu_) = 0;
};

// The sidecar's main: serves the control channel `fd` until it closes (kvcached's main
// calls it for --ucx_sidecar_fd). Returns the process's exit code.
int RunUcxSidecar(int fd);

}  // namespace kvcm::server

#endif  // KVCM_SERVER_UCX_SIDECAR_H_

// UcxTransport: the data plane of the disaggregated hand-off. A source daemon exposes its
// KV pool memory for remote reads (Expose) and sends the key and its worker address to the
// target (over gRPC, elsewhere); the target pulls a sequence's blocks with one Read call.
// UCX chooses the transport: with peer failure handling, UCX 1.13 picks tcp (loopback on one
// node) or RDMA, never its shared-memory transports (see ucx_transfer.cc). A peer on this host
// (same boot, PID and IPC namespaces) is read over UCX's shared memory instead, on a second UCP
// context limited to it, without UCX's failure handling: the Read watches the peer process.
//
// Thread-safe. Every method may be called from any thread; concurrent Read calls each
// borrow a client worker of their own from a pool (a UCP worker is driven by one thread at a
// time), so they neither serialize on each other nor share endpoints. A worker whose Read
// ended in a state UCX could not clean up within a grace period is destroyed, not reused.
//
// The transport owns one UCP context and a serving worker progressed by a thread of its
// own: over transports where UCP emulates reads with messages (TCP), the exposing side must
// progress for a peer's read to be served, and the daemon's threads are busy elsewhere.
#ifndef KVCM_CACHE_MANAGER_KV_UCX_TRANSFER_H_
#define KVCM_CACHE_MANAGER_KV_UCX_TRANSFER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/base/mutex.h"

namespace kvcm {

struct UcxTransportOptions {
  int32_t max_reads_in_flight = 64;  // gets outstanding per Read call; >= 1
  // How long a Read that failed or ran out of time may spend after its deadline making sure
  // UCX has cancelled every outstanding get (after which the worker is destroyed instead).
  absl::Duration cleanup_grace = absl::Seconds(2);
  // The UCX transports (UCX_TLS syntax, e.g. "tcp"). Empty: the environment's UCX_TLS when
  // set, else UCX's default (all; ucx_transfer.cc says which UCX picks, and why).
  std::string transports;
  // Reads from a peer on this host (same boot, PID and IPC namespaces) go over UCX's
  // shared-memory transports (posix, sysv: ~3.5x tcp on the loopback) when both sides allow
  // it and `transports` is empty and UCX_TLS unset (an explicit transport choice wins).
  // UCX 1.13 has no peer failure handling for them, so the Read watches the peer process
  // (a pidfd) and fails with UNAVAILABLE when it exits, as over tcp.
  bool same_host_shared_memory = true;
  // A same-host Read whose gets all stay unanswered this long (at most a quarter of the time
  // left to its deadline) while the peer lives is abandoned and redone over the main
  // context, as are all later reads from that peer: a peer's shared-memory FIFO can wedge for
  // good when another reader of it is killed mid-read (UCX 1.13; see ucx_transfer.cc).
  absl::Duration same_host_stall_timeout = absl::Milliseconds(250);
};

// A remote-readable registration: what a source sends a target. Opaque bytes to everyone
// but UcxTransport.
struct UcxMemoryKey {
  uint64_t remote_address = 0;  // base address in the exposing process
  int64_t bytes = 0;            // length of the exposed region
  // The ucp_rkey_pack bytes in a small envelope (magic, the region's base and length, a
  // checksum): ucp_ep_rkey_unpack takes no length and trusts its input, so damaged or
  // foreign bytes are refused with INVALID_ARGUMENT before UCX parses them, and a read
  // outside the region is refused before it reaches the peer (which would otherwise fault
  // over transports where the peer copies the bytes itself).
  std::string rkey;
};

// One read: `bytes` from the peer's `remote_address` (inside a region exposed under `rkey`)
// to `local` (host memory of this process, `bytes` long).
struct UcxRead {
  const std::string* rkey = nullptr;  // UcxMemoryKey::rkey of the region it reads from
  uint64_t remote_address = 0;
  void* local = nullptr;
  int64_t bytes = 0;
};

class UcxTransport {
 public:
  // One UCP context (RMA) and a serving worker with its own progress thread. UNAVAILABLE
  // with UCX's message when UCX cannot start; INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(UcxTransportOptions options = {});
  // Stops the progress thread, unmaps every region, destroys the workers. REQUIRES: no Read,
  // Expose or RegisterLocal in progress.
  ~UcxTransport();

  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // Registers [base, base + bytes) (host memory) for remote reads for the transport's
  // lifetime. REQUIRES: the memory outlives the transport.
  absl::StatusOr<UcxMemoryKey> Expose(void* base, int64_t bytes);
  // Registers local destination memory (host) for the transport's lifetime; optional, it
  // spares UCX a registration per read. REQUIRES: the memory outlives the transport.
  absl::Status RegisterLocal(void* base, int64_t bytes);

  // The serving worker's address (ucp_worker_get_address bytes, in the same envelope as
  // keys): what a target passes to Read.
  const std::string& worker_address() const { return worker_address_; }

  // Reads every entry of `reads` from the peer at `peer_worker_address`, at most
  // max_reads_in_flight at a time, and returns when all have landed. Errors:
  // INVALID_ARGUMENT (damaged key or address bytes, a read outside its region, a null
  // destination), UNAVAILABLE (peer unreachable or gone mid-read, with UCX's status),
  // DEADLINE_EXCEEDED at `deadline`. On any error every outstanding get has been cancelled
  // before Read returns: no byte lands in `local` memory afterwards (some may have landed
  // before).
  absl::Status Read(absl::string_view peer_worker_address, std::span<const UcxRead> reads,
                    absl::Time deadline);

  // Read calls that completed over the same-host path, and those that left it for the main
  // context after a stall; for logs and tests.
  int64_t same_host_reads() const;
  int64_t same_host_fallbacks() const;

  // Tests only: the serving thread stops answering same-host reads, as a wedged FIFO would.
  void StopServingSameHostForTesting();

  // The UCX transports this context may use (UCX_TLS syntax), for logs; with the same-host
  // path, followed by " (same host: posix,sysv)".
  const std::string& transports() const;

 private:
  struct Handles;  // UCP handles, kept out of this header so that users need no UCX headers
  struct ClientWorker;
  struct Peer;        // an opened worker address
  struct OpenedKeys;  // the keys of one Read, checked against their regions

  explicit UcxTransport(UcxTransportOptions options);
  absl::Status Start();
  void Serve();
  absl::Status StartSameHost();
  absl::StatusOr<std::unique_ptr<ClientWorker>> BorrowWorker(bool same_host);
  // Reads over the main context (UCX's peer failure handling) or the same-host one (which
  // watches the peer process). `retry_over_main`: set when the same-host context could not
  // connect or unpack a key, or stalled; the caller then takes the main one.
  absl::Status ReadOver(const Peer& peer, const OpenedKeys& keys, bool same_host,
                        std::span<const UcxRead> reads, absl::Time deadline,
                        bool* retry_over_main);
  void ReturnWorker(std::unique_ptr<ClientWorker> worker);
  // The registration of local memory that holds [local, local + bytes), or null.
  void* FindLocalMemh(const void* local, int64_t bytes) const;

  const UcxTransportOptions options_;
  std::unique_ptr<Handles> ucp_;
  std::string worker_address_;
  std::thread server_;

  mutable Mutex mu_;
  std::vector<void*> exposed_ ABSL_GUARDED_BY(mu_);  // ucp_mem_h, unmapped at destruction
  std::vector<void*> exposed_same_host_ ABSL_GUARDED_BY(mu_);  // of the same-host context
  // ucp_mem_h of RegisterLocal regions, by base address; value: (end address, memh).
  std::map<uintptr_t, std::pair<uintptr_t, void*>> local_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<ClientWorker>> idle_workers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<ClientWorker>> idle_same_host_workers_ ABSL_GUARDED_BY(mu_);
  // Peers (their address's owner hash) whose same-host path stalled: read over the main one.
  std::set<uint64_t> stalled_peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_UCX_TRANSFER_H_

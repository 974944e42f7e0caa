// ScoreRegions: the score regions of workers on this node, so that a StepReport may name
// a range of one instead of carrying its score bytes, and the engine reads them in place.
// Two kinds:
//   - registered (RegisterScoreRegion): a POSIX shared-memory object the worker made,
//     mapped once, read-only;
//   - created (CreateScoreRegion): memory the daemon allocates where its engine decides
//     (host shared memory for the CPU engine, device memory exported by CUDA IPC handle
//     for the CUDA one) and the worker maps read-write. The engine reads a created region
//     of a device engine in place on the device (View::in_backend).
//
// A region belongs to the tenant that registered or created it: any other tenant is told
// it does not exist. Every reference is checked against the mapping's bounds and, for
// shared memory, against the object's current size (a worker that shrank the object
// would otherwise fault the daemon on the next read; the check narrows that to a shrink
// racing the read itself, which the ownership rule of the proto forbids). Regions nobody
// named for the idle timeout are dropped, except exported device memory (DropIdle).
// Thread-safe.
#ifndef KVCM_CACHE_MANAGER_KV_SCORE_REGIONS_H_
#define KVCM_CACHE_MANAGER_KV_SCORE_REGIONS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/base/byte_budget.h"
#include "cache_manager/base/clock.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/kv/kv_storage.h"

namespace kvcm {

// How the daemon makes the memory of a created region: `bytes` of zero-filled storage on
// `device` (-1: the engine's; device memory only); host storage must be the POSIX
// shared-memory object `shm_name` (a worker maps it by name). Errors as
// NewHostKvStorage's or NewCudaKvStorage's.
using ScoreRegionAllocator = std::function<absl::StatusOr<std::unique_ptr<KvStorage>>(
    int64_t bytes, const std::string& shm_name, int device)>;

struct ScoreRegionsOptions {
  int64_t max_regions = 256;                   // registered and created at once, all tenants
  int64_t max_region_bytes = int64_t{4} << 30; // one region's mapping
  // Created regions (none when the allocator is unset): their memory, and whether it is
  // the engine backend's (a device engine reads them in place) rather than plain host
  // memory. Their bytes come from `created_budget` (may be null: no limit but the
  // per-region one), which the caller keeps alive.
  ScoreRegionAllocator allocate;
  bool created_in_backend = false;
  // Ranks a created region may be placed on (CreateScoreRegionRequest.rank): [0, this).
  int32_t max_rank = 0;
  ByteBudget* created_budget = nullptr;
  // Created regions' shared-memory names: this prefix, then a counter.
  std::string created_name_prefix = "/kvcm-scores-";
  // When a region was last named (for DropIdle); the real clock by default, a ManualClock
  // in tests. Must outlive the regions.
  const Clock* clock = Clock::Real();
};

// What a worker needs to map a created region.
struct CreatedScoreRegion {
  uint64_t region = 0;
  MemoryExport memory;  // kPosixShm (shm_name) or kCudaIpc (handle, device, UUID, bus id)
};

// A range of a region, as a report names it.
struct ScoreRange {
  uint64_t region = 0;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

class ScoreRegions {
 public:
  explicit ScoreRegions(ScoreRegionsOptions options) : options_(options) {}
  ~ScoreRegions();

  ScoreRegions(const ScoreRegions&) = delete;
  ScoreRegions& operator=(const ScoreRegions&) = delete;

  // Opens the POSIX shared-memory object `name` and maps its first `byte_size` bytes.
  // INVALID_ARGUMENT: a bad name or size, an object that cannot be opened, is not a
  // regular file, is smaller than byte_size, or is accessible to other users (it must be
  // mode 0600 or stricter); RESOURCE_EXHAUSTED past max_regions.
  absl::StatusOr<uint64_t> Register(absl::string_view tenant, const std::string& name,
                                    uint64_t byte_size);
  // Allocates a region of `byte_size` bytes for `tenant` (zero-filled; freed by
  // Unregister, the idle drop (not exported device memory), or the daemon's exit).
  // INVALID_ARGUMENT for a bad size; FAILED_PRECONDITION when this daemon creates no
  // regions, or when its memory cannot be shared with a worker (MemoryExport::unavailable,
  // quoted); RESOURCE_EXHAUSTED past max_regions or the created budget (saying what is
  // used and left), or when the memory cannot be had; INTERNAL for other failures of the
  // allocator.
  // `rank` >= 0 (device engines): on that rank's device instead of the engine's
  // (INVALID_ARGUMENT past max_rank).
  absl::StatusOr<CreatedScoreRegion> Create(absl::string_view tenant, uint64_t byte_size,
                                            int32_t rank = -1);

  // NOT_FOUND when `tenant` has no such region. Readers holding a View keep the mapping
  // (a created region: its memory) until they are done.
  absl::Status Unregister(absl::string_view tenant, uint64_t region);

  // The bytes of `range`, valid while the View lives. INVALID_ARGUMENT naming the
  // region, offset and sizes when the region is unknown (to this tenant), the range
  // exceeds the mapping, or the object shrank below the mapping.
  struct View {
    std::shared_ptr<const void> pin;  // keeps the mapping alive
    const std::byte* data = nullptr;  // device memory when in_backend on a CUDA engine
    size_t size = 0;
    // The bytes are the engine backend's memory (a created region of a device engine):
    // read them there, never on the host.
    bool in_backend = false;
    int device = -1;  // with in_backend: the device (-1: the engine's)
  };
  absl::StatusOr<View> Resolve(absl::string_view tenant, const ScoreRange& range) const;

  // Unmaps the regions no report named since `now - idle`; returns how many. Created
  // regions of device memory exported by CUDA IPC handle stay: the daemon cannot see
  // whether a worker still has the handle open, and freed device memory goes to the next
  // allocation (another tenant's region, a KV pool) while that worker can still write it.
  // They go on Unregister (the clients close their mapping first) or at exit, and stay
  // charged to the created budget meanwhile, which bounds them.
  int64_t DropIdle(absl::Duration idle, absl::Time now);

  int64_t count() const;
  int64_t mapped_bytes() const;

 private:
  struct Mapping;

  // Whether `mapping` is memory another process may map without the daemon knowing (a
  // created region exported by CUDA IPC handle): DropIdle keeps it.
  static bool ExportedToAnotherProcess(const Mapping& mapping);
  // Adds `mapping` under a fresh id; RESOURCE_EXHAUSTED past max_regions.
  absl::StatusOr<uint64_t> Insert(std::shared_ptr<Mapping> mapping, absl::string_view what);
  absl::Status CheckRoom(absl::string_view what) const;

  const ScoreRegionsOptions options_;
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Mapping>> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> created_names_{0};
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_SCORE_REGIONS_H_

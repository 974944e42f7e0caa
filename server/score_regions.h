// ScoreRegions: the shared-memory score regions workers on this node registered
// (RegisterScoreRegion), each mapped once, read-only, so that a StepReport may name a
// range of one instead of carrying its score bytes, and the engine reads them in place.
//
// A region belongs to the tenant that registered it: any other tenant is told it does
// not exist. Every reference is checked against the mapping's bounds and against the
// object's current size (a worker that shrank its object after registering would
// otherwise fault the daemon on the next read; the check narrows that to a shrink racing
// the read itself, which the ownership rule of the proto forbids). Regions nobody named
// for the idle timeout are dropped. Thread-safe.
#ifndef KVCM_SERVER_SCORE_REGIONS_H_
#define KVCM_SERVER_SCORE_REGIONS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_manager/mutex.h"

namespace kvcm::server {

struct ScoreRegionsOptions {
  int64_t max_regions = 256;                   // registered at once, all tenants
  int64_t max_region_bytes = int64_t{4} << 30; // one region's mapping
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
  // NOT_FOUND when `tenant` has no such region. Readers holding a View keep the mapping
  // until they are done.
  absl::Status Unregister(absl::string_view tenant, uint64_t region);

  // The bytes of `range`, valid while the View lives. INVALID_ARGUMENT naming the
  // region, offset and sizes when the region is unknown (to this tenant), the range
  // exceeds the mapping, or the object shrank below the mapping.
  struct View {
    std::shared_ptr<const void> pin;  // keeps the mapping alive
    const std::byte* data = nullptr;
    size_t size = 0;
  };
  absl::StatusOr<View> Resolve(absl::string_view tenant, const ScoreRange& range) const;

  // Unmaps the regions no report named since `now - idle`; returns how many.
  int64_t DropIdle(absl::Duration idle, absl::Time now);

  int64_t count() const;
  int64_t mapped_bytes() const;

 private:
  struct Mapping;

  const ScoreRegionsOptions options_;
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Mapping>> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_SCORE_REGIONS_H_

#include "server/score_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcm::server {

struct ScoreRegions::Mapping {
  Mapping(std::string tenant_in, std::string name_in, int fd_in, void* base_in, size_t size_in)
      : tenant(std::move(tenant_in)), name(std::move(name_in)), fd(fd_in), base(base_in),
        size(size_in) {}
  ~Mapping() {
    munmap(base, size);
    close(fd);
  }
  const std::string tenant;
  const std::string name;
  const int fd;
  void* const base;
  const size_t size;
  mutable std::atomic<int64_t> last_used_ns{0};
};

namespace {

int64_t NowNanos() { return absl::ToUnixNanos(absl::Now()); }

absl::Status CheckName(const std::string& name) {
  if (name.size() < 2 || name.size() > 251 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos || name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "score region name must be '/' followed by 1 to 250 bytes without '/' (got ",
        name.size(), " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

ScoreRegions::~ScoreRegions() = default;

absl::StatusOr<uint64_t> ScoreRegions::Register(absl::string_view tenant, const std::string& name,
                                                uint64_t byte_size) {
  if (absl::Status ok = CheckName(name); !ok.ok()) return ok;
  if (byte_size == 0 || byte_size > static_cast<uint64_t>(options_.max_region_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("score region ", name, ": byte_size is ",
                                                   byte_size, "; it must be 1 to ",
                                                   options_.max_region_bytes));
  }
  {
    ReaderMutexLock lock(&mu_);
    if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "score region ", name, ": kvcached already maps the maximum of ",
          options_.max_regions, " score regions; unregister some first"));
    }
  }
  const int fd = shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("score region ", name, ": cannot open it: ", std::strerror(errno)));
  }
  struct stat st {};
  const auto refuse = [&](const std::string& why) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("score region ", name, ": ", why));
  };
  if (fstat(fd, &st) != 0) return refuse(absl::StrCat("fstat: ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) return refuse("not a regular shared-memory object");
  if ((st.st_mode & 077) != 0) {
    return refuse(absl::StrCat("its mode is 0", (st.st_mode & 0777) >> 6, (st.st_mode & 070) >> 3,
                               st.st_mode & 07,
                               "; a score region must be mode 0600 (no group or other access)"));
  }
  if (static_cast<uint64_t>(st.st_size) < byte_size) {
    return refuse(absl::StrCat("the object has ", st.st_size, " bytes, fewer than byte_size ",
                               byte_size));
  }
  void* base = mmap(nullptr, byte_size, PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return refuse(absl::StrCat("mmap: ", std::strerror(errno)));
  auto mapping = std::make_shared<Mapping>(std::string(tenant), name, fd, base,
                                           static_cast<size_t>(byte_size));
  mapping->last_used_ns.store(NowNanos(), std::memory_order_relaxed);

  MutexLock lock(&mu_);
  if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "score region ", name, ": kvcached already maps the maximum of ", options_.max_regions,
        " score regions; unregister some first"));
  }
  if (next_id_ == 0) {
    // Ids start at a random point so that one tenant's ids say nothing of another's.
    next_id_ = std::random_device{}() | 1u;
  }
  const uint64_t id = next_id_++;
  if (next_id_ == 0) next_id_ = 1;
  regions_.emplace(id, std::move(mapping));
  return id;
}

absl::Status ScoreRegions::Unregister(absl::string_view tenant, uint64_t region) {
  std::shared_ptr<Mapping> dropped;  // unmapped outside the lock, once no reader holds it
  MutexLock lock(&mu_);
  auto it = regions_.find(region);
  if (it == regions_.end() || it->second->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("score region ", region, " is not registered"));
  }
  dropped = std::move(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<ScoreRegions::View> ScoreRegions::Resolve(absl::string_view tenant,
                                                         const ScoreRange& range) const {
  std::shared_ptr<const Mapping> mapping;
  {
    ReaderMutexLock lock(&mu_);
    auto it = regions_.find(range.region);
    if (it != regions_.end() && it->second->tenant == tenant) mapping = it->second;
  }
  const auto describe = [&] {
    return absl::StrCat("score region ", range.region, " offset ", range.offset, " byte_size ",
                        range.byte_size);
  };
  if (mapping == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(describe(), ": no such region is registered (RegisterScoreRegion)"));
  }
  if (range.byte_size == 0 || range.offset > mapping->size ||
      range.byte_size > mapping->size - range.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        describe(), ": the range is empty or exceeds the region's ", mapping->size,
        " mapped bytes"));
  }
  struct stat st {};
  if (fstat(mapping->fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < mapping->size) {
    return absl::InvalidArgumentError(absl::StrCat(
        describe(), ": the shared-memory object shrank to ", st.st_size,
        " bytes, below the ", mapping->size, " registered; register it again"));
  }
  mapping->last_used_ns.store(NowNanos(), std::memory_order_relaxed);
  View view;
  view.data = static_cast<const std::byte*>(mapping->base) + range.offset;
  view.size = static_cast<size_t>(range.byte_size);
  view.pin = std::move(mapping);
  return view;
}

int64_t ScoreRegions::DropIdle(absl::Duration idle, absl::Time now) {
  const int64_t cutoff = absl::ToUnixNanos(now - idle);
  std::vector<std::shared_ptr<Mapping>> dropped;
  MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second->last_used_ns.load(std::memory_order_relaxed) <= cutoff) {
      dropped.push_back(std::move(it->second));
      regions_.erase(it++);
    } else {
      ++it;
    }
  }
  return static_cast<int64_t>(dropped.size());
}

int64_t ScoreRegions::count() const {
  ReaderMutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

int64_t ScoreRegions::mapped_bytes() const {
  ReaderMutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto& [id, mapping] : regions_) bytes += static_cast<int64_t>(mapping->size);
  return bytes;
}

}  // namespace kvcm::server

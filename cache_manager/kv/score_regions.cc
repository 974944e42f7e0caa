#include "cache_manager/kv/score_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm {

struct ScoreRegions::Mapping {
  // A registered region: the worker's object, mapped here.
  Mapping(std::string tenant_in, std::string name_in, int fd_in, void* base_in, size_t size_in)
      : tenant(std::move(tenant_in)), name(std::move(name_in)), fd(fd_in), base(base_in),
        size(size_in) {}
  // A created region: `storage` is ours; `fd_in` (host storage only, else -1) a read-only
  // descriptor of its object for the size check; `budget_in` had its bytes taken.
  Mapping(std::string tenant_in, std::unique_ptr<KvStorage> storage_in, int fd_in,
          bool in_backend_in, int device_in, ByteBudget* budget_in)
      : tenant(std::move(tenant_in)), name(storage_in->memory_export().shm_name), fd(fd_in),
        base(storage_in->data()), size(static_cast<size_t>(storage_in->bytes())),
        in_backend(in_backend_in), device(device_in), storage(std::move(storage_in)),
        budget(budget_in) {}
  ~Mapping() {
    if (storage == nullptr) {
      munmap(base, size);
    } else {
      storage.reset();  // unlinks the object, or frees the device memory
      if (budget != nullptr) budget->Release(static_cast<int64_t>(size));
    }
    if (fd >= 0) close(fd);
  }
  const std::string tenant;
  const std::string name;
  const int fd;
  void* const base;
  const size_t size;
  const bool in_backend = false;
  const int device = -1;
  std::unique_ptr<KvStorage> storage;  // created regions
  ByteBudget* const budget = nullptr;
  mutable std::atomic<int64_t> last_used_ns{0};
};

namespace {

int64_t NowNanos(const Clock& clock) { return absl::ToUnixNanos(clock.Now()); }

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

bool ScoreRegions::ExportedToAnotherProcess(const Mapping& mapping) {
  return mapping.storage != nullptr &&
         mapping.storage->memory_export().kind == MemoryExport::Kind::kCudaIpc;
}

ScoreRegions::~ScoreRegions() = default;

absl::StatusOr<uint64_t> ScoreRegions::Register(absl::string_view tenant, const std::string& name,
                                                uint64_t byte_size) {
  if (absl::Status ok = CheckName(name); !ok.ok()) return ok;
  if (byte_size == 0 || byte_size > static_cast<uint64_t>(options_.max_region_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("score region ", name, ": byte_size is ",
                                                   byte_size, "; it must be 1 to ",
                                                   options_.max_region_bytes));
  }
  if (absl::Status room = CheckRoom(absl::StrCat("score region ", name)); !room.ok()) return room;
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
  mapping->last_used_ns.store(NowNanos(*options_.clock), std::memory_order_relaxed);

  return Insert(std::move(mapping), absl::StrCat("score region ", name));
}

absl::Status ScoreRegions::CheckRoom(absl::string_view what) const {
  ReaderMutexLock lock(&mu_);
  if (static_cast<int64_t>(regions_.size()) < options_.max_regions) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, ": kvcached already holds the maximum of ", options_.max_regions,
      " score regions (--max_score_regions); unregister some first"));
}

absl::StatusOr<uint64_t> ScoreRegions::Insert(std::shared_ptr<Mapping> mapping,
                                              absl::string_view what) {
  MutexLock lock(&mu_);
  if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": kvcached already holds the maximum of ", options_.max_regions,
        " score regions (--max_score_regions); unregister some first"));
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

absl::StatusOr<CreatedScoreRegion> ScoreRegions::Create(absl::string_view tenant,
                                                        uint64_t byte_size, int32_t rank) {
  if (!options_.allocate) {
    return absl::FailedPreconditionError(
        "this kvcached creates no score regions (it runs without --allow_shm_scores)");
  }
  if (byte_size == 0 || byte_size > static_cast<uint64_t>(options_.max_region_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("CreateScoreRegion: byte_size is ", byte_size,
                                                   "; it must be 1 to ",
                                                   options_.max_region_bytes));
  }
  if (rank < -1 || rank >= options_.max_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateScoreRegion: rank is ", rank, "; it must be 0 to ", options_.max_rank - 1,
        " (--max_tp_world_size), or unset for the engine's device"));
  }
  // Host memory has no devices: a rank there places nothing.
  const int device = options_.created_in_backend ? rank : -1;
  const int64_t bytes = static_cast<int64_t>(byte_size);
  RETURN_IF_ERROR(CheckRoom(absl::StrCat("CreateScoreRegion of ", bytes, " bytes")));
  ByteBudget* const budget = options_.created_budget;
  const ByteBudget* refused_by = nullptr;
  if (budget != nullptr && !budget->TryTake(bytes, &refused_by)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("CreateScoreRegion: ", refused_by->Refusal(bytes)));
  }
  const std::string shm_name = absl::StrCat(
      options_.created_name_prefix, created_names_.fetch_add(1, std::memory_order_relaxed));
  absl::StatusOr<std::unique_ptr<KvStorage>> storage = options_.allocate(bytes, shm_name, device);
  if (!storage.ok()) {
    if (budget != nullptr) budget->Give(bytes);
    return absl::Status(storage.status().code(),
                        absl::StrCat("CreateScoreRegion of ", bytes,
                                     " bytes: ", storage.status().message()));
  }
  // The allocator may have taken more than asked (device memory exported by IPC comes in
  // whole 2 MiB units): the budget is charged what was taken, and the Mapping gives
  // back storage->bytes() when it goes.
  const int64_t taken = (*storage)->bytes();
  if (budget != nullptr && taken > bytes && !budget->TryTake(taken - bytes, &refused_by)) {
    budget->Give(bytes);
    return absl::ResourceExhaustedError(absl::StrCat(
        "CreateScoreRegion: ", bytes, " bytes take ", taken, " in device memory; ",
        refused_by->Refusal(taken - bytes)));
  }
  // Memory no worker can map (a GPU that cannot export it) is no region at all.
  if ((*storage)->memory_export().kind == MemoryExport::Kind::kNone) {
    const std::string why = (*storage)->memory_export().unavailable;
    storage->reset();
    if (budget != nullptr) budget->Give(taken);
    return absl::FailedPreconditionError(absl::StrCat(
        "CreateScoreRegion: ", why.empty() ? "the memory cannot be shared with a worker" : why,
        "; send the scores inline, or through a region of your own (RegisterScoreRegion)"));
  }
  // Host memory: a descriptor of our own object, to see a worker shrink it (a read past
  // the end of a shrunk object is a SIGBUS).
  int fd = -1;
  if ((*storage)->memory_export().kind == MemoryExport::Kind::kPosixShm) {
    fd = shm_open(shm_name.c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) {
      const int err = errno;
      if (budget != nullptr) budget->Give(taken);
      return absl::InternalError(absl::StrCat("CreateScoreRegion: cannot reopen ", shm_name,
                                              ": ", std::strerror(err)));
    }
  }
  CreatedScoreRegion created;
  created.memory = (*storage)->memory_export();
  // Built before the Mapping takes the storage: from then on the mapping gives the bytes
  // back to the budget when it goes.
  auto mapping = std::make_shared<Mapping>(std::string(tenant), *std::move(storage), fd,
                                           options_.created_in_backend, device, budget);
  mapping->last_used_ns.store(NowNanos(*options_.clock), std::memory_order_relaxed);
  ASSIGN_OR_RETURN(created.region, Insert(std::move(mapping), "CreateScoreRegion"));
  return created;
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
        absl::StrCat(describe(), ": no such region is registered (RegisterScoreRegion) or "
                                 "created (CreateScoreRegion)"));
  }
  if (range.byte_size == 0 || range.offset > mapping->size ||
      range.byte_size > mapping->size - range.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        describe(), ": the range is empty or exceeds the region's ", mapping->size,
        " mapped bytes"));
  }
  struct stat st {};
  if (mapping->fd >= 0 &&
      (fstat(mapping->fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < mapping->size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        describe(), ": the shared-memory object shrank to ", st.st_size,
        " bytes, below the ", mapping->size, " registered; register it again"));
  }
  mapping->last_used_ns.store(NowNanos(*options_.clock), std::memory_order_relaxed);
  View view;
  view.data = static_cast<const std::byte*>(mapping->base) + range.offset;
  view.size = static_cast<size_t>(range.byte_size);
  view.in_backend = mapping->in_backend;
  view.device = mapping->device;
  view.pin = std::move(mapping);
  return view;
}

int64_t ScoreRegions::DropIdle(absl::Duration idle, absl::Time now) {
  const int64_t cutoff = absl::ToUnixNanos(now - idle);
  std::vector<std::shared_ptr<Mapping>> dropped;
  MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second->last_used_ns.load(std::memory_order_relaxed) <= cutoff &&
        !ExportedToAnotherProcess(*it->second)) {
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

}  // namespace kvcm

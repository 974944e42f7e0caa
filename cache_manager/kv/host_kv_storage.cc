// The host backend of KvStorage: anonymous or POSIX shared memory mapped with mmap (page
// aligned, zero-filled by the kernel, released with munmap), moved by the CPU kernel.
//
// A shared-memory object's name is removed on every exit the process can see: when the
// storage is destroyed, by UnlinkSharedMemory (the daemon's drain, which exits without
// destructors), and by UnlinkSharedMemoryAfterCrash (a fatal-signal handler). SIGKILL
// leaves the name behind; the owner holds a shared flock on the object for as long as it
// lives, so that RemoveStaleSharedMemory can tell a dead owner's objects from a live one's.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache_manager/kv/kv_storage.h"

namespace kvcm {
namespace {

absl::Status SystemError(int error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(message);
    case EINVAL:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

bool ValidShmName(absl::string_view name) {
  return name.size() >= 2 && name.size() <= 255 && name[0] == '/' &&
         name.substr(1).find('/') == absl::string_view::npos;
}

// Where glibc's shm_open puts its objects.
constexpr char kShmDir[] = "/dev/shm";

// The /dev/shm paths of this process's live shared-memory objects, for the crash handler:
// fixed storage (a signal handler may not allocate) claimed and released with atomics (it
// may not lock). Objects past kMaxCrashPaths are only removed by the ordinary paths.
constexpr int kMaxCrashPaths = 256;
struct CrashPath {
  std::atomic<int> state{0};  // 0 free, 1 being written, 2 holds `path`
  char path[sizeof(kShmDir) + 256];
};
CrashPath crash_paths[kMaxCrashPaths];

void RememberForCrash(const std::string& name) {
  for (CrashPath& slot : crash_paths) {
    int expected = 0;
    if (!slot.state.compare_exchange_strong(expected, 1)) continue;
    const std::string path = std::string(kShmDir) + name;
    std::memcpy(slot.path, path.c_str(), path.size() + 1);
    slot.state.store(2);
    return;
  }
}

void ForgetForCrash(const std::string& name) {
  const std::string path = std::string(kShmDir) + name;
  for (CrashPath& slot : crash_paths) {
    if (slot.state.load() == 2 && path == slot.path) {
      slot.state.store(0);
      return;
    }
  }
}

class HostKvStorage final : public KvStorage {
 public:
  // `owner_fd`: the shared-memory object, flocked (-1 for private memory).
  HostKvStorage(void* data, int64_t bytes, MemoryExport exported, int owner_fd)
      : data_(data), bytes_(bytes), export_(std::move(exported)), owner_fd_(owner_fd) {}

  ~HostKvStorage() override {
    munmap(data_, static_cast<size_t>(bytes_));
    if (export_.kind == MemoryExport::Kind::kPosixShm) UnlinkSharedMemory(export_.shm_name);
    if (owner_fd_ >= 0) close(owner_fd_);
  }

  MemorySpace space() const override { return MemorySpace::kHost; }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  const MemoryExport& memory_export() const override { return export_; }

  absl::Status CopyOut(int64_t offset, void* dst, int64_t bytes) const override {
    std::memcpy(dst, static_cast<const char*>(data_) + offset, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status CopyIn(int64_t offset, const void* src, int64_t bytes) override {
    std::memcpy(static_cast<char*>(data_) + offset, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }

  absl::Status MoveTokens(const kernels::KvBlockLayout& layout,
                          std::span<const kernels::KvMove> moves) override {
    kernels::cpu::CompactKv(data_, layout, moves.data(), static_cast<int64_t>(moves.size()),
                            nullptr);
    return absl::OkStatus();
  }

 private:
  void* const data_;
  const int64_t bytes_;
  const MemoryExport export_;
  const int owner_fd_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStorage>> NewHostKvStorage(int64_t bytes,
                                                            const HostStorageOptions& options) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host KV storage of ", bytes, " bytes; it must be > 0"));
  }
  MemoryExport exported;
  exported.bytes = bytes;
  void* data = MAP_FAILED;
  if (options.shm_name.empty()) {
    data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      return SystemError(errno, absl::StrCat("mmap of ", bytes, " bytes of host KV storage"));
    }
  } else {
    const std::string& name = options.shm_name;
    if (!ValidShmName(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shared-memory name '", name, "' must be '/' then 1 to 254 characters without '/'"));
    }
    const int fd = options.attach ? shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0)
                                  : shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      if (options.attach && errno == ENOENT) {
        return absl::NotFoundError(absl::StrCat("shared-memory pool '", name, "' is gone"));
      }
      return SystemError(errno, absl::StrCat("shm_open('", name, "')"));
    }
    absl::Status status;
    struct stat st;
    if (options.attach) {
      // An object a live process holds (its exclusive lock fails) is not ours to take.
      if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
        status = absl::FailedPreconditionError(
            absl::StrCat("shared-memory pool '", name, "' is not a file of this user"));
      } else if (st.st_size != bytes) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "shared-memory pool '", name, "' holds ", st.st_size, " bytes; this pool needs ",
            bytes));
      } else if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        status = absl::FailedPreconditionError(absl::StrCat(
            "shared-memory pool '", name, "' is held by a live process"));
      }
      if (!status.ok()) {
        close(fd);  // never unlinked: it is not ours
        return status;
      }
      fchmod(fd, 0600);  // ours again: no longer kept for a restart
    }
    // Reserve the pages now: a tmpfs that runs out later would kill the process with
    // SIGBUS on first touch instead of failing here. An attached object has them.
    if (const int error = options.attach ? 0 : posix_fallocate(fd, 0, static_cast<off_t>(bytes));
        error != 0) {
      status = SystemError(error, absl::StrCat("posix_fallocate('", name, "', ", bytes, ")"));
    } else {
      data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (data == MAP_FAILED) status = SystemError(errno, absl::StrCat("mmap('", name, "')"));
    }
    // The fd stays open only to hold the flock that marks the object as ours while we live
    // (the mapping alone keeps the object alive). An attached object keeps the exclusive
    // lock taken above: turning it into a shared one is not atomic, and a sweep running
    // in between could take the object.
    if (status.ok() && !options.attach && flock(fd, LOCK_SH) != 0) {
      status = SystemError(errno, absl::StrCat("flock('", name, "')"));
    }
    if (!status.ok()) {
      if (data != MAP_FAILED) munmap(data, static_cast<size_t>(bytes));
      close(fd);
      shm_unlink(name.c_str());
      return status;
    }
    RememberForCrash(name);
    exported.kind = MemoryExport::Kind::kPosixShm;
    exported.shm_name = name;
    return std::unique_ptr<KvStorage>(new HostKvStorage(data, bytes, std::move(exported), fd));
  }
  return std::unique_ptr<KvStorage>(new HostKvStorage(data, bytes, std::move(exported), -1));
}

void UnlinkSharedMemory(const std::string& shm_name) {
  ForgetForCrash(shm_name);
  shm_unlink(shm_name.c_str());
}

void UnlinkSharedMemoryAfterCrash() {
  for (CrashPath& slot : crash_paths) {
    if (slot.state.load() == 2) unlink(slot.path);
  }
}

absl::Status MarkSharedMemoryKept(const std::string& shm_name) {
  const int fd = shm_open(shm_name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) return SystemError(errno, absl::StrCat("shm_open('", shm_name, "')"));
  const int marked = fchmod(fd, 0700);
  const int error = errno;
  close(fd);
  if (marked != 0) return SystemError(error, absl::StrCat("fchmod('", shm_name, "')"));
  return absl::OkStatus();
}

std::vector<std::string> RemoveStaleSharedMemory(
    absl::FunctionRef<bool(absl::string_view name)> ours, bool include_kept) {
  std::vector<std::string> removed;
  DIR* dir = opendir(kShmDir);
  if (dir == nullptr) return removed;
  while (const dirent* entry = readdir(dir)) {
    const absl::string_view name = entry->d_name;
    if (name == "." || name == ".." || !ours(name)) continue;
    const std::string shm_name = absl::StrCat("/", name);
    const int fd = shm_open(shm_name.c_str(), O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0) continue;
    struct stat st;
    // Another user's objects are not ours to judge; a held lock means a live owner; a
    // recent mark, a snapshot's pool waiting for its restart.
    const auto kept = [&] {
      return !include_kept && (st.st_mode & S_IXUSR) != 0 &&
             time(nullptr) - st.st_ctime < kKeptSharedMemorySeconds;
    };
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && !kept() &&
        flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (shm_unlink(shm_name.c_str()) == 0) removed.push_back(shm_name);
    }
    close(fd);  // releases the lock
  }
  closedir(dir);
  return removed;
}

}  // namespace kvcm

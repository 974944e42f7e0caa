// The host backend of KvStorage: anonymous or POSIX shared memory mapped with mmap (page
// aligned, zero-filled by the kernel, released with munmap), moved by the CPU kernel.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cache_manager/kv_storage.h"

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

class HostKvStorage final : public KvStorage {
 public:
  HostKvStorage(void* data, int64_t bytes, MemoryExport exported)
      : data_(data), bytes_(bytes), export_(std::move(exported)) {}

  ~HostKvStorage() override {
    munmap(data_, static_cast<size_t>(bytes_));
    if (export_.kind == MemoryExport::Kind::kPosixShm) shm_unlink(export_.shm_name.c_str());
  }

  MemorySpace space() const override { return MemorySpace::kHost; }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  const MemoryExport& memory_export() const override { return export_; }

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
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return SystemError(errno, absl::StrCat("shm_open('", name, "')"));
    absl::Status status;
    // Reserve the pages now: a tmpfs that runs out later would kill the process with
    // SIGBUS on first touch instead of failing here.
    if (const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
      status = SystemError(error, absl::StrCat("posix_fallocate('", name, "', ", bytes, ")"));
    } else {
      data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (data == MAP_FAILED) status = SystemError(errno, absl::StrCat("mmap('", name, "')"));
    }
    close(fd);  // the mapping keeps the object alive
    if (!status.ok()) {
      shm_unlink(name.c_str());
      return status;
    }
    exported.kind = MemoryExport::Kind::kPosixShm;
    exported.shm_name = name;
  }
  return std::unique_ptr<KvStorage>(new HostKvStorage(data, bytes, std::move(exported)));
}

}  // namespace kvcm

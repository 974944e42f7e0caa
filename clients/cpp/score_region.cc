#include "clients/cpp/score_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcm::client {

namespace {

// UnregisterScoreRegion, best effort (a daemon that is gone or dropped the region holds
// nothing of ours).
void UnregisterQuietly(KvCacheClient& client, uint64_t region) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterScoreRegionRequest request;
  request.set_region(region);
  v1::UnregisterScoreRegionResponse response;
  (void)client.stub().UnregisterScoreRegion(&context, request, &response);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ScoreRegion>> ScoreRegion::Create(KvCacheClient& client,
                                                                 int64_t byte_size) {
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("score region size ", byte_size, " <= 0"));
  }
  std::random_device entropy;
  const std::string name = absl::StrFormat("/kvcm-scores-%d-%08x%08x", getpid(), entropy(),
                                           entropy());
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("score region ", name, ": shm_open: ", std::strerror(errno)));
  }
  void* base = MAP_FAILED;
  if (ftruncate(fd, byte_size) == 0) {
    base = mmap(nullptr, static_cast<size_t>(byte_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int saved = errno;
  close(fd);  // the mapping keeps the object
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("score region ", name, ": cannot size or map ",
                                                     byte_size, " bytes: ", std::strerror(saved)));
  }
  std::unique_ptr<ScoreRegion> region(
      new ScoreRegion(client, name, base, static_cast<size_t>(byte_size), /*ours=*/true));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::RegisterScoreRegionRequest request;
  request.set_name(name);
  request.set_byte_size(static_cast<uint64_t>(byte_size));
  v1::RegisterScoreRegionResponse response;
  absl::Status registered = FromGrpc(client.stub().RegisterScoreRegion(&context, request, &response));
  if (!registered.ok()) return registered;  // the destructor unmaps and unlinks
  region->id_ = response.region();
  return region;
}

absl::StatusOr<std::unique_ptr<ScoreRegion>> ScoreRegion::CreateInDaemon(KvCacheClient& client,
                                                                         int64_t byte_size,
                                                                         int32_t rank) {
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("score region size ", byte_size, " <= 0"));
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CreateScoreRegionRequest request;
  request.set_byte_size(static_cast<uint64_t>(byte_size));
  if (rank >= 0) request.set_rank(rank);
  v1::CreateScoreRegionResponse response;
  absl::Status created = FromGrpc(client.stub().CreateScoreRegion(&context, request, &response));
  if (!created.ok()) return created;
  const auto unregister = [&] { UnregisterQuietly(client, response.region()); };
  if (response.backend() != v1::KV_BACKEND_HOST || response.shm_name().empty()) {
    unregister();
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon created score region ", response.region(),
        " in device memory (CUDA IPC handle, device ", response.device_uuid(),
        "); map it with cudaIpcOpenMemHandle, not as shared memory"));
  }
  const int fd = shm_open(response.shm_name().c_str(), O_RDWR | O_CLOEXEC, 0);
  void* base = MAP_FAILED;
  if (fd >= 0) {
    base = mmap(nullptr, static_cast<size_t>(response.bytes()), PROT_READ | PROT_WRITE,
                MAP_SHARED, fd, 0);
  }
  const int saved = errno;
  if (fd >= 0) close(fd);
  if (base == MAP_FAILED) {
    unregister();
    return absl::UnavailableError(absl::StrCat("score region ", response.shm_name(),
                                               ": cannot map it: ", std::strerror(saved)));
  }
  std::unique_ptr<ScoreRegion> region(new ScoreRegion(
      client, response.shm_name(), base, static_cast<size_t>(response.bytes()), /*ours=*/false));
  region->id_ = response.region();
  return region;
}

ScoreRegion::~ScoreRegion() {
  if (id_ != 0) UnregisterQuietly(client_, id_);
  munmap(base_, size_);
  if (ours_) shm_unlink(name_.c_str());
}

void ScoreRegion::Reference(v1::StepReport* report, int64_t offset, int64_t byte_size,
                            int32_t layers, kernels::ScoreDtype dtype, int32_t head_count) const {
  v1::ScoreRef* ref = report->mutable_score_ref();  // clears inline scores (a oneof)
  ref->set_region(id_);
  ref->set_offset(static_cast<uint64_t>(offset));
  ref->set_byte_size(static_cast<uint64_t>(byte_size));
  report->set_layers(layers);
  report->set_dtype(ToProtoDtype(dtype));
  report->set_head_count(head_count);
}

absl::Status ScoreRegion::Put(v1::StepReport* report, int64_t offset,
                              std::span<const std::byte> packed, int32_t layers,
                              kernels::ScoreDtype dtype, int32_t head_count) {
  const auto bytes = static_cast<int64_t>(packed.size());
  if (offset < 0 || bytes > size() || offset > size() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("score region ", name_, ": ", bytes,
                                                   " bytes at offset ", offset,
                                                   " do not fit its ", size_, " bytes"));
  }
  std::memcpy(static_cast<std::byte*>(base_) + offset, packed.data(), packed.size());
  Reference(report, offset, bytes, layers, dtype, head_count);
  return absl::OkStatus();
}

}  // namespace kvcm::client

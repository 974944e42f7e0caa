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
      new ScoreRegion(client, name, base, static_cast<size_t>(byte_size)));
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

ScoreRegion::~ScoreRegion() {
  if (id_ != 0) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::UnregisterScoreRegionRequest request;
    request.set_region(id_);
    v1::UnregisterScoreRegionResponse response;
    (void)client_.stub().UnregisterScoreRegion(&context, request, &response);  // best effort
  }
  munmap(base_, size_);
  shm_unlink(name_.c_str());
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

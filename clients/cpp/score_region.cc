#include "clients/cpp/score_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#ifdef KVCM_HAS_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_adapter.h"
#endif

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

// A device region opened in this process: `pointer` on ordinal `device`, and the event its
// writes are recorded on.
struct DeviceMapping {
  void* pointer = nullptr;
  int device = -1;
  void* event = nullptr;
};

#ifdef KVCM_HAS_CUDA

// "GPU-..." of ordinal `device`, as the daemon writes device_uuid.
absl::StatusOr<std::string> DeviceUuid(int device) {
  cudaDeviceProp properties{};
  const absl::Status got =
      kernels::cuda::CudaStatus(cudaGetDeviceProperties(&properties, device),
                                absl::StrCat("cudaGetDeviceProperties(", device, ")"));
  if (!got.ok()) return got;
  return kernels::cuda::FormatDeviceUuid(properties.uuid);
}

absl::StatusOr<int> DeviceByUuid(const std::string& uuid) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no device or no driver: none to find, not an error state to keep
    count = 0;
  }
  for (int device = 0; device < count; ++device) {
    const absl::StatusOr<std::string> have = DeviceUuid(device);
    if (!have.ok()) return have.status();
    if (absl::EqualsIgnoreCase(*have, uuid)) return device;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("no GPU with UUID ", uuid, " among the ", count, " this process sees"));
}

// This process's ordinal of the GPU the daemon names by `uuid` and `bus_id` (ordinals
// differ between processes, bus ids and UUIDs do not): found by bus id (by UUID when there
// is none) and refused unless the UUIDs agree.
absl::StatusOr<int> FindDevice(const std::string& uuid, const std::string& bus_id) {
  if (bus_id.empty()) {
    if (uuid.empty()) {
      return absl::FailedPreconditionError(
          "the daemon named its region's GPU by neither PCI bus id nor UUID");
    }
    return DeviceByUuid(uuid);
  }
  int device = -1;
  const cudaError_t found = cudaDeviceGetByPCIBusId(&device, bus_id.c_str());
  if (found != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave the thread's error state clean
    return absl::FailedPreconditionError(absl::StrCat(
        "no GPU at PCI bus id ", bus_id, " is visible to this process (CUDA_VISIBLE_DEVICES, "
        "or a daemon on another node?): cudaDeviceGetByPCIBusId: ", cudaGetErrorName(found),
        ": ", cudaGetErrorString(found)));
  }
  if (uuid.empty()) return device;
  const absl::StatusOr<std::string> have = DeviceUuid(device);
  if (!have.ok()) return have.status();
  if (!absl::EqualsIgnoreCase(*have, uuid)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the GPU at PCI bus id ", bus_id, " is ", *have, " here, but the daemon's region is on ",
        uuid, ": not the same GPU (another node, or a container with another view of the bus?)"));
  }
  return device;
}

// Opens the region's CUDA IPC handle on this process's ordinal of its GPU, with an event
// for its writes; the caller's current device is restored.
absl::StatusOr<DeviceMapping> OpenDeviceRegion(const v1::CreateScoreRegionResponse& response) {
  cudaIpcMemHandle_t handle{};
  if (response.cuda_ipc_handle().size() != sizeof(handle)) {
    return absl::InternalError(absl::StrCat("score region ", response.region(), ": a CUDA IPC "
                                            "handle of ", response.cuda_ipc_handle().size(),
                                            " bytes; cudaIpcMemHandle_t has ", sizeof(handle)));
  }
  std::memcpy(&handle, response.cuda_ipc_handle().data(), sizeof(handle));
  const absl::StatusOr<int> device = FindDevice(response.device_uuid(),
                                                response.device_pci_bus_id());
  if (!device.ok()) return device.status();
  const kernels::cuda::ScopedDevice scoped(*device);
  if (!scoped.status().ok()) return scoped.status();
  DeviceMapping mapping;
  mapping.device = *device;
  absl::Status opened = kernels::cuda::CudaStatus(
      cudaIpcOpenMemHandle(&mapping.pointer, handle, cudaIpcMemLazyEnablePeerAccess),
      absl::StrCat("score region ", response.region(), ": cudaIpcOpenMemHandle on device ",
                   *device));
  if (!opened.ok()) return opened;
  cudaEvent_t event = nullptr;
  opened = kernels::cuda::CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                     "cudaEventCreateWithFlags");
  if (!opened.ok()) {
    cudaIpcCloseMemHandle(mapping.pointer);
    return opened;
  }
  mapping.event = event;
  return mapping;
}

#else

absl::StatusOr<DeviceMapping> OpenDeviceRegion(const v1::CreateScoreRegionResponse& response) {
  return absl::FailedPreconditionError(absl::StrCat(
      "the daemon created score region ", response.region(), " in the memory of GPU ",
      response.device_uuid(), " (a CUDA engine), and this client was built without CUDA "
      "(KVCM_CUDA=OFF, or no nvcc at build time), so it cannot open the region's IPC handle: "
      "rebuild the client with CUDA, or use a region of your own (ScoreRegion::Create)"));
}

#endif  // KVCM_HAS_CUDA

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
  if (response.backend() == v1::KV_BACKEND_CUDA) {
    const absl::StatusOr<DeviceMapping> mapped = OpenDeviceRegion(response);
    if (!mapped.ok()) {
      unregister();
      return mapped.status();
    }
    std::unique_ptr<ScoreRegion> region(new ScoreRegion(
        client, absl::StrCat("cuda-ipc:", response.region(), "@", response.device_uuid()),
        mapped->pointer, static_cast<size_t>(response.bytes()), /*ours=*/false));
    region->id_ = response.region();
    region->device_ = mapped->device;
    region->event_ = mapped->event;
    return region;
  }
  if (response.backend() != v1::KV_BACKEND_HOST || response.shm_name().empty()) {
    unregister();
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon created score region ", response.region(), " in memory of backend ",
        v1::KvBackend_Name(response.backend()), " without a shared-memory name, which this "
        "client cannot map"));
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
  if (on_device()) {
    CloseDevice();  // before the daemon frees the memory: no mapping of freed memory
    if (id_ != 0) UnregisterQuietly(client_, id_);
    return;
  }
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
  return Put(report, offset, packed, layers, dtype, head_count, /*stream=*/nullptr);
}

absl::Status ScoreRegion::Put(v1::StepReport* report, int64_t offset,
                              std::span<const std::byte> packed, int32_t layers,
                              kernels::ScoreDtype dtype, int32_t head_count,
                              [[maybe_unused]] void* stream) {
  const auto bytes = static_cast<int64_t>(packed.size());
  if (offset < 0 || bytes > size() || offset > size() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("score region ", name_, ": ", bytes,
                                                   " bytes at offset ", offset,
                                                   " do not fit its ", size_, " bytes"));
  }
  if (on_device()) {
#ifdef KVCM_HAS_CUDA
    const kernels::cuda::ScopedDevice scoped(device_);  // nullptr: device_'s default stream
    if (!scoped.status().ok()) return scoped.status();
    const absl::Status copied = kernels::cuda::CudaStatus(
        cudaMemcpyAsync(static_cast<std::byte*>(base_) + offset, packed.data(), packed.size(),
                        cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
        absl::StrCat("score region ", name_, ": cudaMemcpyAsync of ", bytes, " bytes"));
    if (!copied.ok()) return copied;
    const absl::Status recorded = RecordWrites(stream);
    if (!recorded.ok()) return recorded;
#endif
  } else {
    std::memcpy(static_cast<std::byte*>(base_) + offset, packed.data(), packed.size());
  }
  Reference(report, offset, bytes, layers, dtype, head_count);
  return absl::OkStatus();
}

absl::Status ScoreRegion::RecordWrites([[maybe_unused]] void* stream) {
  if (!on_device()) return absl::OkStatus();
#ifdef KVCM_HAS_CUDA
  const kernels::cuda::ScopedDevice scoped(device_);
  if (!scoped.status().ok()) return scoped.status();
  auto* const event = static_cast<cudaEvent_t>(event_);
  auto* const on = static_cast<cudaStream_t>(stream);
  if (unwaited_ && stream != last_stream_) {
    // The event is about to move to `on`: make `on` wait for what it covers so far.
    const absl::Status chained = kernels::cuda::CudaStatus(
        cudaStreamWaitEvent(on, event, 0),
        absl::StrCat("score region ", name_, ": cudaStreamWaitEvent"));
    if (!chained.ok()) return chained;
  }
  const absl::Status recorded = kernels::cuda::CudaStatus(
      cudaEventRecord(event, on), absl::StrCat("score region ", name_, ": cudaEventRecord"));
  if (!recorded.ok()) return recorded;
  last_stream_ = stream;
  unwaited_ = true;
#endif
  return absl::OkStatus();
}

absl::Status ScoreRegion::WaitForWrites() {
  if (!unwaited_) return absl::OkStatus();
  unwaited_ = false;
#ifdef KVCM_HAS_CUDA
  return kernels::cuda::CudaStatus(
      cudaEventSynchronize(static_cast<cudaEvent_t>(event_)),
      absl::StrCat("score region ", name_, ": waiting for its writes (cudaEventSynchronize)"));
#else
  return absl::OkStatus();
#endif
}

void ScoreRegion::CloseDevice() {
  (void)WaitForWrites();  // a batch that failed after writing: let its copies end first
#ifdef KVCM_HAS_CUDA
  const kernels::cuda::ScopedDevice scoped(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  cudaIpcCloseMemHandle(base_);
#endif
}

}  // namespace kvcm::client

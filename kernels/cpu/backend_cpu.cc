// The CPU backends of kernels/backend.h: the reference kernels over plain host memory.
#include <cstdlib>
#include <cstring>

#include "kernels/backend.h"
#include "kernels/stream_lanes.h"

namespace kvcm::kernels {
namespace {

constexpr size_t kAlignment = 256;

absl::Status NoDevice(int /*device*/) { return absl::OkStatus(); }

absl::Status HostAllocate(size_t bytes, void** ptr) {
  const size_t rounded = (bytes == 0 ? 1 : (bytes + kAlignment - 1) / kAlignment) * kAlignment;
  *ptr = std::aligned_alloc(kAlignment, rounded);
  if (*ptr == nullptr) {
    return absl::ResourceExhaustedError("host allocation failed");
  }
  // Zero-filled, so that the pages are touched where the arrays are allocated (a sequence's
  // Open, an array's growth) rather than in the middle of a step: the first step of a long
  // prefill writes its whole scratch once, and its page faults belong to the Open.
  std::memset(*ptr, 0, rounded);
  return absl::OkStatus();
}

void HostRelease(void* ptr) { std::free(ptr); }

// Host memory is ready at once and freed at once: nothing is queued on a host stream.
absl::Status HostAllocateOnStream(size_t bytes, StreamHandle /*stream*/, void** ptr) {
  return HostAllocate(bytes, ptr);
}

void HostReleaseOnStream(void* ptr, StreamHandle /*stream*/) { HostRelease(ptr); }

absl::Status HostCopy(void* dst, const void* src, size_t bytes, CopyKind /*kind*/,
                      StreamHandle /*stream*/) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status NoStream(int /*device*/, StreamHandle* stream) {
  *stream = nullptr;
  return absl::OkStatus();
}

// One byte per lane: the emulated streams are their addresses.
char emulated_streams[kStreamLanes];

absl::Status EmulatedLaneStream(int /*device*/, StreamHandle* stream) {
  *stream = EmulatedStream(ThreadStreamLane());
  return absl::OkStatus();
}

absl::Status NothingToWaitFor(StreamHandle /*stream*/, const char* /*what*/) {
  return absl::OkStatus();
}

constexpr BackendMemory kHostMemory{&NoDevice,    &HostAllocateOnStream, &HostReleaseOnStream,
                                    &HostAllocate, &HostRelease,          &HostCopy,
                                    &NoStream,     &NothingToWaitFor};
constexpr BackendMemory kEmulatedDeviceMemory{
    &NoDevice, &HostAllocateOnStream, &HostReleaseOnStream, &HostAllocate,
    &HostRelease, &HostCopy, &EmulatedLaneStream, &NothingToWaitFor};

#define KVCM_CPU_KERNEL_ENTRY(kernel, entry) &cpu::kernel,

constexpr KernelBackend kCpu{"cpu", MemorySpace::kHost,
                             KVCM_KERNEL_ENTRIES(KVCM_CPU_KERNEL_ENTRY) kHostMemory};
constexpr KernelBackend kEmulatedDevice{
    "cpu-emulated-device", MemorySpace::kDevice,
    KVCM_KERNEL_ENTRIES(KVCM_CPU_KERNEL_ENTRY) kEmulatedDeviceMemory};

#undef KVCM_CPU_KERNEL_ENTRY

}  // namespace

const KernelBackend& CpuBackend() { return kCpu; }
const KernelBackend& EmulatedDeviceBackend() { return kEmulatedDevice; }

StreamHandle EmulatedStream(int lane) {
  return &emulated_streams[((lane % kStreamLanes) + kStreamLanes) % kStreamLanes];
}

}  // namespace kvcm::kernels

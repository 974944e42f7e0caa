#include "kernels/backend_by_name.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#ifdef KVCM_KERNELS_HAS_CUDA
#include "kernels/cuda/cuda_adapter.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvcm::kernels {
namespace {

// The CUDA table for `device`, or why this process cannot run it.
absl::StatusOr<const KernelBackend*> CudaOn(int device) {
#ifdef KVCM_KERNELS_HAS_CUDA
  const absl::StatusOr<int> devices = cuda::VisibleDeviceCount();
  if (!devices.ok()) return devices.status();
  if (*devices == 0) return absl::UnavailableError("no CUDA device on this machine");
  if (device < 0 || device >= *devices) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, " is not visible: ",
                                               *devices, " CUDA device(s) are"));
  }
  return &cuda::CudaBackend();
#else
  (void)device;
  return absl::UnimplementedError("this build has no CUDA backend (built without CUDA)");
#endif
}

}  // namespace

const std::vector<absl::string_view>& BackendNames() {
  static const auto* const names =
      new std::vector<absl::string_view>{"cpu", "cuda", "emulated", "auto"};
  return *names;
}

absl::StatusOr<const KernelBackend*> BackendByName(absl::string_view name, int device) {
  if (name == "cpu") return &CpuBackend();
  if (name == "emulated") return &EmulatedDeviceBackend();
  if (name == "cuda") return CudaOn(device);
  if (name == "auto") {
    absl::StatusOr<const KernelBackend*> cuda = CudaOn(device);
    // Only the absence of CUDA falls back; a GPU the runtime cannot use is an error.
    if (cuda.ok() || absl::IsInternal(cuda.status())) return cuda;
    return &CpuBackend();
  }
  return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a kernel backend; use ",
                                                 absl::StrJoin(BackendNames(), ", ")));
}

}  // namespace kvcm::kernels

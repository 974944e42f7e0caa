// BackendByName: the one place that turns a backend's name (a flag's value: kvcached's
// --engine_backend, kvcache-replay's --device) into its kernel table (kernels/backend.h),
// so that every tool accepts the same names and refuses the same way.
//
//   cpu       the CPU reference kernels over host memory (CpuBackend)
//   cuda      the CUDA kernels on GPU `device` (cuda::CudaBackend); a build without CUDA,
//             or a machine where that device is not visible, is refused
//   emulated  the device code path on the CPU (EmulatedDeviceBackend), for tests
//   auto      cuda when this build has CUDA and `device` is visible, else cpu
//
// Stateless; thread-safe.
#ifndef KVCM_KERNELS_BACKEND_BY_NAME_H_
#define KVCM_KERNELS_BACKEND_BY_NAME_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace kvcm::kernels {

// The table named `name` for CUDA device ordinal `device` (ignored by the host
// backends). Never null when OK. Errors say what went wrong without naming a flag (the
// caller prefixes its own): INVALID_ARGUMENT for an unknown name, UNIMPLEMENTED for cuda
// in a build without CUDA, UNAVAILABLE when the device is not visible, INTERNAL when the
// CUDA runtime cannot be asked.
absl::StatusOr<const KernelBackend*> BackendByName(absl::string_view name, int device);

// The names BackendByName accepts, in the order of the list above.
const std::vector<absl::string_view>& BackendNames();

}  // namespace kvcm::kernels

#endif  // KVCM_KERNELS_BACKEND_BY_NAME_H_

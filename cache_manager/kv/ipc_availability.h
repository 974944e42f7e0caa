// Whether device memory can be exported to a worker process by CUDA IPC handle on a GPU,
// and if not, why, in words an operator can act on. A pure function of what the CUDA
// runtime reports (the device's compute mode, whether cudaIpcGetMemHandle is supported),
// so that the CPU build tests the wording and the CUDA storage only reports the facts.
//
// Where export is unavailable, a CUDA pool is made without one (DescribeKvPools says why
// in `export_unavailable`, and workers keep K/V in their own tensors) and a created score
// region is refused (FAILED_PRECONDITION with the reason: a worker sends its scores inline
// or through a region of its own).
#ifndef KVCM_CACHE_MANAGER_KV_IPC_AVAILABILITY_H_
#define KVCM_CACHE_MANAGER_KV_IPC_AVAILABILITY_H_

#include <string>

namespace kvcm {

// cudaComputeMode, without CUDA's header.
enum class GpuComputeMode { kDefault, kExclusiveThread, kProhibited, kExclusiveProcess };

// Empty when a worker process can open this process's device memory by IPC handle on a
// GPU of `ordinal` in `mode`; otherwise the reason. `handle_supported`: false when
// cudaIpcGetMemHandle answered cudaErrorNotSupported (no IPC on this platform: some
// virtualized or WSL drivers, MIG-less vGPU profiles).
inline std::string IpcExportUnavailableReason(int ordinal, GpuComputeMode mode,
                                              bool handle_supported) {
  const std::string gpu = "GPU " + std::to_string(ordinal);
  switch (mode) {
    case GpuComputeMode::kExclusiveProcess:
    case GpuComputeMode::kExclusiveThread:
      return gpu + " is in exclusive-process compute mode: only kvcached may hold a context "
             "on it, so no worker process can open its memory (nvidia-smi -c DEFAULT allows "
             "it; or run the workers on other GPUs)";
    case GpuComputeMode::kProhibited:
      return gpu + " is in prohibited compute mode: no process may use it";
    case GpuComputeMode::kDefault:
      break;
  }
  if (!handle_supported) {
    return gpu + " does not support CUDA IPC (cudaIpcGetMemHandle: not supported on this "
           "platform or driver), so no worker process can open its memory";
  }
  return "";
}

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_KV_IPC_AVAILABILITY_H_

// kvcm_gpu_ipc_child: the worker side of tests/gpu/cuda_block_pool_test.cc's two-process
// test. It finds the exporting process's GPU by UUID (ordinals may differ between
// processes), opens the pool by its CUDA IPC handle, copies the mapping to the host and
// checks that every listed slot holds its token's K/V pattern (tests/pools/kv_pattern.h).
//
//   kvcm_gpu_ipc_child HANDLE_HEX UUID BYTES TPB LAYERS KV_HEADS HEAD_DIM DTYPE CHECKS_FILE
//
// CHECKS_FILE holds "slot token" pairs, one per line. Exit status: 0 when every slot
// holds its token, 1 when one does not (printed), 2 on a CUDA or usage error.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_adapter.h"
#include "kernels/kv_compaction.h"
#include "tests/pools/kv_pattern.h"

namespace {

int Fail(const char* what, cudaError_t error) {
  std::fprintf(stderr, "ipc child: %s: %s: %s\n", what, cudaGetErrorName(error),
               cudaGetErrorString(error));
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: %s HANDLE_HEX UUID BYTES TPB LAYERS KV_HEADS HEAD_DIM DTYPE CHECKS\n",
                 argv[0]);
    return 2;
  }
  const std::string hex = argv[1];
  cudaIpcMemHandle_t handle{};
  if (hex.size() != 2 * sizeof(handle.reserved)) {
    std::fprintf(stderr, "ipc child: the handle has %zu hex digits\n", hex.size());
    return 2;
  }
  for (size_t i = 0; i < sizeof(handle.reserved); ++i) {
    handle.reserved[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  const std::string uuid = argv[2];
  const size_t bytes = std::stoull(argv[3]);
  const kvcm::kernels::KvBlockLayout layout{std::stoll(argv[4]), std::stoll(argv[5]),
                                            std::stoll(argv[6]), std::stoll(argv[7]),
                                            static_cast<kvcm::kernels::KvDtype>(std::stoi(argv[8]))};
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) return Fail("cudaGetDeviceCount", e);
  int device = -1;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp properties{};
    if (cudaError_t e = cudaGetDeviceProperties(&properties, d); e != cudaSuccess) {
      return Fail("cudaGetDeviceProperties", e);
    }
    if (kvcm::kernels::cuda::FormatDeviceUuid(properties.uuid) == uuid) device = d;
  }
  if (device < 0) {
    std::fprintf(stderr, "ipc child: no visible device has UUID %s\n", uuid.c_str());
    return 2;
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return Fail("cudaSetDevice", e);
  void* mapped = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return Fail("cudaIpcOpenMemHandle", e);
  }
  std::vector<uint8_t> host(bytes);
  if (cudaError_t e = cudaMemcpy(host.data(), mapped, bytes, cudaMemcpyDeviceToHost); e != cudaSuccess) {
    return Fail("cudaMemcpy", e);
  }
  if (cudaError_t e = cudaIpcCloseMemHandle(mapped); e != cudaSuccess) {
    return Fail("cudaIpcCloseMemHandle", e);
  }
  std::ifstream checks(argv[9]);
  int64_t slot = 0;
  int64_t token = 0;
  int64_t checked = 0;
  while (checks >> slot >> token) {
    const std::string why = kvcm::testing::CheckToken(host.data(), layout, slot, token);
    if (!why.empty()) {
      std::printf("ipc child: %s\n", why.c_str());
      return 1;
    }
    ++checked;
  }
  std::printf("ipc child: %lld slots hold their tokens\n", static_cast<long long>(checked));
  return checked > 0 ? 0 : 1;
}

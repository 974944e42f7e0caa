// kvcm_gpu_ipc_child: the worker side of tests/gpu/cuda_block_pool_test.cc's two-process
// tests. It finds the exporting process's GPU by UUID (ordinals may differ between
// processes) and opens the memory by its CUDA IPC handle. Then either it copies the
// mapping to the host and checks that every listed slot holds its token's K/V pattern
// (tests/cache_manager/kv/kv_pattern.h), or (`write`) it writes a file's bytes at an offset, as a
// worker writes score rows into a score region the daemon created.
//
//   kvcm_gpu_ipc_child HANDLE_HEX UUID BYTES TPB LAYERS KV_HEADS HEAD_DIM DTYPE CHECKS_FILE
//   kvcm_gpu_ipc_child write HANDLE_HEX UUID OFFSET FILE
//
// CHECKS_FILE holds "slot token" pairs, one per line. Exit status: 0 when every slot
// holds its token (or the bytes were written), 1 when one does not (printed), 2 on a CUDA
// or usage error.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_adapter.h"
#include "kernels/kv_compaction.h"
#include "tests/cache_manager/kv/kv_pattern.h"

namespace {

int Fail(const char* what, cudaError_t error) {
  std::fprintf(stderr, "ipc child: %s: %s: %s\n", what, cudaGetErrorName(error),
               cudaGetErrorString(error));
  return 2;
}

// Parses HANDLE_HEX, finds the device with `uuid`, makes it current and opens the handle.
// Returns 0, or the exit status of the failure (printed).
int OpenByUuid(const std::string& hex, const std::string& uuid, void** mapped) {
  cudaIpcMemHandle_t handle{};
  if (hex.size() != 2 * sizeof(handle.reserved)) {
    std::fprintf(stderr, "ipc child: the handle has %zu hex digits\n", hex.size());
    return 2;
  }
  for (size_t i = 0; i < sizeof(handle.reserved); ++i) {
    handle.reserved[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
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
  if (cudaError_t e = cudaIpcOpenMemHandle(mapped, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return Fail("cudaIpcOpenMemHandle", e);
  }
  return 0;
}

// `write` mode: a worker writing its score rows into a daemon-created CUDA score region.
int WriteFile(const std::string& hex, const std::string& uuid, size_t offset, const char* path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  void* mapped = nullptr;
  if (int failed = OpenByUuid(hex, uuid, &mapped); failed != 0) return failed;
  if (cudaError_t e = cudaMemcpy(static_cast<char*>(mapped) + offset, bytes.data(), bytes.size(),
                                 cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return Fail("cudaMemcpy", e);
  }
  // Complete before the report that names the rows is sent (the proto's rule).
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return Fail("cudaDeviceSynchronize", e);
  if (cudaError_t e = cudaIpcCloseMemHandle(mapped); e != cudaSuccess) {
    return Fail("cudaIpcCloseMemHandle", e);
  }
  std::printf("ipc child: wrote %zu bytes at offset %zu\n", bytes.size(), offset);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "write") {
    return WriteFile(argv[2], argv[3], std::stoull(argv[4]), argv[5]);
  }
  if (argc != 10) {
    std::fprintf(stderr,
                 "usage: %s HANDLE_HEX UUID BYTES TPB LAYERS KV_HEADS HEAD_DIM DTYPE CHECKS\n"
                 "       %s write HANDLE_HEX UUID OFFSET FILE\n",
                 argv[0], argv[0]);
    return 2;
  }
  const std::string uuid = argv[2];
  const size_t bytes = std::stoull(argv[3]);
  const kvcm::kernels::KvBlockLayout layout{std::stoll(argv[4]), std::stoll(argv[5]),
                                            std::stoll(argv[6]), std::stoll(argv[7]),
                                            static_cast<kvcm::kernels::KvDtype>(std::stoi(argv[8]))};
  void* mapped = nullptr;
  if (int failed = OpenByUuid(argv[1], uuid, &mapped); failed != 0) return failed;
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

// kvcache-ucx-bench: the hand-off's UCX data plane against a plain copy of the same bytes.
//
//   BM_Memcpy        256 MiB copied in 512 KiB pieces (one KV block of the hand-off
//                    benchmark) with memcpy: the floor on this machine's memory
//   BM_UcxRead/in_flight:N/registered:0/same_host:S
//                    the same 256 MiB pulled with UcxTransport::Read as 512 KiB reads, at
//                    most N outstanding, from a second UcxTransport of this process; S=1:
//                    UcxTransport's default, the same-host path (posix/sysv shared memory),
//                    S=0: same_host_shared_memory off, so UCX 1.13 with peer failure
//                    handling: tcp on the loopback (see cache_manager/kv/ucx_transfer.cc).
//                    Both served by the source's progress thread; real time: the work is
//                    split between this thread and the serving one.
//   BM_UcxRead/in_flight:64/registered:1/same_host:S
//                    the same with the destination registered (RegisterLocal)
//   BM_UcxReadFromOtherProcess/same_host:S/in_flight:N
//                    the same from a source in another process (this binary re-executed):
//                    two daemons of one node
//
// All in one binary so that their ratios come from one run on one machine.
// Run: build/bin/kvcache-ucx-bench --benchmark_repetitions=3 --benchmark_report_aggregates_only
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "cache_manager/kv/ucx_transfer.h"

namespace kvcm {
namespace {

constexpr int64_t kTotalBytes = int64_t{256} << 20;
constexpr int64_t kBlockBytes = int64_t{512} << 10;

// The source pool and the destination, allocated and touched once for every benchmark.
struct Buffers {
  std::vector<char> source = std::vector<char>(kTotalBytes, 'k');
  std::vector<char> destination = std::vector<char>(kTotalBytes, 0);
};
Buffers& SharedBuffers() {
  static Buffers* buffers = new Buffers();
  return *buffers;
}

void BM_Memcpy(benchmark::State& state) {
  Buffers& b = SharedBuffers();
  for (auto _ : state) {
    for (int64_t offset = 0; offset < kTotalBytes; offset += kBlockBytes) {
      std::memcpy(b.destination.data() + offset, b.source.data() + offset, kBlockBytes);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kTotalBytes);
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_UcxRead(benchmark::State& state) {
  Buffers& b = SharedBuffers();
  const bool registered = state.range(1) != 0;
  UcxTransportOptions target_options;
  target_options.max_reads_in_flight = static_cast<int32_t>(state.range(0));
  target_options.same_host_shared_memory = state.range(2) != 0;
  auto source = UcxTransport::Create();
  auto target = UcxTransport::Create(target_options);
  if (!source.ok() || !target.ok()) {
    state.SkipWithError("UCX did not start");
    return;
  }
  absl::StatusOr<UcxMemoryKey> key = (*source)->Expose(b.source.data(), kTotalBytes);
  if (!key.ok() ||
      (registered && !(*target)->RegisterLocal(b.destination.data(), kTotalBytes).ok())) {
    state.SkipWithError("UCX registration failed");
    return;
  }
  std::vector<UcxRead> reads;
  for (int64_t offset = 0; offset < kTotalBytes; offset += kBlockBytes) {
    reads.push_back({&key->rkey, key->remote_address + static_cast<uint64_t>(offset),
                     b.destination.data() + offset, kBlockBytes});
  }
  for (auto _ : state) {
    absl::Status status =
        (*target)->Read((*source)->worker_address(), reads, absl::Now() + absl::Seconds(60));
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
  }
  state.SetBytesProcessed(state.iterations() * kTotalBytes);
  state.SetLabel(absl::StrCat((*target)->transports(), "; same-host reads ",
                              (*target)->same_host_reads()));
}
BENCHMARK(BM_UcxRead)
    ->ArgNames({"in_flight", "registered", "same_host"})
    ->Args({1, 0, 0})
    ->Args({64, 0, 0})
    ->Args({64, 1, 0})
    ->Args({1, 0, 1})
    ->Args({8, 0, 1})
    ->Args({64, 0, 1})
    ->Args({64, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// --- The source in another process ------------------------------------------------------
// This binary re-executed with KVCM_UCX_BENCH_SOURCE=<write fd>: exposes kTotalBytes, writes
// its worker address, key and base to the fd, serves until its stdin closes.

bool WriteString(int fd, const std::string& bytes) {
  const uint32_t size = static_cast<uint32_t>(bytes.size());
  return write(fd, &size, 4) == 4 &&
         write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
}

bool ReadFully(int fd, void* out, size_t bytes) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t got = read(fd, p, bytes);
    if (got <= 0) return false;
    p += got;
    bytes -= static_cast<size_t>(got);
  }
  return true;
}

bool ReadString(int fd, std::string* out) {
  uint32_t size = 0;
  if (!ReadFully(fd, &size, 4)) return false;
  out->resize(size);
  return ReadFully(fd, out->data(), size);
}

int RunSourceIfAsked() {
  const char* spec = std::getenv("KVCM_UCX_BENCH_SOURCE");
  if (spec == nullptr) return 0;
  const int fd = std::atoi(spec);
  std::vector<char> pool(kTotalBytes, 'k');
  auto transport = UcxTransport::Create();
  if (!transport.ok()) _exit(4);
  absl::StatusOr<UcxMemoryKey> key = (*transport)->Expose(pool.data(), kTotalBytes);
  if (!key.ok()) _exit(5);
  if (!WriteString(fd, (*transport)->worker_address()) || !WriteString(fd, key->rkey) ||
      write(fd, &key->remote_address, 8) != 8) {
    _exit(3);
  }
  close(fd);
  char ignored;
  while (read(STDIN_FILENO, &ignored, 1) > 0) {
  }
  transport->reset();
  _exit(0);
}
const int kSourceRan = RunSourceIfAsked();

void BM_UcxReadFromOtherProcess(benchmark::State& state) {
  Buffers& b = SharedBuffers();
  int report[2], alive[2];
  if (pipe(report) != 0 || pipe(alive) != 0) {
    state.SkipWithError("pipe failed");
    return;
  }
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(alive[0], STDIN_FILENO);
    close(alive[1]);
    close(report[0]);
    setenv("KVCM_UCX_BENCH_SOURCE", absl::StrCat(report[1]).c_str(), 1);
    execl("/proc/self/exe", "kvcache-ucx-bench-source", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(report[1]);
  close(alive[0]);
  std::string address;
  UcxMemoryKey key;
  const bool got = ReadString(report[0], &address) && ReadString(report[0], &key.rkey) &&
                   ReadFully(report[0], &key.remote_address, 8);
  close(report[0]);
  UcxTransportOptions options;
  options.same_host_shared_memory = state.range(0) != 0;
  options.max_reads_in_flight = static_cast<int32_t>(state.range(1));
  auto target = UcxTransport::Create(options);
  std::vector<UcxRead> reads;
  for (int64_t offset = 0; offset < kTotalBytes; offset += kBlockBytes) {
    reads.push_back({&key.rkey, key.remote_address + static_cast<uint64_t>(offset),
                     b.destination.data() + offset, kBlockBytes});
  }
  if (!got || !target.ok()) state.SkipWithError("the source process or UCX did not start");
  for (auto _ : state) {
    if (!got || !target.ok()) break;
    absl::Status status = (*target)->Read(address, reads, absl::Now() + absl::Seconds(60));
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
  }
  state.SetBytesProcessed(state.iterations() * kTotalBytes);
  if (target.ok()) {
    state.SetLabel(absl::StrCat((*target)->transports(), "; same-host reads ",
                                (*target)->same_host_reads()));
  }
  target = absl::UnavailableError("done");  // before the source goes
  close(alive[1]);
  waitpid(pid, nullptr, 0);
}
BENCHMARK(BM_UcxReadFromOtherProcess)
    ->ArgNames({"same_host", "in_flight"})
    ->Args({0, 64})
    ->Args({1, 1})
    ->Args({1, 8})
    ->Args({1, 64})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace kvcm

BENCHMARK_MAIN();

// Fuzzes kvtrace/1 parsing (clients/replay/trace.h) the way kvcache-replay reads a trace:
// the input is written to a file and read with TraceReader, header and steps. The file is
// a memfd, opened by its /proc/self/fd path: a file on disk cost each input a truncate
// and a close through the filesystem's journal (a quarter of its time on ext4). Checked
// beyond "no crash, no leak": every error names the file and line; every parsed step's
// scores are exactly its layers x tokens.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "clients/replay/trace.h"

namespace {

// A file of this process's own in memory, rewritten for every input.
struct TraceFile {
  int fd;
  std::string path;
};

const TraceFile& File() {
  static const TraceFile* const file = [] {
    const int fd = memfd_create("kvcm-trace-fuzz", MFD_CLOEXEC);
    KVCM_CHECK(fd >= 0);
    return new TraceFile{fd, absl::StrCat("/proc/self/fd/", fd)};
  }();
  return *file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::replay;
  const TraceFile& file = File();
  const std::string& path = file.path;
  KVCM_CHECK(ftruncate(file.fd, 0) == 0);
  KVCM_CHECK(pwrite(file.fd, data, size, 0) == static_cast<ssize_t>(size));

  absl::StatusOr<std::unique_ptr<TraceReader>> reader = TraceReader::Open(path);
  if (!reader.ok()) {
    KVCM_CHECK(absl::StartsWith(reader.status().message(), path));
    return 0;
  }
  (void)(*reader)->header().ToSequenceOptions();
  TraceStep step;
  while (true) {
    absl::StatusOr<bool> more = (*reader)->Next(&step);
    if (!more.ok()) {
      KVCM_CHECK(absl::StartsWith(more.status().message(), absl::StrCat(path, ":")));
      break;
    }
    if (!*more) break;
    KVCM_CHECK(step.line >= 2);
    KVCM_CHECK(static_cast<int64_t>(step.scores.size()) == step.layers * step.tokens);
    const kvcm::kernels::ScoreMatrix matrix = step.Matrix();
    KVCM_CHECK(matrix.layers == step.layers);
  }
  return 0;
}

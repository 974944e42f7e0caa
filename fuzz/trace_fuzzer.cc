// Fuzzes kvtrace/1 parsing (clients/replay/trace.h) the way kvcache-replay reads a trace:
// the input is written to a file and read with TraceReader, header and steps. Checked
// beyond "no crash, no leak": every error names the file and line; every parsed step's
// scores are exactly its layers x tokens.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/check.h"
#include "clients/replay/trace.h"

namespace {

// A file of this process's own, rewritten for every input.
const std::string& TracePath() {
  static const std::string* const path = [] {
    const char* dir = std::getenv("TMPDIR");
    return new std::string(
        absl::StrCat(dir != nullptr && *dir != '\0' ? dir : "/tmp", "/kvcm-trace-fuzz-",
                     getpid(), ".jsonl"));
  }();
  return *path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::replay;
  const std::string& path = TracePath();
  std::FILE* file = std::fopen(path.c_str(), "wb");
  KVCM_CHECK(file != nullptr);
  KVCM_CHECK(std::fwrite(data, 1, size, file) == size);
  KVCM_CHECK(std::fclose(file) == 0);

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

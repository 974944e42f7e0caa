// The golden vectors of tests/data/golden (copied from the shared test data so that a
// clone is self-contained).
#ifndef KVCM_TESTS_CLIENTS_GOLDEN_H_
#define KVCM_TESTS_CLIENTS_GOLDEN_H_

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvcm::testing {

inline std::string GoldenDir() { return std::string(KVCM_TEST_DATA_DIR) + "/golden"; }
// The golden vectors of span pooling (SPEC.md, "Span pooling"), apart from the shared ones:
// written by tests/python/make_span_pool_golden.py.
inline std::string SpanPoolGoldenDir() {
  return std::string(KVCM_TEST_DATA_DIR) + "/golden_span_pool";
}

// Names NAME of every NAME.trace.jsonl in `dir` (default: the golden directory), sorted.
inline std::vector<std::string> GoldenNames(const std::string& dir = GoldenDir()) {
  std::vector<std::string> names;
  const std::string suffix = ".trace.jsonl";
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.size() > suffix.size() && file.ends_with(suffix)) {
      names.push_back(file.substr(0, file.size() - suffix.size()));
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_CLIENTS_GOLDEN_H_

#include "clients/replay/decision_json.h"

#include <charconv>

namespace kvcm::replay {
namespace {

template <typename T>
void AppendNumber(T value, std::string* out) {
  char buffer[32];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out->append(buffer, end);
}

template <typename T>
void AppendList(std::span<const T> values, std::string* out) {
  out->push_back('[');
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out->push_back(',');
    AppendNumber(values[i], out);
  }
  out->push_back(']');
}

}  // namespace

void AppendDecisionJson(const EvictionDecision& decision, bool with_momentum,
                        std::span<const int64_t> positions, std::span<const float> momentum,
                        std::string* out) {
  out->append("{\"step\":");
  AppendNumber(decision.step, out);
  out->append(",\"evicted\":");
  AppendList(std::span<const int64_t>(decision.evicted), out);
  out->append(",\"cache_size\":");
  AppendNumber(decision.cache_size, out);
  out->append(",\"next_needs_scores\":");
  out->append(decision.next_needs_scores ? "true" : "false");
  if (with_momentum) {
    out->append(",\"momentum\":{\"positions\":");
    AppendList(positions, out);
    out->append(",\"values\":");
    AppendList(momentum, out);
    out->push_back('}');
  }
  out->append("}\n");
}

}  // namespace kvcm::replay

#include "clients/replay/trace.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcm::replay {
namespace {

using nlohmann::json;

absl::StatusOr<json> ParseJson(const std::string& line) {
  // One parse: a malformed line throws with its position and reason (parsing it again
  // without exceptions first doubled the cost of every bad line).
  json value;
  try {
    value = json::parse(line);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number too large for a double (1e400)
    return absl::InvalidArgumentError(absl::StrCat("malformed JSON: ", e.what()));
  }
  if (!value.is_object()) return absl::InvalidArgumentError("line is not a JSON object");
  return value;
}

absl::StatusOr<int64_t> GetInt(const json& object, const char* key) {
  const json& v = object.at(key);
  if (!v.is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be an integer"));
  }
  return v.get<int64_t>();
}

absl::StatusOr<double> GetNumber(const json& object, const char* key) {
  const json& v = object.at(key);
  if (!v.is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be a number"));
  }
  return v.get<double>();
}

absl::StatusOr<Policy> ParsePolicy(const json& p, std::string* preset) {
  if (!p.is_object()) return absl::InvalidArgumentError("\"policy\" must be an object");
  Policy policy;
  for (auto it = p.begin(); it != p.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "aggregation" || key == "refresh" || key == "preset") {
      if (!v.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat("policy \"", key, "\" must be a string"));
      }
      const std::string name = v.get<std::string>();
      if (key == "aggregation") {
        absl::StatusOr<Aggregation> a = ParseAggregation(name);
        if (!a.ok()) return a.status();
        policy.aggregation = *a;
      } else if (key == "refresh") {
        absl::StatusOr<Refresh> r = ParseRefresh(name);
        if (!r.ok()) return r.status();
        policy.refresh = *r;
      } else {
        *preset = name;
      }
    } else if (key == "alpha") {
      if (!v.is_number()) return absl::InvalidArgumentError("policy \"alpha\" must be a number");
      policy.alpha = v.get<double>();
    } else if (key == "refresh_interval" || key == "protect_sinks" || key == "protect_recent" ||
               key == "seed" || key == "span_pool") {
      if (!v.is_number_integer()) {
        return absl::InvalidArgumentError(
            absl::StrCat("policy \"", key, "\" must be an integer"));
      }
      if (key == "refresh_interval") policy.refresh_interval = v.get<int64_t>();
      if (key == "protect_sinks") policy.protect_sinks = v.get<int64_t>();
      if (key == "protect_recent") policy.protect_recent = v.get<int64_t>();
      if (key == "seed") policy.seed = v.get<uint64_t>();
      if (key == "span_pool") policy.span_pool = v.get<int64_t>();  // checked at open
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown policy field \"", key, "\""));
    }
  }
  return policy;
}

}  // namespace

SequenceOptions TraceHeader::ToSequenceOptions() const {
  SequenceOptions options;
  options.prefill_len = prefill_len;
  options.budget = budget;
  options.preset = preset;
  options.policy = policy;
  return options;
}

absl::StatusOr<TraceHeader> ParseTraceHeader(const std::string& line) {
  absl::StatusOr<json> parsed = ParseJson(line);
  if (!parsed.ok()) return parsed.status();
  const json& h = *parsed;
  if (!h.contains("format") || h["format"] != "kvtrace/1") {
    return absl::InvalidArgumentError("header must have \"format\":\"kvtrace/1\"");
  }
  TraceHeader header;
  if (!h.contains("prefill_len")) return absl::InvalidArgumentError("header has no \"prefill_len\"");
  absl::StatusOr<int64_t> prefill = GetInt(h, "prefill_len");
  if (!prefill.ok()) return prefill.status();
  header.prefill_len = *prefill;
  if (h.contains("budget_tokens")) {
    absl::StatusOr<int64_t> b = GetInt(h, "budget_tokens");
    if (!b.ok()) return b.status();
    header.budget.budget_tokens = *b;
  }
  if (h.contains("compression_ratio")) {
    absl::StatusOr<double> r = GetNumber(h, "compression_ratio");
    if (!r.ok()) return r.status();
    header.budget.compression_ratio = *r;
  }
  if (h.contains("policy")) {
    absl::StatusOr<Policy> policy = ParsePolicy(h["policy"], &header.preset);
    if (!policy.ok()) return policy.status();
    header.policy = *policy;
  }
  return header;
}

absl::Status ParseTraceStep(const std::string& line, TraceStep* step) {
  step->step = -1;  // unknown until parsed
  absl::StatusOr<json> parsed = ParseJson(line);
  if (!parsed.ok()) return parsed.status();
  const json& s = *parsed;
  if (!s.contains("step")) return absl::InvalidArgumentError("step line has no \"step\"");
  absl::StatusOr<int64_t> number = GetInt(s, "step");
  if (!number.ok()) return number.status();
  step->step = *number;
  step->layers = 0;
  step->tokens = 0;
  step->scores.clear();
  const auto where = [&] { return absl::StrCat("step ", step->step, ": "); };
  if (!s.contains("layers") || s["layers"].is_null()) return absl::OkStatus();
  const json& layers = s["layers"];
  if (!layers.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where(), "\"layers\" must be a list of lists"));
  }
  step->layers = static_cast<int64_t>(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    const json& row = layers[l];
    if (!row.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "layer ", l, " is not a list"));
    }
    if (l == 0) {
      step->tokens = static_cast<int64_t>(row.size());
      step->scores.reserve(layers.size() * row.size());
    } else if (static_cast<int64_t>(row.size()) != step->tokens) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "layer ", l, " has ", row.size(),
                                                     " scores, layer 0 has ", step->tokens));
    }
    for (size_t i = 0; i < row.size(); ++i) {
      if (!row[i].is_number()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "layer ", l, " score ", i, " is not a number"));
      }
      // Numbers beyond a double fail the parse above; those beyond a float become +-inf
      // here and are rejected by the engine as non-finite, with the layer and position named.
      step->scores.push_back(static_cast<float>(row[i].get<double>()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TraceReader>> TraceReader::Open(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open the trace"));
  std::unique_ptr<TraceReader> reader(new TraceReader(path, std::move(in)));
  while (std::getline(reader->in_, reader->buffer_)) {
    ++reader->line_;
    if (reader->buffer_.find_first_not_of(" \t\r") == std::string::npos) continue;
    absl::StatusOr<TraceHeader> header = ParseTraceHeader(reader->buffer_);
    if (!header.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", reader->line_, ": header: ", header.status().message()));
    }
    reader->header_ = *std::move(header);
    return reader;
  }
  return absl::InvalidArgumentError(absl::StrCat(path, ": the trace is empty (no header)"));
}

absl::StatusOr<bool> TraceReader::Next(TraceStep* step) {
  while (std::getline(in_, buffer_)) {
    ++line_;
    if (buffer_.find_first_not_of(" \t\r") == std::string::npos) continue;
    step->line = line_;
    absl::Status status = ParseTraceStep(buffer_, step);
    if (!status.ok()) {
      // Name the step even when the line is too broken to say: it should have held the
      // step after the last good one.
      const std::string which =
          step->step < 0 ? absl::StrCat("step ", last_step_ + 1, " (expected): ") : "";
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ":", line_, ": ", which, status.message()));
    }
    last_step_ = step->step;
    return true;
  }
  if (in_.bad()) return absl::DataLossError(absl::StrCat(path_, ": read error"));
  return false;
}

}  // namespace kvcm::replay

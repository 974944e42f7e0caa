// Writes the fuzzers' seed corpora from the golden vectors (tests/data/golden):
//   make_seeds GOLDEN_DIR OUT_DIR
// OUT_DIR/open_sequence/: each golden trace's OpenSequenceRequest, and variants of it
//   (tensor-parallel, folded, float16, a preset).
// OUT_DIR/step_batch/: each trace's open and its first steps as StepBatches; a case with
//   two sequences sharing batches, and a tensor-parallel case with both ranks' batches.
// OUT_DIR/trace/: each trace's header and first steps, as kvtrace/1 lines.
// Seeds are kept small (a few steps) so the fuzzers' executions stay fast.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "clients/replay/trace.h"
#include "fuzz/fuzz_support.h"
#include "server/translate.h"

namespace {

namespace fs = std::filesystem;
namespace v1 = ::kvcache::v1;

constexpr int kSeedSteps = 4;
constexpr int64_t kTraceSeedScores = 16;

void Write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  if (!out) {
    std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

v1::OpenSequenceRequest OpenRequest(const std::string& id,
                                    const kvcm::replay::TraceHeader& header) {
  v1::OpenSequenceRequest r;
  r.set_sequence_id(id);
  r.set_prefill_len(header.prefill_len);
  if (header.budget.budget_tokens) r.set_budget_tokens(*header.budget.budget_tokens);
  if (header.budget.compression_ratio) r.set_compression_ratio(*header.budget.compression_ratio);
  if (!header.preset.empty()) {
    r.mutable_policy()->set_preset(header.preset);
    r.mutable_policy()->set_seed(header.policy.seed);
    r.mutable_policy()->set_span_pool(static_cast<int32_t>(header.policy.span_pool));
  } else {
    kvcm::server::ToProto(header.policy, r.mutable_policy());
    r.mutable_policy()->clear_preset();
  }
  return r;
}

void AddReport(const std::string& id, const kvcm::replay::TraceStep& step, int32_t head_count,
               v1::StepBatch* batch) {
  v1::StepReport* report = batch->add_reports();
  report->set_sequence_id(id);
  report->set_step(step.step);
  if (step.layers > 0) {
    report->set_layers(static_cast<int32_t>(step.layers));
    report->set_scores(std::string(reinterpret_cast<const char*>(step.scores.data()),
                                   step.scores.size() * sizeof(float)));
    report->set_dtype(v1::SCORE_DTYPE_FLOAT32);
  }
  report->set_head_count(head_count);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_seeds GOLDEN_DIR OUT_DIR\n");
    return 2;
  }
  const fs::path golden = argv[1];
  const fs::path out = argv[2];
  for (const char* dir : {"open_sequence", "step_batch", "trace"}) fs::create_directories(out / dir);

  int traces = 0;
  for (const auto& entry : fs::directory_iterator(golden)) {
    const std::string file = entry.path().filename().string();
    const std::string suffix = ".trace.jsonl";
    if (file.size() <= suffix.size() || file.compare(file.size() - suffix.size(), suffix.size(),
                                                     suffix) != 0) {
      continue;
    }
    const std::string name = file.substr(0, file.size() - suffix.size());
    auto reader = kvcm::replay::TraceReader::Open(entry.path().string());
    if (!reader.ok()) {
      std::fprintf(stderr, "make_seeds: %s\n", std::string(reader.status().message()).c_str());
      return 1;
    }
    std::vector<kvcm::replay::TraceStep> steps;
    for (int i = 0; i < kSeedSteps; ++i) {
      kvcm::replay::TraceStep step;
      auto more = (*reader)->Next(&step);
      if (!more.ok() || !*more) break;
      steps.push_back(std::move(step));
    }
    const v1::OpenSequenceRequest open = OpenRequest(name, (*reader)->header());

    // OpenSequence seeds.
    Write(out / "open_sequence" / name, open.SerializeAsString());
    v1::OpenSequenceRequest variant = open;
    variant.set_tp_world_size(2);
    variant.set_score_dtype(v1::SCORE_DTYPE_FLOAT16);
    Write(out / "open_sequence" / (name + "-tp2-f16"), variant.SerializeAsString());
    variant = open;
    variant.set_score_layout(v1::SCORE_LAYOUT_FOLDED);
    variant.set_layers(4);
    variant.set_decision_encoding(v1::DECISION_ENCODING_AUTO);
    Write(out / "open_sequence" / (name + "-folded"), variant.SerializeAsString());

    // StepBatch seeds: the trace's first steps, one batch each.
    kvcm::fuzz::StepCase single;
    single.opens.push_back(open);
    for (const auto& step : steps) {
      v1::StepBatch& batch = single.batches.emplace_back();
      batch.set_batch_id(static_cast<uint64_t>(step.step));
      AddReport(name, step, /*head_count=*/0, &batch);
    }
    Write(out / "step_batch" / name, kvcm::fuzz::SerializeStepCase(single));

    // Two sequences of the same trace stepping in the same batches.
    kvcm::fuzz::StepCase pair = single;
    pair.opens.push_back(open);
    pair.opens.back().set_sequence_id(name + "-b");
    for (size_t i = 0; i < pair.batches.size(); ++i) {
      AddReport(name + "-b", steps[i], 0, &pair.batches[i]);
    }
    Write(out / "step_batch" / (name + "-pair"), kvcm::fuzz::SerializeStepCase(pair));

    // Tensor parallel, two ranks: each rank's batch carries the step's scores as the sum
    // over one head, the rank 1 batch following rank 0's.
    kvcm::fuzz::StepCase tp;
    tp.opens.push_back(open);
    tp.opens.back().set_tp_world_size(2);
    for (const auto& step : steps) {
      for (int32_t rank = 0; rank < 2; ++rank) {
        v1::StepBatch& batch = tp.batches.emplace_back();
        batch.set_rank(rank);
        batch.set_batch_id(static_cast<uint64_t>(step.step));
        AddReport(name, step, /*head_count=*/1, &batch);
      }
    }
    Write(out / "step_batch" / (name + "-tp2"), kvcm::fuzz::SerializeStepCase(tp));

    // kvtrace/1 seed: the header verbatim and the first steps with each layer cut to its
    // first scores (the parser's paths are the same; a short line parses faster).
    std::ifstream in(entry.path());
    std::string text;
    std::getline(in, text);
    text += "\n";
    for (const auto& step : steps) {
      text += "{\"step\":" + std::to_string(step.step);
      if (step.layers > 0) {
        text += ",\"layers\":[";
        for (int64_t l = 0; l < step.layers; ++l) {
          text += l == 0 ? "[" : ",[";
          for (int64_t i = 0; i < std::min<int64_t>(step.tokens, kTraceSeedScores); ++i) {
            char number[32];
            std::snprintf(number, sizeof(number), "%s%.9g", i == 0 ? "" : ",",
                          step.scores[static_cast<size_t>(l * step.tokens + i)]);
            text += number;
          }
          text += "]";
        }
        text += "]";
      }
      text += "}\n";
    }
    Write(out / "trace" / name, text);
    ++traces;
  }
  if (traces == 0) {
    std::fprintf(stderr, "make_seeds: no *.trace.jsonl in %s\n", golden.c_str());
    return 1;
  }
  std::printf("make_seeds: seeds from %d golden traces in %s\n", traces, out.c_str());
  return 0;
}

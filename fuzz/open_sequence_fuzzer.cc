// Fuzzes OpenSequence validation as the daemon runs it: the request is translated
// (server/translate.h) and opened in a real SequenceTable. An accepted sequence then
// takes a few steps, with scores of the length it asks for, so that whatever validation
// let through is also used (a bad value passed at Open usually crashes only later, on the
// first evicting step). Checked beyond "no crash, no leak": a refused Open says why and
// leaves the table as it was; an accepted one reads back as opened.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cache_manager/base/check.h"
#include "cache_manager/table/sequence_table.h"
#include "fuzz/fuzz_support.h"
#include "kernels/score_matrix.h"
#include "server/translate.h"

namespace {

constexpr int kSteps = 3;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcm::fuzz::QuietProtobufLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm;
  kvcache::v1::OpenSequenceRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  if (fuzz::TooSlowToFuzz(request)) return -1;

  absl::StatusOr<server::OpenParams> params = server::FromProto(request);
  if (!params.ok()) {
    KVCM_CHECK(!params.status().message().empty());
    return 0;
  }
  SequenceTableOptions options;
  options.max_tp_world_size = 8;
  SequenceTable table(options);
  absl::StatusOr<SequenceInfo> opened =
      table.Open(params->id, params->options, params->tp_world_size, params->score_dtype);
  if (!opened.ok()) {
    KVCM_CHECK(!opened.status().message().empty());
    KVCM_CHECK(table.Totals().open_sequences == 0);
    return 0;
  }
  KVCM_CHECK(opened->id == params->id);
  KVCM_CHECK(opened->tp_world_size == params->tp_world_size);
  KVCM_CHECK(table.Totals().open_sequences == 1);

  // Steps of a single-rank sequence, scored with uniform scores (rows: one per layer as
  // the layout wants it). Tensor-parallel sequences need every rank's report; one rank's
  // step is enough to reach the join, then the table's close abandons it.
  std::vector<float> scores;
  // Outlives the loop: a tensor-parallel step's callback is only called by the Close.
  absl::Status decided;
  for (int64_t step = 1; step <= kSteps; ++step) {
    absl::StatusOr<SequenceInfo> info = table.Inspect(params->id, /*with_cache=*/false);
    KVCM_CHECK(info.ok());
    if (info->cache_size >= fuzz::kMaxFuzzTokens) break;
    const int64_t tokens = info->cache_size + 1;
    scores.assign(static_cast<size_t>(tokens), 1.0f / static_cast<float>(tokens));
    const kernels::ScoreMatrix matrix =
        kernels::ScoreMatrix::Dense(scores.data(), kernels::ScoreDtype::kFloat32, 1, tokens);
    RankReport report;
    report.rank = 0;
    report.step = step;
    if (info->next_needs_scores) report.partial_sums = matrix;
    report.head_count = params->tp_world_size > 1 ? 1 : 0;
    const absl::Status submitted = table.SubmitRankReport(
        params->id, report,
        [&](const absl::StatusOr<EvictionDecision>& d) { decided = d.status(); });
    if (!submitted.ok() || params->tp_world_size > 1 || !decided.ok()) break;
  }
  KVCM_CHECK(table.Close(params->id).ok());
  return 0;
}

#include "clients/loadgen/scores.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/policy/fold.h"

namespace kvcm::loadgen {

namespace v1 = ::kvcache::v1;

std::vector<float> SyntheticScores(int32_t layers, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(static_cast<size_t>(layers) * static_cast<size_t>(tokens));
  for (float& v : s) {
    const float x = u(rng);
    v = x > 0.99f ? x * 0.05f : x * x * 1e-4f;
  }
  return s;
}

std::string EncodeScores(const std::vector<float>& scores, int32_t layers,
                         kernels::ScoreDtype dtype) {
  v1::StepReport report;
  client::SetScores(&report, scores, layers, dtype);
  return report.scores();
}

absl::StatusOr<std::vector<float>> FoldForPolicy(const SequenceOptions& options,
                                                 const std::vector<float>& rows,
                                                 int32_t layers, int64_t tokens) {
  ASSIGN_OR_RETURN(const Policy policy, Sequence::ResolvePolicy(options));
  ASSIGN_OR_RETURN(const FoldWeights weights, FoldWeightsFor(policy, layers));
  std::vector<float> row(static_cast<size_t>(tokens));
  if (!weights.layer_weights.empty()) {
    FoldRows(kernels::ScoreMatrix::Dense(rows.data(), kernels::ScoreDtype::kFloat32, layers,
                                         tokens),
             weights, row.data());
  }
  return row;
}

absl::StatusOr<std::unique_ptr<client::ScoreRegion>> MakeScoreRegion(
    absl::string_view transport, client::KvCacheClient& client, int64_t bytes) {
  if (transport == "created") return client::ScoreRegion::CreateInDaemon(client, bytes);
  if (transport == "shm") return client::ScoreRegion::Create(client, bytes);
  return absl::InvalidArgumentError(
      absl::StrCat("score region transport '", transport, "': expected shm or created"));
}

}  // namespace kvcm::loadgen

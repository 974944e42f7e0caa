// Synthetic scores and score regions that kvcache-loadgen's modes share: the throughput
// run (loadgen.h) and the capacity run (serve.h) send the same attention-like rows, folded
// the same way, through the same kinds of region.
#ifndef KVCM_CLIENTS_LOADGEN_SCORES_H_
#define KVCM_CLIENTS_LOADGEN_SCORES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/engine/sequence.h"
#include "clients/cpp/kvcache_client.h"
#include "clients/cpp/score_region.h"
#include "kernels/score_matrix.h"

namespace kvcm::loadgen {

// Attention-like rows: most tokens get little, a few get much. [layers, tokens] f32.
std::vector<float> SyntheticScores(int32_t layers, int64_t tokens, uint64_t seed);

// The packed bytes of `scores` ([layers, tokens] f32) in `dtype`, as a worker sends them.
std::string EncodeScores(const std::vector<float>& scores, int32_t layers,
                         kernels::ScoreDtype dtype);

// `rows` ([layers, tokens] f32) folded into one row ([tokens] f32) with the weights of the
// policy a sequence opened with `options` resolves to (options.layers = layers): what a
// worker sends for a FOLDED sequence. A policy that reads no scores folds to zeros.
absl::StatusOr<std::vector<float>> FoldForPolicy(const SequenceOptions& options,
                                                 const std::vector<float>& rows,
                                                 int32_t layers, int64_t tokens);

// A score region of `bytes` for a worker stream of `client`: "created" asks the daemon to
// make it (CreateScoreRegion), "shm" makes it in this process and registers it.
// INVALID_ARGUMENT for another transport; the daemon's error otherwise.
absl::StatusOr<std::unique_ptr<client::ScoreRegion>> MakeScoreRegion(
    absl::string_view transport, client::KvCacheClient& client, int64_t bytes);

}  // namespace kvcm::loadgen

#endif  // KVCM_CLIENTS_LOADGEN_SCORES_H_

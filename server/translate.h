// Translation between the kvcache.v1 messages and the engine's plain structs, and between
// absl::Status and grpc::Status. No policy logic: names and numbers in, values out.
#ifndef KVCM_SERVER_TRANSLATE_H_
#define KVCM_SERVER_TRANSLATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/kv/block_pool.h"
#include "cache_manager/kv/score_regions.h"
#include "cache_manager/table/sequence_table.h"
#include "grpcpp/support/status.h"
#include "kernels/score_matrix.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/server_options.h"

namespace kvcm::server {

namespace v1 = ::kvcache::v1;

struct OpenParams {
  std::string id;
  SequenceOptions options;
  int32_t tp_world_size = 1;
  kernels::ScoreDtype score_dtype = kernels::ScoreDtype::kFloat32;
};

// Validates the request's shape (the engine validates the values) and converts it.
absl::StatusOr<OpenParams> FromProto(const v1::OpenSequenceRequest& request);

// The wire dtype; UNSPECIFIED becomes `fallback`. INVALID_ARGUMENT for unknown numbers.
absl::StatusOr<kernels::ScoreDtype> FromProto(v1::ScoreDtype dtype, kernels::ScoreDtype fallback);
v1::ScoreDtype ToProto(kernels::ScoreDtype dtype);

void ToProto(const Policy& policy, v1::Policy* out);
void ToProto(const SequenceStats& stats, v1::SequenceStats* out);
void ToProto(const SequenceInfo& info, absl::Time now, v1::SequenceState* out);
// A successful step's decision into `out` (its sequence_id and step already set; a
// Decision reused from an earlier batch, Clear()ed, keeps its mask buffer). The evicted
// tokens go as positions or as a mask over `decision.evicted_indices`, as the decision's
// encoding says (proto DecisionEncoding; AUTO: the smaller). O(evicted) for positions,
// O(cache / 8 + evicted) for a mask.
void ToProto(const EvictionDecision& decision, v1::Decision* out);
// One pool's description for DescribeKvPools.
void ToProto(const BlockPool& pool, KvBackend backend, v1::KvPool* out);
void ToProto(const kernels::KvBlockLayout& layout, v1::KvBlockGeometry* out);
// How the worker maps a region CreateScoreRegion made.
void ToProto(const CreatedScoreRegion& region, v1::CreateScoreRegionResponse* out);

// Views a report's packed scores, `bytes` (its inline bytes or the range of a score
// region it names), as a [layers, tokens] matrix of `dtype` without copying when the
// bytes are suitably aligned (into `aligned` otherwise). Empty scores give a matrix with
// layers == 0. Errors name the sequence and step.
absl::StatusOr<kernels::ScoreMatrix> ScoresOf(const v1::StepReport& report,
                                              absl::string_view bytes, kernels::ScoreDtype dtype,
                                              std::vector<uint32_t>* aligned);

// The most bytes of an error message a client gets (a status, or a Decision's message):
// gRPC carries a status in the response's metadata, which has a size limit.
inline constexpr size_t kMaxErrorMessageBytes = 1024;

// `text` made safe to log or to return: newlines, carriage returns and tabs as \n, \r and
// \t, a backslash as \\, other control bytes, DEL and bytes that are not valid UTF-8 as
// \xNN (so an id cannot forge a log line, nor make a message that does not serialize);
// cut at a whole character to at most `max_bytes` bytes, saying how long it was.
std::string EscapeText(absl::string_view text, size_t max_bytes = kMaxErrorMessageBytes);

// The status as the client gets it: its message escaped and bounded (EscapeText).
grpc::Status ToGrpc(const absl::Status& status);

}  // namespace kvcm::server

#endif  // KVCM_SERVER_TRANSLATE_H_

#include "server/translate.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/check.h"
#include "cache_manager/engine/open_request.h"
#include "cache_manager/policy/policy_request.h"
#include "google/protobuf/io/coded_stream.h"
#include "wire/wire_dtype.h"

namespace kvcm::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "scores travel little-endian and are read in place");

absl::StatusOr<Aggregation> FromProto(v1::Aggregation a) {
  switch (a) {
    case v1::AGGREGATION_UNSPECIFIED:
    case v1::AGGREGATION_EMA:
      return Aggregation::kEma;
    case v1::AGGREGATION_CUMULATIVE:
      return Aggregation::kCumulative;
    case v1::AGGREGATION_SINGLE_STEP:
      return Aggregation::kSingleStep;
    case v1::AGGREGATION_RECENCY:
      return Aggregation::kRecency;
    case v1::AGGREGATION_RANDOM:
      return Aggregation::kRandom;
    default:
      return absl::InvalidArgumentError(absl::StrCat("policy: unknown aggregation ", a));
  }
}

absl::StatusOr<Refresh> FromProto(v1::Refresh r) {
  switch (r) {
    case v1::REFRESH_UNSPECIFIED:
    case v1::REFRESH_EVERY_STEP:
      return Refresh::kEveryStep;
    case v1::REFRESH_LAZY:
      return Refresh::kLazy;
    case v1::REFRESH_SCORE_FREE:
      return Refresh::kScoreFree;
    default:
      return absl::InvalidArgumentError(absl::StrCat("policy: unknown refresh ", r));
  }
}

v1::Aggregation ToProto(Aggregation a) {
  switch (a) {
    case Aggregation::kEma:
      return v1::AGGREGATION_EMA;
    case Aggregation::kCumulative:
      return v1::AGGREGATION_CUMULATIVE;
    case Aggregation::kSingleStep:
      return v1::AGGREGATION_SINGLE_STEP;
    case Aggregation::kRecency:
      return v1::AGGREGATION_RECENCY;
    case Aggregation::kRandom:
      return v1::AGGREGATION_RANDOM;
  }
  return v1::AGGREGATION_UNSPECIFIED;
}

v1::Refresh ToProto(Refresh r) {
  switch (r) {
    case Refresh::kEveryStep:
      return v1::REFRESH_EVERY_STEP;
    case Refresh::kLazy:
      return v1::REFRESH_LAZY;
    case Refresh::kScoreFree:
      return v1::REFRESH_SCORE_FREE;
  }
  return v1::REFRESH_UNSPECIFIED;
}

absl::StatusOr<DecisionEncoding> FromProto(v1::DecisionEncoding e) {
  switch (e) {
    case v1::DECISION_ENCODING_UNSPECIFIED:
    case v1::DECISION_ENCODING_POSITIONS:
      return DecisionEncoding::kPositions;
    case v1::DECISION_ENCODING_MASK:
      return DecisionEncoding::kMask;
    case v1::DECISION_ENCODING_AUTO:
      return DecisionEncoding::kAuto;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown decision_encoding ", e, " (expected POSITIONS, MASK or AUTO)"));
  }
}

v1::DecisionEncoding ToProto(DecisionEncoding e) {
  switch (e) {
    case DecisionEncoding::kPositions:
      return v1::DECISION_ENCODING_POSITIONS;
    case DecisionEncoding::kMask:
      return v1::DECISION_ENCODING_MASK;
    case DecisionEncoding::kAuto:
      return v1::DECISION_ENCODING_AUTO;
  }
  return v1::DECISION_ENCODING_UNSPECIFIED;
}

// The wire's policy as asked: enums left UNSPECIFIED and unset optionals stay unset.
absl::StatusOr<PolicyRequest> FromProto(const v1::Policy& p) {
  PolicyRequest request;
  request.preset = p.preset();
  if (p.aggregation() != v1::AGGREGATION_UNSPECIFIED) {
    absl::StatusOr<Aggregation> aggregation = FromProto(p.aggregation());
    if (!aggregation.ok()) return aggregation.status();
    request.aggregation = *aggregation;
  }
  if (p.refresh() != v1::REFRESH_UNSPECIFIED) {
    absl::StatusOr<Refresh> refresh = FromProto(p.refresh());
    if (!refresh.ok()) return refresh.status();
    request.refresh = *refresh;
  }
  if (p.has_alpha()) request.alpha = p.alpha();
  if (p.has_refresh_interval()) request.refresh_interval = p.refresh_interval();
  request.protect_sinks = p.protect_sinks();
  request.protect_recent = p.protect_recent();
  request.seed = p.seed();
  request.span_pool = p.span_pool();
  return request;
}

size_t VarintBytes(int64_t value) {
  return google::protobuf::io::CodedOutputStream::VarintSize64(static_cast<uint64_t>(value));
}

// Whether `d` travels as a mask of `mask_tokens` bits. AUTO compares the payloads: the
// packed varints of the positions against the mask's bytes plus the mask_tokens varint
// (ties: positions); the sum stops as soon as the positions cost more, so it is O(evicted)
// at worst and O(mask bytes) on a large step.
bool EncodesAsMask(const EvictionDecision& d, int64_t mask_tokens) {
  switch (d.encoding) {
    case DecisionEncoding::kPositions:
      return false;
    case DecisionEncoding::kMask:
      return true;
    case DecisionEncoding::kAuto:
      break;
  }
  const size_t mask_bytes =
      static_cast<size_t>((mask_tokens + 7) / 8) + VarintBytes(mask_tokens);
  size_t position_bytes = 0;
  for (const int64_t p : d.evicted) {
    position_bytes += VarintBytes(p);
    if (position_bytes > mask_bytes) return true;
  }
  return false;
}

// Bit i of `mask` (byte i / 8, bit i % 8, LSB first) set for every evicted index; the
// string's capacity is reused, so a reused Decision allocates only when the cache grows.
void SetEvictedMask(const std::vector<int64_t>& indices, int64_t mask_tokens,
                    std::string* mask) {
  mask->assign(static_cast<size_t>((mask_tokens + 7) / 8), '\0');
  // The indices are ascending and below the cache before eviction plus the new token.
  KVCM_CHECK(indices.empty() || (indices.front() >= 0 && indices.back() < mask_tokens));
  auto* bytes = reinterpret_cast<unsigned char*>(mask->data());
  for (const int64_t i : indices) bytes[i >> 3] |= static_cast<unsigned char>(1u << (i & 7));
}

}  // namespace

absl::StatusOr<kernels::ScoreDtype> FromProto(v1::ScoreDtype dtype,
                                              kernels::ScoreDtype fallback) {
  if (dtype == v1::SCORE_DTYPE_UNSPECIFIED) return fallback;
  if (std::optional<kernels::ScoreDtype> known = wire::FromProto(dtype)) return *known;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown score dtype ", dtype, " (expected float32, float16 or bfloat16)"));
}

v1::ScoreDtype ToProto(kernels::ScoreDtype dtype) { return wire::ToProto(dtype); }

absl::StatusOr<OpenParams> FromProto(const v1::OpenSequenceRequest& request) {
  OpenParams params;
  params.id = request.sequence_id();
  const auto context = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("sequence '", params.id, "': ", s.message()));
  };
  params.options.prefill_len = request.prefill_len();
  switch (request.budget_case()) {
    case v1::OpenSequenceRequest::kBudgetTokens:
      params.options.budget.budget_tokens = request.budget_tokens();
      break;
    case v1::OpenSequenceRequest::kCompressionRatio:
      params.options.budget.compression_ratio = request.compression_ratio();
      break;
    case v1::OpenSequenceRequest::BUDGET_NOT_SET:
      break;  // the engine rejects it with the budget rule's message
  }
  absl::StatusOr<PolicyRequest> policy = FromProto(request.policy());
  if (!policy.ok()) return context(policy.status());
  absl::StatusOr<RequestedPolicy> resolved = ResolvePolicyRequest(*policy);
  if (!resolved.ok()) return context(resolved.status());
  params.options.preset = std::move(resolved->preset);
  params.options.policy = std::move(resolved->policy);
  switch (request.score_layout()) {
    case v1::SCORE_LAYOUT_UNSPECIFIED:
    case v1::SCORE_LAYOUT_PER_LAYER:
      params.options.score_layout = ScoreLayout::kPerLayer;
      break;
    case v1::SCORE_LAYOUT_FOLDED:
      params.options.score_layout = ScoreLayout::kFolded;
      break;
    default:
      return context(absl::InvalidArgumentError(
          absl::StrCat("unknown score_layout ", request.score_layout(),
                       " (expected PER_LAYER or FOLDED)")));
  }
  params.options.layers = request.layers();
  absl::StatusOr<DecisionEncoding> encoding = FromProto(request.decision_encoding());
  if (!encoding.ok()) return context(encoding.status());
  params.options.decision_encoding = *encoding;
  params.tp_world_size = TpWorldSizeOrDefault(request.tp_world_size());
  absl::StatusOr<kernels::ScoreDtype> dtype =
      FromProto(request.score_dtype(), kernels::ScoreDtype::kFloat32);
  if (!dtype.ok()) return context(dtype.status());
  params.score_dtype = *dtype;
  if (request.has_resume()) {
    const v1::ResumeState& resume = request.resume();
    absl::StatusOr<SequenceProgress> progress = WorkerResume(
        resume.last_step(),
        std::vector<int64_t>(resume.cached_positions().begin(), resume.cached_positions().end()));
    if (!progress.ok()) return context(progress.status());
    params.options.resume = *std::move(progress);
  }
  return params;
}

void ToProto(const Policy& policy, v1::Policy* out) {
  out->set_preset(policy.preset);
  out->set_aggregation(ToProto(policy.aggregation));
  out->set_alpha(policy.alpha);
  out->set_refresh(ToProto(policy.refresh));
  out->set_refresh_interval(policy.refresh_interval);
  out->set_protect_sinks(policy.protect_sinks);
  out->set_protect_recent(policy.protect_recent);
  out->set_seed(policy.seed);
  out->set_span_pool(static_cast<int32_t>(policy.span_pool));  // validated: 0 to 255
}

void ToProto(const SequenceStats& stats, v1::SequenceStats* out) {
  out->set_steps(stats.steps);
  out->set_scoring_steps(stats.scoring_steps);
  out->set_skipped_scoring_steps(stats.skipped_scoring_steps);
  out->set_ignored_score_reports(stats.ignored_score_reports);
  out->set_tokens_evicted(stats.tokens_evicted);
}

void ToProto(const SequenceInfo& info, absl::Time now, v1::SequenceState* out) {
  out->set_sequence_id(info.id);
  out->set_prefill_len(info.prefill_len);
  out->set_budget(info.budget);
  ToProto(info.policy, out->mutable_policy());
  out->set_tp_world_size(info.tp_world_size);
  out->set_score_dtype(ToProto(info.score_dtype));
  out->set_last_step(info.last_step);
  out->set_cache_size(info.cache_size);
  out->set_next_needs_scores(info.next_needs_scores);
  out->set_ranks_reported(info.ranks_reported);
  ToProto(info.stats, out->mutable_stats());
  out->set_idle_seconds(absl::ToDoubleSeconds(now - info.last_active));
  out->set_score_layout(info.score_layout == ScoreLayout::kFolded ? v1::SCORE_LAYOUT_FOLDED
                                                                   : v1::SCORE_LAYOUT_PER_LAYER);
  out->set_layers(static_cast<int32_t>(info.layers));
  out->set_decision_encoding(ToProto(info.decision_encoding));
  if (!info.fold_weights.layer_weights.empty()) {
    v1::FoldWeights* fold = out->mutable_fold_weights();
    fold->mutable_layer_weights()->Add(info.fold_weights.layer_weights.begin(),
                                       info.fold_weights.layer_weights.end());
    fold->set_decay(info.fold_weights.decay);
  }
  out->mutable_positions()->Add(info.positions.begin(), info.positions.end());
  out->mutable_momentum()->Add(info.momentum.begin(), info.momentum.end());
  for (size_t r = 0; r < info.kv_slots.size(); ++r) {
    v1::KvSlots* slots = out->add_kv_slots();
    slots->set_rank(static_cast<int32_t>(r));
    slots->mutable_slots()->Add(info.kv_slots[r].begin(), info.kv_slots[r].end());
  }
}

void ToProto(const EvictionDecision& decision, v1::Decision* out) {
  const int64_t mask_tokens = decision.cache_size + static_cast<int64_t>(decision.evicted.size());
  if (EncodesAsMask(decision, mask_tokens)) {
    KVCM_CHECK(decision.evicted_indices.size() == decision.evicted.size());  // the engine's
    SetEvictedMask(decision.evicted_indices, mask_tokens, out->mutable_evicted_mask());
    out->set_mask_tokens(mask_tokens);
  } else {
    out->mutable_evicted()->Add(decision.evicted.begin(), decision.evicted.end());
  }
  out->set_cache_size(decision.cache_size);
  out->set_next_needs_scores(decision.next_needs_scores);
  for (const KvSlotChanges& k : decision.kv) {
    v1::KvChange* change = out->add_kv_changes();
    change->set_rank(k.rank);
    change->set_new_token_slot(k.new_token_slot);
    for (const kernels::KvMove& move : k.moves) {
      change->add_moved_from(move.src_slot);
      change->add_moved_to(move.dst_slot);
    }
    change->mutable_released_blocks()->Add(k.released_blocks.begin(), k.released_blocks.end());
  }
}

namespace {

// How a worker maps daemon memory (a KV pool, a created score region): the fields the
// two messages share, by name.
template <typename Message>
void SetMemoryExport(const MemoryExport& memory, Message* out) {
  out->set_bytes(memory.bytes);
  out->set_shm_name(memory.shm_name);
  out->set_cuda_ipc_handle(memory.cuda_ipc_handle);
  out->set_device(memory.device);
  out->set_device_uuid(memory.device_uuid);
  out->set_device_pci_bus_id(memory.device_pci_bus_id);
}

}  // namespace

namespace {

// A block's geometry into a message that has these fields (KvPool, KvBlockGeometry).
template <typename Message>
void SetGeometry(const kernels::KvBlockLayout& layout, Message* out) {
  out->set_tokens_per_block(layout.tokens_per_block);
  out->set_layers(layout.layers);
  out->set_kv_heads(layout.kv_heads);
  out->set_head_dim(layout.head_dim);
  out->set_dtype(layout.dtype == kernels::KvDtype::kFloat32   ? v1::SCORE_DTYPE_FLOAT32
                 : layout.dtype == kernels::KvDtype::kFloat16 ? v1::SCORE_DTYPE_FLOAT16
                                                              : v1::SCORE_DTYPE_BFLOAT16);
  out->set_block_bytes(layout.BlockBytes());
}

}  // namespace

void ToProto(const BlockPool& pool, KvBackend backend, v1::KvPool* out) {
  const kernels::KvBlockLayout& layout = pool.layout();
  const BlockPoolUsage usage = pool.Usage();
  const MemoryExport& memory = pool.memory_export();
  out->set_rank(pool.rank());
  out->set_backend(backend == KvBackend::kCuda ? v1::KV_BACKEND_CUDA : v1::KV_BACKEND_HOST);
  SetGeometry(layout, out);
  out->set_capacity_blocks(usage.capacity_blocks);
  out->set_used_blocks(usage.used_blocks);
  SetMemoryExport(memory, out);
  out->set_export_unavailable(memory.unavailable);
}

void ToProto(const kernels::KvBlockLayout& layout, v1::KvBlockGeometry* out) {
  SetGeometry(layout, out);
}

void ToProto(const CreatedScoreRegion& region, v1::CreateScoreRegionResponse* out) {
  out->set_region(region.region);
  out->set_backend(region.memory.kind == MemoryExport::Kind::kCudaIpc ? v1::KV_BACKEND_CUDA
                                                                      : v1::KV_BACKEND_HOST);
  SetMemoryExport(region.memory, out);
}

absl::StatusOr<kernels::ScoreMatrix> ScoresOf(const v1::StepReport& report,
                                              absl::string_view bytes, kernels::ScoreDtype dtype,
                                              std::vector<uint32_t>* aligned) {
  const auto where = [&] {
    return absl::StrCat("sequence '", report.sequence_id(), "' step ", report.step(), ": ");
  };
  if (bytes.empty()) {
    if (report.layers() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "layers is ", report.layers(), " but scores is empty"));
    }
    return kernels::ScoreMatrix{};
  }
  if (report.layers() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "scores has ", bytes.size(), " bytes but layers is ", report.layers()));
  }
  const size_t element = kernels::ScoreDtypeSize(dtype);
  const size_t row_elements = bytes.size() / element / static_cast<size_t>(report.layers());
  if (bytes.size() % (element * static_cast<size_t>(report.layers())) != 0 || row_elements == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), "scores has ", bytes.size(), " bytes, not a whole number of ", report.layers(),
        " layers of ", kernels::ScoreDtypeName(dtype), " (", element, " bytes each)"));
  }
  const void* data = bytes.data();
  if (reinterpret_cast<uintptr_t>(data) % element != 0) {
    aligned->resize((bytes.size() + 3) / 4);
    std::memcpy(aligned->data(), bytes.data(), bytes.size());
    data = aligned->data();
  }
  return kernels::ScoreMatrix::Dense(data, dtype, report.layers(),
                                     static_cast<int64_t>(row_elements));
}

namespace {

// The length of the valid UTF-8 character at the start of `s` (2 to 4 bytes; never an
// ASCII byte), or 0 when it does not start with one.
size_t Utf8CharLength(absl::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b0 = byte(0);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3;
    if (b0 == 0xe0) lo = 0xa0;  // overlong
    if (b0 == 0xed) hi = 0x9f;  // surrogates
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4;
    if (b0 == 0xf0) lo = 0x90;  // overlong
    if (b0 == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xbf) return 0;
  }
  return n;
}

}  // namespace

std::string EscapeText(absl::string_view text, size_t max_bytes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes));
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    char buf[8];
    absl::string_view unit;
    size_t consumed = 1;
    if (c == '\n') {
      unit = "\\n";
    } else if (c == '\r') {
      unit = "\\r";
    } else if (c == '\t') {
      unit = "\\t";
    } else if (c == '\\') {
      unit = "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      unit = text.substr(i, 1);
    } else if (size_t n = c >= 0x80 ? Utf8CharLength(text.substr(i)) : 0; n > 0) {
      unit = text.substr(i, n);
      consumed = n;
    } else {
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      unit = absl::string_view(buf, 4);
    }
    if (out.size() + unit.size() > max_bytes) {
      // Cut at a whole unit, leaving room to say how much was left out.
      const std::string tail = absl::StrCat("... (cut; ", text.size(), " bytes in all)");
      while (!out.empty() && out.size() + tail.size() > max_bytes) {
        // Drop whole characters: continuation bytes first, then the lead byte.
        while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xc0) == 0x80) {
          out.pop_back();
        }
        if (!out.empty()) out.pop_back();
      }
      out += tail;
      return out;
    }
    out.append(unit.data(), unit.size());
    i += consumed;
  }
  return out;
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), EscapeText(status.message()));
}

}  // namespace kvcm::server

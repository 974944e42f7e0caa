#include "cache_manager/table/sequence_slot.h"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/table/sequence_rules.h"

namespace kvcm {

namespace {

// The sequence's KV events as it opens, or null without a log.
std::unique_ptr<KvSequenceEvents> MakeEvents(KvEventLog* log, const Sequence& s,
                                             int32_t tp_world_size,
                                             const std::optional<SequenceKv>& kv,
                                             const std::string& tenant) {
  if (log == nullptr) return nullptr;
  KvSequenceState state;
  state.sequence_id = s.id();
  state.tenant = tenant;
  state.prefill_len = s.prefill_len();
  state.budget = s.budget();
  state.policy = s.policy().preset.empty() ? "custom" : s.policy().preset;
  state.tp_world_size = tp_world_size;
  state.last_step = s.last_step();
  state.cache_size = s.cache_size();
  if (kv.has_value()) {
    for (int32_t r = 0; r < kv->ranks(); ++r) state.held_blocks.push_back(kv->block_count(r));
  }
  return std::make_unique<KvSequenceEvents>(log, std::move(state));
}

}  // namespace

SequenceSlot::SequenceSlot(std::unique_ptr<Sequence> sequence, int32_t tp_world_size,
                           kernels::ScoreDtype score_dtype, std::optional<SequenceKv> kv,
                           SlotLimits limits, int64_t charged_bytes, absl::Time now,
                           KvEventLog* events, std::string tenant)
    : score_dtype_(score_dtype),
      tp_world_size_(tp_world_size),
      tenant_(std::move(tenant)),
      limits_(limits),
      sequence_(std::move(sequence)),
      // Partial sums in the sequence's device memory are joined there, on its stream.
      join_(tp_world_size, kernels::CpuBackend(), &sequence_->state().backend(),
            sequence_->state().device(), limits.cross_device, sequence_->state().stream()),
      kv_(std::move(kv)),
      events_(MakeEvents(events, *sequence_, tp_world_size, kv_, tenant_)),
      memory_bytes_(charged_bytes),
      last_active_(now) {
  MutexLock lock(&mu_);
  SettleBytesLocked();
}

bool SequenceSlot::InDeviceMemoryLocked(const RankReport& report) const {
  // On a host backend "the backend's memory" is host memory.
  return report.in_backend &&
         sequence_->state().backend().memory != kernels::MemorySpace::kHost;
}

SequenceSlot::~SequenceSlot() {
  MutexLock lock(&mu_);
  ReleaseJoinBytesLocked();
  if (limits_.memory_budget != nullptr && memory_bytes_ != 0) {
    limits_.memory_budget->Release(memory_bytes_);
  }
}

void SequenceSlot::ReleaseJoinBytesLocked() {
  if (limits_.join_budget != nullptr && join_bytes_ > 0) limits_.join_budget->Give(join_bytes_);
  join_bytes_ = 0;
}

int64_t SequenceSlot::HeldBytesLocked() const {
  const auto vectors = decision_.evicted.capacity() + decision_.evicted_indices.capacity();
  return sequence_->state().reserved_bytes() +
         static_cast<int64_t>(vectors * sizeof(int64_t));
}

void SequenceSlot::SettleBytesLocked() {
  const int64_t held = HeldBytesLocked();
  if (limits_.memory_budget != nullptr) {
    if (held > memory_bytes_) limits_.memory_budget->Take(held - memory_bytes_);
    if (held < memory_bytes_) limits_.memory_budget->Release(memory_bytes_ - held);
  }
  memory_bytes_ = held;
}

absl::Status SequenceSlot::ReserveStepLocked(int64_t step, const EvictionDecision* decision) {
  const Sequence& s = *sequence_;
  RETURN_IF_ERROR(CheckSequenceTokens(s.id(), s.prefill_len(), step, limits_.max_sequence_tokens));
  if (limits_.memory_budget == nullptr) return absl::OkStatus();
  // A full cache grows its arrays; a step that evicts more tokens than the slot's decision
  // has room for grows that (the first step of a long prefill).
  int64_t bytes = s.state().BytesToAppend();
  if (decision == &decision_) {
    const int64_t evicts = s.cache_size() + 1 - s.budget();
    const auto room = static_cast<int64_t>(
        std::min(decision_.evicted.capacity(), decision_.evicted_indices.capacity()));
    if (evicts > room) bytes += (evicts - room) * 2 * static_cast<int64_t>(sizeof(int64_t));
  }
  if (bytes <= 0) return absl::OkStatus();
  const ByteBudget* refused = nullptr;
  if (!limits_.memory_budget->TryTake(bytes, &refused)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", s.id(), "' step ", step, ": its cache of ", s.cache_size(),
        " tokens needs more memory to take the step's token: ", refused->Refusal(bytes),
        "; close sequences or raise the limit"));
  }
  memory_bytes_ += bytes;
  return absl::OkStatus();
}

absl::Status SequenceSlot::StepLocked(int64_t step, const kernels::ScoreMatrix* scores,
                                      EvictionDecision* decision,
                                      MomentumState::ScoreSpace space) {
  // After the first step of a long prefill the slot's decision holds the positions of
  // most of it; steady steps evict one, so give that memory back.
  const auto steady = static_cast<size_t>(sequence_->budget()) + 64;
  if (decision_.evicted.capacity() > 2 * steady || decision_.evicted_indices.capacity() > 2 * steady) {
    decision_.evicted = std::vector<int64_t>();
    decision_.evicted_indices = std::vector<int64_t>();
    SettleBytesLocked();
  }
  if (step == sequence_->last_step() + 1) RETURN_IF_ERROR(ReserveStepLocked(step, decision));
  absl::Status stepped = StepKvLocked(step, scores, decision, space);
  SettleBytesLocked();
  RETURN_IF_ERROR(stepped);
  if (events_ != nullptr) events_->Stepped(*decision, kv_.has_value() ? &*kv_ : nullptr);
  return absl::OkStatus();
}

absl::Status SequenceSlot::StepKvLocked(int64_t step, const kernels::ScoreMatrix* scores,
                                        EvictionDecision* decision,
                                        MomentumState::ScoreSpace space) {
  if (!kv_.has_value()) return sequence_->Step(step, scores, decision, space);
  // The new token's slot first, so that a full pool rejects the step before it happens.
  const bool in_order = step == sequence_->last_step() + 1;
  if (in_order) RETURN_IF_ERROR(kv_->AppendToken(sequence_->id(), step));
  absl::Status stepped = sequence_->Step(step, scores, decision, space);
  if (!stepped.ok()) {
    if (in_order) kv_->UndoAppend();
    return stepped;
  }
  kv_->ApplyEvictions(decision->evicted_indices, &decision->kv);
  return absl::OkStatus();
}

absl::Status SequenceSlot::Step(int64_t step, const kernels::ScoreMatrix* scores,
                                EvictionDecision* decision, absl::Time now) {
  MutexLock lock(&mu_);
  if (closed_) {
    return SequenceNotOpen(sequence_->id());
  }
  RETURN_IF_ERROR(CheckNotExportingLocked(step));
  if (tp_world_size_ != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence '", sequence_->id(), "' has ", tp_world_size_,
        " tensor-parallel ranks; step it with one report per rank"));
  }
  RETURN_IF_ERROR(StepLocked(step, scores, decision));
  last_active_ = now;
  return absl::OkStatus();
}

absl::Status SequenceSlot::Submit(const RankReport& report, DecisionWaiter waiter,
                                  absl::Time now) {
  MutexLock lock(&mu_);
  if (closed_) {
    return SequenceNotOpen(sequence_->id());
  }
  RETURN_IF_ERROR(CheckNotExportingLocked(report.step));
  if (tp_world_size_ > 1 || report.head_count != 0) return SubmitToJoinLocked(report, waiter, now);
  // Already pooled by a single-rank worker: step in place, no copy, no join.
  if (report.rank != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", sequence_->id(), "' step ", report.step, ": rank ", report.rank,
        " reported for a sequence with a single rank"));
  }
  if (InDeviceMemoryLocked(report) && report.device >= 0 && report.device != sequence_->state().device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", sequence_->id(), "' step ", report.step, ": its scores are on device ",
        report.device, " and the sequence decides on device ", sequence_->state().device(),
        "; a single-rank sequence's score region must be created without a rank"));
  }
  const absl::Time start = limits_.clock->Now();
  RETURN_IF_ERROR(StepLocked(report.step, &report.partial_sums, &decision_,
                             report.in_backend ? MomentumState::ScoreSpace::kBackend
                                               : MomentumState::ScoreSpace::kHost));
  decision_.decide_seconds = absl::ToDoubleSeconds(limits_.clock->Now() - start);
  last_active_ = now;
  waiter.sink->OnDecided(waiter.tag, absl::OkStatus(), decision_);
  return absl::OkStatus();
}

std::optional<absl::Status> SequenceSlot::TakeRejectionLocked(const RankReport& report,
                                                              bool known_rank) {
  if (!rejection_.has_value() || !known_rank) return std::nullopt;
  std::vector<bool>& told = rejection_->told;
  if (rejection_->step == report.step && !told[static_cast<size_t>(report.rank)]) {
    told[static_cast<size_t>(report.rank)] = true;
    absl::Status status = rejection_->status;
    if (std::all_of(told.begin(), told.end(), [](bool t) { return t; })) rejection_.reset();
    return status;
  }
  // This rank retries the step (or has moved on): the old rejection is not its business.
  if (rejection_->step != report.step) rejection_.reset();
  return std::nullopt;
}

absl::Status SequenceSlot::ChargeJoinLocked(const RankReport& report, int64_t bytes) {
  ByteBudget* const join_budget = limits_.join_budget;
  const ByteBudget* refused_by = nullptr;
  if (bytes == 0 || join_budget == nullptr || join_budget->TryTake(bytes, &refused_by)) {
    return absl::OkStatus();
  }
  const std::string why =
      refused_by == join_budget
          ? absl::StrCat("pending tensor-parallel steps hold ", join_budget->used(),
                         " of the daemon's ", join_budget->limit(),
                         " bytes (--max_pending_join_bytes)")
          : refused_by->Refusal(bytes);
  return absl::ResourceExhaustedError(
      absl::StrCat("sequence '", sequence_->id(), "' step ", report.step, " rank ", report.rank,
                   ": its ", bytes, " bytes of partial sums do not fit: ", why));
}

void SequenceSlot::DecideJoinedLocked(int64_t step) {
  const absl::Time start = limits_.clock->Now();
  const bool ignored = join_.any_scores_ignored();
  absl::Status status;
  if (join_.any_on_device()) {
    // Joined on the device, where the step reads them in place.
    absl::StatusOr<kernels::ScoreMatrix> joined = join_.JoinOnDevice();
    status = joined.ok() ? StepLocked(step, &*joined, &decision_,
                                      MomentumState::ScoreSpace::kBackend)
                         : absl::Status(joined.status().code(),
                                        absl::StrCat("sequence '", sequence_->id(), "' step ",
                                                     step, ": ", joined.status().message()));
  } else {
    const kernels::ScoreMatrix joined = join_.Join();
    status = StepLocked(step, &joined, &decision_);
  }
  if (status.ok()) {
    // The ranks' scores on a non-scoring step never reach Sequence::Step (the join drops
    // them), so the accounting of ignored scores happens here.
    decision_.scores_ignored = decision_.scores_ignored || ignored;
    decision_.decide_seconds = absl::ToDoubleSeconds(limits_.clock->Now() - start);
  }
  FinishJoinLocked(status);
}

absl::Status SequenceSlot::SubmitToJoinLocked(const RankReport& report, DecisionWaiter waiter,
                                              absl::Time now) {
  const Sequence& sequence = *sequence_;
  const int64_t step = sequence.last_step() + 1;
  const bool known_rank = report.rank >= 0 && report.rank < tp_world_size_;
  if (std::optional<absl::Status> rejected = TakeRejectionLocked(report, known_rank)) {
    return *rejected;
  }
  const JoinExpectation expect{sequence.id(), step, sequence.next_score_length(),
                               sequence.policy().IsScoringStep(step)};
  const kernels::ScoreMatrix& p = report.partial_sums;
  // The bytes the join copies (a report in device memory is referenced, not copied).
  const bool copied =
      expect.scoring_step && !InDeviceMemoryLocked(report) && p.layers > 0 && p.tokens > 0;
  const int64_t bytes =
      copied ? p.layers * p.tokens * static_cast<int64_t>(ScoreDtypeSize(p.dtype)) : 0;
  // Whether this report is a rank's first for the pending step: then its rejection
  // rejects the step on every rank. A stray report (another step, a rank that already
  // reported) is refused alone.
  const auto joins_pending_step = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (!known_rank || report.step != step) return false;
    const std::vector<int32_t> missing = join_.MissingRanks();
    return std::find(missing.begin(), missing.end(), report.rank) != missing.end();
  };
  if (absl::Status charged = ChargeJoinLocked(report, bytes); !charged.ok()) {
    if (joins_pending_step()) RejectStepLocked(step, report.rank, charged);
    return charged;
  }
  if (absl::Status added = join_.Add(report, expect); !added.ok()) {
    if (bytes > 0 && limits_.join_budget != nullptr) limits_.join_budget->Give(bytes);
    if (joins_pending_step()) RejectStepLocked(step, report.rank, added);
    return added;
  }
  join_bytes_ += bytes;
  last_active_ = now;
  if (join_.arrived() == 1) join_started_ = now;
  waiting_.push_back(waiter);
  if (join_.complete()) DecideJoinedLocked(step);
  return absl::OkStatus();
}

void SequenceSlot::FinishJoinLocked(const absl::Status& status) {
  for (const DecisionWaiter& w : waiting_) w.sink->OnDecided(w.tag, status, decision_);
  waiting_.clear();
  join_.Reset();
  ReleaseJoinBytesLocked();
}

void SequenceSlot::RejectStepLocked(int64_t step, int32_t rank, const absl::Status& status) {
  Rejection rejection{step, status, std::vector<bool>(static_cast<size_t>(tp_world_size_), false)};
  // The rejected rank is told by its own Submit, the waiting ones by FinishJoinLocked.
  std::fill(rejection.told.begin(), rejection.told.end(), true);
  for (int32_t missing : join_.MissingRanks()) rejection.told[static_cast<size_t>(missing)] = false;
  rejection.told[static_cast<size_t>(rank)] = true;
  FinishJoinLocked(status);
  if (!std::all_of(rejection.told.begin(), rejection.told.end(), [](bool t) { return t; })) {
    rejection_ = std::move(rejection);
  }
}

SequenceInfo SequenceSlot::SnapshotLocked(bool with_cache) const {
  const Sequence& s = *sequence_;
  SequenceInfo info;
  info.id = s.id();
  info.tenant = tenant_;
  info.score_dtype = score_dtype_;
  info.prefill_len = s.prefill_len();
  info.budget = s.budget();
  info.policy = s.policy();
  info.score_layout = s.score_layout();
  info.layers = s.layers();
  info.fold_weights = s.fold_weights();
  info.decision_encoding = s.decision_encoding();
  info.tp_world_size = tp_world_size_;
  info.last_step = s.last_step();
  info.cache_size = s.cache_size();
  info.next_needs_scores = s.next_needs_scores();
  info.ranks_reported = join_.arrived();
  info.memory_bytes = memory_bytes_;
  info.stats = s.stats();
  info.last_active = last_active_;
  if (with_cache) {
    const auto positions = s.state().positions();
    const auto momentum = s.state().momentum();
    info.positions.assign(positions.begin(), positions.end());
    info.momentum.assign(momentum.begin(), momentum.end());
    if (kv_.has_value()) info.kv_slots = kv_->Slots();
  }
  return info;
}

absl::StatusOr<SequenceInfo> SequenceSlot::Snapshot(bool with_cache, absl::Time touch) {
  MutexLock lock(&mu_);
  if (closed_) {
    return SequenceNotOpen(sequence_->id());
  }
  last_active_ = touch;
  return SnapshotLocked(with_cache);
}

SequenceInfo SequenceSlot::Peek() const {
  ReaderMutexLock lock(&mu_);
  return SnapshotLocked(/*with_cache=*/false);
}

SequenceRecord SequenceSlot::Record() const {
  ReaderMutexLock lock(&mu_);
  const Sequence& s = *sequence_;
  SequenceRecord record;
  record.id = s.id();
  record.tenant = tenant_;
  record.budget = s.budget();
  record.tp_world_size = tp_world_size_;
  record.score_dtype = score_dtype_;
  SequenceOptions& o = record.options;
  o.prefill_len = s.prefill_len();
  o.budget = BudgetSpec::Tokens(s.budget());
  o.policy = s.policy();  // resolved, the preset kept as its label
  o.score_layout = s.score_layout();
  o.layers = s.layers();
  o.decision_encoding = s.decision_encoding();
  o.resume = s.Progress();
  if (kv_.has_value()) record.kv = kv_->State();
  return record;
}

int64_t SequenceSlot::cache_size() const {
  ReaderMutexLock lock(&mu_);
  return sequence_->cache_size();
}

bool SequenceSlot::closed() const {
  ReaderMutexLock lock(&mu_);
  return closed_;
}

SequenceInfo SequenceSlot::Close(const absl::Status& why, absl::string_view reason) {
  MutexLock lock(&mu_);
  if (events_ != nullptr && !closed_) events_->Closed(reason);
  closed_ = true;
  export_id_ = 0;
  rejection_.reset();
  FinishJoinLocked(why);
  return SnapshotLocked(/*with_cache=*/false);
}

void SequenceSlot::PublishOpened() {
  MutexLock lock(&mu_);
  if (events_ != nullptr) events_->Opened();
}

void SequenceSlot::ContributeKvSnapshot() {
  MutexLock lock(&mu_);
  if (events_ != nullptr) events_->ContributeToSnapshots();
}

bool SequenceSlot::AbortJoinStartedBefore(absl::Time cutoff, absl::Duration timeout) {
  MutexLock lock(&mu_);
  if (closed_ || join_.arrived() == 0 || join_started_ > cutoff) return false;
  FinishJoinLocked(absl::DeadlineExceededError(absl::StrCat(
      "sequence '", sequence_->id(), "' step ", sequence_->last_step() + 1, ": rank(s) ",
      absl::StrJoin(join_.MissingRanks(), ", "), " did not report within ",
      absl::FormatDuration(timeout), "; the step was abandoned and may be sent again")));
  return true;
}

void SequenceSlot::AbandonPendingStep(const absl::Status& why) {
  MutexLock lock(&mu_);
  if (join_.arrived() > 0) FinishJoinLocked(why);
}

bool SequenceSlot::IdleSince(absl::Time cutoff) {
  // A slot whose lock is busy is being stepped right now: not idle. TryLock keeps a long
  // step from stalling the reclaimer's scan of the registry.
  if (!mu_.TryLock()) return false;
  const bool idle = last_active_ <= cutoff && export_id_ == 0;
  mu_.Unlock();
  return idle;
}

absl::Status SequenceSlot::CheckNotExportingLocked(int64_t step) const {
  if (export_id_ == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "sequence '", sequence_->id(), "' step ", step, ": the sequence is being handed off "
      "to another kvcached (export ", export_id_, "); send its steps to the daemon that "
      "imports it, or again here if the hand-off fails"));
}

absl::StatusOr<SequenceRecord> SequenceSlot::BeginExport(uint64_t export_id) {
  {
    MutexLock lock(&mu_);
    if (closed_) return SequenceNotOpen(sequence_->id());
    if (export_id_ != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence '", sequence_->id(), "' is already being handed off (export ", export_id_,
          ")"));
    }
    if (join_.arrived() > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence '", sequence_->id(), "' has a pending tensor-parallel step ",
          sequence_->last_step() + 1, " (", join_.arrived(), " of ", tp_world_size_,
          " ranks reported); hand it off between steps"));
    }
    export_id_ = export_id;
  }
  // Frozen: nothing changes it until EndExport, so the record taken now stays true.
  return Record();
}

bool SequenceSlot::EndExport(uint64_t export_id) {
  MutexLock lock(&mu_);
  if (export_id_ != export_id) return false;
  export_id_ = 0;
  last_active_ = limits_.clock->Now();  // the reclaimer's idle time starts again
  return true;
}

uint64_t SequenceSlot::export_id() const {
  ReaderMutexLock lock(&mu_);
  return export_id_;
}

}  // namespace kvcm

#include "cache_manager/sequence_table.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache_manager/status_macros.h"

namespace kvcm {
namespace {

constexpr size_t kMaxIdLength = 256;

void RunCallbacks(std::vector<RankDecisionCallback>& callbacks,
                  const absl::StatusOr<EvictionDecision>& result) {
  for (RankDecisionCallback& callback : callbacks) std::move(callback)(result);
}

}  // namespace

SequenceTable::SequenceTable(SequenceTableOptions options)
    : options_(options), clock_(options.clock != nullptr ? options.clock : Clock::Real()) {}

SequenceTable::~SequenceTable() {
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries;
  {
    MutexLock lock(&mu_);
    entries.swap(entries_);
  }
  for (auto& [id, entry] : entries) {
    std::vector<RankDecisionCallback> callbacks = Abandon(*entry);
    RunCallbacks(callbacks, absl::AbortedError(
                                absl::StrCat("sequence '", id, "': the table was destroyed")));
  }
}

std::shared_ptr<SequenceTable::Entry> SequenceTable::Find(absl::string_view id) const {
  ReaderMutexLock lock(&mu_);
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : it->second;
}

absl::Status SequenceTable::NotFound(absl::string_view id) const {
  return absl::NotFoundError(absl::StrCat("sequence '", id, "' is not open"));
}

absl::StatusOr<SequenceInfo> SequenceTable::Open(std::string id,
                                                 const SequenceOptions& options,
                                                 int32_t tp_world_size,
                                                 kernels::ScoreDtype score_dtype) {
  if (id.empty() || id.size() > kMaxIdLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence id must be 1 to ", kMaxIdLength, " bytes (got ", id.size(), ")"));
  }
  if (tp_world_size < 1 || tp_world_size > options_.max_tp_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence '", id, "': tp_world_size is ", tp_world_size,
                     "; it must be 1 to ", options_.max_tp_world_size));
  }
  // Build outside the table lock: the prefill cache of a long context takes a moment.
  ASSIGN_OR_RETURN(std::unique_ptr<Sequence> sequence, Sequence::Create(id, options));
  auto entry = std::make_shared<Entry>(std::move(sequence), tp_world_size, score_dtype);
  SequenceInfo info;
  {
    MutexLock entry_lock(&entry->mu);
    if (options_.kv_pools != nullptr) {
      ASSIGN_OR_RETURN(SequenceKv kv,
                       SequenceKv::Lease(*options_.kv_pools, options.prefill_len, id));
      entry->kv.emplace(std::move(kv));
    }
    entry->last_active = clock_->Now();
    info = Snapshot(*entry, /*with_cache=*/false);
  }
  MutexLock lock(&mu_);
  if (entries_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence '", id, "' is already open"));
  }
  if (static_cast<int64_t>(entries_.size()) >= options_.max_sequences) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", id, "': the table already holds the maximum of ",
        options_.max_sequences, " sequences; close some first"));
  }
  entries_.emplace(std::move(id), std::move(entry));
  return info;
}

std::vector<RankDecisionCallback> SequenceTable::Abandon(Entry& entry) {
  MutexLock lock(&entry.mu);
  entry.closed = true;
  entry.join.Reset();
  return std::exchange(entry.waiting, {});
}

absl::StatusOr<SequenceInfo> SequenceTable::Close(absl::string_view id) {
  std::shared_ptr<Entry> entry;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return NotFound(id);
    entry = std::move(it->second);
    entries_.erase(it);
  }
  SequenceInfo last;
  {
    MutexLock lock(&entry->mu);
    last = Snapshot(*entry, /*with_cache=*/false);
  }
  std::vector<RankDecisionCallback> callbacks = Abandon(*entry);
  RunCallbacks(callbacks, absl::AbortedError(absl::StrCat(
                              "sequence '", id, "' was closed while its step waited for ranks")));
  return last;
}

absl::StatusOr<kernels::ScoreDtype> SequenceTable::DefaultScoreDtype(absl::string_view id) const {
  std::shared_ptr<Entry> entry = Find(id);
  if (entry == nullptr) return NotFound(id);
  return entry->score_dtype;
}

absl::Status SequenceTable::Step(absl::string_view id, int64_t step,
                                 const kernels::ScoreMatrix* scores,
                                 EvictionDecision* decision) {
  std::shared_ptr<Entry> entry = Find(id);
  if (entry == nullptr) return NotFound(id);
  MutexLock lock(&entry->mu);
  if (entry->closed) return NotFound(id);
  if (entry->join.world_size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence '", id, "' has ", entry->join.world_size(),
        " tensor-parallel ranks; step it with one report per rank"));
  }
  RETURN_IF_ERROR(StepEntry(*entry, step, scores, decision));
  entry->last_active = clock_->Now();
  return absl::OkStatus();
}

absl::Status SequenceTable::StepEntry(Entry& entry, int64_t step,
                                      const kernels::ScoreMatrix* scores,
                                      EvictionDecision* decision) {
  if (!entry.kv.has_value()) return entry.sequence->Step(step, scores, decision);
  // The new token's slot first, so that a full pool rejects the step before it happens.
  if (step == entry.sequence->last_step() + 1) {
    RETURN_IF_ERROR(entry.kv->AppendToken(entry.sequence->id(), step));
  }
  absl::Status stepped = entry.sequence->Step(step, scores, decision);
  if (!stepped.ok()) {
    if (step == entry.sequence->last_step() + 1) entry.kv->UndoAppend();
    return stepped;
  }
  entry.kv->ApplyDecision(decision);
  return absl::OkStatus();
}

absl::Status SequenceTable::SubmitRankReport(absl::string_view id, const RankReport& report,
                                             RankDecisionCallback on_decided) {
  std::shared_ptr<Entry> entry = Find(id);
  if (entry == nullptr) return NotFound(id);
  std::vector<RankDecisionCallback> callbacks;
  absl::StatusOr<EvictionDecision> result;
  {
    MutexLock lock(&entry->mu);
    if (entry->closed) return NotFound(id);
    if (entry->join.world_size() == 1 && report.head_count == 0) {
      // Already pooled by a single-rank worker: step in place, no copy, no join.
      if (report.rank != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", id, "' step ", report.step, ": rank ", report.rank,
            " reported for a sequence with a single rank"));
      }
      RETURN_IF_ERROR(StepEntry(*entry, report.step, &report.partial_sums, &entry->decision));
      entry->last_active = clock_->Now();
      result = entry->decision;
    } else {
      RETURN_IF_ERROR(AddToJoin(*entry, id, report, std::move(on_decided), &result, &callbacks));
      if (callbacks.empty()) return absl::OkStatus();  // waiting for the other ranks
    }
  }
  if (callbacks.empty()) {
    std::move(on_decided)(result);
  } else {
    RunCallbacks(callbacks, result);
  }
  return absl::OkStatus();
}

absl::Status SequenceTable::AddToJoin(Entry& entry, absl::string_view id, const RankReport& report,
                                      RankDecisionCallback on_decided,
                                      absl::StatusOr<EvictionDecision>* result,
                                      std::vector<RankDecisionCallback>* callbacks) {
  {
    Sequence& sequence = *entry.sequence;
    const int64_t step = sequence.last_step() + 1;
    const JoinExpectation expect{id, step, sequence.next_score_length(),
                                 sequence.policy().IsScoringStep(step)};
    RETURN_IF_ERROR(entry.join.Add(report, expect));
    entry.last_active = clock_->Now();
    if (entry.join.arrived() == 1) entry.join_started = entry.last_active;
    entry.waiting.push_back(std::move(on_decided));
    if (!entry.join.complete()) return absl::OkStatus();

    const kernels::ScoreMatrix joined = entry.join.Join();
    const bool ignored = entry.join.any_scores_ignored();
    absl::Status status = StepEntry(entry, step, &joined, &entry.decision);
    if (status.ok()) {
      // The ranks' scores on a non-scoring step never reach Sequence::Step (the join drops
      // them), so the accounting of ignored scores happens here.
      entry.decision.scores_ignored = entry.decision.scores_ignored || ignored;
      *result = entry.decision;
    } else {
      *result = status;
    }
    entry.join.Reset();
    *callbacks = std::exchange(entry.waiting, {});
  }
  return absl::OkStatus();
}

SequenceInfo SequenceTable::Snapshot(const Entry& entry, bool with_cache) {
  const Sequence& s = *entry.sequence;
  SequenceInfo info;
  info.id = s.id();
  info.score_dtype = entry.score_dtype;
  info.prefill_len = s.prefill_len();
  info.budget = s.budget();
  info.policy = s.policy();
  info.tp_world_size = entry.join.world_size();
  info.last_step = s.last_step();
  info.cache_size = s.cache_size();
  info.next_needs_scores = s.next_needs_scores();
  info.ranks_reported = entry.join.arrived();
  info.stats = s.stats();
  info.last_active = entry.last_active;
  if (with_cache) {
    const auto positions = s.state().positions();
    const auto momentum = s.state().momentum();
    info.positions.assign(positions.begin(), positions.end());
    info.momentum.assign(momentum.begin(), momentum.end());
    if (entry.kv.has_value()) info.kv_slots = entry.kv->Slots();
  }
  return info;
}

absl::StatusOr<SequenceInfo> SequenceTable::Inspect(absl::string_view id,
                                                    bool with_cache) const {
  std::shared_ptr<Entry> entry = Find(id);
  if (entry == nullptr) return NotFound(id);
  MutexLock lock(&entry->mu);
  if (entry->closed) return NotFound(id);
  entry->last_active = clock_->Now();
  return Snapshot(*entry, with_cache);
}

std::vector<SequenceInfo> SequenceTable::List() const {
  std::vector<std::shared_ptr<Entry>> entries;
  {
    ReaderMutexLock lock(&mu_);
    entries.reserve(entries_.size());
    for (const auto& [id, entry] : entries_) entries.push_back(entry);
  }
  std::vector<SequenceInfo> out;
  out.reserve(entries.size());
  for (const auto& entry : entries) {
    MutexLock lock(&entry->mu);
    if (!entry->closed) out.push_back(Snapshot(*entry, /*with_cache=*/false));
  }
  return out;
}

SequenceTableTotals SequenceTable::Totals() const {
  std::vector<std::shared_ptr<Entry>> entries;
  {
    ReaderMutexLock lock(&mu_);
    entries.reserve(entries_.size());
    for (const auto& [id, entry] : entries_) entries.push_back(entry);
  }
  SequenceTableTotals totals;
  for (const auto& entry : entries) {
    MutexLock lock(&entry->mu);
    if (entry->closed) continue;
    ++totals.open_sequences;
    totals.cached_tokens += entry->sequence->cache_size();
  }
  return totals;
}

int64_t SequenceTable::AbortStaleJoins(absl::Duration timeout) {
  std::vector<std::shared_ptr<Entry>> entries;
  {
    ReaderMutexLock lock(&mu_);
    for (const auto& [id, entry] : entries_) entries.push_back(entry);
  }
  const absl::Time cutoff = clock_->Now() - timeout;
  int64_t aborted = 0;
  for (const auto& entry : entries) {
    std::vector<RankDecisionCallback> callbacks;
    std::string why;
    {
      MutexLock lock(&entry->mu);
      if (entry->closed || entry->join.arrived() == 0 || entry->join_started > cutoff) continue;
      why = absl::StrCat("sequence '", entry->sequence->id(), "' step ",
                         entry->sequence->last_step() + 1, ": rank(s) ",
                         absl::StrJoin(entry->join.MissingRanks(), ", "), " did not report within ",
                         absl::FormatDuration(timeout),
                         "; the step was abandoned and may be sent again");
      entry->join.Reset();
      callbacks = std::exchange(entry->waiting, {});
    }
    RunCallbacks(callbacks, absl::DeadlineExceededError(why));
    ++aborted;
  }
  return aborted;
}

std::vector<SequenceInfo> SequenceTable::ReclaimIdle(absl::Duration idle_timeout) {
  const absl::Time cutoff = clock_->Now() - idle_timeout;
  std::vector<std::pair<std::string, std::shared_ptr<Entry>>> idle;
  {
    MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      // An entry whose lock is busy is being stepped right now: not idle. TryLock keeps a
      // long step from stalling the whole table behind this scan.
      bool expired = false;
      Entry& entry = *it->second;
      if (entry.mu.TryLock()) {
        expired = entry.last_active <= cutoff;
        entry.mu.Unlock();
      }
      if (expired) {
        idle.emplace_back(it->first, std::move(it->second));
        entries_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  std::vector<SequenceInfo> reclaimed;
  reclaimed.reserve(idle.size());
  for (auto& [id, entry] : idle) {
    {
      MutexLock lock(&entry->mu);
      reclaimed.push_back(Snapshot(*entry, /*with_cache=*/false));
    }
    std::vector<RankDecisionCallback> callbacks = Abandon(*entry);
    RunCallbacks(callbacks,
                 absl::AbortedError(absl::StrCat("sequence '", id,
                                                 "' was reclaimed after idling while its "
                                                 "step waited for ranks")));
  }
  return reclaimed;
}

}  // namespace kvcm

#include "cache_manager/table/sequence_table.h"

#include <algorithm>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/table/sequence_rules.h"

namespace kvcm {
namespace {

// Adapts a callback to a DecisionSink; deletes itself once called.
class CallbackSink final : public DecisionSink {
 public:
  explicit CallbackSink(RankDecisionCallback callback) : callback_(std::move(callback)) {}
  void OnDecided(int64_t /*tag*/, const absl::Status& status,
                 const EvictionDecision& decision) override {
    if (status.ok()) {
      std::move(callback_)(decision);
    } else {
      std::move(callback_)(status);
    }
    delete this;
  }
  // Frees a sink that was never handed to a slot (its report was refused).
  void Discard() { delete this; }

 private:
  ~CallbackSink() = default;
  RankDecisionCallback callback_;
};

}  // namespace

absl::Status CheckSequenceId(absl::string_view id) {
  if (id.empty() || id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence id must be 1 to ", kMaxSequenceIdBytes, " bytes (got ", id.size(), ")"));
  }
  return absl::OkStatus();
}

SequenceTable::SequenceTable(SequenceTableOptions options)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      memory_budget_(options.memory_limit_bytes, "--memory_limit_bytes"),
      join_budget_(options.max_pending_join_bytes, "--max_pending_join_bytes",
                   &memory_budget_) {}

SequenceTable::~SequenceTable() {
  absl::flat_hash_map<std::string, std::shared_ptr<SequenceSlot>> slots;
  {
    MutexLock lock(&mu_);
    slots.swap(slots_);
  }
  for (auto& [key, slot] : slots) {
    if (slot == nullptr) continue;
    slot->Close(absl::AbortedError(absl::StrCat("sequence '", slot->Peek().id,
                                                "': the table was destroyed")),
                "shutdown");
  }
}

SequenceKey::SequenceKey(absl::string_view tenant, absl::string_view id) {
  const absl::AlphaNum size(tenant.size());  // formatted on the stack
  bytes_.reserve(size.size() + 1 + tenant.size() + id.size());
  bytes_.insert(bytes_.end(), size.data(), size.data() + size.size());
  bytes_.push_back(':');
  bytes_.insert(bytes_.end(), tenant.begin(), tenant.end());
  bytes_.insert(bytes_.end(), id.begin(), id.end());
}

ByteBudget* SequenceTable::TenantBudgetLocked(absl::string_view tenant) {
  if (options_.tenant_memory_limit_bytes <= 0) return &memory_budget_;
  TenantUsage& usage = tenants_[tenant];
  if (usage.memory == nullptr) {
    usage.memory = std::make_unique<ByteBudget>(
        options_.tenant_memory_limit_bytes, "--tenant_memory_share", &memory_budget_,
        absl::StrCat("tenant '", tenant, "'"));
  }
  return usage.memory.get();
}

void SequenceTable::ForgetLocked(absl::string_view tenant) {
  auto it = tenants_.find(tenant);
  if (it != tenants_.end()) --it->second.sequences;
}

std::shared_ptr<SequenceSlot> SequenceTable::Find(absl::string_view tenant,
                                                  absl::string_view id) const {
  const SequenceKey key(tenant, id);
  ReaderMutexLock lock(&mu_);
  auto it = slots_.find(key.view());
  return it == slots_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<SequenceSlot>> SequenceTable::AllSlots() const {
  std::vector<std::shared_ptr<SequenceSlot>> slots;
  ReaderMutexLock lock(&mu_);
  slots.reserve(slots_.size());
  for (const auto& [id, slot] : slots_) {
    if (slot != nullptr) slots.push_back(slot);
  }
  return slots;
}

absl::Status SequenceTable::NotFound(absl::string_view id) const {
  // A too long id is never open: say so without echoing it.
  RETURN_IF_ERROR(CheckSequenceId(id));
  return SequenceNotOpen(id);
}

void SequenceTable::Erase(absl::string_view tenant, absl::string_view key,
                          const SequenceSlot* slot) {
  MutexLock lock(&mu_);
  auto it = slots_.find(key);
  if (it != slots_.end() && it->second.get() == slot) {
    slots_.erase(it);
    ForgetLocked(tenant);
  }
}

SequenceOptions SequenceTable::WithEngine(const SequenceOptions& options) const {
  if (options.backend != nullptr || options_.engine_backend == nullptr) return options;
  SequenceOptions out = options;
  out.backend = options_.engine_backend;
  out.device = options_.engine_device;
  return out;
}

absl::StatusOr<SequenceInfo> SequenceTable::Open(std::string id,
                                                 const SequenceOptions& options,
                                                 int32_t tp_world_size,
                                                 kernels::ScoreDtype score_dtype,
                                                 absl::string_view tenant) {
  return OpenWithKv(std::move(id), options, tp_world_size, score_dtype, nullptr, KvFrom::kFresh,
                    tenant);
}

absl::Status SequenceTable::CheckRecord(const SequenceRecord& record) const {
  absl::StatusOr<int64_t> budget = ResolveBudget(record.options.prefill_len, record.options.budget);
  if (budget.ok() && *budget != record.budget) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", record.id, "': its recorded budget ", record.budget, " resolves to ",
        *budget));
  }
  if (record.kv.empty() != (options_.kv_pools == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", record.id, "': it was recorded ", record.kv.empty() ? "without" : "with",
        " KV leases, and this table has ",
        options_.kv_pools == nullptr ? "no KV pools" : "KV pools"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> SequenceTable::Restore(const SequenceRecord& record) {
  RETURN_IF_ERROR(CheckRecord(record));
  return OpenWithKv(record.id, record.options, record.tp_world_size, record.score_dtype,
                    record.kv.empty() ? nullptr : &record.kv, KvFrom::kRecorded, record.tenant);
}

absl::StatusOr<SequenceTable::PendingImport> SequenceTable::PrepareImport(
    const SequenceRecord& record) {
  RETURN_IF_ERROR(CheckRecord(record));
  if (!record.options.resume.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence '", record.id, "': the record carries no progress"));
  }
  return Build(record.id, record.options, record.tp_world_size, record.score_dtype,
               record.kv.empty() ? nullptr : &record.kv, KvFrom::kShapedLike, record.tenant);
}

SequenceInfo SequenceTable::CommitImport(PendingImport pending) {
  return Install(std::move(pending.reservation_), std::move(pending.slot_));
}

absl::StatusOr<SequenceTable::Exported> SequenceTable::BeginExport(absl::string_view tenant,
                                                                   absl::string_view id,
                                                                   uint64_t export_id) {
  std::shared_ptr<SequenceSlot> slot = Find(tenant, id);
  if (slot == nullptr) return NotFound(id);
  ASSIGN_OR_RETURN(SequenceRecord record, slot->BeginExport(export_id));
  return Exported{std::move(record), std::move(slot)};
}

absl::StatusOr<SequenceInfo> SequenceTable::CommitExport(absl::string_view tenant,
                                                         absl::string_view id,
                                                         uint64_t export_id) {
  std::vector<std::pair<std::string, std::shared_ptr<SequenceSlot>>> removed;
  {
    const SequenceKey key(tenant, id);
    MutexLock lock(&mu_);
    auto it = slots_.find(key.view());
    // The slot's export id is read under the registry lock: EndExport and Close, which
    // change it, come only through this table.
    if (it == slots_.end() || it->second == nullptr || it->second->export_id() != export_id) {
      return NotFound(id);
    }
    if (options_.kv_events != nullptr) in_transit_.push_back(it->second);
    removed.emplace_back(std::string(id), std::move(it->second));
    slots_.erase(it);
    ForgetLocked(tenant);
  }
  return std::move(
      CloseRemoved(std::move(removed), "was handed off to another kvcached", "handed_off")
          .front());
}

absl::Status SequenceTable::AbortExport(absl::string_view tenant, absl::string_view id,
                                        uint64_t export_id) {
  const std::shared_ptr<SequenceSlot> slot = Find(tenant, id);
  if (slot == nullptr || !slot->EndExport(export_id)) return NotFound(id);
  return absl::OkStatus();
}

std::vector<SequenceRecord> SequenceTable::Records() const {
  std::vector<SequenceRecord> records;
  for (const auto& slot : AllSlots()) {
    if (!slot->closed()) records.push_back(slot->Record());
  }
  return records;
}

SequenceTable::OpenReservation::~OpenReservation() {
  if (table_ == nullptr) return;  // committed, or moved from
  if (bytes_ > 0) budget_->Give(bytes_);
  table_->Erase(tenant_, key_, nullptr);
}

SequenceTable::OpenReservation::OpenReservation(OpenReservation&& other) noexcept
    : table_(std::exchange(other.table_, nullptr)),
      tenant_(std::move(other.tenant_)),
      key_(std::move(other.key_)),
      budget_(other.budget_),
      bytes_(other.bytes_) {}

absl::Status SequenceTable::CheckOpen(absl::string_view id, const SequenceOptions& options,
                                      int32_t tp_world_size) const {
  RETURN_IF_ERROR(CheckSequenceId(id));
  if (tp_world_size < 1 || tp_world_size > options_.max_tp_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence '", id, "': tp_world_size is ", tp_world_size,
                     "; it must be 1 to ", options_.max_tp_world_size));
  }
  // A resumed sequence has taken last_step tokens of its life already.
  const int64_t taken = options.resume.has_value() ? options.resume->last_step : 0;
  return CheckSequenceTokens(id, options.prefill_len, taken, options_.max_sequence_tokens);
}

absl::StatusOr<SequenceTable::OpenReservation> SequenceTable::Reserve(
    absl::string_view tenant, absl::string_view id, int64_t state_bytes,
    int64_t prefill_len) {
  // The id first: a duplicate or a full table is refused without allocating the engine
  // state or leasing KV memory.
  const SequenceKey key(tenant, id);
  OpenReservation reservation;
  {
    MutexLock lock(&mu_);
    if (slots_.contains(key.view())) {
      return absl::AlreadyExistsError(absl::StrCat("sequence '", id, "' is already open"));
    }
    if (static_cast<int64_t>(slots_.size()) >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence '", id, "': the table already holds the maximum of ",
          options_.max_sequences, " sequences; close some first"));
    }
    auto usage = tenants_.find(tenant);
    const int64_t held = usage != tenants_.end() ? usage->second.sequences : 0;
    if (options_.tenant_max_sequences > 0 && held >= options_.tenant_max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence '", id, "': tenant '", tenant, "' already holds its maximum of ",
          options_.tenant_max_sequences, " sequences (--tenant_max_sequences): 1 asked, 0 "
          "left; close some first"));
    }
    reservation.budget_ = TenantBudgetLocked(tenant);
    ++tenants_[tenant].sequences;
    slots_.emplace(key.str(), nullptr);
  }
  reservation.table_ = this;
  reservation.tenant_ = std::string(tenant);
  reservation.key_ = key.str();
  // Then the engine state's memory, before it is allocated, so that a refused Open
  // allocates nothing. It is sized by the cache the sequence holds now; it grows with the
  // cache, each step taking what it needs (SequenceSlot).
  const ByteBudget* refused = nullptr;
  if (!reservation.budget_->TryTake(state_bytes, &refused)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", id, "': its prefill of ", prefill_len, " tokens needs ", state_bytes,
        " bytes of engine state: ", refused->Refusal(state_bytes),
        "; close sequences or raise the limit"));
  }
  reservation.bytes_ = state_bytes;
  return reservation;
}

absl::StatusOr<std::unique_ptr<Sequence>> SequenceTable::BuildSequence(
    absl::string_view id, const SequenceOptions& engine_options, int64_t state_bytes) const {
  absl::StatusOr<std::unique_ptr<Sequence>> sequence;
  try {
    sequence = Sequence::Create(std::string(id), engine_options);
  } catch (const std::bad_alloc&) {
    // The limit is above what the machine has: refuse this one rather than die.
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence '", id, "': the daemon could not allocate the ", state_bytes,
                     " bytes of its engine state (--memory_limit_bytes is above what the "
                     "machine can give)"));
  }
  if (sequence.ok() && SampledForDiagnostics(options_.diagnostics, std::string_view(id.data(), id.size()))) {
    (*sequence)->EnableDiagnostics(options_.diagnostics.every);
  }
  return sequence;
}

absl::StatusOr<std::optional<SequenceKv>> SequenceTable::LeaseKv(
    absl::string_view id, int64_t cache_size, const std::vector<BlockLeaseState>* kv_state,
    KvFrom kv_from) const {
  if (options_.kv_pools == nullptr) return std::optional<SequenceKv>();
  absl::StatusOr<SequenceKv> lease;
  switch (kv_from) {
    case KvFrom::kFresh:
      lease = SequenceKv::Lease(*options_.kv_pools, cache_size, id);
      break;
    case KvFrom::kRecorded:
      lease = SequenceKv::Restore(*options_.kv_pools, *kv_state, cache_size, id);
      break;
    case KvFrom::kShapedLike:
      lease = SequenceKv::LeaseLike(*options_.kv_pools, *kv_state, cache_size, id);
      break;
  }
  if (!lease.ok()) return lease.status();
  return std::optional<SequenceKv>(*std::move(lease));
}

SequenceInfo SequenceTable::Install(OpenReservation reservation,
                                    std::shared_ptr<SequenceSlot> slot) {
  SequenceInfo info = slot->Peek();
  if (options_.kv_events != nullptr) {
    // Opened before the slot is findable (so before any of its steps), while snapshots
    // list it as opening (kv_events.h).
    {
      MutexLock lock(&mu_);
      in_transit_.push_back(slot);
    }
    slot->PublishOpened();
  }
  MutexLock lock(&mu_);
  if (options_.kv_events != nullptr) {
    in_transit_.erase(std::find(in_transit_.begin(), in_transit_.end(), slot));
  }
  slots_[reservation.key_] = std::move(slot);
  reservation.table_ = nullptr;  // the slot now owns the id and the bytes
  return info;
}

absl::StatusOr<SequenceInfo> SequenceTable::OpenWithKv(std::string id,
                                                       const SequenceOptions& options,
                                                       int32_t tp_world_size,
                                                       kernels::ScoreDtype score_dtype,
                                                       const std::vector<BlockLeaseState>* kv,
                                                       KvFrom kv_from, absl::string_view tenant) {
  ASSIGN_OR_RETURN(PendingImport built,
                   Build(std::move(id), options, tp_world_size, score_dtype, kv, kv_from, tenant));
  return Install(std::move(built.reservation_), std::move(built.slot_));
}

absl::StatusOr<SequenceTable::PendingImport> SequenceTable::Build(
    std::string id, const SequenceOptions& options, int32_t tp_world_size,
    kernels::ScoreDtype score_dtype, const std::vector<BlockLeaseState>* kv_state,
    KvFrom kv_from, absl::string_view tenant) {
  RETURN_IF_ERROR(CheckOpen(id, options, tp_world_size));
  const SequenceOptions engine_options = WithEngine(options);
  const kernels::KernelBackend& backend =
      engine_options.backend != nullptr ? *engine_options.backend : kernels::CpuBackend();
  // A resumed sequence holds its cache, not its prefill.
  const int64_t held_tokens =
      options.resume.has_value() ? static_cast<int64_t>(options.resume->positions.size())
                                 : options.prefill_len;
  const int64_t state_bytes = MomentumState::BytesFor(held_tokens + 1, backend);
  absl::StatusOr<OpenReservation> reservation =
      Reserve(tenant, id, state_bytes, options.prefill_len);
  if (!reservation.ok()) return reservation.status();
  // Built outside the registry lock: the prefill cache of a long context takes a moment.
  // Any refusal from here on gives the reservation back as it goes out of scope.
  absl::StatusOr<std::unique_ptr<Sequence>> sequence =
      BuildSequence(id, engine_options, state_bytes);
  if (!sequence.ok()) return sequence.status();
  absl::StatusOr<std::optional<SequenceKv>> kv = LeaseKv(id, (*sequence)->cache_size(), kv_state, kv_from);
  if (!kv.ok()) return kv.status();
  const SlotLimits limits{&join_budget_, reservation->budget_, options_.max_sequence_tokens,
                          options_.cross_device_joiner, clock_};
  // Only an import reads its leases back (to copy blocks into them): a plain Open does
  // not copy its prefill's slot table for nothing.
  std::vector<BlockLeaseState> kv_here;
  if (kv_from == KvFrom::kShapedLike && kv->has_value()) kv_here = (*kv)->State();
  auto slot = std::make_shared<SequenceSlot>(*std::move(sequence), tp_world_size, score_dtype,
                                             *std::move(kv), limits, state_bytes, clock_->Now(),
                                             options_.kv_events, std::string(tenant));
  reservation->bytes_ = 0;  // the slot holds them now, and gives them back when destroyed
  PendingImport built(*std::move(reservation), std::move(slot));
  built.kv_ = std::move(kv_here);
  return built;
}

absl::StatusOr<SequenceInfo> SequenceTable::Close(absl::string_view id,
                                                  absl::string_view tenant) {
  std::vector<std::pair<std::string, std::shared_ptr<SequenceSlot>>> removed;
  {
    const SequenceKey key(tenant, id);
    MutexLock lock(&mu_);
    auto it = slots_.find(key.view());
    if (it == slots_.end() || it->second == nullptr) return NotFound(id);
    if (options_.kv_events != nullptr) in_transit_.push_back(it->second);
    removed.emplace_back(std::string(id), std::move(it->second));
    slots_.erase(it);
    ForgetLocked(tenant);
  }
  return std::move(CloseRemoved(std::move(removed), "was closed", "client").front());
}

std::vector<SequenceInfo> SequenceTable::CloseRemoved(
    std::vector<std::pair<std::string, std::shared_ptr<SequenceSlot>>> removed,
    absl::string_view message, absl::string_view reason) {
  std::vector<SequenceInfo> last;
  last.reserve(removed.size());
  for (auto& [id, slot] : removed) {
    last.push_back(slot->Close(
        absl::AbortedError(absl::StrCat("sequence '", id, "' ", message,
                                        " while its step waited for ranks")),
        reason));
  }
  if (options_.kv_events != nullptr && !removed.empty()) {
    MutexLock lock(&mu_);
    for (auto& [id, slot] : removed) {
      in_transit_.erase(std::find(in_transit_.begin(), in_transit_.end(), slot));
    }
  }
  return last;
}

absl::StatusOr<std::unique_ptr<KvEventSubscription>> SequenceTable::SubscribeKvEvents(
    uint64_t after_event_id, absl::string_view daemon_run, std::string tenant) {
  KvEventLog* const log = options_.kv_events;
  if (log == nullptr) {
    return absl::FailedPreconditionError("the sequence table keeps no KV events");
  }
  std::unique_ptr<KvEventSubscription> subscription;
  std::vector<std::shared_ptr<SequenceSlot>> open;
  {
    // Under the registry lock, the slots listed include every sequence open at the
    // snapshot's as_of (kv_events.h).
    ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(subscription,
                     log->Subscribe(after_event_id, daemon_run, std::move(tenant)));
    if (!subscription->snapshot_pending()) return subscription;
    open.reserve(slots_.size() + in_transit_.size());
    for (const auto& [id, slot] : slots_) {
      if (slot != nullptr) open.push_back(slot);
    }
    open.insert(open.end(), in_transit_.begin(), in_transit_.end());
  }
  for (const std::shared_ptr<SequenceSlot>& slot : open) slot->ContributeKvSnapshot();
  subscription->CompleteSnapshot();
  return subscription;
}

absl::StatusOr<kernels::ScoreDtype> SequenceTable::DefaultScoreDtype(
    absl::string_view id, absl::string_view tenant) const {
  std::shared_ptr<SequenceSlot> slot = Find(tenant, id);
  if (slot == nullptr) return NotFound(id);
  return slot->score_dtype();
}

absl::Status SequenceTable::Step(absl::string_view id, int64_t step,
                                 const kernels::ScoreMatrix* scores,
                                 EvictionDecision* decision, absl::string_view tenant) {
  std::shared_ptr<SequenceSlot> slot = Find(tenant, id);
  if (slot == nullptr) return NotFound(id);
  return slot->Step(step, scores, decision, clock_->Now());
}

absl::Status SequenceTable::SubmitRankReport(absl::string_view id, const RankReport& report,
                                             DecisionWaiter waiter, absl::string_view tenant) {
  std::shared_ptr<SequenceSlot> slot = Find(tenant, id);
  if (slot == nullptr) return NotFound(id);
  return slot->Submit(report, waiter, clock_->Now());
}

absl::Status SequenceTable::SubmitRankReport(absl::string_view id, const RankReport& report,
                                             RankDecisionCallback on_decided,
                                             absl::string_view tenant) {
  auto* sink = new CallbackSink(std::move(on_decided));
  absl::Status status = SubmitRankReport(id, report, DecisionWaiter{sink, 0}, tenant);
  if (!status.ok()) sink->Discard();  // refused: the callback is never called
  return status;
}

absl::StatusOr<SequenceInfo> SequenceTable::Inspect(absl::string_view id,
                                                    bool with_cache,
                                                    absl::string_view tenant) const {
  std::shared_ptr<SequenceSlot> slot = Find(tenant, id);
  if (slot == nullptr) return NotFound(id);
  return slot->Snapshot(with_cache, clock_->Now());
}

std::vector<SequenceInfo> SequenceTable::List(absl::string_view tenant) const {
  std::vector<SequenceInfo> out;
  for (const auto& slot : AllSlots()) {
    if (slot->tenant() != tenant) continue;
    SequenceInfo info = slot->Peek();
    if (!slot->closed()) out.push_back(std::move(info));
  }
  return out;
}

std::vector<SequenceInfo> SequenceTable::ListEveryTenant() const {
  std::vector<SequenceInfo> out;
  for (const auto& slot : AllSlots()) {
    SequenceInfo info = slot->Peek();
    if (!slot->closed()) out.push_back(std::move(info));
  }
  return out;
}

SequenceTableTotals SequenceTable::Totals() const {
  SequenceTableTotals totals;
  for (const auto& slot : AllSlots()) {
    if (slot->closed()) continue;
    ++totals.open_sequences;
    totals.cached_tokens += slot->cache_size();
  }
  return totals;
}

int64_t SequenceTable::AbortStaleJoins(absl::Duration timeout) {
  const absl::Time cutoff = clock_->Now() - timeout;
  int64_t aborted = 0;
  for (const auto& slot : AllSlots()) {
    if (slot->AbortJoinStartedBefore(cutoff, timeout)) ++aborted;
  }
  return aborted;
}

void SequenceTable::AbandonPendingSteps(const absl::Status& why) {
  for (const auto& slot : AllSlots()) slot->AbandonPendingStep(why);
}

std::vector<SequenceInfo> SequenceTable::ReclaimIdle(absl::Duration idle_timeout) {
  const absl::Time cutoff = clock_->Now() - idle_timeout;
  std::vector<std::pair<std::string, std::shared_ptr<SequenceSlot>>> idle;
  {
    MutexLock lock(&mu_);
    for (auto it = slots_.begin(); it != slots_.end();) {
      if (it->second != nullptr && it->second->IdleSince(cutoff)) {
        if (options_.kv_events != nullptr) in_transit_.push_back(it->second);
        ForgetLocked(it->second->tenant());
        std::string id = it->second->Peek().id;
        idle.emplace_back(std::move(id), std::move(it->second));
        slots_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  return CloseRemoved(std::move(idle), "was reclaimed after idling", "idle_timeout");
}

}  // namespace kvcm

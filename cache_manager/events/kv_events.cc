#include "cache_manager/events/kv_events.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"

namespace kvcm {

// Calls a subscriber's wakeup. Shared by the subscriber and the appends about to wake it,
// so that a subscription may go away while a wakeup is pending: its destructor clears the
// function under `mu`, after any call in progress.
struct KvWaker {
  Mutex mu;
  absl::AnyInvocable<void()> wakeup ABSL_GUARDED_BY(mu);

  void Wake() {
    MutexLock lock(&mu);
    if (wakeup) wakeup();
  }
};

enum class SubscriberPhase : uint8_t {
  kResync,    // next: the RESYNC, then the snapshot
  kSnapshot,  // next: the snapshot's entries (once complete), then SNAPSHOT_DONE
  kLive,      // next: the ring's event next_id
  kDropped,   // fell behind: next the RESYNC marker, then the end
  kEnded,
};

// One subscriber. Guarded by the log's mutex (the analysis cannot name it from here),
// except `waker`, which is set once.
struct KvSubscriberState {
  SubscriberPhase phase = SubscriberPhase::kLive;
  uint64_t next_id = 1;  // the next ring event to deliver
  uint64_t as_of = 0;
  bool needs_snapshot = false;
  uint64_t epoch = 0;  // the snapshot's epoch
  bool snapshot_complete = false;
  std::vector<KvSequenceState> snapshot;
  size_t snapshot_next = 0;
  std::string reason;  // the RESYNC's
  absl::Status end;
  bool armed = false;  // a Next found nothing: wake it when something comes
  std::string tenant;  // only this tenant's events are delivered (set once, at Subscribe)
  const std::shared_ptr<KvWaker> waker = std::make_shared<KvWaker>();

  bool attached() const {
    return phase != SubscriberPhase::kDropped && phase != SubscriberPhase::kEnded;
  }
};

namespace {

// The wakeups deferred by this thread's KvEventWakeupScopes.
struct DeferredWakeups {
  int depth = 0;
  absl::InlinedVector<std::shared_ptr<KvWaker>, 4> wakers;
};
thread_local DeferredWakeups deferred;

void Wake(absl::InlinedVector<std::shared_ptr<KvWaker>, 4>& wakers) {
  if (deferred.depth > 0) {
    for (std::shared_ptr<KvWaker>& w : wakers) {
      if (std::find(deferred.wakers.begin(), deferred.wakers.end(), w) == deferred.wakers.end()) {
        deferred.wakers.push_back(std::move(w));
      }
    }
    return;
  }
  for (const std::shared_ptr<KvWaker>& w : wakers) w->Wake();
}

std::string RandomRunId() {
  std::random_device rd;
  const uint64_t bits = (uint64_t{rd()} << 32) | rd();
  return absl::StrCat(absl::Hex(bits, absl::kZeroPad16));
}

}  // namespace

// --- KvEventWakeupScope -------------------------------------------------------------

KvEventWakeupScope::KvEventWakeupScope(bool active) : active_(active) {
  if (active_) ++deferred.depth;
}

KvEventWakeupScope::~KvEventWakeupScope() {
  if (!active_ || --deferred.depth > 0) return;
  absl::InlinedVector<std::shared_ptr<KvWaker>, 4> wakers;
  wakers.swap(deferred.wakers);
  Wake(wakers);  // depth is 0: now
}

// --- KvSequenceEvents ---------------------------------------------------------------

KvSequenceEvents::KvSequenceEvents(KvEventLog* log, KvSequenceState state)
    : log_(log), state_(std::move(state)) {}

namespace {

void AddBlocks(std::vector<KvEvent>& batch, int32_t rank, int64_t step, int64_t leased,
               int64_t released, int64_t held) {
  KvEvent& e = batch.emplace_back();
  e.kind = KvEventKind::kBlocks;
  e.rank = rank;
  e.step = step;
  e.leased_blocks = leased;
  e.released_blocks = released;
  e.held_blocks = held;
}

}  // namespace

void KvSequenceEvents::Opened() {
  batch_.clear();
  KvEvent& e = batch_.emplace_back();
  e.kind = KvEventKind::kOpened;
  e.prefill_len = state_.prefill_len;
  e.budget = state_.budget;
  e.policy = state_.policy;
  e.tp_world_size = state_.tp_world_size;
  for (size_t r = 0; r < state_.held_blocks.size(); ++r) {
    const int64_t held = state_.held_blocks[r];
    if (held > 0) AddBlocks(batch_, static_cast<int32_t>(r), 0, held, 0, held);
  }
  log_->Append(this, batch_);
}

void KvSequenceEvents::Stepped(const EvictionDecision& decision, const SequenceKv* kv) {
  batch_.clear();
  KvEvent& e = batch_.emplace_back();
  e.kind = KvEventKind::kStep;
  e.step = decision.step;
  e.evicted = static_cast<int64_t>(decision.evicted.size());
  e.cache_size = decision.cache_size;
  const size_t ranks = kv == nullptr ? 0 : std::min(static_cast<size_t>(kv->ranks()),
                                                      state_.held_blocks.size());
  for (size_t r = 0; r < ranks; ++r) {
    const int64_t held = kv->block_count(static_cast<int32_t>(r));
    const int64_t released =
        r < decision.kv.size() ? static_cast<int64_t>(decision.kv[r].released_blocks.size()) : 0;
    // Against the last count reported, so that a block kept by a rejected step is counted
    // by the next step that is decided.
    const int64_t leased = held - state_.held_blocks[r] + released;
    if (leased != 0 || released != 0) {
      AddBlocks(batch_, static_cast<int32_t>(r), decision.step, leased, released, held);
    }
  }
  log_->Append(this, batch_);
  state_.last_step = decision.step;
  state_.cache_size = decision.cache_size;
  for (size_t r = 0; r < ranks; ++r) {
    state_.held_blocks[r] = kv->block_count(static_cast<int32_t>(r));
  }
}

void KvSequenceEvents::Closed(absl::string_view reason) {
  if (closed_) return;
  batch_.clear();
  for (size_t r = 0; r < state_.held_blocks.size(); ++r) {
    const int64_t held = state_.held_blocks[r];
    if (held > 0) AddBlocks(batch_, static_cast<int32_t>(r), state_.last_step, 0, held, 0);
  }
  KvEvent& e = batch_.emplace_back();
  e.kind = KvEventKind::kClosed;
  e.step = state_.last_step;
  e.reason = std::string(reason);
  log_->Append(this, batch_);
  closed_ = true;
  std::fill(state_.held_blocks.begin(), state_.held_blocks.end(), 0);
}

void KvSequenceEvents::ContributeToSnapshots() { log_->Contribute(this); }

// --- KvEventSubscription ------------------------------------------------------------

KvEventSubscription::KvEventSubscription(KvEventLog* log, KvSubscriberState* state,
                                         std::string tenant)
    : log_(log), state_(state), tenant_(std::move(tenant)) {}

KvEventSubscription::~KvEventSubscription() { log_->Detach(state_); }

KvEventSubscription::Poll KvEventSubscription::Next(KvEvent* out) {
  MutexLock lock(&log_->mu_);
  return log_->NextLocked(state_, out);
}

void KvEventSubscription::SetWakeup(absl::AnyInvocable<void()> wakeup) {
  MutexLock lock(&state_->waker->mu);
  state_->waker->wakeup = std::move(wakeup);
}

bool KvEventSubscription::snapshot_pending() const {
  MutexLock lock(&log_->mu_);
  return state_->needs_snapshot && !state_->snapshot_complete;
}

void KvEventSubscription::CompleteSnapshot() { log_->CompleteSnapshot(state_); }

uint64_t KvEventSubscription::as_of() const {
  MutexLock lock(&log_->mu_);
  return state_->as_of;
}

absl::Status KvEventSubscription::end_status() const {
  MutexLock lock(&log_->mu_);
  return state_->end;
}

// --- KvEventLog ---------------------------------------------------------------------

KvEventLog::KvEventLog(KvEventLogOptions options)
    : max_backlog_(options.max_backlog <= 0 ||
                           options.max_backlog > std::max<int64_t>(1, options.ring_capacity)
                       ? std::max<int64_t>(1, options.ring_capacity)
                       : options.max_backlog),
      max_subscribers_(options.max_subscribers),
      run_(options.run.empty() ? RandomRunId() : options.run),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      ring_(static_cast<size_t>(std::max<int64_t>(1, options.ring_capacity))) {}

KvEventLog::~KvEventLog() = default;

int64_t KvEventLog::NowMicros() const { return absl::ToUnixMicros(clock_->Now()); }

uint64_t KvEventLog::OldestLocked() const {
  const uint64_t capacity = ring_.size();
  return newest_ > capacity ? newest_ - capacity + 1 : 1;
}

void KvEventLog::Append(KvSequenceEvents* source, std::vector<KvEvent>& events) {
  const int64_t now = NowMicros();
  absl::InlinedVector<std::shared_ptr<KvWaker>, 4> wake;
  {
    MutexLock lock(&mu_);
    if (!source->opened_) {
      // Its Opened: the sequence was open at no earlier snapshot's as_of.
      source->opened_ = true;
      source->epoch_ = epoch_;
    } else if (source->epoch_ != epoch_) {
      ContributeLocked(source);  // its state before these events: the state at as_of
    }
    const size_t capacity = ring_.size();
    for (const KvEvent& e : events) {
      KvEvent& slot = ring_[newest_ % capacity];
      slot = e;
      slot.id = ++newest_;
      slot.unix_micros = now;
      slot.sequence_id = source->state_.sequence_id;
      slot.tenant = source->state_.tenant;
    }
    for (const std::unique_ptr<Subscriber>& s : subscribers_) {
      if (!s->attached()) continue;
      const uint64_t backlog = newest_ + 1 - s->next_id;
      if (backlog > static_cast<uint64_t>(max_backlog_)) {
        s->phase = SubscriberPhase::kDropped;
        s->reason = absl::StrCat("overflow: the subscriber fell ", backlog,
                                 " events behind (at most ", max_backlog_, ")");
        s->end = absl::AbortedError(absl::StrCat(
            "kvcached dropped this event subscriber: it fell more than ", max_backlog_,
            " events behind; subscribe again with after_event_id = the last id received"));
        s->snapshot = {};
        ++dropped_;
      } else if (s->phase != SubscriberPhase::kLive) {
        continue;  // a snapshot still being taken: it wakes when complete
      }
      if (s->armed) {
        s->armed = false;
        wake.push_back(s->waker);
      }
    }
  }
  Wake(wake);
}

void KvEventLog::ContributeLocked(KvSequenceEvents* source) {
  for (Subscriber* s : snapshotting_) {
    if (s->epoch > source->epoch_ && s->attached() && s->tenant == source->state_.tenant) {
      s->snapshot.push_back(source->state_);
    }
  }
  source->epoch_ = epoch_;
}

void KvEventLog::Contribute(KvSequenceEvents* source) {
  MutexLock lock(&mu_);
  if (!source->opened_ || source->epoch_ == epoch_) return;
  if (source->closed_) {
    // Its Closed came before every snapshot it has not given its state to (a Closed
    // appended after a snapshot opened would have given it).
    source->epoch_ = epoch_;
    return;
  }
  ContributeLocked(source);
}

absl::StatusOr<std::unique_ptr<KvEventSubscription>> KvEventLog::Subscribe(
    uint64_t after_event_id, absl::string_view daemon_run, std::string tenant) {
  MutexLock lock(&mu_);
  const int64_t attached = std::count_if(subscribers_.begin(), subscribers_.end(),
                                         [](const auto& s) { return s->attached(); });
  if (attached >= max_subscribers_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kvcached already serves the maximum of ", max_subscribers_, " KV event subscribers"));
  }
  const uint64_t after = after_event_id;
  const uint64_t oldest = OldestLocked();
  std::string why;
  if (after == 0) {
    why = "start: a snapshot of the open sequences, then every later event";
  } else if (daemon_run != run_) {
    why = absl::StrCat("event ", after, " is of daemon run '", daemon_run, "'; this is run '",
                       run_, "'");
  } else if (after > newest_) {
    why = absl::StrCat("after_event_id ", after, " is ahead of the newest event, ", newest_);
  } else if (after + 1 < oldest) {
    why = absl::StrCat("the events after ", after, " are gone: the ring holds ", oldest, " to ",
                       newest_);
  } else if (newest_ - after > static_cast<uint64_t>(max_backlog_)) {
    why = absl::StrCat("after_event_id ", after, " is ", newest_ - after,
                       " events behind; a subscriber may be at most ", max_backlog_, " behind");
  }
  auto state = std::make_unique<Subscriber>();
  state->tenant = tenant;
  if (why.empty()) {
    state->next_id = after + 1;
    state->as_of = after;
  } else {
    state->phase = SubscriberPhase::kResync;
    state->reason = std::move(why);
    state->needs_snapshot = true;
    state->as_of = newest_;
    state->next_id = newest_ + 1;
    state->epoch = ++epoch_;
    snapshotting_.push_back(state.get());
  }
  Subscriber* raw = state.get();
  subscribers_.push_back(std::move(state));
  return std::unique_ptr<KvEventSubscription>(
      new KvEventSubscription(this, raw, std::move(tenant)));
}

void KvEventLog::CompleteSnapshot(Subscriber* s) {
  std::shared_ptr<KvWaker> wake;
  {
    MutexLock lock(&mu_);
    snapshotting_.erase(std::remove(snapshotting_.begin(), snapshotting_.end(), s),
                        snapshotting_.end());
    s->snapshot_complete = true;
    if (s->armed) {
      s->armed = false;
      wake = s->waker;
    }
  }
  if (wake != nullptr) wake->Wake();
}

KvEventSubscription::Poll KvEventLog::NextLocked(Subscriber* s, KvEvent* out) {
  using Poll = KvEventSubscription::Poll;
  switch (s->phase) {
    case SubscriberPhase::kResync:
    case SubscriberPhase::kDropped:
      *out = KvEvent{};
      out->kind = KvEventKind::kResync;
      out->unix_micros = NowMicros();
      out->reason = s->reason;
      out->oldest_available = OldestLocked();
      s->phase = s->phase == SubscriberPhase::kResync ? SubscriberPhase::kSnapshot
                                                      : SubscriberPhase::kEnded;
      return Poll::kEvent;
    case SubscriberPhase::kSnapshot:
      if (!s->snapshot_complete) {
        s->armed = true;
        return Poll::kNothing;
      }
      *out = KvEvent{};
      out->unix_micros = NowMicros();
      if (s->snapshot_next < s->snapshot.size()) {
        KvSequenceState& entry = s->snapshot[s->snapshot_next++];
        out->kind = KvEventKind::kSnapshot;
        out->sequence_id = std::move(entry.sequence_id);
        out->tenant = std::move(entry.tenant);
        out->prefill_len = entry.prefill_len;
        out->budget = entry.budget;
        out->policy = std::move(entry.policy);
        out->tp_world_size = entry.tp_world_size;
        out->step = entry.last_step;
        out->cache_size = entry.cache_size;
        out->held_per_rank = std::move(entry.held_blocks);
        return Poll::kEvent;
      }
      out->kind = KvEventKind::kSnapshotDone;
      out->as_of = s->as_of;
      s->snapshot = {};
      s->phase = SubscriberPhase::kLive;
      return Poll::kEvent;
    case SubscriberPhase::kLive:
      // Other tenants' events are skipped: a subscriber sees only its own sequences.
      while (s->next_id <= newest_) {
        const KvEvent& event = ring_[(s->next_id - 1) % ring_.size()];
        ++s->next_id;
        if (event.tenant != s->tenant) continue;
        *out = event;
        return Poll::kEvent;
      }
      s->armed = true;
      return Poll::kNothing;
    case SubscriberPhase::kEnded:
      break;
  }
  return Poll::kEnded;
}

void KvEventLog::Detach(Subscriber* s) {
  std::shared_ptr<KvWaker> waker;
  std::unique_ptr<Subscriber> owned;
  {
    MutexLock lock(&mu_);
    snapshotting_.erase(std::remove(snapshotting_.begin(), snapshotting_.end(), s),
                        snapshotting_.end());
    auto it = std::find_if(subscribers_.begin(), subscribers_.end(),
                           [s](const auto& p) { return p.get() == s; });
    owned = std::move(*it);
    subscribers_.erase(it);
    waker = owned->waker;
  }
  MutexLock lock(&waker->mu);  // waits for a wakeup in progress
  waker->wakeup = nullptr;
}

void KvEventLog::EndSubscriptions(absl::string_view why) {
  absl::InlinedVector<std::shared_ptr<KvWaker>, 4> wake;
  {
    MutexLock lock(&mu_);
    for (const std::unique_ptr<Subscriber>& s : subscribers_) {
      if (!s->attached()) continue;
      s->phase = SubscriberPhase::kEnded;
      s->end = absl::UnavailableError(why);
      s->snapshot = {};
      if (s->armed) {
        s->armed = false;
        wake.push_back(s->waker);
      }
    }
  }
  for (const std::shared_ptr<KvWaker>& w : wake) w->Wake();
}

KvEventStats KvEventLog::Stats() const {
  MutexLock lock(&mu_);
  KvEventStats stats;
  stats.subscribers = std::count_if(subscribers_.begin(), subscribers_.end(),
                                    [](const auto& s) { return s->attached(); });
  stats.published = newest_;
  stats.dropped = dropped_;
  return stats;
}

}  // namespace kvcm

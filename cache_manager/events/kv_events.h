// KvEventLog: the daemon's KV events for KV-aware routers (proto WatchKvEvents): sequences
// opened and closed, each step's evictions and cache size, KV blocks leased and released
// per rank. One totally ordered stream per daemon run: ids start at 1 and increase by one,
// and run() (random per log) tells runs apart.
//
// Publishing. Each open sequence has a KvSequenceEvents, owned by its SequenceSlot and used
// under the slot's mutex. Appending its events takes the log's mutex only to copy them into
// a fixed ring (`ring_capacity` events; the oldest is overwritten) and to compare each
// subscriber's position with the newest id: it never waits for a subscriber. A subscriber
// more than `max_backlog` events behind is dropped (counted): it gets one RESYNC marker, then
// its subscription ends and it may subscribe again from the last id it saw.
//
// Subscribing. Subscribe(after_id, run) resumes after `after_id` when that run's later
// events are all still in the ring; otherwise the subscriber gets RESYNC, a snapshot of the
// sequences open at an event id `as_of`, SNAPSHOT_DONE(as_of), then every event after
// as_of. Next() never blocks; when it finds nothing, the subscription's wakeup is called
// once, on the thread of the next append (which holds that sequence's slot mutex: a wakeup
// must not block or call into the table; it may call Next), or at the end of that
// thread's KvEventWakeupScope.
//
// Snapshot consistency: the snapshot plus every event after as_of is exactly the state. The
// snapshot is a consistent cut at as_of taken without stopping any step:
//   1. Every event of a sequence is appended under its slot's mutex; Opened before the
//      slot becomes findable (so before any step), Closed after it stopped being so. In
//      between, and for as long as either event may still be coming, the table's registry
//      lists the slot (as open, or as opening or closing).
//   2. SequenceTable::SubscribeKvEvents calls Subscribe under the registry mutex, which,
//      under the log's mutex, sets as_of to the newest id and opens a snapshot epoch. Every
//      sequence open at as_of (Opened at or before it, Closed after it) is then listed by
//      the registry; the table takes that list.
//   3. Each sequence gives its state to an epoch at most once: at its next append, under
//      the log's mutex, before the new events take ids; or when the table visits it
//      (ContributeToSnapshots, under the slot's mutex) if it has appended nothing since.
//      Both are the first moment the sequence could change after as_of, so the state given
//      is its state at as_of. A listed sequence whose Opened comes after as_of gives
//      nothing, nor does one whose Closed came before it; one closed after as_of gave its
//      state when it appended Closed.
//   4. After the visit (CompleteSnapshot) every sequence open at as_of has given its state,
//      and every event the subscriber then gets has an id above as_of.
// Lock order: the table's registry mutex, a slot's mutex, a subscription's wakeup mutex,
// then the log's mutex (a leaf: nothing is called while it is held).
//
// Costs: an append is one lock, a copy per event and a compare per subscriber; a step emits
// one Step event, plus one Blocks event per rank whose block count changed. The ring holds
// ring_capacity events of about 250 bytes. A snapshot in progress adds one copy of each
// sequence's state; it is held by the subscriber until delivered.
//
// Thread-safe, except KvSequenceEvents (its slot serializes it).
#ifndef KVCM_CACHE_MANAGER_EVENTS_KV_EVENTS_H_
#define KVCM_CACHE_MANAGER_EVENTS_KV_EVENTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/base/clock.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/engine/eviction_decision.h"
#include "cache_manager/kv/kv_pools.h"

namespace kvcm {

enum class KvEventKind : uint8_t {
  kOpened,
  kClosed,
  kStep,
  kBlocks,
  kResync,        // not in the ring: the subscriber missed events (or starts); a snapshot follows
  kSnapshot,      // not in the ring: one open sequence
  kSnapshotDone,  // not in the ring: the snapshot is complete as of `as_of`
};

// One event. Only the fields of its kind are meaningful.
struct KvEvent {
  uint64_t id = 0;  // 1, 2, ... per run; 0 for kResync, kSnapshot and kSnapshotDone
  int64_t unix_micros = 0;
  KvEventKind kind = KvEventKind::kStep;
  std::string sequence_id;  // empty for kResync and kSnapshotDone
  std::string tenant;       // the sequence's tenant ("" without authentication)
  // kOpened and kSnapshot.
  int64_t prefill_len = 0;
  int64_t budget = 0;
  std::string policy;  // the preset name, or "custom"
  int32_t tp_world_size = 1;
  // kStep: the step. kBlocks: the step (0: the prefill lease at open). kClosed and kSnapshot:
  // the last step.
  int64_t step = 0;
  int64_t evicted = 0;     // kStep: tokens evicted by the step
  int64_t cache_size = 0;  // kStep and kSnapshot: tokens cached after it
  // kBlocks: one rank's blocks: taken by the step, returned by it, held after it.
  int32_t rank = 0;
  int64_t leased_blocks = 0;
  int64_t released_blocks = 0;
  int64_t held_blocks = 0;
  std::vector<int64_t> held_per_rank;  // kSnapshot, with KV pools: blocks held per rank
  // kClosed: the reason ("client", "idle_timeout", "shutdown"). kResync: why.
  std::string reason;
  uint64_t as_of = 0;             // kSnapshotDone
  uint64_t oldest_available = 0;  // kResync: the oldest id the ring still holds
};

// A sequence as a snapshot shows it (the fields of a kSnapshot event).
struct KvSequenceState {
  std::string sequence_id;
  std::string tenant;  // who opened it: a subscriber sees only its own tenant's sequences
  int64_t prefill_len = 0;
  int64_t budget = 0;
  std::string policy;
  int32_t tp_world_size = 1;
  int64_t last_step = 0;
  int64_t cache_size = 0;
  std::vector<int64_t> held_blocks;  // per rank; empty without KV pools
};

struct KvEventLogOptions {
  int64_t ring_capacity = 65536;  // events kept for subscribers that resume (>= 1)
  // Events a subscriber may be behind before it is dropped; 0 or above ring_capacity:
  // ring_capacity.
  int64_t max_backlog = 0;
  int32_t max_subscribers = 64;
  std::string run = "";          // the daemon run id; "": 16 random hex digits
  const Clock* clock = nullptr;  // for unix_micros; nullptr: Clock::Real()
};

struct KvEventStats {
  int64_t subscribers = 0;  // attached: not dropped, not ended
  uint64_t published = 0;   // events appended (the newest id)
  uint64_t dropped = 0;     // subscribers dropped for falling behind
};

class KvEventLog;
struct KvSubscriberState;  // kv_events.cc

// While one is alive on a thread, the wakeups due to that thread's appends wait for its
// end, outside every lock, and each subscriber is woken once however many events came:
// the daemon's engine threads hold one around a batch's steps, so a decision leaves before
// the events it caused wake their subscribers. Scopes nest (the outermost wakes).
// `active` false: does nothing.
class KvEventWakeupScope {
 public:
  explicit KvEventWakeupScope(bool active = true);
  ~KvEventWakeupScope();

  KvEventWakeupScope(const KvEventWakeupScope&) = delete;
  KvEventWakeupScope& operator=(const KvEventWakeupScope&) = delete;

 private:
  const bool active_;
};

// The events of one open sequence, as they are appended. Owned by its SequenceSlot; every
// call under the slot's mutex. Appends nothing after Closed.
class KvSequenceEvents {
 public:
  // `state`: the sequence as opened (held_blocks: its prefill lease per rank). `log` must
  // outlive this.
  KvSequenceEvents(KvEventLog* log, KvSequenceState state);

  KvSequenceEvents(const KvSequenceEvents&) = delete;
  KvSequenceEvents& operator=(const KvSequenceEvents&) = delete;

  // Opened, then per rank a Blocks event (step 0) for the prefill lease. First, before the
  // sequence can step (see the header comment).
  void Opened();
  // A decided step: Step, then a Blocks event for each rank of `kv` (null without pools)
  // whose blocks changed since the last event.
  void Stepped(const EvictionDecision& decision, const SequenceKv* kv);
  // A Blocks event per rank returning every held block, then Closed(reason).
  void Closed(absl::string_view reason);
  // Gives the state to every snapshot in progress that has not had it yet.
  void ContributeToSnapshots();

 private:
  friend class KvEventLog;

  KvEventLog* const log_;
  KvSequenceState state_;     // as of the last event appended
  std::vector<KvEvent> batch_;  // one append's events, reused
  // Written under the log's mutex (the analysis cannot name it here): the snapshot epoch
  // up to which this sequence has given its state (or was not open).
  uint64_t epoch_ = 0;
  bool opened_ = false;
  bool closed_ = false;
};

// One subscriber's position in the log. Next and the wakeup are thread-safe.
class KvEventSubscription {
 public:
  enum class Poll : uint8_t {
    kEvent,    // *out holds the next event
    kNothing,  // nothing now; the wakeup is called once something comes
    kEnded,    // the subscription is over: end_status() says why
  };

  // Detaches from the log. Once it returns, the wakeup is not running and is never called.
  ~KvEventSubscription();

  KvEventSubscription(const KvEventSubscription&) = delete;
  KvEventSubscription& operator=(const KvEventSubscription&) = delete;

  // The next event, without blocking. `out` is overwritten (its capacity reused).
  Poll Next(KvEvent* out);
  // Called, without the log's mutex, once after a Next that found nothing, when there is
  // something (an event, or the end). See the header comment for what it may do.
  void SetWakeup(absl::AnyInvocable<void()> wakeup);

  // Whether the subscriber starts with a snapshot (it could not resume). The snapshot is
  // taken by the subscriber's creator: every sequence open at as_of calls
  // ContributeToSnapshots, then CompleteSnapshot().
  bool snapshot_pending() const;
  void CompleteSnapshot();
  uint64_t as_of() const;  // with a snapshot: what it reflects; when resuming: after_event_id

  // Why Next returned kEnded: ABORTED (it fell behind and was dropped) or UNAVAILABLE (the
  // log ended every subscription: the daemon drains).
  absl::Status end_status() const;
  // The subscriber gets only the events (and snapshot entries) of this tenant's
  // sequences; event ids stay the daemon's, so it sees gaps where others' events were.
  const std::string& tenant() const { return tenant_; }

 private:
  friend class KvEventLog;
  KvEventSubscription(KvEventLog* log, KvSubscriberState* state, std::string tenant);

  KvEventLog* const log_;
  KvSubscriberState* const state_;  // owned by the log
  const std::string tenant_;
};

class KvEventLog {
 public:
  explicit KvEventLog(KvEventLogOptions options = {});
  // REQUIRES: no subscription and no KvSequenceEvents left.
  ~KvEventLog();

  KvEventLog(const KvEventLog&) = delete;
  KvEventLog& operator=(const KvEventLog&) = delete;

  const std::string& run() const { return run_; }

  // Resumes after `after_event_id` of `daemon_run` when every later event is still in the
  // ring and at most max_backlog of them; otherwise (after_event_id 0, another run, an id
  // ahead of the newest or too old) starts with a RESYNC and a snapshot, which the caller
  // must take (snapshot_pending()). Call it with the table's registry mutex held
  // (SequenceTable::SubscribeKvEvents), so that as_of and the registry's list agree.
  // RESOURCE_EXHAUSTED at max_subscribers. `tenant`: see KvEventSubscription::tenant.
  absl::StatusOr<std::unique_ptr<KvEventSubscription>> Subscribe(uint64_t after_event_id,
                                                                  absl::string_view daemon_run,
                                                                  std::string tenant)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ends every subscription now (drain): each gets kEnded with UNAVAILABLE(`why`).
  void EndSubscriptions(absl::string_view why) ABSL_LOCKS_EXCLUDED(mu_);

  KvEventStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class KvEventSubscription;
  friend class KvSequenceEvents;
  using Subscriber = KvSubscriberState;

  // Appends `source`'s events (their ids, times and sequence id are filled in here), after
  // giving its state to the snapshots in progress that lack it.
  void Append(KvSequenceEvents* source, std::vector<KvEvent>& events) ABSL_LOCKS_EXCLUDED(mu_);
  void ContributeLocked(KvSequenceEvents* source) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Contribute(KvSequenceEvents* source) ABSL_LOCKS_EXCLUDED(mu_);
  KvEventSubscription::Poll NextLocked(Subscriber* s, KvEvent* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Detach(Subscriber* s) ABSL_LOCKS_EXCLUDED(mu_);
  void CompleteSnapshot(Subscriber* s) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t OldestLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t NowMicros() const;

  const int64_t max_backlog_;
  const int32_t max_subscribers_;
  const std::string run_;
  const Clock* const clock_;

  mutable Mutex mu_;
  std::vector<KvEvent> ring_ ABSL_GUARDED_BY(mu_);  // event id i at (i - 1) % size
  uint64_t newest_ ABSL_GUARDED_BY(mu_) = 0;         // 0: none yet
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;          // snapshots opened so far
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<Subscriber>> subscribers_ ABSL_GUARDED_BY(mu_);
  std::vector<Subscriber*> snapshotting_ ABSL_GUARDED_BY(mu_);  // snapshot not complete yet
};

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_EVENTS_KV_EVENTS_H_

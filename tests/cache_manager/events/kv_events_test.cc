// KvEventLog and the sequence table's events: ids, the ring, resuming, RESYNC with a
// snapshot, dropped subscribers, wakeups, and the snapshot rule (snapshot + every later
// event = the table's state) under concurrent opens, steps and closes. Labelled
// concurrency: scripts/test.sh runs it under ThreadSanitizer.
#include "cache_manager/events/kv_events.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_manager/kv/kv_pools.h"
#include "cache_manager/table/sequence_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using Poll = KvEventSubscription::Poll;

// streaming_llm takes no scores.
SequenceOptions Recency(int64_t prefill = 12, int64_t budget = 8) {
  return testing::PresetOptions(prefill, budget, "streaming_llm");
}

// 4 tokens per block.
std::unique_ptr<KvPools> Pools(int32_t ranks, int64_t blocks) {
  return testing::SmallHostKvPools(ranks, blocks);
}

void StepOrDie(SequenceTable& table, const std::string& id, int64_t step) {
  EvictionDecision d;
  ASSERT_TRUE(table.Step(id, step, nullptr, &d).ok()) << id << " step " << step;
}

// Every event available now.
std::vector<KvEvent> Drain(KvEventSubscription& sub) {
  std::vector<KvEvent> out;
  KvEvent e;
  while (sub.Next(&e) == Poll::kEvent) out.push_back(e);
  return out;
}

// What a router knows, rebuilt from one subscription's events; `error` names the first
// event that does not follow from the ones before.
struct Model {
  struct Sequence {
    int64_t last_step = 0;
    int64_t cache_size = 0;
    std::vector<int64_t> held;
  };
  std::map<std::string, Sequence> open;
  uint64_t last_id = 0;  // the resume point: the last live id, or SNAPSHOT_DONE's as_of
  int64_t resyncs = 0;
  std::map<std::pair<std::string, int64_t>, int> steps_seen;  // (sequence, step) -> times
  std::string error;

  void Fail(const KvEvent& e, absl::string_view what) {
    if (error.empty()) error = absl::StrCat("event ", e.id, " of '", e.sequence_id, "': ", what);
  }

  void Apply(const KvEvent& e) {
    switch (e.kind) {
      case KvEventKind::kResync:
        open.clear();
        ++resyncs;
        return;
      case KvEventKind::kSnapshot:
        open[e.sequence_id] = {e.step, e.cache_size, e.held_per_rank};
        return;
      case KvEventKind::kSnapshotDone:
        last_id = e.as_of;
        return;
      default:
        break;
    }
    if (e.id != last_id + 1) Fail(e, absl::StrCat("expected id ", last_id + 1));
    last_id = e.id;
    auto it = open.find(e.sequence_id);
    if (e.kind == KvEventKind::kOpened) {
      if (it != open.end()) return Fail(e, "opened twice");
      open[e.sequence_id] = {0, e.prefill_len, {}};
      return;
    }
    if (it == open.end()) return Fail(e, "not open");
    Sequence& s = it->second;
    switch (e.kind) {
      case KvEventKind::kStep:
        if (e.step != s.last_step + 1) Fail(e, absl::StrCat("step ", e.step, " after ", s.last_step));
        s.last_step = e.step;
        s.cache_size = e.cache_size;
        ++steps_seen[{e.sequence_id, e.step}];
        break;
      case KvEventKind::kBlocks: {
        if (s.held.size() <= static_cast<size_t>(e.rank)) s.held.resize(e.rank + 1, 0);
        int64_t& held = s.held[static_cast<size_t>(e.rank)];
        if (held + e.leased_blocks - e.released_blocks != e.held_blocks) Fail(e, "blocks do not add up");
        held = e.held_blocks;
        break;
      }
      case KvEventKind::kClosed:
        if (e.step != s.last_step) Fail(e, "closed at another step");
        open.erase(it);
        break;
      default:
        Fail(e, "unexpected kind");
    }
  }

  void ApplyAll(KvEventSubscription& sub) {
    for (const KvEvent& e : Drain(sub)) Apply(e);
  }

  // The model against the table itself (and the pools' used blocks).
  void ExpectMatches(const SequenceTable& table, const KvPools* pools = nullptr) const {
    EXPECT_EQ(error, "");
    std::vector<SequenceInfo> listed = table.List();
    EXPECT_EQ(open.size(), listed.size());
    for (const SequenceInfo& info : listed) {
      auto it = open.find(info.id);
      ASSERT_NE(it, open.end()) << info.id;
      EXPECT_EQ(it->second.last_step, info.last_step) << info.id;
      EXPECT_EQ(it->second.cache_size, info.cache_size) << info.id;
    }
    if (pools == nullptr) return;
    for (int32_t r = 0; r < pools->ranks(); ++r) {
      int64_t held = 0;
      for (const auto& [id, s] : open) held += r < static_cast<int32_t>(s.held.size()) ? s.held[r] : 0;
      EXPECT_EQ(held, pools->pool(r).Usage().used_blocks) << "rank " << r;
    }
  }
};

TEST(KvEventLogTest, IdsStartAtOneAndIncreaseByOneAcrossSequences) {
  KvEventLog log(KvEventLogOptions{.run = "run-1"});
  SequenceTable table(SequenceTableOptions{.kv_events = &log});
  auto sub = table.SubscribeKvEvents(0, "", "");
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_TRUE(table.Open("a", Recency()).ok());
  ASSERT_TRUE(table.Open("b", Recency(20, 10)).ok());
  StepOrDie(table, "a", 1);
  StepOrDie(table, "b", 1);
  ASSERT_TRUE(table.Close("a").ok());

  std::vector<KvEvent> events = Drain(**sub);
  ASSERT_EQ(events.size(), 7u);
  EXPECT_EQ(events[0].kind, KvEventKind::kResync);
  EXPECT_THAT(events[0].reason, HasSubstr("start"));
  EXPECT_EQ(events[1].kind, KvEventKind::kSnapshotDone);
  EXPECT_EQ(events[1].as_of, 0u);
  for (size_t i = 2; i < events.size(); ++i) EXPECT_EQ(events[i].id, i - 1);
  EXPECT_EQ(events[2].kind, KvEventKind::kOpened);
  EXPECT_EQ(events[2].sequence_id, "a");
  EXPECT_EQ(events[2].prefill_len, 12);
  EXPECT_EQ(events[2].budget, 8);
  EXPECT_EQ(events[2].policy, "streaming_llm");
  EXPECT_EQ(events[4].kind, KvEventKind::kStep);
  EXPECT_EQ(events[4].step, 1);
  EXPECT_EQ(events[4].evicted, 5);  // 12 + 1 down to 8
  EXPECT_EQ(events[4].cache_size, 8);
  EXPECT_EQ(events[5].sequence_id, "b");
  EXPECT_EQ(events[5].cache_size, 10);
  EXPECT_EQ(events[6].kind, KvEventKind::kClosed);
  EXPECT_EQ(events[6].reason, "client");
  EXPECT_EQ(events[6].step, 1);
  EXPECT_EQ(log.Stats().published, 5u);
  EXPECT_EQ(log.run(), "run-1");
  EXPECT_EQ(KvEventLog().run().size(), 16u);  // random by default
}

TEST(KvEventLogTest, ATableWithoutALogRefusesSubscribers) {
  SequenceTable table;
  EXPECT_EQ(table.SubscribeKvEvents(0, "", "").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(KvEventLogTest, ResumesAfterAnIdStillInTheRingAndResyncsOtherwise) {
  KvEventLog log(KvEventLogOptions{.ring_capacity = 8, .run = "r"});
  SequenceTable table(SequenceTableOptions{.kv_events = &log});
  ASSERT_TRUE(table.Open("a", Recency()).ok());  // id 1
  for (int64_t t = 1; t <= 11; ++t) StepOrDie(table, "a", t);  // ids 2 .. 12; the ring: 5 .. 12

  auto resumed = table.SubscribeKvEvents(4, "r", "");  // 5 onwards: all kept
  ASSERT_TRUE(resumed.ok());
  EXPECT_FALSE((*resumed)->snapshot_pending());
  std::vector<KvEvent> events = Drain(**resumed);
  ASSERT_EQ(events.size(), 8u);
  EXPECT_EQ(events.front().id, 5u);
  EXPECT_EQ(events.front().step, 4);
  EXPECT_EQ(events.back().id, 12u);

  auto caught_up = table.SubscribeKvEvents(12, "r", "");
  ASSERT_TRUE(caught_up.ok());
  EXPECT_TRUE(Drain(**caught_up).empty());

  struct Case {
    uint64_t after;
    std::string run;
    std::string why;
  };
  for (const Case& c : {Case{3, "r", "gone"}, Case{13, "r", "ahead"},
                        Case{10, "other", "daemon run 'other'"}}) {
    auto sub = table.SubscribeKvEvents(c.after, c.run, "");
    ASSERT_TRUE(sub.ok());
    std::vector<KvEvent> got = Drain(**sub);
    ASSERT_EQ(got.size(), 3u) << c.why;
    EXPECT_EQ(got[0].kind, KvEventKind::kResync);
    EXPECT_THAT(got[0].reason, HasSubstr(c.why));
    EXPECT_EQ(got[0].oldest_available, 5u);
    EXPECT_EQ(got[1].kind, KvEventKind::kSnapshot);
    EXPECT_EQ(got[1].sequence_id, "a");
    EXPECT_EQ(got[1].step, 11);
    EXPECT_EQ(got[1].cache_size, 8);
    EXPECT_EQ(got[2].kind, KvEventKind::kSnapshotDone);
    EXPECT_EQ(got[2].as_of, 12u);
  }
}

TEST(KvEventLogTest, SnapshotPlusLaterEventsIsTheTableStateWithBlocks) {
  auto pools = Pools(2, 64);
  KvEventLog log;
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get(), .kv_events = &log});
  ASSERT_TRUE(table.Open("a", Recency(40, 8)).ok());  // 10 blocks per rank
  ASSERT_TRUE(table.Open("b", Recency(9, 8)).ok());
  StepOrDie(table, "a", 1);  // 41 -> 8 tokens: compaction returns 8 blocks per rank
  auto sub = table.SubscribeKvEvents(0, "", "");
  ASSERT_TRUE(sub.ok());
  Model model;
  model.ApplyAll(**sub);
  model.ExpectMatches(table, pools.get());
  EXPECT_EQ(model.open["a"].held, (std::vector<int64_t>{2, 2}));

  for (int64_t t = 2; t <= 9; ++t) StepOrDie(table, "a", t);
  for (int64_t t = 1; t <= 9; ++t) StepOrDie(table, "b", t);
  ASSERT_TRUE(table.Open("c", Recency(30, 8)).ok());
  ASSERT_TRUE(table.Close("b").ok());
  model.ApplyAll(**sub);
  model.ExpectMatches(table, pools.get());
  EXPECT_EQ(model.resyncs, 1);
}

TEST(KvEventLogTest, ReclaimedAndDestroyedSequencesCloseWithTheirReason) {
  ManualClock clock;
  KvEventLog log;
  auto table = std::make_unique<SequenceTable>(
      SequenceTableOptions{.clock = &clock, .kv_events = &log});
  ASSERT_TRUE(table->Open("idle", Recency()).ok());
  ASSERT_TRUE(table->Open("kept", Recency()).ok());
  auto sub = table->SubscribeKvEvents(2, log.run(), "");
  ASSERT_TRUE(sub.ok());
  clock.Advance(absl::Minutes(5));
  StepOrDie(*table, "kept", 1);
  EXPECT_EQ(table->ReclaimIdle(absl::Minutes(1)).size(), 1u);
  table.reset();
  std::vector<KvEvent> events = Drain(**sub);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1].sequence_id, "idle");
  EXPECT_EQ(events[1].reason, "idle_timeout");
  EXPECT_EQ(events[2].sequence_id, "kept");
  EXPECT_EQ(events[2].reason, "shutdown");
}

TEST(KvEventLogTest, ASubscriberTooFarBehindIsDroppedWithAResyncMarker) {
  KvEventLog log(KvEventLogOptions{.ring_capacity = 64, .max_backlog = 10, .run = "r"});
  SequenceTable table(SequenceTableOptions{.kv_events = &log});
  ASSERT_TRUE(table.Open("a", Recency()).ok());
  auto slow = table.SubscribeKvEvents(1, "r", "");
  ASSERT_TRUE(slow.ok());
  KvEvent e;
  for (int64_t t = 1; t <= 10; ++t) StepOrDie(table, "a", t);  // 2 .. 11 unread: attached
  ASSERT_EQ((*slow)->Next(&e), Poll::kEvent);
  EXPECT_EQ(e.id, 2u);
  StepOrDie(table, "a", 11);
  EXPECT_EQ(log.Stats().dropped, 0u);  // 3 .. 12: 10 unread
  StepOrDie(table, "a", 12);           // 11 unread: dropped
  EXPECT_EQ(log.Stats().dropped, 1u);
  EXPECT_EQ(log.Stats().subscribers, 0);
  ASSERT_EQ((*slow)->Next(&e), Poll::kEvent);
  EXPECT_EQ(e.kind, KvEventKind::kResync);
  EXPECT_THAT(e.reason, HasSubstr("overflow"));
  EXPECT_EQ((*slow)->Next(&e), Poll::kEnded);
  EXPECT_EQ((*slow)->end_status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT((*slow)->end_status().message(), HasSubstr("after_event_id"));
  // Further steps cost it nothing and it stays ended.
  StepOrDie(table, "a", 13);
  EXPECT_EQ((*slow)->Next(&e), Poll::kEnded);
  EXPECT_EQ(log.Stats().dropped, 1u);
  // From its last id it is more than max_backlog behind: a fresh snapshot.
  auto again = table.SubscribeKvEvents(2, "r", "");
  ASSERT_TRUE(again.ok());
  EXPECT_THAT(Drain(**again).front().reason, HasSubstr("at most 10 behind"));
}

TEST(KvEventLogTest, TheWakeupIsCalledOnceWhenSomethingComesAfterNothingOrAtTheEnd) {
  KvEventLog log;
  SequenceTable table(SequenceTableOptions{.kv_events = &log});
  auto sub = table.SubscribeKvEvents(0, "", "");
  ASSERT_TRUE(sub.ok());
  std::atomic<int> wakeups{0};
  (*sub)->SetWakeup([&] { ++wakeups; });
  EXPECT_EQ(Drain(**sub).size(), 2u);  // RESYNC, SNAPSHOT_DONE; then nothing: armed
  ASSERT_TRUE(table.Open("a", Recency()).ok());
  EXPECT_EQ(wakeups.load(), 1);
  StepOrDie(table, "a", 1);
  EXPECT_EQ(wakeups.load(), 1);  // not armed again until it finds nothing
  EXPECT_EQ(Drain(**sub).size(), 2u);
  StepOrDie(table, "a", 2);
  EXPECT_EQ(wakeups.load(), 2);
  EXPECT_EQ(Drain(**sub).size(), 1u);  // armed again
  log.EndSubscriptions("draining");    // the end wakes it too
  EXPECT_EQ(wakeups.load(), 3);
  KvEvent e;
  EXPECT_EQ((*sub)->Next(&e), Poll::kEnded);
  EXPECT_EQ((*sub)->end_status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(log.Stats().subscribers, 0);
}

TEST(KvEventLogTest, AWakeupScopeWakesOnceAtItsEnd) {
  KvEventLog log;
  SequenceTable table(SequenceTableOptions{.kv_events = &log});
  ASSERT_TRUE(table.Open("a", Recency()).ok());
  auto sub = table.SubscribeKvEvents(0, "", "");
  ASSERT_TRUE(sub.ok());
  int wakeups = 0;
  (*sub)->SetWakeup([&] { ++wakeups; });
  Drain(**sub);  // armed
  {
    KvEventWakeupScope outer;
    {
      KvEventWakeupScope inner;
      StepOrDie(table, "a", 1);
    }
    StepOrDie(table, "a", 2);
    EXPECT_EQ(wakeups, 0);
  }
  EXPECT_EQ(wakeups, 1);
  EXPECT_EQ(Drain(**sub).size(), 2u);
  {
    KvEventWakeupScope off(false);
    StepOrDie(table, "a", 3);
    EXPECT_EQ(wakeups, 2);  // at once
  }
}

TEST(KvEventLogTest, SubscribersAreLimited) {
  KvEventLog log(KvEventLogOptions{.max_subscribers = 2});
  SequenceTable table(SequenceTableOptions{.kv_events = &log});
  auto a = table.SubscribeKvEvents(0, "", "");
  auto b = table.SubscribeKvEvents(0, "", "");
  ASSERT_TRUE(a.ok() && b.ok());
  absl::Status refused = table.SubscribeKvEvents(0, "", "").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("2 KV event subscribers"));
  a->reset();
  EXPECT_TRUE(table.SubscribeKvEvents(0, "", "").ok());
}

// The snapshot rule with the interleavings forced by hand: a sequence that steps after
// as_of but before the table visits it gives its state as of as_of; one opened after
// as_of gives none; one closed after as_of gives its state before the close.
TEST(KvEventLogTest, SequencesGiveTheirStateAsOfTheSnapshotWhateverComesFirst) {
  KvEventLog log(KvEventLogOptions{.run = "r"});
  auto state = [](const char* id) {
    KvSequenceState s;
    s.sequence_id = id;
    s.prefill_len = 10;
    s.cache_size = 10;
    return s;
  };
  KvSequenceEvents stepped(&log, state("stepped")), closed(&log, state("closed")),
      idle(&log, state("idle"));
  stepped.Opened();
  closed.Opened();
  idle.Opened();
  EvictionDecision d;
  d.step = 1;
  d.cache_size = 7;
  d.evicted = {1, 2, 3, 4};
  stepped.Stepped(d, nullptr);  // id 4

  // As SequenceTable::SubscribeKvEvents does it, with the visits delayed.
  auto sub = log.Subscribe(0, "", "");
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE((*sub)->snapshot_pending());
  EXPECT_EQ((*sub)->as_of(), 4u);
  d.step = 2;
  d.cache_size = 8;
  d.evicted = {};
  stepped.Stepped(d, nullptr);  // id 5: gives its state first (step 1, 7 tokens)
  closed.Closed("client");       // id 6: gives its state first
  KvSequenceEvents late(&log, state("late"));
  late.Opened();  // id 7: opened after as_of, never in this snapshot
  for (KvSequenceEvents* s : {&stepped, &closed, &idle}) s->ContributeToSnapshots();
  late.ContributeToSnapshots();
  (*sub)->CompleteSnapshot();

  std::map<std::string, KvEvent> snapshot;
  std::vector<KvEvent> live;
  for (const KvEvent& e : Drain(**sub)) {
    if (e.kind == KvEventKind::kSnapshot) snapshot[e.sequence_id] = e;
    if (e.id != 0) live.push_back(e);
  }
  ASSERT_EQ(snapshot.size(), 3u);
  EXPECT_EQ(snapshot["stepped"].step, 1);
  EXPECT_EQ(snapshot["stepped"].cache_size, 7);
  EXPECT_EQ(snapshot["closed"].step, 0);
  EXPECT_EQ(snapshot["idle"].cache_size, 10);
  ASSERT_EQ(live.size(), 3u);
  EXPECT_EQ(live[0].id, 5u);
  EXPECT_EQ(live[2].sequence_id, "late");
  idle.Closed("client");
  stepped.Closed("client");
  late.Closed("client");
}

// Workers open, step and close sequences (with KV pools) while subscribers watch:
//   - a follower subscribes first and then keeps disconnecting and resuming from its
//     last id: it must see every step of every sequence exactly once, in order;
//   - a latecomer subscribes mid-run again and again (a snapshot each time), waiting on
//     its wakeup.
// At the end each one's model is exactly the table.
TEST(KvEventConcurrencyTest, SnapshotAndResumeAreExactWhileSequencesChange) {
  auto pools = Pools(2, 4096);
  KvEventLog log(KvEventLogOptions{.ring_capacity = 1 << 16, .run = "r"});
  SequenceTable table(SequenceTableOptions{.kv_pools = pools.get(), .kv_events = &log});
  constexpr int kWorkers = 4;
  constexpr int kSequences = 16;
  constexpr int64_t kSteps = 40;
  std::atomic<bool> done{false};

  Model follower;
  auto first = table.SubscribeKvEvents(0, "", "");  // before any sequence opens
  ASSERT_TRUE(first.ok());
  std::thread follow([&, s = *std::move(first)]() mutable {
    int64_t events = 0;
    KvEvent e;
    for (;;) {
      const bool finished = done.load();
      const Poll p = s->Next(&e);
      ASSERT_NE(p, Poll::kEnded);
      if (p == Poll::kNothing) {
        if (finished) break;
        std::this_thread::yield();
        continue;
      }
      follower.Apply(e);
      if (++events % 97 == 0) {  // disconnect, and resume from the last id
        s.reset();
        auto resumed = table.SubscribeKvEvents(follower.last_id, log.run(), "");
        ASSERT_TRUE(resumed.ok());
        ASSERT_FALSE((*resumed)->snapshot_pending());
        s = *std::move(resumed);
      }
    }
  });

  Model latecomer;
  std::string latecomer_errors;  // of the rounds before the last
  std::atomic<int> rounds{0};     // subscriptions the latecomer made mid-run
  std::thread late([&] {
    std::mutex mu;
    std::condition_variable cv;
    bool woken = false;
    for (;;) {
      latecomer_errors += latecomer.error;
      latecomer = Model();
      auto sub = table.SubscribeKvEvents(0, "", "");
      ASSERT_TRUE(sub.ok());
      (*sub)->SetWakeup([&] {
        std::lock_guard<std::mutex> lock(mu);
        woken = true;
        cv.notify_one();
      });
      KvEvent e;
      for (int i = 0; i < 100; ++i) {
        const bool finished = done.load();
        const Poll p = (*sub)->Next(&e);
        ASSERT_NE(p, Poll::kEnded);
        if (p == Poll::kEvent) {
          latecomer.Apply(e);
          continue;
        }
        if (finished) break;
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, std::chrono::milliseconds(5), [&] { return woken; });
        woken = false;
      }
      if (done.load()) {
        latecomer.ApplyAll(**sub);
        break;
      }
      ++rounds;
    }
  });

  // The workers wait for the latecomer to subscribe again every few sequences, so that
  // its snapshots are taken mid-run (a second at most, should it have failed).
  std::atomic<int64_t> stepped{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      for (int s = 0; s < kSequences; ++s) {
        const absl::Time give_up = absl::Now() + absl::Seconds(1);
        while (rounds.load() < s / 2 && absl::Now() < give_up) std::this_thread::yield();
        const std::string id = absl::StrCat("w", w, "-", s);
        ASSERT_TRUE(table.Open(id, Recency(20 + s, 8)).ok());
        for (int64_t t = 1; t <= kSteps; ++t) StepOrDie(table, id, t);
        stepped += kSteps;
        if (s % 3 != 0) {
          ASSERT_TRUE(table.Close(id).ok());
        }
      }
    });
  }
  for (std::thread& t : workers) t.join();
  done = true;
  follow.join();
  late.join();

  follower.ExpectMatches(table, pools.get());
  EXPECT_EQ(follower.resyncs, 1);
  EXPECT_EQ(static_cast<int64_t>(follower.steps_seen.size()), stepped.load());
  for (const auto& [key, times] : follower.steps_seen) {
    EXPECT_EQ(times, 1) << key.first << " step " << key.second;
  }
  latecomer.ExpectMatches(table, pools.get());
  EXPECT_EQ(latecomer_errors, "");
  EXPECT_GE(rounds.load(), kSequences / 2 - 1);
  EXPECT_EQ(log.Stats().dropped, 0u);
}

}  // namespace
}  // namespace kvcm

// WatchKvEvents against a real kvcached: a subscriber that connects mid-run and keeps
// reconnecting sees every event exactly once and in order (checked against the workers'
// own decisions and the daemon's state); one that never reads is dropped without slowing
// the steps; a too-old id gets RESYNC and a snapshot; a drain ends the watch; and
// kvcache-events prints the stream as JSON lines.
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::MetricValue;
using ::testing::HasSubstr;

// Small KV pools, so that the events carry blocks: 4 tokens per block, 64-byte blocks.
const std::vector<std::string> kPoolFlags = {
    "--pool_memory_bytes=1048576", "--kv_layers=1",       "--kv_heads=1",
    "--kv_head_dim=8",             "--kv_tokens_per_block=4", "--kv_dtype=float16",
    "--kv_shared_memory=false"};

std::vector<std::string> With(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

// One WatchKvEvents call read on its own thread.
class Watch {
 public:
  Watch(v1::KvCache::Stub& stub, uint64_t after, const std::string& run) {
    v1::WatchKvEventsRequest request;
    request.set_after_event_id(after);
    request.set_daemon_run(run);
    reader_ = stub.WatchKvEvents(&context_, request);
    thread_ = std::thread([this] {
      v1::KvEvent e;
      while (reader_->Read(&e)) {
        std::lock_guard<std::mutex> lock(mu_);
        events_.push_back(e);
        changed_.notify_all();
      }
      grpc::Status status = reader_->Finish();
      std::lock_guard<std::mutex> lock(mu_);
      status_ = status;
      ended_ = true;
      changed_.notify_all();
    });
  }
  ~Watch() { Stop(); }

  // Waits until `done(events)` holds (true) or `timeout` passes (false); woken by each
  // event received and by the end of the call.
  bool WaitFor(const std::function<bool(const std::vector<v1::KvEvent>&)>& done,
               absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_until(lock, absl::ToChronoTime(absl::Now() + timeout),
                               [&] { return done(events_); });
  }
  bool WaitForEnd(absl::Duration timeout) {
    return WaitFor([this](const auto&) { return ended_; }, timeout);
  }
  // Disconnects (cancels the call) and returns what it received.
  std::vector<v1::KvEvent> Stop() {
    if (thread_.joinable()) {
      context_.TryCancel();
      thread_.join();
    }
    return events();
  }
  std::vector<v1::KvEvent> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  grpc::Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::KvEvent>> reader_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable changed_;  // an event arrived, or the call ended
  std::vector<v1::KvEvent> events_;
  grpc::Status status_;
  bool ended_ = false;
};

// The resume point of a list of events (docs/EVENTS.md): the last non-zero id, or the
// as_of of the last SNAPSHOT_DONE.
uint64_t ResumePoint(const std::vector<v1::KvEvent>& events, uint64_t from) {
  for (const v1::KvEvent& e : events) {
    if (e.event_id() != 0) from = e.event_id();
    if (e.has_snapshot_done()) from = e.snapshot_done().as_of();
  }
  return from;
}

// What one worker decided for one step.
struct Decided {
  int64_t evicted = 0;
  int64_t cache_size = 0;
};

class KvEventsTest : public testing::DaemonTest {
 protected:
  double Published() { return MetricValue(Metrics(), "kvcache_kv_events_published_total"); }

  // Opens `id` (streaming_llm, 8 tokens: no scores) and steps it `steps` times on `stream`, writing
  // each decision to `decided`.
  void OpenAndStep(client::StepStream& stream, const std::string& id, int64_t prefill,
                   int64_t steps, std::map<int64_t, Decided>* decided) {
    ASSERT_TRUE(client_->Open(Budgeted(id, prefill)).ok());
    for (int64_t t = 1; t <= steps; ++t) {
      v1::StepBatch batch;
      client::AddReport(&batch, id, t);
      absl::StatusOr<v1::DecisionBatch> reply = stream.Step(batch);
      ASSERT_TRUE(reply.ok()) << reply.status();
      const v1::Decision& d = reply->decisions(0);
      ASSERT_EQ(d.code(), 0) << d.message();
      (*decided)[t] = {d.evicted_size(), d.cache_size()};
    }
  }

  // streaming_llm (no scores) at a budget of 8 tokens.
  static v1::OpenSequenceRequest Budgeted(const std::string& id, int64_t prefill) {
    v1::OpenSequenceRequest r = client::OpenRequest(id, prefill, 0.5, "streaming_llm");
    r.set_budget_tokens(8);
    return r;
  }
};

TEST_F(KvEventsTest, AMidRunSubscriberThatReconnectsSeesEveryEventExactlyOnceInOrder) {
  StartDaemon(kPoolFlags);
  constexpr int kWorkers = 3;
  constexpr int kSequences = 10;
  constexpr int64_t kSteps = 25;
  std::vector<std::map<std::string, std::map<int64_t, Decided>>> decided(kWorkers);
  std::atomic<int> sequences_done{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client_->OpenStepStream();
      ASSERT_TRUE(stream.ok());
      for (int s = 0; s < kSequences; ++s) {
        const std::string id = absl::StrCat("w", w, "-", s);
        OpenAndStep(**stream, id, 20 + s, kSteps, &decided[w][id]);
        if (s % 3 != 0) {
          ASSERT_TRUE(client_->Close(id).ok());
        }
        ++sequences_done;
      }
    });
  }

  // Connect mid-run, then disconnect and resume three times while the workers go on.
  const ::testing::AssertionResult mid_run = testing::WaitFor(
      [&] { return sequences_done.load() >= 4; }, absl::Seconds(60),
      "the workers stepped 4 sequences through");
  if (!mid_run) {
    for (std::thread& t : workers) t.join();
    FAIL() << mid_run.message();
  }
  std::vector<v1::KvEvent> seen;
  uint64_t after = 0;
  std::string run;
  for (int round = 0; round < 4; ++round) {
    Watch watch(client_->stub(), after, run);
    const size_t start = seen.size();
    ASSERT_TRUE(watch.WaitFor([](const auto& e) { return e.size() >= 40; }, absl::Seconds(20)));
    std::vector<v1::KvEvent> got = watch.Stop();
    seen.insert(seen.end(), got.begin(), got.end());
    after = ResumePoint(got, after);
    run = seen.back().daemon_run();
    if (round > 0) {  // a resume: no RESYNC, the next id exactly
      ASSERT_NE(got.front().event_id(), 0u) << got.front().DebugString();
      EXPECT_EQ(got.front().event_id(), seen[start - 1].event_id() + 1);
    }
  }
  for (std::thread& t : workers) t.join();
  {  // The rest, up to the newest event.
    Watch watch(client_->stub(), after, run);
    const double newest = Published();
    ASSERT_TRUE(watch.WaitFor(
        [&](const auto& e) { return !e.empty() && e.back().event_id() == newest; },
        absl::Seconds(20)));
    std::vector<v1::KvEvent> got = watch.Stop();
    seen.insert(seen.end(), got.begin(), got.end());
  }

  // One RESYNC (the first connection), then consecutive ids.
  ASSERT_TRUE(seen[0].has_resync());
  EXPECT_THAT(seen[0].resync().reason(), HasSubstr("start"));
  struct Known {
    int64_t last_step = 0;
    int64_t cache_size = 0;
    int64_t first_step_expected = 1;  // steps after the snapshot's
    std::map<int64_t, int> steps;     // step -> times seen
    std::vector<int64_t> held;
    bool open = true;
  };
  std::map<std::string, Known> known;
  uint64_t last_id = 0;
  for (const v1::KvEvent& e : seen) {
    if (e.has_resync()) {
      EXPECT_EQ(&e, &seen[0]) << "a second RESYNC: " << e.DebugString();
      continue;
    }
    if (e.has_snapshot()) {
      Known& k = known[e.sequence_id()];
      k.last_step = e.snapshot().last_step();
      k.cache_size = e.snapshot().cache_size();
      k.first_step_expected = k.last_step + 1;
      k.held.assign(e.snapshot().held_blocks().begin(), e.snapshot().held_blocks().end());
      continue;
    }
    if (e.has_snapshot_done()) {
      last_id = e.snapshot_done().as_of();
      continue;
    }
    ASSERT_EQ(e.event_id(), last_id + 1) << e.DebugString();
    last_id = e.event_id();
    if (e.has_opened()) {
      ASSERT_FALSE(known.contains(e.sequence_id())) << e.DebugString();
      known[e.sequence_id()].cache_size = e.opened().prefill_len();
      continue;
    }
    ASSERT_TRUE(known.contains(e.sequence_id())) << e.DebugString();
    Known& k = known[e.sequence_id()];
    ASSERT_TRUE(k.open) << e.DebugString();
    if (e.has_step()) {
      EXPECT_EQ(e.step().step(), k.last_step + 1) << e.DebugString();
      k.last_step = e.step().step();
      k.cache_size = e.step().cache_size();
      ++k.steps[e.step().step()];
    } else if (e.has_blocks()) {
      const size_t r = static_cast<size_t>(e.blocks().rank());
      if (k.held.size() <= r) k.held.resize(r + 1, 0);
      EXPECT_EQ(k.held[r] + e.blocks().leased_blocks() - e.blocks().released_blocks(),
                e.blocks().held_blocks());
      k.held[r] = e.blocks().held_blocks();
    } else if (e.has_closed()) {
      EXPECT_EQ(e.closed().reason(), "client");
      EXPECT_EQ(e.closed().last_step(), k.last_step);
      k.open = false;
    }
  }

  // Every step each worker had decided after the subscriber first knew its sequence came
  // exactly once, with the worker's own decision.
  int64_t checked = 0;
  for (int w = 0; w < kWorkers; ++w) {
    for (const auto& [id, steps] : decided[w]) {
      auto it = known.find(id);
      if (it == known.end()) continue;  // closed before the subscriber connected
      const Known& k = it->second;
      for (const auto& [step, d] : steps) {
        if (step < k.first_step_expected) {
          EXPECT_FALSE(k.steps.contains(step)) << id << " step " << step;
          continue;
        }
        ASSERT_TRUE(k.steps.contains(step)) << id << " step " << step;
        EXPECT_EQ(k.steps.at(step), 1) << id << " step " << step;
        ++checked;
      }
      EXPECT_EQ(k.steps.size(), static_cast<size_t>(kSteps - k.first_step_expected + 1)) << id;
    }
  }
  EXPECT_GT(checked, kSteps * kWorkers * 3);
  // What the subscriber knows is the daemon's state.
  absl::StatusOr<std::vector<v1::SequenceState>> listed = client_->List();
  ASSERT_TRUE(listed.ok());
  int64_t open = 0;
  for (const auto& [id, k] : known) open += k.open ? 1 : 0;
  EXPECT_EQ(open, static_cast<int64_t>(listed->size()));
  for (const v1::SequenceState& s : *listed) {
    ASSERT_TRUE(known.contains(s.sequence_id())) << s.sequence_id();
    EXPECT_TRUE(known[s.sequence_id()].open);
    EXPECT_EQ(known[s.sequence_id()].last_step, s.last_step());
    EXPECT_EQ(known[s.sequence_id()].cache_size, s.cache_size());
  }
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_kv_event_subscribers_dropped_total"), 0);
}

// A channel whose calls take few bytes before the application reads them.
std::unique_ptr<v1::KvCache::Stub> TightStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  return v1::KvCache::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

TEST_F(KvEventsTest, ASubscriberThatNeverReadsIsDroppedWithoutSlowingSteps) {
  StartDaemon({"--kv_events_ring=1024"});
  constexpr int kSequences = 32;
  constexpr int64_t kBatches = 150;  // 32 events each: far more than the ring
  for (int s = 0; s < kSequences; ++s) {
    ASSERT_TRUE(client_->Open(Budgeted(absl::StrCat("s", s), 16)).ok());
  }
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  int64_t next_step = 1;
  const auto run_batches = [&](int64_t batches) {
    const absl::Time start = absl::Now();
    for (int64_t b = 0; b < batches; ++b, ++next_step) {
      v1::StepBatch batch;
      for (int s = 0; s < kSequences; ++s) client::AddReport(&batch, absl::StrCat("s", s), next_step);
      absl::StatusOr<v1::DecisionBatch> reply = (*stream)->Step(batch);
      EXPECT_TRUE(reply.ok());
    }
    return absl::Now() - start;
  };
  const absl::Duration alone = run_batches(kBatches);

  auto tight = TightStub(daemon_->grpc_address());
  grpc::ClientContext context;
  v1::WatchKvEventsRequest request;
  request.set_after_event_id(0);
  std::unique_ptr<grpc::ClientReader<v1::KvEvent>> stuck = tight->WatchKvEvents(&context, request);
  // Attached (its RESYNC and snapshot are written), and not reading.
  ASSERT_TRUE(testing::WaitFor(
      [&] { return MetricValue(Metrics(), "kvcache_kv_event_subscribers") == 1; },
      absl::Seconds(10), "the subscriber that never reads was attached"));
  const absl::Duration watched = run_batches(kBatches);
  const std::string metrics = Metrics();
  EXPECT_EQ(MetricValue(metrics, "kvcache_kv_event_subscribers_dropped_total"), 1);
  EXPECT_EQ(MetricValue(metrics, "kvcache_kv_event_subscribers"), 0);
  EXPECT_GE(MetricValue(metrics, "kvcache_kv_events_published_total"), 2.0 * kBatches * kSequences);
  // Loose (machines under load vary): a step path that waited for the subscriber would
  // not finish at all.
  EXPECT_LT(watched, alone * 3 + absl::Seconds(1)) << "alone " << alone;

  // Reading now: what it was sent, the RESYNC marker, then ABORTED.
  std::vector<v1::KvEvent> got;
  v1::KvEvent e;
  while (stuck->Read(&e)) got.push_back(e);
  const grpc::Status status = stuck->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("after_event_id"));
  ASSERT_GE(got.size(), 3u);
  EXPECT_TRUE(got.back().has_resync());
  EXPECT_THAT(got.back().resync().reason(), HasSubstr("overflow"));
  uint64_t last = 0;
  for (const v1::KvEvent& ev : got) {
    if (ev.event_id() == 0) continue;
    if (last != 0) {
      EXPECT_EQ(ev.event_id(), last + 1);
    }
    last = ev.event_id();
  }
  EXPECT_LT(last, static_cast<uint64_t>(2 * kBatches * kSequences));
}

TEST_F(KvEventsTest, ATooOldIdGetsAResyncAndASnapshotOfTheOpenSequences) {
  StartDaemon(With(kPoolFlags, {"--kv_events_ring=16"}));
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  std::map<int64_t, Decided> decided;
  OpenAndStep(**stream, "a", 30, 12, &decided);
  OpenAndStep(**stream, "b", 10, 3, &decided);
  OpenAndStep(**stream, "gone", 10, 1, &decided);
  ASSERT_TRUE(client_->Close("gone").ok());
  std::string run;
  {
    Watch first(client_->stub(), 0, "");
    ASSERT_TRUE(first.WaitFor([](const auto& e) { return !e.empty(); }, absl::Seconds(10)));
    run = first.Stop().front().daemon_run();
  }
  EXPECT_EQ(run.size(), 16u);
  const double newest = Published();
  ASSERT_GT(newest, 16);

  struct Case {
    uint64_t after;
    std::string run;
    std::string why;
  };
  for (const Case& c : {Case{1, run, "are gone"}, Case{100000, run, "ahead"},
                        Case{5, "another", "daemon run 'another'"}}) {
    Watch watch(client_->stub(), c.after, c.run);
    ASSERT_TRUE(watch.WaitFor([](const auto& e) { return !e.empty() && e.back().has_snapshot_done(); },
                              absl::Seconds(10)));
    std::vector<v1::KvEvent> got = watch.Stop();
    ASSERT_EQ(got.size(), 4u) << c.why;
    EXPECT_TRUE(got[0].has_resync());
    EXPECT_THAT(got[0].resync().reason(), HasSubstr(c.why));
    EXPECT_EQ(got[0].resync().oldest_available(), static_cast<uint64_t>(newest) - 15);
    std::map<std::string, v1::SnapshotSequenceEvent> snapshot;
    for (int i = 1; i <= 2; ++i) {
      ASSERT_TRUE(got[i].has_snapshot());
      EXPECT_EQ(got[i].event_id(), 0u);
      snapshot[got[i].sequence_id()] = got[i].snapshot();
    }
    EXPECT_EQ(snapshot["a"].last_step(), 12);
    EXPECT_EQ(snapshot["a"].cache_size(), 8);
    EXPECT_EQ(snapshot["a"].prefill_len(), 30);
    EXPECT_EQ(snapshot["a"].budget(), 8);
    EXPECT_EQ(snapshot["a"].policy(), "streaming_llm");
    EXPECT_EQ(snapshot["a"].tp_world_size(), 1);
    EXPECT_THAT(snapshot["a"].held_blocks(), ::testing::ElementsAre(3));  // 8-9 tokens
    EXPECT_EQ(snapshot["b"].last_step(), 3);
    EXPECT_EQ(got[3].snapshot_done().as_of(), static_cast<uint64_t>(newest));
  }
}

TEST_F(KvEventsTest, ADrainEndsTheWatchAndKeepsNoEventsWhenOff) {
  StartDaemon({"--drain_deadline=60s"});
  Watch watch(client_->stub(), 0, "");
  ASSERT_TRUE(watch.WaitFor([](const auto& e) { return e.size() >= 2; }, absl::Seconds(10)));
  const absl::Time start = absl::Now();
  ASSERT_EQ(kill(daemon_->pid(), SIGTERM), 0);
  // The watch ends at once; the daemon exits well before its drain deadline (gRPC's
  // shutdown still waits some seconds for idle client connections).
  ASSERT_TRUE(watch.WaitForEnd(absl::Seconds(5)));
  EXPECT_EQ(daemon_->SignalAndWait(0, absl::Seconds(70)), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(watch.status().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(watch.status().error_message(), HasSubstr("draining"));

  daemon_.reset();
  StartDaemon({"--kv_events_ring=0"});
  Watch off(client_->stub(), 0, "");
  ASSERT_TRUE(off.WaitForEnd(absl::Seconds(10)));
  EXPECT_EQ(off.status().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(off.status().error_message(), HasSubstr("--kv_events_ring=0"));
  EXPECT_EQ(MetricValue(Metrics(), "kvcache_kv_events_published_total"), 0);
}

TEST_F(KvEventsTest, KvcacheEventsPrintsJsonLinesAndResumes) {
  StartDaemon();
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  std::map<int64_t, Decided> decided;
  OpenAndStep(**stream, "a", 12, 2, &decided);  // events 1 .. 3
  const auto run_tool = [&](const std::string& flags) {
    const std::string command = absl::StrCat(KVCM_BIN_DIR, "/kvcache-events --server=",
                                             daemon_->grpc_address(), " ", flags, " 2>/dev/null");
    std::string out;
    FILE* pipe = popen(command.c_str(), "r");
    char buffer[4096];
    while (pipe != nullptr && fgets(buffer, sizeof(buffer), pipe) != nullptr) out += buffer;
    EXPECT_EQ(pipe != nullptr ? pclose(pipe) : -1, 0) << command;
    std::vector<nlohmann::json> lines;
    size_t begin = 0;
    for (size_t end; (end = out.find('\n', begin)) != std::string::npos; begin = end + 1) {
      lines.push_back(nlohmann::json::parse(out.substr(begin, end - begin)));
    }
    return lines;
  };
  std::vector<nlohmann::json> lines = run_tool("--max_events=3");
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["kind"], "resync");
  EXPECT_EQ(lines[1]["kind"], "snapshot");
  EXPECT_EQ(lines[1]["sequence_id"], "a");
  EXPECT_EQ(lines[1]["last_step"], 2);
  EXPECT_EQ(lines[2]["kind"], "snapshot_done");
  EXPECT_EQ(lines[2]["as_of"], 3);
  const std::string run = lines[0]["daemon_run"];

  lines = run_tool(absl::StrCat("--after=1 --run=", run, " --max_events=2"));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["event_id"], 2);
  EXPECT_EQ(lines[0]["kind"], "step");
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_EQ(lines[0]["evicted"], 5);
  EXPECT_EQ(lines[0]["cache_size"], 8);
  EXPECT_EQ(lines[1]["event_id"], 3);
}

}  // namespace
}  // namespace kvcm

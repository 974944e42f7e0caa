// The client side of WatchKvEvents (kvcache-events, and routers written in C++): one JSON
// line per event, the resume rule, and a loop that follows the stream across reconnects.
// docs/EVENTS.md has the contract. Not thread-safe (one watcher per thread).
#ifndef KVCM_CLIENTS_EVENTS_EVENT_WATCH_H_
#define KVCM_CLIENTS_EVENTS_EVENT_WATCH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcm::events {

namespace v1 = ::kvcache::v1;

// The event as one line of JSON (no newline): event_id, daemon_run, unix_micros,
// sequence_id (when set), "kind" (opened, closed, step, blocks, resync, snapshot,
// snapshot_done) and the fields of that kind under their proto names.
std::string EventJson(const v1::KvEvent& event);

// Where to resume: the id of the last event received with a non-zero id, or the as_of of
// the last SNAPSHOT_DONE (RESYNC and snapshot entries do not move it).
struct WatchPosition {
  uint64_t after_event_id = 0;
  std::string daemon_run;

  void Advance(const v1::KvEvent& event);
};

struct WatchOptions {
  WatchPosition start;        // {0, ""}: from a snapshot of the open sequences
  bool resume = false;        // reconnect when the stream ends, from the last position
  absl::Duration reconnect_delay = absl::Seconds(1);
  int64_t max_events = 0;     // stop after this many events (0: never)
};

// Watches `stub` and calls `on_event` for each event until the stream ends (without
// `resume`), `max_events` have come, or `on_event` returns false. `on_status` hears of each
// stream's end (resume or not). Returns the last stream's status (OK when stopped by
// max_events or on_event).
absl::Status Watch(v1::KvCache::Stub& stub, const WatchOptions& options,
                   const std::function<bool(const v1::KvEvent&)>& on_event,
                   const std::function<void(const absl::Status&, const WatchPosition&)>& on_status,
                   WatchPosition* position);

}  // namespace kvcm::events

#endif  // KVCM_CLIENTS_EVENTS_EVENT_WATCH_H_

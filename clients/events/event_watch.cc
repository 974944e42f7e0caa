#include "clients/events/event_watch.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcm::events {
namespace {

using Json = nlohmann::ordered_json;

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace

std::string EventJson(const v1::KvEvent& e) {
  Json j;
  j["event_id"] = e.event_id();
  j["daemon_run"] = e.daemon_run();
  j["unix_micros"] = e.unix_micros();
  if (!e.sequence_id().empty()) j["sequence_id"] = e.sequence_id();
  switch (e.kind_case()) {
    case v1::KvEvent::kOpened:
      j["kind"] = "opened";
      j["prefill_len"] = e.opened().prefill_len();
      j["budget"] = e.opened().budget();
      j["policy"] = e.opened().policy();
      j["tp_world_size"] = e.opened().tp_world_size();
      break;
    case v1::KvEvent::kClosed:
      j["kind"] = "closed";
      j["reason"] = e.closed().reason();
      j["last_step"] = e.closed().last_step();
      break;
    case v1::KvEvent::kStep:
      j["kind"] = "step";
      j["step"] = e.step().step();
      j["evicted"] = e.step().evicted();
      j["cache_size"] = e.step().cache_size();
      break;
    case v1::KvEvent::kBlocks:
      j["kind"] = "blocks";
      j["rank"] = e.blocks().rank();
      j["step"] = e.blocks().step();
      j["leased_blocks"] = e.blocks().leased_blocks();
      j["released_blocks"] = e.blocks().released_blocks();
      j["held_blocks"] = e.blocks().held_blocks();
      break;
    case v1::KvEvent::kResync:
      j["kind"] = "resync";
      j["reason"] = e.resync().reason();
      j["oldest_available"] = e.resync().oldest_available();
      break;
    case v1::KvEvent::kSnapshot:
      j["kind"] = "snapshot";
      j["prefill_len"] = e.snapshot().prefill_len();
      j["budget"] = e.snapshot().budget();
      j["policy"] = e.snapshot().policy();
      j["tp_world_size"] = e.snapshot().tp_world_size();
      j["last_step"] = e.snapshot().last_step();
      j["cache_size"] = e.snapshot().cache_size();
      j["held_blocks"] = Json(std::vector<int64_t>(e.snapshot().held_blocks().begin(),
                                                   e.snapshot().held_blocks().end()));
      break;
    case v1::KvEvent::kSnapshotDone:
      j["kind"] = "snapshot_done";
      j["as_of"] = e.snapshot_done().as_of();
      break;
    case v1::KvEvent::KIND_NOT_SET:
      j["kind"] = "unknown";
      break;
  }
  return j.dump();
}

void WatchPosition::Advance(const v1::KvEvent& event) {
  if (event.event_id() != 0) {
    after_event_id = event.event_id();
    daemon_run = event.daemon_run();
  } else if (event.has_snapshot_done()) {
    after_event_id = event.snapshot_done().as_of();
    daemon_run = event.daemon_run();
  }
}

absl::Status Watch(v1::KvCache::Stub& stub, const WatchOptions& options,
                   const std::function<bool(const v1::KvEvent&)>& on_event,
                   const std::function<void(const absl::Status&, const WatchPosition&)>& on_status,
                   WatchPosition* position) {
  *position = options.start;
  int64_t seen = 0;
  for (;;) {
    grpc::ClientContext context;
    v1::WatchKvEventsRequest request;
    request.set_after_event_id(position->after_event_id);
    request.set_daemon_run(position->daemon_run);
    std::unique_ptr<grpc::ClientReader<v1::KvEvent>> reader = stub.WatchKvEvents(&context, request);
    v1::KvEvent event;
    bool stopped = false;
    while (reader->Read(&event)) {
      position->Advance(event);
      if (!on_event(event) || (options.max_events > 0 && ++seen >= options.max_events)) {
        stopped = true;
        context.TryCancel();
        break;
      }
    }
    const absl::Status status = FromGrpc(reader->Finish());
    if (stopped) return absl::OkStatus();
    if (on_status) on_status(status, *position);
    if (!options.resume) return status;
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(options.reconnect_delay));
  }
}

}  // namespace kvcm::events

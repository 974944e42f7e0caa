// KvEventsReactor: one WatchKvEvents call, i.e. one subscriber of the daemon's KV events
// (cache_manager/events/kv_events.h). Writes one event at a time, taken from its subscription;
// the log bounds what a subscriber may leave unread (past it the subscriber is dropped,
// gets a RESYNC marker, and the call ends ABORTED), so the reactor buffers one event.
// Never blocks: when the subscription has nothing, the reactor waits for its wakeup, which
// comes on the engine thread that appends the next event (after its batch's decisions
// are out: KvEventWakeupScope) and starts the write there; the writes after it start from
// OnWriteDone, on gRPC's threads.
// The call ends on cancel, when the log ends every subscription (drain: UNAVAILABLE), or
// when the subscriber is dropped.
//
// Lifetime: deletes itself in OnDone, once its subscription is gone (which waits for a
// wakeup in progress). OnDone comes only after Finish, so the reactor lives until Start.
#ifndef KVCM_SERVER_KV_EVENTS_REACTOR_H_
#define KVCM_SERVER_KV_EVENTS_REACTOR_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "cache_manager/base/mutex.h"
#include "cache_manager/events/kv_events.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcm::server {

// The wire form of an event; `daemon_run` is the log's run().
void ToProto(const KvEvent& event, absl::string_view daemon_run, ::kvcache::v1::KvEvent* out);

// Writes serialized KvEvents: the service takes WatchKvEvents raw (kvcache_service.h).
class KvEventsReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit KvEventsReactor(std::string daemon_run);

  // Starts writing `subscription`'s events, or ends the call at once with `refusal` when it
  // is not OK (`subscription` may then be null). Called once, from any thread, possibly
  // after OnCancel (the subscription is taken on an engine thread while gRPC may already
  // have cancelled the call): the call then ends CANCELLED.
  void Start(std::unique_ptr<KvEventSubscription> subscription, const grpc::Status& refusal);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  ~KvEventsReactor() override = default;

  // Starts the next write, or finishes the call, unless a write is in flight or there is
  // nothing yet (then the wakeup calls it again).
  void Pump() ABSL_LOCKS_EXCLUDED(mu_);

  const std::string daemon_run_;
  Mutex mu_;
  std::unique_ptr<KvEventSubscription> subscription_ ABSL_GUARDED_BY(mu_);
  KvEvent event_ ABSL_GUARDED_BY(mu_);  // reused
  ::kvcache::v1::KvEvent reply_;  // filled under mu_
  grpc::ByteBuffer reply_bytes_;  // reply_ serialized; gRPC reads it until OnWriteDone
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_KV_EVENTS_REACTOR_H_

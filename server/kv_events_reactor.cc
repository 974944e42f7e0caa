#include "server/kv_events_reactor.h"

#include <optional>
#include <utility>

#include "server/translate.h"

namespace kvcm::server {

void ToProto(const KvEvent& e, absl::string_view daemon_run, ::kvcache::v1::KvEvent* out) {
  out->Clear();
  out->set_event_id(e.id);
  out->set_daemon_run(std::string(daemon_run));
  out->set_unix_micros(e.unix_micros);
  out->set_sequence_id(e.sequence_id);
  switch (e.kind) {
    case KvEventKind::kOpened: {
      auto* o = out->mutable_opened();
      o->set_prefill_len(e.prefill_len);
      o->set_budget(e.budget);
      o->set_policy(e.policy);
      o->set_tp_world_size(e.tp_world_size);
      break;
    }
    case KvEventKind::kClosed: {
      auto* c = out->mutable_closed();
      c->set_reason(e.reason);
      c->set_last_step(e.step);
      break;
    }
    case KvEventKind::kStep: {
      auto* s = out->mutable_step();
      s->set_step(e.step);
      s->set_evicted(e.evicted);
      s->set_cache_size(e.cache_size);
      break;
    }
    case KvEventKind::kBlocks: {
      auto* b = out->mutable_blocks();
      b->set_rank(e.rank);
      b->set_step(e.step);
      b->set_leased_blocks(e.leased_blocks);
      b->set_released_blocks(e.released_blocks);
      b->set_held_blocks(e.held_blocks);
      break;
    }
    case KvEventKind::kResync: {
      auto* r = out->mutable_resync();
      r->set_reason(e.reason);
      r->set_oldest_available(e.oldest_available);
      break;
    }
    case KvEventKind::kSnapshot: {
      auto* s = out->mutable_snapshot();
      s->set_prefill_len(e.prefill_len);
      s->set_budget(e.budget);
      s->set_policy(e.policy);
      s->set_last_step(e.step);
      s->set_cache_size(e.cache_size);
      s->mutable_held_blocks()->Add(e.held_per_rank.begin(), e.held_per_rank.end());
      s->set_tp_world_size(e.tp_world_size);
      break;
    }
    case KvEventKind::kSnapshotDone:
      out->mutable_snapshot_done()->set_as_of(e.as_of);
      break;
  }
}

KvEventsReactor::KvEventsReactor(std::string daemon_run) : daemon_run_(std::move(daemon_run)) {}

void KvEventsReactor::Start(std::unique_ptr<KvEventSubscription> subscription,
                            const grpc::Status& refusal) {
  if (!refusal.ok() || subscription == nullptr) {
    {
      MutexLock lock(&mu_);
      finished_ = true;
    }
    subscription.reset();
    Finish(refusal.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "no subscription") : refusal);
    return;
  }
  // The subscription lives until OnDone, which waits for a wakeup in progress. The wakeup
  // is set before the subscription is published: Pump finds it only under mu_.
  subscription->SetWakeup([this] { Pump(); });
  {
    MutexLock lock(&mu_);
    subscription_ = std::move(subscription);
  }
  Pump();
}

void KvEventsReactor::Pump() {
  bool write = false;
  std::optional<grpc::Status> finish;
  {
    MutexLock lock(&mu_);
    if (writing_ || finished_ || subscription_ == nullptr) return;
    if (cancelled_) {
      finished_ = true;
      finish = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    } else {
      switch (subscription_->Next(&event_)) {
        case KvEventSubscription::Poll::kEvent: {
          ToProto(event_, daemon_run_, &reply_);
          bool own_buffer = false;
          reply_bytes_.Clear();  // the last write is done: its bytes are free
          (void)grpc::SerializationTraits<::kvcache::v1::KvEvent>::Serialize(
              reply_, &reply_bytes_, &own_buffer);
          writing_ = write = true;
          break;
        }
        case KvEventSubscription::Poll::kNothing:
          return;
        case KvEventSubscription::Poll::kEnded:
          finished_ = true;
          finish = ToGrpc(subscription_->end_status());
          break;
      }
    }
  }
  if (write) StartWrite(&reply_bytes_);
  if (finish) Finish(*finish);
}

void KvEventsReactor::OnWriteDone(bool ok) {
  {
    MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;  // the stream broke: the client is gone
  }
  Pump();
}

void KvEventsReactor::OnCancel() {
  {
    MutexLock lock(&mu_);
    cancelled_ = true;
  }
  Pump();
}

void KvEventsReactor::OnDone() {
  std::unique_ptr<KvEventSubscription> subscription;
  {
    MutexLock lock(&mu_);
    subscription = std::move(subscription_);
  }
  subscription.reset();  // detaches; waits for a wakeup in progress (it finds no subscription)
  delete this;
}

}  // namespace kvcm::server

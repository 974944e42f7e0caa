#include "server/step_stream_reactor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/kvcache_service.h"

namespace kvcm::server {

StepStreamReactor::StepStreamReactor(KvCacheService* service, StepBatchProcessor* processor,
                                     ServerMetrics* metrics, int32_t max_inflight,
                                     std::string tenant, absl::Duration idle_timeout)
    : service_(service),
      processor_(processor),
      metrics_(metrics),
      account_(Rpc::kStepStream, metrics),
      max_inflight_(max_inflight),
      tenant_(std::move(tenant)),
      idle_timeout_(idle_timeout) {
  slots_.reserve(static_cast<size_t>(max_inflight));
  for (int32_t i = 0; i < max_inflight; ++i) slots_.push_back(std::make_unique<Slot>());
}

void StepStreamReactor::Start(const grpc::Status& refusal) {
  if (!refusal.ok()) {
    account_.Failed(static_cast<absl::StatusCode>(refusal.error_code()));
    {
      MutexLock lock(&mu_);
      finished_ = true;
    }
    Finish(refusal);
    return;
  }
  accepted_ = true;
  metrics_->StreamOpened();
  {
    MutexLock lock(&mu_);
    reading_ = true;
    last_read_ = absl::Now();
    if (idle_timeout_ > absl::ZeroDuration()) SetIdleAlarmLocked(last_read_ + idle_timeout_);
  }
  StartRead(&SlotAt(0).request_bytes);
}

void StepStreamReactor::SetIdleAlarmLocked(absl::Time deadline) {
  // The alarm it replaces has fired: destroying it is safe (its callback holds its own
  // reference) and setting a used Alarm again is not.
  idle_alarm_ = std::make_unique<grpc::Alarm>();
  idle_alarm_set_ = true;
  idle_alarm_->Set(absl::ToChronoTime(deadline), [this](bool fired) { OnIdleAlarm(fired); });
}

void StepStreamReactor::OnIdleAlarm(bool fired) {
  bool finish = false;
  bool delete_now = false;
  {
    MutexLock lock(&mu_);
    idle_alarm_set_ = false;
    const bool over = finished_ || cancelled_ || done_;
    // Only the client's silence counts: a batch still in the engine or a reply not yet
    // written is the daemon's to answer.
    const bool owes_nothing = read_seq_ == written_seq_ && in_engine_ == 0 && !writing_;
    const absl::Time idle_until = last_read_ + idle_timeout_;
    if (fired && !over && owes_nothing && absl::Now() >= idle_until) {
      finished_ = true;
      finish = true;
    } else if (!over) {
      SetIdleAlarmLocked(std::max(idle_until, absl::Now() + absl::Milliseconds(100)));
    }
    delete_now = CanDeleteLocked();
  }
  if (delete_now) {
    delete this;
    return;
  }
  if (finish) {
    Finish(grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("step stream idle: no StepBatch for ", absl::FormatDuration(idle_timeout_),
                     " (--stream_idle_timeout), so kvcached ended it to free its slot; the "
                     "stream's sequences stay open: open a new stream to go on")));
  }
}

StepStreamReactor::Slot* StepStreamReactor::TakeWriteLocked() {
  if (writing_ || finished_ || cancelled_ || written_seq_ == read_seq_) return nullptr;
  Slot& oldest = SlotAt(written_seq_);
  if (!oldest.decided) return nullptr;
  writing_ = true;
  return &oldest;
}

void StepStreamReactor::Write(Slot* slot) {
  bool own_buffer = false;
  // The slot's previous reply is written (its OnWriteDone came); gRPC serializes only into
  // an empty buffer.
  slot->reply_bytes.Clear();
  // Fails only past 2 GiB, which --max_message_bytes keeps replies under.
  (void)grpc::SerializationTraits<::kvcache::v1::DecisionBatch>::Serialize(
      slot->batch.reply(), &slot->reply_bytes, &own_buffer);
  StartWrite(&slot->reply_bytes);
}

bool StepStreamReactor::TakeReadLocked() {
  if (reading_ || reads_done_ || finished_ || cancelled_) return false;
  if (read_seq_ - written_seq_ >= max_inflight_) return false;  // back-pressure
  reading_ = true;
  return true;
}

std::optional<grpc::Status> StepStreamReactor::TakeFinishLocked() {
  if (finished_ || writing_) return std::nullopt;  // a write in flight finishes later
  if (cancelled_) {
    finished_ = true;
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
  if (reads_done_ && written_seq_ == read_seq_) {  // every batch answered
    finished_ = true;
    return read_error_;
  }
  return std::nullopt;
}

void StepStreamReactor::OnReadDone(bool ok) {
  std::optional<grpc::Status> finish;
  Slot* slot = nullptr;
  absl::Status parsed;
  if (ok) {
    // Parsed outside the lock: the slot read into is this reactor's alone until it is
    // counted as read below.
    Slot* read_into = nullptr;
    {
      MutexLock lock(&mu_);
      read_into = &SlotAt(read_seq_);
    }
    parsed = ParseRequest(read_into->request_bytes, &read_into->request);
    read_into->request_bytes.Clear();
  }
  {
    MutexLock lock(&mu_);
    reading_ = false;
    if (!ok || !parsed.ok()) {  // the client half-closed, the call ended, or bad bytes
      reads_done_ = true;
      if (!parsed.ok()) {
        read_error_ = grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("message ", read_seq_ + 1, " of this stream: ", parsed.message(),
                         "; the stream ends after the replies to the batches before it"));
        account_.Failed(parsed.code());
      }
      finish = TakeFinishLocked();
    } else {
      slot = &SlotAt(read_seq_++);
      slot->decided = false;
      ++in_engine_;
      last_read_ = absl::Now();
    }
  }
  if (slot == nullptr) {
    if (finish) Finish(*finish);
    return;
  }
  // BatchDone may run inside (single-rank batches decided at once) or on an engine thread.
  processor_->Process(slot->request, tenant_, account_, &slot->batch, this);
  grpc::ByteBuffer* next = nullptr;
  {
    MutexLock lock(&mu_);
    if (TakeReadLocked()) next = &SlotAt(read_seq_).request_bytes;
  }
  if (next != nullptr) StartRead(next);
}

void StepStreamReactor::BatchDone(PendingBatch* batch) {
  Slot* to_write = nullptr;
  std::optional<grpc::Status> finish;
  bool delete_now = false;
  {
    MutexLock lock(&mu_);
    for (auto& slot : slots_) {
      if (&slot->batch == batch) slot->decided = true;
    }
    --in_engine_;
    to_write = TakeWriteLocked();
    if (to_write == nullptr) finish = TakeFinishLocked();
    delete_now = CanDeleteLocked();
  }
  if (delete_now) {
    delete this;
    return;
  }
  if (to_write != nullptr) Write(to_write);
  if (finish) Finish(*finish);
}

void StepStreamReactor::OnWriteDone(bool ok) {
  Slot* to_write = nullptr;
  grpc::ByteBuffer* next_read = nullptr;
  std::optional<grpc::Status> finish;
  {
    MutexLock lock(&mu_);
    writing_ = false;
    if (ok) {
      SlotAt(written_seq_).decided = false;
      ++written_seq_;  // that slot is free again
    } else {
      cancelled_ = true;  // the stream broke: the client is gone
    }
    to_write = TakeWriteLocked();
    if (TakeReadLocked()) next_read = &SlotAt(read_seq_).request_bytes;
    if (to_write == nullptr) finish = TakeFinishLocked();
  }
  if (to_write != nullptr) Write(to_write);
  if (next_read != nullptr) StartRead(next_read);
  if (finish) Finish(*finish);
}

void StepStreamReactor::OnCancel() {
  std::optional<grpc::Status> finish;
  {
    MutexLock lock(&mu_);
    cancelled_ = true;
    finish = TakeFinishLocked();
  }
  if (finish) Finish(*finish);
}

void StepStreamReactor::OnDone() {
  if (accepted_) metrics_->StreamClosed();
  service_->StreamDone();
  bool delete_now;
  {
    MutexLock lock(&mu_);
    done_ = true;
    // Its callback (another thread) runs soon and deletes the reactor if nothing else does.
    if (idle_alarm_set_) idle_alarm_->Cancel();
    delete_now = CanDeleteLocked();
  }
  if (delete_now) delete this;
}

}  // namespace kvcm::server

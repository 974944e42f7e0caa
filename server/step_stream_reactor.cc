#include "server/step_stream_reactor.h"

#include <utility>

#include "server/kvcache_service.h"

namespace kvcm::server {

StepStreamReactor::StepStreamReactor(KvCacheService* service, StepBatchProcessor* processor,
                                     ServerMetrics* metrics, int32_t max_inflight,
                                     std::string tenant)
    : service_(service),
      processor_(processor),
      metrics_(metrics),
      max_inflight_(max_inflight),
      tenant_(std::move(tenant)) {
  slots_.reserve(static_cast<size_t>(max_inflight));
  for (int32_t i = 0; i < max_inflight; ++i) slots_.push_back(std::make_unique<Slot>());
}

void StepStreamReactor::Start(const grpc::Status& refusal) {
  if (!refusal.ok()) {
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
  }
  StartRead(&SlotAt(0).request);
}

const ::kvcache::v1::DecisionBatch* StepStreamReactor::TakeWriteLocked() {
  if (writing_ || finished_ || cancelled_ || written_seq_ == read_seq_) return nullptr;
  Slot& oldest = SlotAt(written_seq_);
  if (!oldest.decided) return nullptr;
  writing_ = true;
  return &oldest.batch.reply();
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
    return grpc::Status::OK;
  }
  return std::nullopt;
}

void StepStreamReactor::OnReadDone(bool ok) {
  std::optional<grpc::Status> finish;
  Slot* slot = nullptr;
  {
    MutexLock lock(&mu_);
    reading_ = false;
    if (!ok) {  // the client half-closed, or the call ended
      reads_done_ = true;
      finish = TakeFinishLocked();
    } else {
      slot = &SlotAt(read_seq_++);
      slot->decided = false;
      ++in_engine_;
    }
  }
  if (slot == nullptr) {
    if (finish) Finish(*finish);
    return;
  }
  // BatchDone may run inside (single-rank batches decided at once) or on an engine thread.
  processor_->Process(slot->request, tenant_, Rpc::kStepStream, &slot->batch, this);
  ::kvcache::v1::StepBatch* next = nullptr;
  {
    MutexLock lock(&mu_);
    if (TakeReadLocked()) next = &SlotAt(read_seq_).request;
  }
  if (next != nullptr) StartRead(next);
}

void StepStreamReactor::BatchDone(PendingBatch* batch) {
  const ::kvcache::v1::DecisionBatch* to_write = nullptr;
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
    delete_now = done_ && in_engine_ == 0;
  }
  if (delete_now) {
    delete this;
    return;
  }
  if (to_write != nullptr) StartWrite(to_write);
  if (finish) Finish(*finish);
}

void StepStreamReactor::OnWriteDone(bool ok) {
  const ::kvcache::v1::DecisionBatch* to_write = nullptr;
  ::kvcache::v1::StepBatch* next_read = nullptr;
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
    if (TakeReadLocked()) next_read = &SlotAt(read_seq_).request;
    if (to_write == nullptr) finish = TakeFinishLocked();
  }
  if (to_write != nullptr) StartWrite(to_write);
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
    delete_now = in_engine_ == 0;
  }
  if (delete_now) delete this;
}

}  // namespace kvcm::server

#include "server/step_stream_reactor.h"

#include <utility>

#include "server/kvcache_service.h"

namespace kvcm::server {

StepStreamReactor::StepStreamReactor(KvCacheService* service, StepBatchProcessor* processor,
                                     ServerMetrics* metrics)
    : service_(service), processor_(processor), metrics_(metrics), link_(std::make_shared<Link>()) {
  absl::MutexLock lock(&link_->mu);
  link_->reactor = this;
}

void StepStreamReactor::Start(const grpc::Status& refusal) {
  if (!refusal.ok()) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    Finish(refusal);
    return;
  }
  accepted_ = true;
  metrics_->StreamOpened();
  StartRead(&request_);
}

std::optional<grpc::Status> StepStreamReactor::TakeFinishLocked() {
  if (finished_ || writing_) return std::nullopt;  // a write in flight finishes later
  if (cancelled_) {
    finished_ = true;
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }
  if (in_flight_ > 0) return std::nullopt;  // answer what was asked first
  if (reads_done_) {
    finished_ = true;
    return grpc::Status::OK;
  }
  return std::nullopt;
}

void StepStreamReactor::OnReadDone(bool ok) {
  std::optional<grpc::Status> finish;
  if (!ok) {  // the client half-closed, or the call ended
    {
      absl::MutexLock lock(&mu_);
      reads_done_ = true;
      finish = TakeFinishLocked();
    }
    if (finish) Finish(*finish);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  // The reply may come back inside Process (single-rank sequences) or later from the
  // thread of another rank's report; either way through the link.
  processor_->Process(request_, Rpc::kStepStream,
                      [link = link_](::kvcache::v1::DecisionBatch reply) {
                        absl::MutexLock lock(&link->mu);
                        if (link->reactor != nullptr) link->reactor->Deliver(std::move(reply));
                      });
  bool read_more;
  {
    absl::MutexLock lock(&mu_);
    read_more = !finished_;
  }
  if (read_more) StartRead(&request_);
}

void StepStreamReactor::Deliver(::kvcache::v1::DecisionBatch reply) {
  const ::kvcache::v1::DecisionBatch* to_write = nullptr;
  {
    absl::MutexLock lock(&mu_);
    --in_flight_;
    if (finished_ || cancelled_) return;  // nobody to answer any more
    writes_.push_back(std::move(reply));
    if (!writing_) {
      writing_ = true;
      to_write = &writes_.front();  // deque elements stay put while others are appended
    }
  }
  if (to_write != nullptr) StartWrite(to_write);
}

void StepStreamReactor::OnWriteDone(bool ok) {
  const ::kvcache::v1::DecisionBatch* to_write = nullptr;
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    writes_.pop_front();
    if (!ok) cancelled_ = true;  // the stream broke: the client is gone
    if (ok && !writes_.empty()) {
      to_write = &writes_.front();
    } else {
      writes_.clear();
      writing_ = false;
      finish = TakeFinishLocked();
    }
  }
  if (to_write != nullptr) StartWrite(to_write);
  if (finish) Finish(*finish);
}

void StepStreamReactor::OnCancel() {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    finish = TakeFinishLocked();
  }
  if (finish) Finish(*finish);
}

void StepStreamReactor::OnDone() {
  {
    absl::MutexLock lock(&link_->mu);
    link_->reactor = nullptr;
  }
  if (accepted_) metrics_->StreamClosed();
  service_->StreamDone();
  delete this;
}

}  // namespace kvcm::server

// StepStreamReactor: one StepStream call, i.e. one worker rank. Reads StepBatches into a
// fixed ring of `max_inflight` batch slots, hands each to the StepBatchProcessor, and
// writes each DecisionBatch in the order the batches were read (the client still matches
// them by batch_id). With every slot busy (batches in the engine, or replies the client
// has not read yet) it stops reading: HTTP/2 flow control then holds the client back, and
// the daemon buffers nothing more for this stream.
//
// Messages travel as bytes that the reactor parses and serializes itself, so that a
// message that does not parse ends the stream with INVALID_ARGUMENT (once the batches read
// before it are answered) instead of looking like the client's half-close.
//
// Idle streams: with an idle timeout, a stream that owes the client nothing (every batch
// answered) and received no batch for that long is ended with UNAVAILABLE, which frees
// its --max_streams slot; its sequences stay open for the next stream. A grpc::Alarm
// checks it (gRPC's timer thread, no engine work).
//
// Lifetime: a batch of a tensor-parallel step may stay in the engine after the call has
// ended (until its other ranks report, the join times out, or the sequence closes). The
// reactor then outlives OnDone and deletes itself when its last batch comes back and its
// idle alarm has fired or been cancelled.
#ifndef KVCM_SERVER_STEP_STREAM_REACTOR_H_
#define KVCM_SERVER_STEP_STREAM_REACTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "cache_manager/base/mutex.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/metrics.h"
#include "server/step_batch_processor.h"

namespace kvcm::server {

class KvCacheService;

class StepStreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                                public BatchCompletion {
 public:
  StepStreamReactor(KvCacheService* service, StepBatchProcessor* processor,
                    ServerMetrics* metrics, int32_t max_inflight, std::string tenant,
                    absl::Duration idle_timeout = absl::ZeroDuration());  // 0: never

  // Starts reading, or ends the call at once with `refusal` when it is not OK (counted as
  // one of the stream's errors).
  void Start(const grpc::Status& refusal);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  void BatchDone(PendingBatch* batch) override;

 private:
  struct Slot {
    grpc::ByteBuffer request_bytes;  // read into, then parsed into `request`
    ::kvcache::v1::StepBatch request;
    PendingBatch batch;
    grpc::ByteBuffer reply_bytes;  // the reply, serialized for its write
    bool decided = false;  // BatchDone came; the reply may be written
  };

  ~StepStreamReactor() override = default;

  Slot& SlotAt(int64_t sequence) { return *slots_[static_cast<size_t>(sequence % max_inflight_)]; }
  // Starts the next write when none is in flight and the oldest batch is decided.
  // Returns the slot whose reply to write (the caller calls Write after unlocking), or null.
  Slot* TakeWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Serializes the slot's reply and starts writing it.
  void Write(Slot* slot);
  // Whether to start the next read now (a slot is free and reading is not over).
  bool TakeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When the call should end now, marks it finished and returns the status to finish with.
  std::optional<grpc::Status> TakeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether nothing is left to keep the reactor alive after OnDone.
  bool CanDeleteLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return done_ && in_engine_ == 0 && !idle_alarm_set_;
  }
  // Sets a fresh idle alarm for `deadline` (an Alarm is never set twice).
  void SetIdleAlarmLocked(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnIdleAlarm(bool fired);

  KvCacheService* const service_;
  StepBatchProcessor* const processor_;
  ServerMetrics* const metrics_;
  const RpcAccount account_;  // StepStream's: every batch, refusal and bad message
  const int32_t max_inflight_;
  const std::string tenant_;
  const absl::Duration idle_timeout_;
  std::vector<std::unique_ptr<Slot>> slots_;  // a ring, by read sequence number

  Mutex mu_;
  int64_t read_seq_ ABSL_GUARDED_BY(mu_) = 0;     // batches read so far (next slot to fill)
  int64_t written_seq_ ABSL_GUARDED_BY(mu_) = 0;  // replies fully written (oldest busy slot)
  int64_t in_engine_ ABSL_GUARDED_BY(mu_) = 0;    // batches read, BatchDone not yet called
  bool reading_ ABSL_GUARDED_BY(mu_) = false;     // a read is in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;     // a write is in flight
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  // Why reading stopped early (a message that did not parse): the stream's final status.
  grpc::Status read_error_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;        // OnDone ran
  absl::Time last_read_ ABSL_GUARDED_BY(mu_);    // when the last batch arrived
  std::unique_ptr<grpc::Alarm> idle_alarm_ ABSL_GUARDED_BY(mu_);
  bool idle_alarm_set_ ABSL_GUARDED_BY(mu_) = false;  // its callback has not run yet
  bool accepted_ = false;                         // counted in kvcache_streams_open
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_STEP_STREAM_REACTOR_H_

#include "server/step_batch_processor.h"

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/translate.h"

namespace kvcm::server {
namespace {

// The reply under construction. `remaining` starts one above the report count: the
// submitting loop holds that extra share, so the reply cannot go out before every report
// has at least been submitted.
struct PendingBatch {
  absl::Mutex mu;
  ::kvcache::v1::DecisionBatch reply ABSL_GUARDED_BY(mu);
  int64_t remaining ABSL_GUARDED_BY(mu) = 0;
  StepBatchProcessor::ReplyCallback on_reply;
  absl::Time start;
  // in_submit[i]: report i is inside SubmitRankReport right now, so a callback for it
  // comes from the report that completed the step.
  std::unique_ptr<std::atomic<bool>[]> in_submit;
  Rpc rpc = Rpc::kStep;
  ServerMetrics* metrics = nullptr;

  // Marks one share done; the last one sends the reply.
  void Release() {
    ::kvcache::v1::DecisionBatch out;
    {
      absl::MutexLock lock(&mu);
      if (--remaining > 0) return;
      out = std::move(reply);
    }
    metrics->BatchDone(rpc, out.decisions_size(), absl::ToDoubleSeconds(absl::Now() - start));
    std::move(on_reply)(std::move(out));
  }

  void Fail(int index, const absl::Status& status) {
    metrics->Error(rpc, status.code());
    {
      absl::MutexLock lock(&mu);
      ::kvcache::v1::Decision& d = *reply.mutable_decisions(index);
      d.set_code(static_cast<int32_t>(status.code()));
      d.set_message(std::string(status.message()));
    }
    Release();
  }

  void Succeed(int index, const EvictionDecision& decision) {
    {
      absl::MutexLock lock(&mu);
      ToProto(decision, reply.mutable_decisions(index));
    }
    Release();
  }
};

}  // namespace

void StepBatchProcessor::Process(const ::kvcache::v1::StepBatch& batch, Rpc rpc,
                                 ReplyCallback on_reply) {
  auto pending = std::make_shared<PendingBatch>();
  pending->on_reply = std::move(on_reply);
  pending->start = absl::Now();
  pending->rpc = rpc;
  pending->metrics = metrics_;
  metrics_->Request(rpc, static_cast<int64_t>(batch.ByteSizeLong()));
  const int n = batch.reports_size();
  pending->in_submit = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(n));
  {
    absl::MutexLock lock(&pending->mu);
    pending->reply.set_batch_id(batch.batch_id());
    pending->remaining = n + 1;
    for (const auto& report : batch.reports()) {
      ::kvcache::v1::Decision* d = pending->reply.add_decisions();
      d->set_sequence_id(report.sequence_id());
      d->set_step(report.step());
    }
  }

  std::vector<uint32_t> aligned;  // for scores whose bytes are not aligned to their dtype
  for (int i = 0; i < n; ++i) {
    const ::kvcache::v1::StepReport& report = batch.reports(i);
    const std::string& id = report.sequence_id();
    absl::StatusOr<kernels::ScoreDtype> dtype =
        report.dtype() == ::kvcache::v1::SCORE_DTYPE_UNSPECIFIED && !report.scores().empty()
            ? table_->DefaultScoreDtype(id)
            : FromProto(report.dtype(), kernels::ScoreDtype::kFloat32);
    if (!dtype.ok()) {
      pending->Fail(i, absl::Status(dtype.status().code(),
                                    absl::StrCat("sequence '", id, "' step ", report.step(), ": ",
                                                 dtype.status().message())));
      continue;
    }
    absl::StatusOr<kernels::ScoreMatrix> scores = ScoresOf(report, *dtype, &aligned);
    if (!scores.ok()) {
      pending->Fail(i, scores.status());
      continue;
    }
    metrics_->ScoreBytes(*dtype, static_cast<int64_t>(report.scores().size()));
    RankReport rank_report;
    rank_report.rank = batch.rank();
    rank_report.step = report.step();
    rank_report.partial_sums = *scores;
    rank_report.head_count = report.head_count();

    // The report that completes a step sees its callback run inside SubmitRankReport: that
    // one accounts the step (once, not once per rank) with the engine time it took.
    pending->in_submit[static_cast<size_t>(i)] = true;
    const absl::Time submitted = absl::Now();
    absl::Status status = table_->SubmitRankReport(
        id, rank_report,
        [pending, i, submitted, metrics = metrics_](const absl::StatusOr<EvictionDecision>& result) {
          if (!result.ok()) {
            pending->Fail(i, result.status());
            return;
          }
          if (pending->in_submit[static_cast<size_t>(i)]) {
            metrics->StepDecided(*result, absl::ToDoubleSeconds(absl::Now() - submitted));
          }
          pending->Succeed(i, *result);
        });
    pending->in_submit[static_cast<size_t>(i)] = false;
    if (!status.ok()) pending->Fail(i, status);
  }
  pending->Release();
}

}  // namespace kvcm::server

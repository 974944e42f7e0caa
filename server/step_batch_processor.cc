#include "server/step_batch_processor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/translate.h"

namespace kvcm::server {

void PendingBatch::OnDecided(int64_t tag, const absl::Status& status,
                             const EvictionDecision& decision) {
  if (!status.ok()) {
    Fail(tag, status);
    return;
  }
  // Every rank's batch gets the decision; the step is accounted once, by rank 0's.
  if (request_->rank() == 0) processor_->metrics_->StepDecided(decision, decision.decide_seconds);
  // Reports of one batch are decided on several engine threads at once, each writing its
  // own Decision; the container itself was sized in Process and is not touched.
  ::kvcache::v1::Decision* d = reply_.mutable_decisions(static_cast<int>(tag));
  ToProto(decision, d);
  reply_bytes_.fetch_add(static_cast<int64_t>(d->evicted_size() * sizeof(int64_t) +
                                              d->evicted_mask().size()),
                         std::memory_order_relaxed);
  Release();
}

PendingBatch::~PendingBatch() { ReleaseReply(); }

void PendingBatch::ReleaseReply() {
  if (charged_reply_bytes_ == 0) return;
  processor_->table_->memory_budget()->Release(charged_reply_bytes_);
  // A reply of a long prefill's first step holds megabytes; the next batches need bytes.
  constexpr int64_t kKeptReplyBytes = int64_t{1} << 20;
  if (charged_reply_bytes_ > kKeptReplyBytes) reply_ = ::kvcache::v1::DecisionBatch();
  charged_reply_bytes_ = 0;
}

void PendingBatch::Fail(int64_t index, const absl::Status& status) {
  account_.Failed(status.code());
  ::kvcache::v1::Decision& d = *reply_.mutable_decisions(static_cast<int>(index));
  d.set_code(static_cast<int32_t>(status.code()));
  d.set_message(EscapeText(status.message()));
  Release();
}

void PendingBatch::Release() {
  // acq_rel: the thread that completes the batch sees every other thread's Decision.
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  processor_->metrics_->BatchDone(account_.rpc(), reply_.decisions_size(),
                                  absl::ToDoubleSeconds(absl::Now() - start_));
  // Taken even past the limit: the steps happened. What comes next is refused instead.
  charged_reply_bytes_ = reply_bytes_.exchange(0, std::memory_order_relaxed);
  if (charged_reply_bytes_ > 0) processor_->table_->memory_budget()->Take(charged_reply_bytes_);
  completion_->BatchDone(this);
}

StepBatchProcessor::StepBatchProcessor(SequenceTable* table, StepExecutor* executor,
                                       const ScoreRegions* regions, ServerMetrics* metrics)
    : table_(table),
      executor_(executor),
      regions_(regions),
      metrics_(metrics),
      aligned_(static_cast<size_t>(executor->threads())) {}

void StepBatchProcessor::Process(const ::kvcache::v1::StepBatch& request,
                                 absl::string_view tenant, RpcAccount account, PendingBatch* batch,
                                 BatchCompletion* completion) {
  PendingBatch& b = *batch;
  if (b.processor_ != nullptr) b.ReleaseReply();
  b.processor_ = this;
  b.completion_ = completion;
  b.request_ = &request;
  b.tenant_.assign(tenant.data(), tenant.size());
  b.account_ = account;
  b.start_ = absl::Now();
  account.Received(static_cast<int64_t>(request.ByteSizeLong()));

  const int n = request.reports_size();
  const int32_t threads = executor_->threads();
  ::kvcache::v1::DecisionBatch& reply = b.reply_;
  reply.Clear();  // keeps the Decision objects of earlier batches for reuse
  reply.set_batch_id(request.batch_id());
  b.report_shard_.resize(static_cast<size_t>(n));
  b.by_shard_.resize(static_cast<size_t>(n));
  b.shard_begin_.assign(static_cast<size_t>(threads) + 1, 0);
  b.tasks_.resize(static_cast<size_t>(threads));
  // A counting sort of the reports by engine thread, keeping report order within each.
  for (int i = 0; i < n; ++i) {
    const ::kvcache::v1::StepReport& report = request.reports(i);
    ::kvcache::v1::Decision* d = reply.add_decisions();
    d->set_sequence_id(report.sequence_id());
    d->set_step(report.step());
    const int32_t shard = executor_->ShardOf(report.sequence_id());
    b.report_shard_[static_cast<size_t>(i)] = shard;
    ++b.shard_begin_[static_cast<size_t>(shard) + 1];
  }
  for (int32_t s = 0; s < threads; ++s) {
    b.shard_begin_[static_cast<size_t>(s) + 1] += b.shard_begin_[static_cast<size_t>(s)];
  }
  b.next_.assign(b.shard_begin_.begin(), b.shard_begin_.end() - 1);
  for (int i = 0; i < n; ++i) {
    const int32_t shard = b.report_shard_[static_cast<size_t>(i)];
    b.by_shard_[static_cast<size_t>(b.next_[static_cast<size_t>(shard)]++)] = i;
  }
  b.remaining_.store(n + 1, std::memory_order_relaxed);  // one share held until all posted
  for (int32_t s = 0; s < threads; ++s) {
    const int32_t begin = b.shard_begin_[static_cast<size_t>(s)];
    const int32_t end = b.shard_begin_[static_cast<size_t>(s) + 1];
    if (begin == end) continue;
    b.tasks_[static_cast<size_t>(s)].batch = &b;
    if (!executor_->Post(s, {&StepBatchProcessor::RunShard, &b.tasks_[static_cast<size_t>(s)]})) {
      for (int32_t k = begin; k < end; ++k) {
        const int32_t i = b.by_shard_[static_cast<size_t>(k)];
        b.Fail(i, absl::ResourceExhaustedError(absl::StrCat(
                      "sequence '", request.reports(i).sequence_id(), "' step ",
                      request.reports(i).step(),
                      ": the engine's queue is full (or kvcached is stopping); retry")));
      }
    }
  }
  b.Release();
}

void StepBatchProcessor::RunShard(void* task, int32_t shard) {
  PendingBatch& b = *static_cast<PendingBatch::ShardTask*>(task)->batch;
  StepBatchProcessor& self = *b.processor_;
  const int32_t begin = b.shard_begin_[static_cast<size_t>(shard)];
  const int32_t end = b.shard_begin_[static_cast<size_t>(shard) + 1];
  // Only the last Submit can complete the batch (the later reports of this shard are
  // still undecided before it), and nothing here touches the batch after it: from then on
  // its owner may reuse it. KV event subscribers are woken after the loop, once each: the
  // decisions go out first.
  KvEventWakeupScope wakeups(self.table_->kv_events() != nullptr);
  for (int32_t k = begin; k < end; ++k) {
    self.Submit(b, b.by_shard_[static_cast<size_t>(k)], shard);
  }
}

void StepBatchProcessor::Submit(PendingBatch& b, int32_t index, int32_t shard) {
  const ::kvcache::v1::StepReport& report = b.request_->reports(index);
  const std::string& id = report.sequence_id();
  // Before any message quotes the id: a too long one is refused without echoing it.
  if (absl::Status valid = CheckSequenceId(id); !valid.ok()) {
    b.Fail(index, valid);
    return;
  }
  const auto fail = [&](const absl::Status& status) {
    b.Fail(index, absl::Status(status.code(),
                               absl::StrCat("sequence '", id, "' step ", report.step(), ": ",
                                            status.message())));
  };
  const bool by_reference = report.has_score_ref();
  absl::string_view bytes = report.scores();
  ScoreRegions::View region;  // pins the region's mapping while the engine reads it
  if (by_reference) {
    if (regions_ == nullptr) {
      fail(absl::FailedPreconditionError(
          "the report names a score region, and this kvcached runs without "
          "--allow_shm_scores; send the scores inline"));
      return;
    }
    const ::kvcache::v1::ScoreRef& ref = report.score_ref();
    absl::StatusOr<ScoreRegions::View> view =
        regions_->Resolve(b.tenant_, {ref.region(), ref.offset(), ref.byte_size()});
    if (!view.ok()) {
      fail(view.status());
      return;
    }
    region = *std::move(view);
    bytes = absl::string_view(reinterpret_cast<const char*>(region.data), region.size);
  }
  absl::StatusOr<kernels::ScoreDtype> dtype =
      report.dtype() == ::kvcache::v1::SCORE_DTYPE_UNSPECIFIED && !bytes.empty()
          ? table_->DefaultScoreDtype(id, b.tenant_)
          : FromProto(report.dtype(), kernels::ScoreDtype::kFloat32);
  if (!dtype.ok()) {
    fail(dtype.status());
    return;
  }
  if (by_reference && report.score_ref().offset() % kernels::ScoreDtypeSize(*dtype) != 0) {
    const ::kvcache::v1::ScoreRef& ref = report.score_ref();
    fail(absl::InvalidArgumentError(absl::StrCat(
        "score region ", ref.region(), " offset ", ref.offset(), " byte_size ", ref.byte_size(),
        ": the offset is not a multiple of ", kernels::ScoreDtypeSize(*dtype), " (",
        kernels::ScoreDtypeName(*dtype), ")")));
    return;
  }
  // A created region of a device engine holds device memory: only its address is used
  // here (never its bytes). Its base is 256-byte aligned and the offset a multiple of the
  // dtype's size, so ScoresOf never copies it for alignment.
  absl::StatusOr<kernels::ScoreMatrix> scores =
      ScoresOf(report, bytes, *dtype, &aligned_[static_cast<size_t>(shard)]);
  if (!scores.ok()) {
    b.Fail(index, scores.status());
    return;
  }
  metrics_->ScoreBytes(*dtype, static_cast<int64_t>(bytes.size()), by_reference);
  RankReport rank_report;
  rank_report.rank = b.request_->rank();
  rank_report.step = report.step();
  rank_report.partial_sums = *scores;
  rank_report.head_count = report.head_count();
  rank_report.in_backend = region.in_backend;
  // A tensor-parallel step keeps the region's rows referenced until its last rank reports.
  if (region.in_backend) {
    rank_report.pin = region.pin;
    rank_report.device = region.device;
  }
  absl::Status status = table_->SubmitRankReport(id, rank_report, DecisionWaiter{&b, index},
                                                 b.tenant_);
  if (!status.ok()) b.Fail(index, status);
}

}  // namespace kvcm::server

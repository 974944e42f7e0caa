#include "clients/loadgen/loadgen.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/policy/token_budget.h"
#include "cache_manager/table/sequence_table.h"
#include "clients/cpp/kvcache_client.h"
#include "clients/cpp/score_region.h"
#include "clients/loadgen/scores.h"

namespace kvcm::loadgen {
namespace {

namespace v1 = ::kvcache::v1;

SequenceOptions EngineOptions(const LoadOptions& o) {
  SequenceOptions so;
  so.prefill_len = o.context;
  so.budget.budget_tokens = o.budget_tokens;
  if (!o.budget_tokens) so.budget.compression_ratio = o.compression_ratio;
  so.preset = o.policy;
  if (o.folded) {
    so.score_layout = ScoreLayout::kFolded;
    so.layers = o.layers;
  }
  return so;
}

// The inputs both runs share: the budget and the packed scores of the first step (the
// whole prefill plus one) and of every steady step (the budget plus one); folded, one
// row each, the layer rows folded with the policy's weights.
struct Inputs {
  int64_t budget = 0;
  int64_t steady_tokens = 0;
  int32_t rows = 0;  // rows per scoring step: layers, or 1 folded
  std::string first;
  std::string steady;
};

absl::StatusOr<Inputs> MakeInputs(const LoadOptions& o) {
  Inputs in;
  BudgetSpec spec;
  spec.budget_tokens = o.budget_tokens;
  if (!o.budget_tokens) spec.compression_ratio = o.compression_ratio;
  ASSIGN_OR_RETURN(in.budget, ResolveBudget(o.context, spec));
  in.steady_tokens = std::min(o.context, in.budget) + 1;
  std::vector<float> first = SyntheticScores(o.layers, o.context + 1, o.seed);
  std::vector<float> steady = SyntheticScores(o.layers, in.steady_tokens, o.seed + 1);
  in.rows = o.layers;
  if (o.folded) {
    ASSIGN_OR_RETURN(first, FoldForPolicy(EngineOptions(o), first, o.layers, o.context + 1));
    ASSIGN_OR_RETURN(steady, FoldForPolicy(EngineOptions(o), steady, o.layers, in.steady_tokens));
    in.rows = 1;
  }
  in.first = EncodeScores(first, in.rows, o.dtype);
  in.steady = EncodeScores(steady, in.rows, o.dtype);
  return in;
}

// One step of every sequence of a worker; `needs[i]` says whether sequence i's step
// carries scores, and is updated from the decisions.
class BatchRunner {
 public:
  virtual ~BatchRunner() = default;
  virtual absl::Status Open(const std::vector<std::string>& ids) = 0;
  // Returns the request bytes sent; counts evictions into `evicted`.
  virtual absl::StatusOr<int64_t> Step(int64_t step, std::vector<bool>& needs,
                                       int64_t* evicted) = 0;
  virtual absl::Status Close() = 0;
};

class DaemonRunner : public BatchRunner {
 public:
  DaemonRunner(const LoadOptions& o, const Inputs& in, client::KvCacheClient* client)
      : o_(o), in_(in), client_(client) {}

  absl::Status Open(const std::vector<std::string>& ids) override {
    ids_ = ids;
    for (const std::string& id : ids) {
      v1::OpenSequenceRequest r;
      r.set_sequence_id(id);
      r.set_prefill_len(o_.context);
      if (o_.budget_tokens) {
        r.set_budget_tokens(*o_.budget_tokens);
      } else {
        r.set_compression_ratio(o_.compression_ratio.value_or(0.9));
      }
      r.mutable_policy()->set_preset(o_.policy);
      r.set_score_dtype(client::ToProtoDtype(o_.dtype));
      if (o_.folded) {
        r.set_score_layout(v1::SCORE_LAYOUT_FOLDED);
        r.set_layers(o_.layers);
      }
      RETURN_IF_ERROR(client_->Open(r).status());
      client::AddReport(&batch_, id, 0);
    }
    parked_.assign(ids.size(), std::string());
    if (o_.transport != "grpc") {
      // One range per sequence, sized for the steady step; the scores are written once
      // (as the grpc transport packs them into the request once) and referenced after.
      // "created": the daemon makes the region (CreateScoreRegion), "shm": this process.
      stride_ = client::NextScoreOffset(0, static_cast<int64_t>(in_.steady.size()));
      const int64_t bytes = stride_ * static_cast<int64_t>(ids.size());
      ASSIGN_OR_RETURN(region_, MakeScoreRegion(o_.transport, *client_, bytes));
    }
    ASSIGN_OR_RETURN(stream_, client_->OpenStepStream());
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Step(int64_t step, std::vector<bool>& needs, int64_t* evicted) override {
    if (region_ != nullptr && step >= 2) return StepShm(step, needs, evicted);
    batch_.set_batch_id(static_cast<uint64_t>(step));
    for (size_t i = 0; i < ids_.size(); ++i) {
      v1::StepReport* report = batch_.mutable_reports(static_cast<int>(i));
      report->set_step(step);
      if (step == 1) {
        report->set_scores(in_.first);
      } else if (step == 2) {
        report->set_scores(in_.steady);  // copied once; later steps reuse it
      }
      // A step that needs no scores parks them aside (a swap, no copy).
      if (report->scores().empty() == needs[i]) report->mutable_scores()->swap(parked_[i]);
      report->set_layers(needs[i] ? in_.rows : 0);
    }
    return SendAndRead(needs, evicted);
  }

  // A steady step over the score region: each report references its sequence's range,
  // which holds the steady scores from step 2 on.
  absl::StatusOr<int64_t> StepShm(int64_t step, std::vector<bool>& needs, int64_t* evicted) {
    batch_.set_batch_id(static_cast<uint64_t>(step));
    const auto packed = std::as_bytes(std::span(in_.steady.data(), in_.steady.size()));
    for (size_t i = 0; i < ids_.size(); ++i) {
      v1::StepReport* report = batch_.mutable_reports(static_cast<int>(i));
      report->set_step(step);
      const int64_t offset = stride_ * static_cast<int64_t>(i);
      if (!needs[i]) {
        report->clear_score_source();
        report->set_layers(0);
      } else if (step == 2) {
        RETURN_IF_ERROR(region_->Put(report, offset, packed, in_.rows, o_.dtype));
      } else {
        region_->Reference(report, offset, static_cast<int64_t>(packed.size()), in_.rows,
                           o_.dtype);
      }
    }
    return SendAndRead(needs, evicted);
  }

  absl::StatusOr<int64_t> SendAndRead(std::vector<bool>& needs, int64_t* evicted) {
    const auto bytes = static_cast<int64_t>(batch_.ByteSizeLong());
    ASSIGN_OR_RETURN(v1::DecisionBatch reply, stream_->Step(batch_));
    for (size_t i = 0; i < ids_.size(); ++i) {
      const v1::Decision& d = reply.decisions(static_cast<int>(i));
      RETURN_IF_ERROR(client::DecisionStatus(d));
      needs[i] = d.next_needs_scores();
      *evicted += d.evicted_size();
    }
    return bytes;
  }

  absl::Status Close() override {
    RETURN_IF_ERROR(stream_->Close());
    region_.reset();
    for (const std::string& id : ids_) RETURN_IF_ERROR(client_->Close(id).status());
    return absl::OkStatus();
  }

 private:
  const LoadOptions& o_;
  const Inputs& in_;
  client::KvCacheClient* const client_;
  std::unique_ptr<client::ScoreRegion> region_;  // transports shm and created
  int64_t stride_ = 0;                           // bytes between two sequences' ranges
  std::vector<std::string> ids_;
  std::unique_ptr<client::StepStream> stream_;
  v1::StepBatch batch_;
  std::vector<std::string> parked_;
};

class EmbeddedRunner : public BatchRunner {
 public:
  EmbeddedRunner(const LoadOptions& o, const Inputs& in, SequenceTable* table)
      : o_(o), in_(in), table_(table) {}

  absl::Status Open(const std::vector<std::string>& ids) override {
    ids_ = ids;
    const SequenceOptions so = EngineOptions(o_);
    for (const std::string& id : ids) RETURN_IF_ERROR(table_->Open(id, so, 1, o_.dtype).status());
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Step(int64_t step, std::vector<bool>& needs, int64_t* evicted) override {
    const bool first = step == 1;
    // Each sequence reads its own copy of the steady scores, as the daemon does (every
    // report's bytes are its own): the same memory traffic, not one block kept hot.
    if (steady_.size() != ids_.size()) steady_.assign(ids_.size(), in_.steady);
    int64_t bytes = 0;
    for (size_t i = 0; i < ids_.size(); ++i) {
      const std::string& blob = first ? in_.first : steady_[i];
      const kernels::ScoreMatrix scores = kernels::ScoreMatrix::Dense(
          blob.data(), o_.dtype, in_.rows, first ? o_.context + 1 : in_.steady_tokens);
      RETURN_IF_ERROR(table_->Step(ids_[i], step, needs[i] ? &scores : nullptr, &decision_));
      needs[i] = decision_.next_needs_scores;
      *evicted += static_cast<int64_t>(decision_.evicted.size());
      bytes += needs[i] ? static_cast<int64_t>(blob.size()) : 0;
    }
    return bytes;
  }

  absl::Status Close() override {
    for (const std::string& id : ids_) RETURN_IF_ERROR(table_->Close(id).status());
    return absl::OkStatus();
  }

 private:
  const LoadOptions& o_;
  const Inputs& in_;
  SequenceTable* const table_;
  std::vector<std::string> ids_;
  std::vector<std::string> steady_;  // one copy per sequence
  EvictionDecision decision_;
};

struct WorkerTotals {
  std::vector<double> batch_ms;
  int64_t steps = 0;
  int64_t scored = 0;
  int64_t bytes = 0;
  int64_t evicted = 0;
  double first_ms = 0;
  absl::Status status;
};

// Step 1 (all sequences score their prefill), then steady steps until `stop`.
void RunWorker(BatchRunner& runner, const std::vector<std::string>& ids,
               absl::BlockingCounter* first_steps, const absl::Notification* go,
               const absl::Time* stop, WorkerTotals* out) {
  bool counted = false;
  auto fail = [&](absl::Status s) {
    out->status = std::move(s);
    if (!counted) first_steps->DecrementCount();  // the others go on; the error is reported
  };
  if (absl::Status s = runner.Open(ids); !s.ok()) return fail(s);
  std::vector<bool> needs(ids.size(), true);
  int64_t evicted_first = 0;
  absl::Time t0 = absl::Now();
  if (absl::StatusOr<int64_t> b = runner.Step(1, needs, &evicted_first); !b.ok()) {
    return fail(b.status());
  }
  out->first_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  counted = true;
  first_steps->DecrementCount();
  go->WaitForNotification();  // the steady phase starts for every worker at once
  for (int64_t step = 2; absl::Now() < *stop; ++step) {
    for (bool n : needs) out->scored += n ? 1 : 0;
    t0 = absl::Now();
    absl::StatusOr<int64_t> bytes = runner.Step(step, needs, &out->evicted);
    if (!bytes.ok()) return fail(bytes.status());
    out->batch_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    out->bytes += *bytes;
    out->steps += static_cast<int64_t>(ids.size());
  }
  if (absl::Status s = runner.Close(); !s.ok()) out->status = s;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Runs `streams` workers, each over its share of the sequences.
template <typename MakeRunner>
absl::StatusOr<LoadResult> Run(const LoadOptions& o, absl::string_view run,
                               MakeRunner make_runner) {
  if (o.sequences < 1 || o.streams < 1 || o.layers < 1) {
    return absl::InvalidArgumentError("--sequences, --streams and --layers must be >= 1");
  }
  if (o.transport != "grpc" && o.transport != "shm" && o.transport != "created") {
    return absl::InvalidArgumentError("--transport must be grpc, shm or created");
  }
  ASSIGN_OR_RETURN(const Inputs in, MakeInputs(o));
  const int32_t streams = std::min(o.streams, o.sequences);
  std::vector<WorkerTotals> totals(static_cast<size_t>(streams));
  std::vector<std::unique_ptr<BatchRunner>> runners;
  for (int32_t w = 0; w < streams; ++w) runners.push_back(make_runner(in));
  absl::Time stop = absl::InfiniteFuture();
  absl::BlockingCounter first_steps(streams);
  absl::Notification go;
  std::vector<std::thread> threads;
  for (int32_t w = 0; w < streams; ++w) {
    std::vector<std::string> ids;
    for (int32_t i = w; i < o.sequences; i += streams) {
      ids.push_back(absl::StrCat("loadgen-", run, "-", o.policy, "-", i));
    }
    threads.emplace_back([&, w, ids] {
      RunWorker(*runners[static_cast<size_t>(w)], ids, &first_steps, &go, &stop,
                &totals[static_cast<size_t>(w)]);
    });
  }
  // The steady phase starts when every worker finished its first step.
  first_steps.Wait();
  const absl::Time start = absl::Now();
  stop = start + o.duration;
  go.Notify();
  for (std::thread& t : threads) t.join();
  const absl::Duration elapsed = absl::Now() - start;
  for (const WorkerTotals& t : totals) RETURN_IF_ERROR(t.status);

  LoadResult r;
  r.policy = o.policy;
  r.budget = in.budget;
  r.elapsed = elapsed;
  std::vector<double> all;
  int64_t scored = 0, bytes = 0;
  for (const WorkerTotals& t : totals) {
    all.insert(all.end(), t.batch_ms.begin(), t.batch_ms.end());
    r.sequence_steps += t.steps;
    scored += t.scored;
    bytes += t.bytes;
    r.tokens_evicted += t.evicted;
    r.first_step_ms = std::max(r.first_step_ms, t.first_ms);
  }
  r.batches = static_cast<int64_t>(all.size());
  r.steps_per_second = static_cast<double>(r.sequence_steps) / absl::ToDoubleSeconds(elapsed);
  r.batch_p50_ms = Percentile(all, 0.50);
  r.batch_p99_ms = Percentile(all, 0.99);
  if (r.sequence_steps > 0) {
    r.bytes_per_step = static_cast<double>(bytes) / static_cast<double>(r.sequence_steps);
    r.scored_fraction = static_cast<double>(scored) / static_cast<double>(r.sequence_steps);
  }
  return r;
}

}  // namespace

absl::StatusOr<LoadResult> RunAgainstDaemon(const LoadOptions& o) {
  client::ClientOptions co = o.connection;
  co.address = o.server;
  co.max_message_bytes = (int64_t{1} << 31) - 1;
  std::vector<std::unique_ptr<client::KvCacheClient>> clients;
  // One channel per stream: separate HTTP/2 connections, as separate workers would have.
  for (int32_t w = 0; w < std::min(o.streams, o.sequences); ++w) {
    ASSIGN_OR_RETURN(std::unique_ptr<client::KvCacheClient> c, client::KvCacheClient::Connect(co));
    clients.push_back(std::move(c));
  }
  size_t next = 0;
  return Run(o, absl::StrCat("d", absl::ToUnixMicros(absl::Now())), [&](const Inputs& in) {
    return std::make_unique<DaemonRunner>(o, in, clients[next++].get());
  });
}

absl::StatusOr<LoadResult> RunEmbedded(const LoadOptions& o) {
  // The in-process run measures the engine's steady step, millions of steps per sequence
  // in a few seconds: no lifetime token cap (a daemon's --max_sequence_tokens) or memory
  // limit applies; the budget bounds each sequence's memory anyway.
  SequenceTableOptions options;
  options.max_sequence_tokens = std::numeric_limits<int64_t>::max();
  options.memory_limit_bytes = std::numeric_limits<int64_t>::max();
  SequenceTable table(options);
  return Run(o, "embedded", [&](const Inputs& in) {
    return std::make_unique<EmbeddedRunner>(o, in, &table);
  });
}

std::string FormatTable(const std::vector<LoadResult>& daemon,
                        const std::vector<LoadResult>& embedded) {
  std::string out = absl::StrFormat("%-15s %7s %11s %9s %9s %11s %7s %9s %12s %7s\n", "policy",
                                    "budget", "seq-steps/s", "p50 ms", "p99 ms", "bytes/step",
                                    "scored", "step1 ms", "in-process/s", "ratio");
  for (size_t i = 0; i < daemon.size(); ++i) {
    const LoadResult& d = daemon[i];
    const LoadResult* e = i < embedded.size() ? &embedded[i] : nullptr;
    absl::StrAppendFormat(&out, "%-15s %7d %11.0f %9.3f %9.3f %11.0f %6.0f%% %9.1f", d.policy,
                          d.budget, d.steps_per_second, d.batch_p50_ms, d.batch_p99_ms,
                          d.bytes_per_step, 100 * d.scored_fraction, d.first_step_ms);
    if (e != nullptr) {
      absl::StrAppendFormat(&out, " %12.0f %7.2f", e->steps_per_second,
                            e->steps_per_second > 0 ? d.steps_per_second / e->steps_per_second : 0);
    }
    out += "\n";
  }
  return out;
}

}  // namespace kvcm::loadgen

#include "clients/loadgen/serve.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/policy/token_budget.h"
#include "clients/cpp/score_region.h"
#include "clients/loadgen/scores.h"

namespace kvcm::loadgen {
namespace {

namespace v1 = ::kvcache::v1;

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The value at quantile q of `values` (nearest rank); 0 when empty.
double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  const auto rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  const size_t k = std::min(values.size() - 1, rank == 0 ? 0 : rank - 1);
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(k), values.end());
  return values[k];
}

absl::StatusOr<ServeConfig> ParseOneConfig(absl::string_view entry) {
  ServeConfig c;
  c.name = std::string(entry);
  if (entry == "full") {
    c.full = true;
    c.preset = "streaming_llm";
    return c;
  }
  const std::vector<absl::string_view> at = absl::StrSplit(entry, '@');
  if (at.size() != 2 || !absl::SimpleAtod(at[1], &c.rho) || !(c.rho > 0 && c.rho < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--serve_configs: '", entry,
        "' is not full, <preset>@<rho>, handoff@<rho> or handoff:<preset>@<rho> (0 < rho < 1)"));
  }
  c.preset = std::string(at[0]);
  if (absl::StartsWith(c.preset, "handoff")) {
    c.handoff = true;
    c.preset = c.preset == "handoff" ? "inertia" : c.preset.substr(c.preset.find(':') + 1);
    if (at[0] != "handoff" && !absl::StartsWith(at[0], "handoff:")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--serve_configs: '", entry, "': expected handoff:<preset>@<rho>"));
    }
  }
  if (c.preset.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--serve_configs: '", entry, "' names no preset"));
  }
  return c;
}

// A request as it arrives: its index in arrival order, when, and its prompt.
struct Request {
  int64_t index = 0;
  absl::Duration arrival;
  int64_t prompt = 0;
};

std::vector<Request> MakeArrivals(const ServeOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(o.arrival_rate);
  std::uniform_int_distribution<int64_t> uniform(o.prompt_min, o.prompt_max);
  std::uniform_real_distribution<double> log_len(std::log(static_cast<double>(o.prompt_min)),
                                                 std::log(static_cast<double>(o.prompt_max)));
  std::vector<Request> out;
  double t = 0;
  for (int64_t i = 0;; ++i) {
    t += gap(rng);
    const absl::Duration at = absl::Seconds(t);
    if (o.duration > absl::ZeroDuration() ? at >= o.duration : i >= o.requests) break;
    const int64_t prompt =
        o.prompt_log_uniform
            ? std::clamp(static_cast<int64_t>(std::llround(std::exp(log_len(rng)))), o.prompt_min,
                         o.prompt_max)
            : uniform(rng);
    out.push_back({i, at, prompt});
  }
  return out;
}

// The packed folded rows every sequence's scores are prefixes of: step 1 sends the first
// prompt + 1 values of `first`, a steady step the first cache + 1 of `steady`.
struct PackedRows {
  std::string first;
  std::string steady;
  int64_t value_bytes = 2;
};

absl::StatusOr<PackedRows> MakeRows(const ServeOptions& o, const ServeConfig& c) {
  PackedRows rows;
  rows.value_bytes = static_cast<int64_t>(kernels::ScoreDtypeSize(o.dtype));
  if (c.full) return rows;  // streaming_llm reads no scores
  SequenceOptions so;
  so.prefill_len = o.prompt_max;
  so.budget.compression_ratio = c.rho;
  so.preset = c.preset;
  so.score_layout = ScoreLayout::kFolded;
  so.layers = o.layers;
  const int64_t tokens = o.prompt_max + 1;
  ASSIGN_OR_RETURN(std::vector<float> first,
                   FoldForPolicy(so, SyntheticScores(o.layers, tokens, o.seed), o.layers, tokens));
  ASSIGN_OR_RETURN(std::vector<float> steady, FoldForPolicy(so, SyntheticScores(o.layers, tokens,
                                                                                o.seed + 1),
                                                            o.layers, tokens));
  rows.first = EncodeScores(first, 1, o.dtype);
  rows.steady = EncodeScores(steady, 1, o.dtype);
  return rows;
}

// A decoding sequence, owned by the run; stepped by one worker per iteration.
struct Live {
  Request request;
  std::string id;
  int64_t step = 1;    // the next step
  int64_t cached = 0;  // tokens cached before the next step
  bool needs = false;  // the next step carries scores
  int64_t reserved = 0;  // its blocks in the admission ledger
  int64_t steady_reserve = 0;
  int32_t worker = 0;
  bool released = false;  // the last step returned blocks to the pool
};

// One worker stream: a connection, a step stream and a daemon-created score region sized
// for every report of an iteration (the pool's tokens bound them, step 1's prompt rows
// included), so that reports go inline only if that bound were wrong.
class StepWorker {
 public:
  static absl::StatusOr<std::unique_ptr<StepWorker>> Start(const client::ClientOptions& co,
                                                           int64_t region_bytes, bool scored) {
    auto w = std::unique_ptr<StepWorker>(new StepWorker());
    ASSIGN_OR_RETURN(w->client_, client::KvCacheClient::Connect(co));
    if (scored) {
      ASSIGN_OR_RETURN(w->region_, MakeScoreRegion("created", *w->client_, region_bytes));
    }
    ASSIGN_OR_RETURN(w->stream_, w->client_->OpenStepStream());
    return w;
  }

  // Steps each of `seqs` once, in one batch, and updates it from its decision.
  absl::Status Step(const std::vector<Live*>& seqs, const PackedRows& rows, uint64_t batch_id,
                    int64_t* inline_reports) {
    v1::StepBatch batch;
    batch.set_batch_id(batch_id);
    int64_t offset = 0;
    for (Live* s : seqs) {
      v1::StepReport* report = client::AddReport(&batch, s->id, s->step);
      if (!s->needs) continue;
      const std::string& row = s->step == 1 ? rows.first : rows.steady;
      const int64_t bytes = (s->step == 1 ? s->request.prompt + 1 : s->cached + 1) * rows.value_bytes;
      const auto packed = std::as_bytes(std::span(row.data(), static_cast<size_t>(bytes)));
      if (region_ != nullptr && offset + bytes <= region_->size()) {
        RETURN_IF_ERROR(region_->Put(report, offset, packed, 1, dtype_));
        offset = client::NextScoreOffset(offset, bytes);
      } else {
        report->set_scores(row.data(), static_cast<size_t>(bytes));
        report->set_layers(1);
        ++*inline_reports;
      }
    }
    ASSIGN_OR_RETURN(v1::DecisionBatch reply, stream_->Step(batch));
    for (size_t i = 0; i < seqs.size(); ++i) {
      const v1::Decision& d = reply.decisions(static_cast<int>(i));
      Live* s = seqs[i];
      if (absl::Status st = client::DecisionStatus(d); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat("step ", s->step, " of ", s->id,
                                                    " was refused: ", st.message()));
      }
      s->released = false;
      for (const v1::KvChange& k : d.kv_changes()) s->released |= k.released_blocks_size() > 0;
      s->needs = d.next_needs_scores();
      s->cached = d.cache_size();
      ++s->step;
    }
    return absl::OkStatus();
  }

  absl::Status Close() {
    RETURN_IF_ERROR(stream_->Close());
    region_.reset();
    return absl::OkStatus();
  }

  void set_dtype(kernels::ScoreDtype dtype) { dtype_ = dtype; }

 private:
  StepWorker() = default;
  std::unique_ptr<client::KvCacheClient> client_;
  std::unique_ptr<client::ScoreRegion> region_;
  std::unique_ptr<client::StepStream> stream_;
  kernels::ScoreDtype dtype_ = kernels::ScoreDtype::kFloat16;
};

struct PoolUsage {
  int64_t capacity = 0;
  int64_t used = 0;
  int64_t tokens_per_block = 0;
};

absl::StatusOr<PoolUsage> DescribePools(client::KvCacheClient& c, absl::string_view which) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::DescribeKvPoolsResponse response;
  RETURN_IF_ERROR(client::FromGrpc(c.stub().DescribeKvPools(&context, {}, &response)));
  if (response.pools().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        which, " has no KV pools: start it with --pool_memory_bytes and the --kv_* geometry"));
  }
  PoolUsage u;
  for (const v1::KvPool& p : response.pools()) {
    u.capacity += p.capacity_blocks();
    u.used += p.used_blocks();
    u.tokens_per_block = p.tokens_per_block();
  }
  return u;
}

// Waits up to 5 s for the pool to be empty: every sequence of the last run is closed.
absl::Status ExpectEmptyPool(client::KvCacheClient& c, absl::string_view which,
                             absl::string_view when) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (;;) {
    ASSIGN_OR_RETURN(const PoolUsage u, DescribePools(c, which));
    if (u.used == 0) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::FailedPreconditionError(absl::StrCat(
          which, ": its pool holds ", u.used, " blocks ", when,
          " (another client's sequences? the run needs the pool to itself)"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// One iteration's record.
struct Iteration {
  absl::Duration start;  // since the run's start
  absl::Duration length;
  int32_t decoding = 0;
  int32_t finished = 0;
  bool blocked = false;  // the queue's head waited
};

std::string SequenceId(const ServeConfig& c, absl::string_view tag, const Request& r) {
  return absl::StrCat("serve-", c.name, "-", tag, "-", r.index);
}

absl::Status Named(absl::string_view rpc, absl::string_view id, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(rpc, " of ", id, ": ", s.message()));
}

v1::OpenSequenceRequest OpenRequestFor(const ServeOptions& o, const ServeConfig& c,
                                       const std::string& id, const Request& r) {
  v1::OpenSequenceRequest open;
  open.set_sequence_id(id);
  open.set_prefill_len(r.prompt);
  open.mutable_policy()->set_preset(c.preset);
  if (c.full) {
    open.set_budget_tokens(r.prompt + o.generate);  // never evicts
  } else {
    open.set_compression_ratio(c.rho);
    open.set_score_dtype(client::ToProtoDtype(o.dtype));
    open.set_score_layout(v1::SCORE_LAYOUT_FOLDED);
    open.set_layers(o.layers);
  }
  return open;
}

// The prefill node of a hand-off. As prefill workers do, it works ahead of the decode
// node: on its own thread it opens the queue's requests on the prefill kvcached and runs
// their step 1 there (the folded prompt row inline, one unary call), in arrival order, at
// most kAhead requests ahead of the decode node's admission, which imports them in the
// same order. A refusal of the prefill node's pool is retried after `backoff`.
// Thread-safe: the run's thread offers and takes, the prefiller's thread prefills.
class Prefiller {
 public:
  static constexpr size_t kAhead = 16;

  Prefiller(const ServeOptions& o, const ServeConfig& c, client::KvCacheClient& node,
            const PackedRows& rows, std::string tag)
      : o_(o), c_(c), node_(node), rows_(rows), tag_(std::move(tag)),
        thread_([this] { Loop(); }) {}
  ~Prefiller() { Stop().IgnoreError(); }

  // Appends `r` to the line; false when kAhead requests are in it.
  bool Offer(const Request& r) {
    absl::MutexLock lock(&mu_);
    if (line_.size() >= kAhead) return false;
    line_.push_back({r, false});
    work_.Signal();
    return true;
  }
  // Whether request `index`, the line's first, is prefilled; the prefiller's error if it
  // failed.
  absl::StatusOr<bool> Ready(int64_t index) {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(status_);
    return !line_.empty() && line_.front().first.index == index && line_.front().second;
  }
  // The first request was imported. REQUIRES: Ready.
  void Pop() {
    absl::MutexLock lock(&mu_);
    line_.pop_front();
  }
  // Ends the thread and closes, at the prefill node, the requests prefilled and not taken.
  absl::Status Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      work_.Signal();
    }
    if (thread_.joinable()) thread_.join();
    std::deque<std::pair<Request, bool>> left;
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      left.swap(line_);
      status = status_;
    }
    for (const auto& [request, prefilled] : left) {
      if (!prefilled) continue;
      const std::string id = SequenceId(c_, tag_, request);
      RETURN_IF_ERROR(Named("CloseSequence (prefill node)", id, node_.Close(id).status()));
    }
    return status;
  }

 private:
  void Loop() {
    for (;;) {
      Request next;
      {
        absl::MutexLock lock(&mu_);
        while (!stop_ && NextIndex() == line_.size()) work_.Wait(&mu_);
        if (stop_) return;
        next = line_[NextIndex()].first;
      }
      const absl::Status s = PrefillOne(next);
      if (absl::IsResourceExhausted(s)) {
        absl::SleepFor(std::max(o_.model_step, absl::Milliseconds(1)));
        continue;
      }
      absl::MutexLock lock(&mu_);
      if (!s.ok()) {
        status_ = s;
        return;
      }
      line_[NextIndex()].second = true;  // the first not prefilled is `next`: FIFO
    }
  }
  size_t NextIndex() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t i = 0;
    while (i < line_.size() && line_[i].second) ++i;
    return i;
  }

  absl::Status PrefillOne(const Request& r) {
    const std::string id = SequenceId(c_, tag_, r);
    absl::StatusOr<v1::SequenceState> opened = node_.Open(OpenRequestFor(o_, c_, id, r));
    if (absl::IsResourceExhausted(opened.status())) return opened.status();
    RETURN_IF_ERROR(Named("OpenSequence (prefill node)", id, opened.status()));
    v1::StepBatch batch;
    v1::StepReport* report = client::AddReport(&batch, id, 1);
    if (opened->next_needs_scores()) {
      report->set_scores(rows_.first.data(), static_cast<size_t>((r.prompt + 1) * rows_.value_bytes));
      report->set_layers(1);
    }
    ASSIGN_OR_RETURN(const v1::DecisionBatch reply, node_.Step(batch));
    return Named("step 1 (prefill node)", id, client::DecisionStatus(reply.decisions(0)));
  }

  const ServeOptions& o_;
  const ServeConfig& c_;
  client::KvCacheClient& node_;
  const PackedRows& rows_;
  const std::string tag_;
  absl::Mutex mu_;
  absl::CondVar work_;
  std::deque<std::pair<Request, bool>> line_ ABSL_GUARDED_BY(mu_);  // (request, prefilled)
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the rest is built
};

// One configuration's run.
class ServeRun {
 public:
  ServeRun(const ServeOptions& o, const ServeConfig& c, client::KvCacheClient& decode,
           client::KvCacheClient* prefill)
      : o_(o), c_(c), decode_(decode), prefill_(prefill) {}

  absl::StatusOr<ServeResult> Run() {
    RETURN_IF_ERROR(Setup());
    arrivals_ = MakeArrivals(o_);
    start_ = absl::Now();
    for (uint64_t batch = 1; !Done(); ++batch) RETURN_IF_ERROR(Iterate(batch));
    if (prefiller_ != nullptr) RETURN_IF_ERROR(prefiller_->Stop());
    for (auto& w : workers_) RETURN_IF_ERROR(w->Close());
    RETURN_IF_ERROR(ExpectEmptyPool(decode_, DecodeName(), "after the run"));
    if (prefill_ != nullptr) {
      RETURN_IF_ERROR(ExpectEmptyPool(*prefill_, PrefillName(), "after the run"));
    }
    return Summarize();
  }

 private:
  absl::Status Setup() {
    RETURN_IF_ERROR(ExpectEmptyPool(decode_, DecodeName(), "before the run"));
    if (c_.handoff) RETURN_IF_ERROR(ExpectEmptyPool(*prefill_, PrefillName(), "before the run"));
    ASSIGN_OR_RETURN(const PoolUsage u, DescribePools(decode_, DecodeName()));
    capacity_ = u.capacity;
    tpb_ = u.tokens_per_block;
    ASSIGN_OR_RETURN(rows_, MakeRows(o_, c_));
    client::ClientOptions co = o_.connection;
    co.address = o_.server;
    co.max_message_bytes = (int64_t{1} << 31) - 1;
    // Every token of an iteration's reports is a pool slot (step 1's prompt is leased),
    // plus one new token and 64-byte alignment per sequence, at most one per block.
    const int64_t region_bytes = capacity_ * ((tpb_ + 1) * rows_.value_bytes + 64);
    for (int32_t i = 0; i < o_.streams; ++i) {
      ASSIGN_OR_RETURN(std::unique_ptr<StepWorker> w, StepWorker::Start(co, region_bytes, !c_.full));
      w->set_dtype(o_.dtype);
      workers_.push_back(std::move(w));
    }
    per_worker_count_.assign(workers_.size(), 0);
    run_tag_ = absl::StrCat(absl::ToUnixMicros(absl::Now()));
    if (c_.handoff) prefiller_ = std::make_unique<Prefiller>(o_, c_, *prefill_, rows_, run_tag_);
    return absl::OkStatus();
  }

  std::string DecodeName() const {
    return absl::StrCat(c_.handoff ? "the decode node's " : "", "kvcached at ", o_.server);
  }
  std::string PrefillName() const {
    return absl::StrCat("the prefill node's kvcached at ", o_.prefill_server);
  }

  bool AdmissionOpen() const {
    return o_.duration <= absl::ZeroDuration() || absl::Now() - start_ < o_.duration;
  }

  bool Done() const {
    if (!live_.empty()) return false;
    if (!AdmissionOpen()) return true;
    return next_arrival_ == arrivals_.size() && queue_.empty();
  }

  int64_t Budget(int64_t prompt) const {
    if (c_.full) return prompt + o_.generate;
    BudgetSpec spec;
    spec.compression_ratio = c_.rho;
    return ResolveBudget(prompt, spec).value_or(1);
  }
  // The ledger's blocks for a sequence: until its step 1, and after.
  int64_t FirstReserve(int64_t prompt) const {
    if (c_.full) return CeilDiv(prompt + o_.generate, tpb_);
    if (c_.handoff) return SteadyReserve(prompt);
    return std::max(CeilDiv(prompt + 1, tpb_), SteadyReserve(prompt));
  }
  int64_t SteadyReserve(int64_t prompt) const {
    if (c_.full) return FirstReserve(prompt);
    return CeilDiv(std::min(prompt, Budget(prompt)) + 1, tpb_) + 1;
  }

  absl::Status Iterate(uint64_t batch) {
    const absl::Time t0 = absl::Now();
    std::vector<std::vector<Live*>> per_worker(workers_.size());
    for (auto& s : live_) per_worker[static_cast<size_t>(s->worker)].push_back(s.get());
    std::vector<absl::Status> statuses(workers_.size());
    std::vector<int64_t> inlined(workers_.size(), 0);
    std::vector<std::thread> threads;
    // A thread per busy worker per iteration: at most --streams threads per model step.
    for (size_t w = 0; w < workers_.size(); ++w) {
      if (per_worker[w].empty()) continue;
      threads.emplace_back([&, w] {
        statuses[w] = workers_[w]->Step(per_worker[w], rows_, batch, &inlined[w]);
      });
    }
    // Admission runs while the workers step: the new sequences join the next iteration.
    absl::StatusOr<bool> blocked = Admit();
    for (std::thread& t : threads) t.join();
    RETURN_IF_ERROR(blocked.status());
    for (size_t w = 0; w < workers_.size(); ++w) {
      RETURN_IF_ERROR(statuses[w]);
      inline_reports_ += inlined[w];
    }
    Iteration it;
    it.start = t0 - start_;
    it.decoding = static_cast<int32_t>(live_.size());
    it.blocked = *blocked;
    const int64_t finished_before = finished_;
    RETURN_IF_ERROR(Retire());
    it.finished = static_cast<int32_t>(finished_ - finished_before);
    for (auto& s : admitted_now_) live_.push_back(std::move(s));
    admitted_now_.clear();
    RETURN_IF_ERROR(Sample(it.decoding));
    absl::SleepFor(t0 + o_.model_step - absl::Now());
    it.length = absl::Now() - t0;
    iterations_.push_back(it);
    return absl::OkStatus();
  }

  // Admits from the queue's head while the ledger and the pool take it. Returns whether
  // the head had to wait.
  absl::StatusOr<bool> Admit() {
    if (!AdmissionOpen()) return false;
    const absl::Duration now = absl::Now() - start_;
    while (next_arrival_ < arrivals_.size() && arrivals_[next_arrival_].arrival <= now) {
      queue_.push_back(arrivals_[next_arrival_++]);
    }
    if (prefiller_ != nullptr) {
      while (offered_ < queue_.size() && prefiller_->Offer(queue_[offered_])) ++offered_;
    }
    while (!queue_.empty()) {
      const Request& head = queue_.front();
      const int64_t need = FirstReserve(head.prompt);
      if (need > capacity_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "request ", head.index, ": a prompt of ", head.prompt, " tokens needs ",
            need, " blocks, the pool has ", capacity_, "; lower --prompt_max or grow the pool"));
      }
      if (reserved_ + need > capacity_) {
        ++held_;
        return true;
      }
      // After a refusal the head is tried again only once blocks came back, or, with
      // nothing decoding (nothing to give blocks back), once per iteration.
      if (waiting_for_blocks_ && !live_.empty()) return true;
      if (prefiller_ != nullptr) {
        ASSIGN_OR_RETURN(const bool prefilled, prefiller_->Ready(head.index));
        if (!prefilled) return false;  // the prefill node's pace, not the pool
      }
      ASSIGN_OR_RETURN(const bool admitted, TryAdmit(head));
      if (!admitted) {
        ++refused_;
        waiting_for_blocks_ = true;
        if (live_.empty() && ++idle_refusals_ > 500) {
          return absl::ResourceExhaustedError(
              "the pool refuses the queue's head with nothing decoding for 500 iterations: "
              "does another client hold its blocks?");
        }
        return true;
      }
      waiting_for_blocks_ = false;
      idle_refusals_ = 0;
      queue_.pop_front();
      if (prefiller_ != nullptr) {
        prefiller_->Pop();
        --offered_;
      }
    }
    return false;
  }

  // Opens the head (a hand-off: imports it from the prefill node). false when the pool
  // answered RESOURCE_EXHAUSTED.
  absl::StatusOr<bool> TryAdmit(const Request& head) {
    auto s = std::make_unique<Live>();
    s->request = head;
    s->id = SequenceId(c_, run_tag_, head);
    if (c_.handoff) {
      absl::StatusOr<v1::ImportSequenceResponse> imported =
          decode_.ImportSequence(s->id, o_.prefill_peer);
      if (absl::IsResourceExhausted(imported.status())) return false;
      RETURN_IF_ERROR(Named("ImportSequence", s->id, imported.status()));
      s->step = imported->state().last_step() + 1;
      s->cached = imported->state().cache_size();
      s->needs = imported->state().next_needs_scores();
    } else {
      absl::StatusOr<v1::SequenceState> opened = decode_.Open(OpenRequestFor(o_, c_, s->id, head));
      if (absl::IsResourceExhausted(opened.status())) return false;
      RETURN_IF_ERROR(Named("OpenSequence", s->id, opened.status()));
      s->cached = head.prompt;
      s->needs = opened->next_needs_scores();
    }
    s->reserved = FirstReserve(head.prompt);
    s->steady_reserve = SteadyReserve(head.prompt);
    reserved_ += s->reserved;
    max_reserved_ = std::max(max_reserved_, reserved_);
    s->worker = LeastLoadedWorker();
    ++per_worker_count_[static_cast<size_t>(s->worker)];
    queue_wait_ms_.push_back(absl::ToDoubleMilliseconds(absl::Now() - start_ - head.arrival));
    admission_order_.push_back(head.index);
    admitted_now_.push_back(std::move(s));
    return true;
  }

  int32_t LeastLoadedWorker() const {
    return static_cast<int32_t>(std::min_element(per_worker_count_.begin(), per_worker_count_.end()) -
                                per_worker_count_.begin());
  }

  // After the steps: closes the sequences that generated their tokens and moves the
  // others' ledger entries to their steady need after step 1.
  absl::Status Retire() {
    bool returned = false;
    for (auto it = live_.begin(); it != live_.end();) {
      Live& s = **it;
      returned |= s.released;
      if (s.step <= o_.generate) {
        reserved_ -= s.reserved - s.steady_reserve;
        s.reserved = s.steady_reserve;
        ++it;
        continue;
      }
      RETURN_IF_ERROR(Named("CloseSequence", s.id, decode_.Close(s.id).status()));
      reserved_ -= s.reserved;
      --per_worker_count_[static_cast<size_t>(s.worker)];
      ++finished_;
      returned = true;
      it = live_.erase(it);
    }
    if (returned) waiting_for_blocks_ = false;
    return absl::OkStatus();
  }

  absl::Status Sample(int32_t decoding) {
    ASSIGN_OR_RETURN(const PoolUsage u, DescribePools(decode_, DecodeName()));
    OccupancySample s;
    s.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    s.used_blocks = u.used;
    s.reserved_blocks = reserved_;
    for (const auto& l : live_) s.cached_tokens += l->cached;
    s.decoding = decoding;
    s.queued = static_cast<int64_t>(queue_.size());
    max_used_ = std::max(max_used_, u.used);
    max_over_reserved_ = std::max(max_over_reserved_, u.used - reserved_);
    occupancy_.push_back(s);
    return absl::OkStatus();
  }

  ServeResult Summarize() const;

  const ServeOptions& o_;
  const ServeConfig& c_;
  client::KvCacheClient& decode_;
  client::KvCacheClient* const prefill_;
  std::vector<std::unique_ptr<StepWorker>> workers_;
  std::vector<int64_t> per_worker_count_;
  PackedRows rows_;
  std::string run_tag_;
  int64_t capacity_ = 0;
  int64_t tpb_ = 1;
  std::vector<Request> arrivals_;
  size_t next_arrival_ = 0;
  std::deque<Request> queue_;
  size_t offered_ = 0;  // hand-off: the queue's first requests given to the prefiller
  std::unique_ptr<Prefiller> prefiller_;
  std::vector<std::unique_ptr<Live>> live_;
  std::vector<std::unique_ptr<Live>> admitted_now_;
  absl::Time start_;
  int64_t reserved_ = 0;
  bool waiting_for_blocks_ = false;
  int64_t idle_refusals_ = 0;
  std::vector<Iteration> iterations_;
  std::vector<OccupancySample> occupancy_;
  std::vector<double> queue_wait_ms_;
  std::vector<int64_t> admission_order_;
  int64_t held_ = 0, refused_ = 0, finished_ = 0, inline_reports_ = 0;
  int64_t max_used_ = 0, max_reserved_ = 0, max_over_reserved_ = std::numeric_limits<int64_t>::min();
};

ServeResult ServeRun::Summarize() const {
  ServeResult r;
  r.config = c_.name;
  r.capacity_blocks = capacity_;
  r.tokens_per_block = tpb_;
  // The window: from the first completion (the ramp-up, one request's lifetime, is left
  // out) to the last iteration whose queue head waited (the drain is left out).
  size_t first = 0, last = iterations_.empty() ? 0 : iterations_.size() - 1;
  const auto blocked = [](const Iteration& it) { return it.blocked; };
  const auto lb = std::find_if(iterations_.rbegin(), iterations_.rend(), blocked);
  if (lb != iterations_.rend()) {
    r.pool_bound = true;
    last = iterations_.size() - 1 - static_cast<size_t>(lb - iterations_.rbegin());
    const auto done = std::find_if(iterations_.begin(), iterations_.end(),
                                   [](const Iteration& it) { return it.finished > 0; });
    const auto fb = std::find_if(iterations_.begin(), iterations_.end(), blocked);
    first = static_cast<size_t>(std::max(fb, done) - iterations_.begin());
    if (first > last) first = static_cast<size_t>(fb - iterations_.begin());
  }
  std::vector<double> decoding, lengths;
  double occupancy = 0, per_token = 0, tokens = 0;
  int64_t per_token_samples = 0;
  for (size_t i = first; i <= last && i < iterations_.size(); ++i) {
    decoding.push_back(iterations_[i].decoding);
    lengths.push_back(absl::ToDoubleMilliseconds(iterations_[i].length));
    tokens += iterations_[i].decoding;
    r.window_seconds += absl::ToDoubleSeconds(iterations_[i].length);
    const OccupancySample& s = occupancy_[i];
    occupancy += static_cast<double>(s.used_blocks) / static_cast<double>(capacity_);
    if (s.cached_tokens > 0) {
      per_token += static_cast<double>(s.used_blocks * tpb_) / static_cast<double>(s.cached_tokens);
      ++per_token_samples;
    }
  }
  r.window_iterations = static_cast<int64_t>(decoding.size());
  const double n = std::max<double>(1, static_cast<double>(decoding.size()));
  for (double d : decoding) r.decoding_mean += d / n;
  r.decoding_p99 = Quantile(decoding, 0.99);
  for (const Iteration& it : iterations_) r.decoding_max = std::max<int64_t>(r.decoding_max, it.decoding);
  r.tokens_per_second = r.window_seconds > 0 ? tokens / r.window_seconds : 0;
  r.iteration_p50_ms = Quantile(lengths, 0.50);
  r.iteration_p99_ms = Quantile(lengths, 0.99);
  r.occupancy_mean = occupancy / n;
  r.blocks_per_token_mean = per_token_samples > 0 ? per_token / static_cast<double>(per_token_samples) : 0;
  r.queue_wait_p50_ms = Quantile(queue_wait_ms_, 0.50);
  r.queue_wait_p99_ms = Quantile(queue_wait_ms_, 0.99);
  r.requests_arrived = static_cast<int64_t>(next_arrival_);
  r.requests_admitted = static_cast<int64_t>(admission_order_.size());
  r.requests_finished = finished_;
  r.refused = refused_;
  r.held = held_;
  r.max_used_blocks = max_used_;
  r.max_reserved_blocks = max_reserved_;
  r.max_used_over_reserved =
      max_over_reserved_ == std::numeric_limits<int64_t>::min() ? 0 : max_over_reserved_;
  r.inline_reports = inline_reports_;
  r.admission_order = admission_order_;
  r.occupancy = occupancy_;
  return r;
}

absl::Status ValidateServeOptions(const ServeOptions& o) {
  const auto bad = [](absl::string_view flag, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", why));
  };
  if (o.server.empty()) return bad("server", "is required with --serve");
  if (o.configs.empty()) return bad("serve_configs", "names no configuration");
  if (!(o.arrival_rate > 0)) return bad("arrival_rate", "must be > 0");
  if (o.duration <= absl::ZeroDuration() && o.requests < 1) {
    return bad("requests", "must be >= 1 (or give --serve_duration)");
  }
  if (o.prompt_min < 1 || o.prompt_max < o.prompt_min) {
    return bad("prompt_min", "must be >= 1 and <= --prompt_max");
  }
  if (o.generate < 1) return bad("generate", "must be >= 1");
  if (o.streams < 1 || o.layers < 1) return bad("streams", "and --layers must be >= 1");
  if (o.model_step < absl::ZeroDuration()) return bad("model_step", "must be >= 0");
  for (const ServeConfig& c : o.configs) {
    if (c.handoff && (o.prefill_server.empty() || o.prefill_peer.empty())) {
      return bad("prefill_server", absl::StrCat("and --prefill_peer are required by '", c.name, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<ServeConfig>> ParseServeConfigs(absl::string_view spec) {
  std::vector<std::string> names;
  if (spec == "all") {
    names.push_back("full");
    for (const char* preset : {"inertia", "inertia_lazy4", "score_free"}) {
      for (const char* rho : {"0.5", "0.8", "0.9"}) names.push_back(absl::StrCat(preset, "@", rho));
    }
    names.push_back("handoff@0.9");
  } else {
    names = absl::StrSplit(spec, ',', absl::SkipEmpty());
  }
  std::vector<ServeConfig> out;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(ServeConfig c, ParseOneConfig(name));
    out.push_back(std::move(c));
  }
  return out;
}

absl::StatusOr<std::vector<ServeResult>> RunServe(const ServeOptions& o) {
  RETURN_IF_ERROR(ValidateServeOptions(o));
  client::ClientOptions co = o.connection;
  co.address = o.server;
  co.max_message_bytes = (int64_t{1} << 31) - 1;
  ASSIGN_OR_RETURN(std::unique_ptr<client::KvCacheClient> decode, client::KvCacheClient::Connect(co));
  std::unique_ptr<client::KvCacheClient> prefill;
  if (!o.prefill_server.empty()) {
    co.address = o.prefill_server;
    ASSIGN_OR_RETURN(prefill, client::KvCacheClient::Connect(co));
  }
  std::vector<ServeResult> results;
  for (const ServeConfig& c : o.configs) {
    ServeRun run(o, c, *decode, c.handoff ? prefill.get() : nullptr);
    absl::StatusOr<ServeResult> r = run.Run();
    if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(c.name, ": ", r.status().message()));
    results.push_back(*std::move(r));
  }
  return results;
}

std::string FormatServeTable(const std::vector<ServeResult>& results) {
  std::string out = absl::StrFormat(
      "%-24s %9s %7s %8s %9s %9s %9s %6s %9s %8s %7s %7s %9s\n", "config", "decoding", "p99",
      "tokens/s", "wait p50", "wait p99", "occupancy", "blk/tk", "finished", "refused", "held",
      "iter ms", "max used");
  for (const ServeResult& r : results) {
    absl::StrAppendFormat(&out, "%-24s %9.1f %7.0f %8.0f %8.0fms %8.0fms %8.0f%% %6.2f %9d %8d %7d %7.1f %9d%s\n",
                          r.config, r.decoding_mean, r.decoding_p99, r.tokens_per_second,
                          r.queue_wait_p50_ms, r.queue_wait_p99_ms, 100 * r.occupancy_mean,
                          r.blocks_per_token_mean, r.requests_finished, r.refused, r.held,
                          r.iteration_p50_ms, r.max_used_blocks,
                          r.pool_bound ? "" : "  (never pool-bound)");
  }
  if (!results.empty() && results.front().config == "full" && results.front().decoding_mean > 0) {
    for (size_t i = 1; i < results.size(); ++i) {
      absl::StrAppendFormat(&out, "%s %s %.2fx", i == 1 ? "concurrency against full:" : ",",
                            results[i].config, results[i].decoding_mean / results.front().decoding_mean);
    }
    if (results.size() > 1) out += "\n";
  }
  return out;
}

std::string ServeJson(const ServeOptions& o, const std::vector<ServeResult>& results) {
  std::string out = absl::StrFormat(
      "{\n  \"options\": {\"requests\": %d, \"duration_s\": %g, \"arrival_rate\": %g, "
      "\"prompt_min\": %d, \"prompt_max\": %d, \"prompt_distribution\": \"%s\", \"generate\": %d, "
      "\"streams\": %d, \"layers\": %d, \"model_step_ms\": %g, \"seed\": %d},\n  \"configs\": [",
      o.requests, absl::ToDoubleSeconds(o.duration), o.arrival_rate, o.prompt_min, o.prompt_max,
      o.prompt_log_uniform ? "log_uniform" : "uniform", o.generate, o.streams, o.layers,
      absl::ToDoubleMilliseconds(o.model_step), o.seed);
  for (size_t i = 0; i < results.size(); ++i) {
    const ServeResult& r = results[i];
    const ServeConfig& c = o.configs[i];
    absl::StrAppendFormat(
        &out,
        "%s\n    {\"config\": \"%s\", \"preset\": \"%s\", \"rho\": %g, \"full\": %s, \"handoff\": %s, "
        "\"capacity_blocks\": %d, \"tokens_per_block\": %d, \"pool_bound\": %s, "
        "\"window_seconds\": %g, \"window_iterations\": %d, \"decoding_mean\": %g, "
        "\"decoding_p99\": %g, \"decoding_max\": %d, \"tokens_per_second\": %g, "
        "\"iteration_p50_ms\": %g, \"iteration_p99_ms\": %g, \"occupancy_mean\": %g, "
        "\"blocks_per_token_mean\": %g, \"queue_wait_p50_ms\": %g, \"queue_wait_p99_ms\": %g, "
        "\"requests_arrived\": %d, \"requests_admitted\": %d, \"requests_finished\": %d, "
        "\"refused\": %d, \"held\": %d, \"max_used_blocks\": %d, \"max_reserved_blocks\": %d, "
        "\"max_used_over_reserved\": %d, \"inline_reports\": %d,\n     \"occupancy\": [",
        i == 0 ? "" : ",", r.config, c.preset, c.rho, c.full ? "true" : "false",
        c.handoff ? "true" : "false", r.capacity_blocks, r.tokens_per_block,
        r.pool_bound ? "true" : "false", r.window_seconds, r.window_iterations, r.decoding_mean,
        r.decoding_p99, r.decoding_max, r.tokens_per_second, r.iteration_p50_ms,
        r.iteration_p99_ms, r.occupancy_mean, r.blocks_per_token_mean, r.queue_wait_p50_ms,
        r.queue_wait_p99_ms, r.requests_arrived, r.requests_admitted, r.requests_finished,
        r.refused, r.held, r.max_used_blocks, r.max_reserved_blocks, r.max_used_over_reserved,
        r.inline_reports);
    for (size_t k = 0; k < r.occupancy.size(); ++k) {
      const OccupancySample& s = r.occupancy[k];
      absl::StrAppendFormat(&out, "%s[%.4f, %d, %d, %d, %d, %d]", k == 0 ? "" : ", ", s.seconds,
                            s.used_blocks, s.reserved_blocks, s.cached_tokens, s.decoding, s.queued);
    }
    out += "],\n     \"occupancy_columns\": [\"seconds\", \"used_blocks\", \"reserved_blocks\", "
           "\"cached_tokens\", \"decoding\", \"queued\"]}";
  }
  out += "\n  ]\n}\n";
  return out;
}

}  // namespace kvcm::loadgen

#include "server/kvcache_service.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"
#include "server/importer.h"
#include "server/kv_events_reactor.h"
#include "server/step_stream_reactor.h"
#include "server/translate.h"
#include "server/unary_call.h"

namespace kvcm::server {
namespace {

namespace v1 = ::kvcache::v1;

// Work over every sequence of a tenant (a list, a KV events snapshot) has no engine thread
// of its own: any one keeps it off the gRPC threads, and it waits there only for steps
// in progress, as it would anywhere. The tenant's shard spreads tenants over the threads.
int32_t ShardOfTenant(const StepExecutor& executor, const std::string& tenant) {
  return executor.ShardOf(tenant);
}

// A unary call whose reply holds bytes charged to the memory budget (--memory_limit_bytes):
// they are given back when gRPC is done with the call, the reply sent or the call dropped.
class ChargedReplyReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit ChargedReplyReactor(ByteBudget* budget) : budget_(budget) {}
  // Charges `bytes` when they fit; false (nothing taken) when not, with the refusal.
  // Called at most once per call, before Finish (so OnDone sees `charged_`).
  absl::Status Charge(int64_t bytes, absl::string_view what) {
    const ByteBudget* refused_by = budget_;
    if (!budget_->TryTake(bytes, &refused_by)) {
      return absl::ResourceExhaustedError(absl::StrCat(what, ": ", refused_by->Refusal(bytes)));
    }
    charged_ += bytes;
    return absl::OkStatus();
  }
  void OnDone() override {
    if (charged_ > 0) budget_->Release(charged_);
    delete this;
  }

 private:
  ~ChargedReplyReactor() override = default;
  ByteBudget* const budget_;
  int64_t charged_ = 0;
};

// Bytes an InspectSequence reply with include_cache holds at its peak, for a cache of
// `tokens` and `ranks` KV pools: each token's position (int64), momentum (float) and slot
// per rank (int64) in the table's snapshot and again in the response message, plus the
// serialized reply (a varint of at most 10 bytes for each int64).
int64_t InspectReplyBytes(int64_t tokens, int32_t ranks) {
  const int64_t in_memory = 8 + 4 + 8 * int64_t{ranks};
  const int64_t on_wire = 10 + 4 + 10 * int64_t{ranks};
  return tokens * (2 * in_memory + on_wire);
}

}  // namespace

// The unary Step: one PendingBatch per call, freed when the call's reply is out.
class UnaryStep final : public BatchCompletion {
 public:
  UnaryStep(grpc::ServerUnaryReactor* reactor, grpc::ByteBuffer* response)
      : reactor_(reactor), response_(response) {}
  v1::StepBatch& request() { return request_; }
  PendingBatch& batch() { return batch_; }
  void BatchDone(PendingBatch* batch) override {
    SerializeTo(batch->reply(), response_);
    reactor_->Finish(grpc::Status::OK);
    delete this;
  }
  // Ends `call` (this Step) with `status` and no reply: its request did not parse, or its
  // caller has no token. Counted as a unary call: the processor counts the batches it runs.
  void Refuse(UnaryCall call, const absl::Status& status) {
    call.Finish(status);
    delete this;
  }

 private:
  ~UnaryStep() = default;
  grpc::ServerUnaryReactor* const reactor_;
  grpc::ByteBuffer* const response_;
  v1::StepBatch request_;  // the batch reads it until BatchDone
  PendingBatch batch_;
};

KvCacheService::KvCacheService(const ServerOptions& options, SequenceTable* table,
                               const KvPools* pools, StepExecutor* executor,
                               ScoreRegions* regions, ServerMetrics* metrics,
                               const BearerTokens* tokens)
    : options_(options),
      table_(table),
      pools_(pools),
      executor_(executor),
      regions_(regions),
      metrics_(metrics),
      tokens_(tokens),
      processor_(table, executor, regions, metrics) {}

KvCacheService::~KvCacheService() = default;

absl::StatusOr<std::string> KvCacheService::Authenticate(
    const grpc::CallbackServerContext* context) const {
  if (tokens_ == nullptr) return std::string();
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  const absl::string_view value =
      it == metadata.end() ? absl::string_view() : absl::string_view(it->second.data(),
                                                                      it->second.size());
  return tokens_->TenantOf(value);
}

grpc::ServerUnaryReactor* KvCacheService::OpenSequence(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* raw_request,
                                                       grpc::ByteBuffer* raw_response) {
  // On the sequence's engine thread: an Open builds engine state (device memory with the
  // CUDA engine), and a step sent right after it queues behind it.
  return EngineUnary<v1::OpenSequenceRequest, v1::OpenSequenceResponse>(
      UnaryCall(RpcAccount(Rpc::kOpenSequence, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response, executor_,
      ShardOfSequence<v1::OpenSequenceRequest>,
      [this](const v1::OpenSequenceRequest& request, const std::string& tenant,
             v1::OpenSequenceResponse* response) {
        absl::StatusOr<OpenParams> params = FromProto(request);
        if (!params.ok()) return params.status();
        absl::StatusOr<SequenceInfo> info = table_->Open(
            params->id, params->options, params->tp_world_size, params->score_dtype, tenant);
        if (!info.ok()) return info.status();
        metrics_->SequenceOpened(info->policy.preset);
        ToProto(*info, absl::Now(), response->mutable_state());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::CloseSequence(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* raw_request,
                                                        grpc::ByteBuffer* raw_response) {
  // On the sequence's engine thread, after the steps queued before it: a step in progress
  // holds the slot the Close takes.
  return EngineUnary<v1::CloseSequenceRequest, v1::CloseSequenceResponse>(
      UnaryCall(RpcAccount(Rpc::kCloseSequence, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response, executor_,
      ShardOfSequence<v1::CloseSequenceRequest>,
      [this](const v1::CloseSequenceRequest& request, const std::string& tenant,
             v1::CloseSequenceResponse* response) {
        absl::StatusOr<SequenceInfo> last = table_->Close(request.sequence_id(), tenant);
        if (!last.ok()) return last.status();
        metrics_->SequenceClosed(last->policy.preset, CloseReason::kClient);
        ToProto(last->stats, response->mutable_stats());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::InspectSequence(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* raw_request,
                                                          grpc::ByteBuffer* raw_response) {
  // The reply's bytes are held until OnDone, so the reactor is our own. On the sequence's
  // engine thread: the Inspect waits for the slot a step holds, and with include_cache
  // copies the cache (device memory with the CUDA engine).
  auto* reactor = new ChargedReplyReactor(table_->memory_budget());
  return EngineUnary<v1::InspectSequenceRequest, v1::InspectSequenceResponse>(
      UnaryCall(RpcAccount(Rpc::kInspectSequence, metrics_), reactor,
                static_cast<int64_t>(raw_request->Length())),
      Authenticate(context), *raw_request, raw_response, executor_,
      ShardOfSequence<v1::InspectSequenceRequest>,
      [this, reactor](const v1::InspectSequenceRequest& request, const std::string& tenant,
                      v1::InspectSequenceResponse* response) {
        if (request.include_cache()) {
          // The reply grows with the cache (up to --max_sequence_tokens entries): its bytes
          // are taken before it is built, as a step takes what its growth needs. Steps
          // decided in between add a token each at most (the cache stops at its budget);
          // not charged.
          absl::StatusOr<SequenceInfo> brief =
              table_->Inspect(request.sequence_id(), false, tenant);
          if (!brief.ok()) return brief.status();
          const int32_t ranks = pools_ != nullptr ? pools_->ranks() : 0;
          RETURN_IF_ERROR(reactor->Charge(InspectReplyBytes(brief->cache_size, ranks),
                                          "InspectSequence with include_cache"));
        }
        absl::StatusOr<SequenceInfo> info =
            table_->Inspect(request.sequence_id(), request.include_cache(), tenant);
        if (!info.ok()) return info.status();
        ToProto(*info, absl::Now(), response->mutable_state());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::ListSequences(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* raw_request,
                                                        grpc::ByteBuffer* raw_response) {
  // A list reads every slot of the tenant, waiting for steps in progress: on one engine
  // thread (ShardOfTenant), not fanned out, since the list promises no order with any one
  // sequence's steps and a single task keeps it one call's work.
  return EngineUnary<v1::ListSequencesRequest, v1::ListSequencesResponse>(
      UnaryCall(RpcAccount(Rpc::kListSequences, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response, executor_,
      [](const StepExecutor& executor, const v1::ListSequencesRequest& /*request*/,
         const std::string& tenant) { return ShardOfTenant(executor, tenant); },
      [this](const v1::ListSequencesRequest& /*request*/, const std::string& tenant,
             v1::ListSequencesResponse* response) {
        const absl::Time now = absl::Now();
        for (const SequenceInfo& info : table_->List(tenant)) {
          ToProto(info, now, response->add_sequences());
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::DescribeKvPools(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* raw_request,
                                                          grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::DescribeKvPoolsRequest, v1::DescribeKvPoolsResponse>(
      UnaryCall(RpcAccount(Rpc::kDescribeKvPools, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response,
      [this](const v1::DescribeKvPoolsRequest& /*request*/, const std::string& /*tenant*/,
             v1::DescribeKvPoolsResponse* response) {
        if (pools_ != nullptr) {
          for (int32_t r = 0; r < pools_->ranks(); ++r) {
            ToProto(pools_->pool(r), options_.backend, response->add_pools());
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::Step(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* raw_request,
                                               grpc::ByteBuffer* raw_response) {
  // A batch that runs is counted by the processor (one request, and one error per failed
  // report); the call itself cannot fail once the batch parsed.
  const RpcAccount account(Rpc::kStep, metrics_);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto* call = new UnaryStep(reactor, raw_response);
  absl::StatusOr<std::string> tenant = Authenticate(context);
  absl::Status refused = tenant.status();
  if (refused.ok()) refused = ParseRequest(*raw_request, &call->request());
  if (!refused.ok()) {
    call->Refuse(UnaryCall(account, reactor, static_cast<int64_t>(raw_request->Length())),
                 refused);
    return reactor;
  }
  processor_.Process(call->request(), *tenant, account, &call->batch(), call);
  return reactor;
}

absl::Status KvCacheService::RegionsAllowed() const {
  if (regions_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "kvcached runs without --allow_shm_scores: score regions are off; send scores inline");
}

grpc::ServerUnaryReactor* KvCacheService::RegisterScoreRegion(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* raw_request,
                                                              grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::RegisterScoreRegionRequest, v1::RegisterScoreRegionResponse>(
      UnaryCall(RpcAccount(Rpc::kRegisterScoreRegion, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response,
      [this](const v1::RegisterScoreRegionRequest& request, const std::string& tenant,
             v1::RegisterScoreRegionResponse* response) {
        RETURN_IF_ERROR(RegionsAllowed());
        absl::StatusOr<uint64_t> region =
            regions_->Register(tenant, request.name(), request.byte_size());
        if (!region.ok()) return region.status();
        response->set_region(*region);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::CreateScoreRegion(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* raw_request,
                                                            grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::CreateScoreRegionRequest, v1::CreateScoreRegionResponse>(
      UnaryCall(RpcAccount(Rpc::kCreateScoreRegion, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response,
      [this](const v1::CreateScoreRegionRequest& request, const std::string& tenant,
             v1::CreateScoreRegionResponse* response) {
        RETURN_IF_ERROR(RegionsAllowed());
        absl::StatusOr<CreatedScoreRegion> region = regions_->Create(
            tenant, request.byte_size(), request.has_rank() ? request.rank() : -1);
        if (!region.ok()) return region.status();
        ToProto(*region, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvCacheService::UnregisterScoreRegion(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response) {
  return RawUnary<v1::UnregisterScoreRegionRequest, v1::UnregisterScoreRegionResponse>(
      UnaryCall(RpcAccount(Rpc::kUnregisterScoreRegion, metrics_), context, *raw_request),
      Authenticate(context), *raw_request, raw_response,
      [this](const v1::UnregisterScoreRegionRequest& request, const std::string& tenant,
             v1::UnregisterScoreRegionResponse* /*response*/) {
        RETURN_IF_ERROR(RegionsAllowed());
        return regions_->Unregister(tenant, request.region());
      });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::StepStream(
    grpc::CallbackServerContext* context) {
  absl::StatusOr<std::string> tenant = Authenticate(context);
  auto* reactor = new StepStreamReactor(this, &processor_, metrics_,
                                        options_.max_inflight_batches,
                                        tenant.ok() ? *tenant : std::string(),
                                        options_.stream_idle_timeout);
  grpc::Status refusal;
  {
    MutexLock lock(&mu_);
    if (!tenant.ok()) {
      refusal = ToGrpc(tenant.status());
    } else if (draining_) {
      refusal = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "kvcached is draining; open the stream on another daemon");
    } else if (open_streams_ >= options_.max_streams) {
      refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             absl::StrCat("kvcached already serves the maximum of ",
                                          options_.max_streams, " step streams"));
    }
    ++open_streams_;  // refused ones too: every reactor reports StreamDone
  }
  reactor->Start(refusal);  // counts a refusal as one of StepStream's errors
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheService::WatchKvEvents(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  const RpcAccount account(Rpc::kWatchKvEvents, metrics_);
  account.Received(static_cast<int64_t>(raw_request->Length()));
  KvEventLog* const log = table_->kv_events();
  auto* reactor = new KvEventsReactor(log != nullptr ? log->run() : "");
  absl::StatusOr<std::string> tenant = Authenticate(context);
  v1::WatchKvEventsRequest request;
  absl::Status refusal = tenant.status();
  if (refusal.ok()) refusal = ParseRequest(*raw_request, &request);
  if (refusal.ok() && log == nullptr) {
    refusal = absl::FailedPreconditionError(
        "kvcached runs with --kv_events_ring=0: it keeps no KV events");
  }
  if (refusal.ok()) {
    // The subscription's snapshot reads every sequence of the tenant, waiting for steps in
    // progress: on an engine thread (ShardOfTenant says which), which starts the reactor.
    refusal = RunOnEngine(
        executor_, ShardOfTenant(*executor_, *tenant), Rpc::kWatchKvEvents,
        [this, reactor, account, request = std::move(request), tenant = *tenant] {
          absl::StatusOr<std::unique_ptr<KvEventSubscription>> subscribed =
              Subscribe(request, tenant);
          account.Record(subscribed.status());
          reactor->Start(subscribed.ok() ? *std::move(subscribed) : nullptr,
                         ToGrpc(subscribed.status()));
        });
    if (refusal.ok()) return reactor;
  }
  account.Record(refusal);
  reactor->Start(nullptr, ToGrpc(refusal));
  return reactor;
}

absl::StatusOr<std::unique_ptr<KvEventSubscription>> KvCacheService::Subscribe(
    const ::kvcache::v1::WatchKvEventsRequest& request, const std::string& tenant) {
  // The subscriber sees only its tenant's sequences (KvEventSubscription::tenant).
  absl::StatusOr<std::unique_ptr<KvEventSubscription>> subscribed =
      table_->SubscribeKvEvents(request.after_event_id(), request.daemon_run(), tenant);
  if (!subscribed.ok()) return subscribed.status();
  // Checked after subscribing: StartDraining sets draining_ before it ends the
  // subscriptions, so a subscription it missed is refused here (and dropped).
  MutexLock lock(&mu_);
  if (draining_) {
    return absl::UnavailableError("kvcached is draining; watch another daemon's KV events");
  }
  return subscribed;
}

void KvCacheService::StartDraining() {
  {
    MutexLock lock(&mu_);
    draining_ = true;
  }
  if (KvEventLog* log = table_->kv_events(); log != nullptr) {
    log->EndSubscriptions("kvcached is draining: its KV events end here");
  }
}

void KvCacheService::StreamDone() {
  MutexLock lock(&mu_);
  --open_streams_;
}

grpc::ServerUnaryReactor* KvCacheService::ImportSequence(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* raw_request,
                                                         grpc::ByteBuffer* raw_response) {
  UnaryCall call(RpcAccount(Rpc::kImportSequence, metrics_), context, *raw_request);
  grpc::ServerUnaryReactor* const reactor = call.reactor();
  const absl::StatusOr<std::string> tenant = Authenticate(context);
  if (!tenant.ok()) return call.Finish(tenant.status());
  v1::ImportSequenceRequest request;
  if (absl::Status parsed = ParseRequest(*raw_request, &request); !parsed.ok()) {
    return call.Finish(parsed);
  }
  if (importer_ == nullptr) {
    return call.Finish(absl::UnimplementedError("this kvcached imports no sequences"));
  }
  // The import waits on the network: it runs on the importer's threads, which finish the
  // call; the gRPC thread returns now.
  absl::Status queued = importer_->Submit(
      *tenant, std::move(request),
      [call, raw_response](const absl::Status& status,
                           const v1::ImportSequenceResponse& response) mutable {
        if (status.ok()) SerializeTo(response, raw_response);
        call.Finish(status);
      });
  if (!queued.ok()) return call.Finish(queued);
  return reactor;
}

}  // namespace kvcm::server

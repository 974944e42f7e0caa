// The plumbing every unary RPC of kvcached's services goes through (KvCache, KvPeer):
// counting and finishing a call (UnaryCall), parsing its raw request, and running its
// handler on the gRPC thread (RawUnary, for work that never waits for the engine) or on
// an engine thread (EngineUnary). Header-only templates.
#ifndef KVCM_SERVER_UNARY_CALL_H_
#define KVCM_SERVER_UNARY_CALL_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/table/step_executor.h"
#include "grpcpp/grpcpp.h"
#include "server/kvcache_service.h"
#include "server/metrics.h"
#include "server/rpc_account.h"
#include "server/translate.h"

namespace kvcm::server {

// Every unary RPC goes through this: counts the request, and its failure by code, through
// the RPC's RpcAccount (the streams use theirs directly).
class UnaryCall {
 public:
  UnaryCall(RpcAccount account, grpc::ServerUnaryReactor* reactor, int64_t request_bytes)
      : account_(account), reactor_(reactor) {
    account_.Received(request_bytes);
  }
  UnaryCall(RpcAccount account, grpc::CallbackServerContext* context,
            const grpc::ByteBuffer& raw_request)
      : UnaryCall(account, context->DefaultReactor(),
                  static_cast<int64_t>(raw_request.Length())) {}

  Rpc rpc() const { return account_.rpc(); }
  grpc::ServerUnaryReactor* reactor() const { return reactor_; }

  // Thread-safe (ServerUnaryReactor::Finish is), so an engine thread may finish the call.
  grpc::ServerUnaryReactor* Finish(const absl::Status& status) {
    account_.Record(status);
    reactor_->Finish(ToGrpc(status));
    return reactor_;
  }

 private:
  RpcAccount account_;
  grpc::ServerUnaryReactor* reactor_;
};

// A response into the bytes gRPC sends.
template <typename Message>
void SerializeTo(const Message& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  // Fails only past 2 GiB, which --max_message_bytes keeps requests and replies under.
  (void)grpc::SerializationTraits<Message>::Serialize(message, out, &own_buffer);
}

// Runs `work` once on engine thread `shard`, carried there on the heap. OK, or why it was
// not queued (then nothing runs): RESOURCE_EXHAUSTED naming the queue, or UNAVAILABLE when
// the engine is stopping, each with what `rpc` should do about it.
inline absl::Status RunOnEngine(StepExecutor* executor, int32_t shard, Rpc rpc,
                         absl::AnyInvocable<void()> work) {
  using Work = absl::AnyInvocable<void()>;
  auto owned = std::make_unique<Work>(std::move(work));
  const StepExecutor::Task task{[](void* context, int32_t /*shard*/) {
                                  std::unique_ptr<Work> mine(static_cast<Work*>(context));
                                  (*mine)();
                                },
                                owned.get()};
  absl::Status posted = executor->TryPost(shard, task);
  if (posted.ok()) {
    owned.release();  // the task deletes it
    return posted;
  }
  const bool stopping = posted.code() == absl::StatusCode::kUnavailable;
  return absl::Status(posted.code(),
                      absl::StrCat(RpcName(rpc), " was not run: ", posted.message(),
                                   stopping ? "; kvcached is shutting down, so retry against "
                                              "the daemon that replaces it"
                                            : ""));
}

// One unary call on raw bytes from its parsed request to its reply. Heap-allocated: it
// owns the request, the caller's tenant and the handler until the call is finished, on
// whichever thread runs it (the gRPC thread, or an engine thread), then deletes itself.
template <typename Request, typename Response>
class UnaryTask {
 public:
  // The handler: the parsed request and the caller's tenant in, the response out.
  using Handler =
      absl::AnyInvocable<absl::Status(const Request&, const std::string& tenant, Response*)>;

  // Checks the caller's token (`tenant`) and parses the request; null (the call finished
  // with why) when either fails.
  static UnaryTask* Begin(UnaryCall call, const absl::StatusOr<std::string>& tenant,
                          const grpc::ByteBuffer& raw_request, grpc::ByteBuffer* raw_response,
                          Handler handle) {
    if (!tenant.ok()) {
      call.Finish(tenant.status());
      return nullptr;
    }
    auto* task = new UnaryTask(call, *tenant, raw_response, std::move(handle));
    if (absl::Status parsed = ParseRequest(raw_request, &task->request_); !parsed.ok()) {
      task->Finish(parsed);
      return nullptr;
    }
    return task;
  }

  const Request& request() const { return request_; }
  const std::string& tenant() const { return tenant_; }

  // Handles the request on this thread, sends the response when OK, finishes the call.
  void Run() {
    Response response;
    absl::Status status = handle_(request_, tenant_, &response);
    if (status.ok()) SerializeTo(response, raw_response_);
    Finish(status);
  }

  // Run, on engine thread `shard`; finishes the call with why when it cannot be queued.
  void RunOn(StepExecutor* executor, int32_t shard) {
    absl::Status posted = RunOnEngine(executor, shard, call_.rpc(), [this] { Run(); });
    if (!posted.ok()) Finish(posted);
  }

 private:
  UnaryTask(UnaryCall call, std::string tenant, grpc::ByteBuffer* raw_response, Handler handle)
      : call_(call),
        tenant_(std::move(tenant)),
        raw_response_(raw_response),
        handle_(std::move(handle)) {}

  void Finish(const absl::Status& status) {
    call_.Finish(status);
    delete this;
  }

  UnaryCall call_;
  const std::string tenant_;
  grpc::ByteBuffer* const raw_response_;  // gRPC's, valid until the call is done
  Handler handle_;
  Request request_;
};

// A unary RPC whose work never waits for the engine (the pools' description, score
// regions): counted, authenticated, parsed and handled on the gRPC thread.
template <typename Request, typename Response>
grpc::ServerUnaryReactor* RawUnary(UnaryCall call, const absl::StatusOr<std::string>& tenant,
                                   const grpc::ByteBuffer& raw_request,
                                   grpc::ByteBuffer* raw_response,
                                   typename UnaryTask<Request, Response>::Handler handle) {
  grpc::ServerUnaryReactor* const reactor = call.reactor();
  auto* task = UnaryTask<Request, Response>::Begin(call, tenant, raw_request, raw_response,
                                                   std::move(handle));
  if (task != nullptr) task->Run();
  return reactor;
}

// A unary RPC with table work: counted, authenticated and parsed on the gRPC thread, then
// handled on the engine thread `shard_of(executor, request, tenant)` names, behind the
// steps already queued there; that thread finishes the call.
template <typename Request, typename Response, typename ShardOf>
grpc::ServerUnaryReactor* EngineUnary(UnaryCall call, const absl::StatusOr<std::string>& tenant,
                                      const grpc::ByteBuffer& raw_request,
                                      grpc::ByteBuffer* raw_response, StepExecutor* executor,
                                      ShardOf shard_of,
                                      typename UnaryTask<Request, Response>::Handler handle) {
  grpc::ServerUnaryReactor* const reactor = call.reactor();  // the task may be gone below
  auto* task = UnaryTask<Request, Response>::Begin(call, tenant, raw_request, raw_response,
                                                   std::move(handle));
  if (task != nullptr) task->RunOn(executor, shard_of(*executor, task->request(), task->tenant()));
  return reactor;
}

// The engine thread of the request's sequence: its Open, steps, Inspect and Close run
// there in the order they arrive, and never contend for its slot with one another.
template <typename Request>
int32_t ShardOfSequence(const StepExecutor& executor, const Request& request,
                        const std::string& /*tenant*/) {
  return executor.ShardOf(request.sequence_id());
}

}  // namespace kvcm::server

#endif  // KVCM_SERVER_UNARY_CALL_H_

#include "server/kv_peer_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "server/tls.h"
#include "server/translate.h"
#include "server/unary_call.h"

namespace kvcm::server {
namespace {

namespace v1 = ::kvcache::v1;

constexpr int64_t kDefaultChunkBytes = int64_t{4} << 20;
constexpr int64_t kMaxChunkBytes = int64_t{64} << 20;

// Streams whole blocks of one rank of an export, a bounded chunk at a time: the next chunk
// is copied only once the last was written, so one stream holds one chunk.
class ExportedKvWriter final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  ExportedKvWriter(const ExportTable* exports, const KvPools* pools, RpcAccount account)
      : exports_(exports), pools_(pools), account_(account) {}

  void Start(const absl::StatusOr<std::string>& peer, const grpc::ByteBuffer& raw) {
    if (!peer.ok()) return End(peer.status());
    if (absl::Status parsed = ParseRequest(raw, &request_); !parsed.ok()) return End(parsed);
    if (pools_ == nullptr || request_.rank() < 0 || request_.rank() >= pools_->ranks()) {
      return End(absl::InvalidArgumentError(absl::StrCat(
          "ReadExportedKv: rank ", request_.rank(), " is not a KV pool rank of this kvcached")));
    }
    const int64_t block_bytes = pools_->pool(request_.rank()).layout().BlockBytes();
    const int64_t asked = request_.max_chunk_bytes() > 0 ? request_.max_chunk_bytes()
                                                         : kDefaultChunkBytes;
    blocks_per_chunk_ = std::max<int64_t>(1, std::min(asked, kMaxChunkBytes) / block_bytes);
    next_ = request_.first_block();
    end_ = request_.first_block() + std::max<int64_t>(0, request_.block_count());
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return End(absl::CancelledError("ReadExportedKv: the reader went away"));
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (next_ >= end_) return End(absl::OkStatus());
    const int64_t count = std::min(blocks_per_chunk_, end_ - next_);
    v1::ExportedKvChunk chunk;
    chunk.set_first_block(next_);
    if (absl::Status copied = exports_->CopyBlocks(request_.export_id(), request_.rank(), next_,
                                                   count, chunk.mutable_data());
        !copied.ok()) {
      return End(copied);
    }
    next_ += count;
    // Serialize writes into an empty buffer only: the last chunk's bytes go first (gRPC is
    // done with them once OnWriteDone ran).
    buffer_.Clear();
    bool own_buffer = false;
    if (const grpc::Status serialized = grpc::SerializationTraits<v1::ExportedKvChunk>::Serialize(
            chunk, &buffer_, &own_buffer);
        !serialized.ok()) {
      return End(absl::InternalError(absl::StrCat("ReadExportedKv: a chunk of ", count,
                                                   " blocks does not serialize: ",
                                                   serialized.error_message())));
    }
    StartWrite(&buffer_);
  }
  void End(const absl::Status& status) {
    account_.Record(status);
    Finish(ToGrpc(status));
  }

  const ExportTable* const exports_;
  const KvPools* const pools_;
  RpcAccount account_;
  v1::ReadExportedKvRequest request_;
  grpc::ByteBuffer buffer_;  // the chunk being written
  int64_t blocks_per_chunk_ = 1;
  int64_t next_ = 0;
  int64_t end_ = 0;
};

}  // namespace

KvPeerService::KvPeerService(ExportTable* exports, const KvPools* pools, UcxSidecar* ucx,
                             StepExecutor* executor, ServerMetrics* metrics, PeerTrust trust)
    : exports_(exports),
      pools_(pools),
      ucx_(ucx),
      executor_(executor),
      metrics_(metrics),
      trust_(std::move(trust)) {}

absl::StatusOr<std::string> KvPeerService::AuthenticatePeer(
    const grpc::CallbackServerContext* context) const {
  const bool by_token = trust_.tokens != nullptr;
  const bool by_certificate = !trust_.peer_ca_pem.empty();
  if (!by_token && !by_certificate) return std::string();
  if (by_certificate) {
    const std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
    for (const grpc::string_ref& pem : auth->FindPropertyValues("x509_pem_cert")) {
      if (IssuedBy(std::string(pem.data(), pem.size()), trust_.peer_ca_pem)) return std::string();
    }
  }
  if (by_token) {
    const auto& metadata = context->client_metadata();
    if (auto it = metadata.find("authorization"); it != metadata.end()) {
      absl::StatusOr<TokenEntry> entry =
          trust_.tokens->Find(absl::string_view(it->second.data(), it->second.size()));
      if (entry.ok() && entry->peer) return std::string();
      if (entry.ok()) {
        return absl::PermissionDeniedError(
            "KvPeer serves other kvcached only: this token's line in --auth_tokens_file "
            "lacks the role 'peer'");
      }
    }
  }
  return absl::UnauthenticatedError(
      "KvPeer serves other kvcached only: present a peer token (a 'token tenant peer' line "
      "of --auth_tokens_file, sent with --peer_token_file) or a client certificate issued "
      "by --peer_ca_file");
}

grpc::ServerUnaryReactor* KvPeerService::ExportSequence(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* raw_request,
                                                        grpc::ByteBuffer* raw_response) {
  // On the sequence's engine thread: the freeze waits for its steps already queued.
  return EngineUnary<v1::ExportSequenceRequest, v1::ExportSequenceResponse>(
      UnaryCall(RpcAccount(Rpc::kExportSequence, metrics_), context, *raw_request),
      AuthenticatePeer(context), *raw_request, raw_response, executor_,
      ShardOfSequence<v1::ExportSequenceRequest>,
      [this](const v1::ExportSequenceRequest& request, const std::string& /*peer*/,
             v1::ExportSequenceResponse* response) {
        RETURN_IF_ERROR(CheckSequenceId(request.sequence_id()));
        ASSIGN_OR_RETURN(ExportTicket ticket,
                         exports_->Begin(request.tenant(), request.sequence_id()));
        response->set_export_id(ticket.export_id);
        response->set_record(std::move(ticket.record));
        response->set_pool_ranks(pools_ != nullptr ? pools_->ranks() : 0);
        response->set_lease_seconds(absl::ToDoubleSeconds(exports_->lease()));
        if (pools_ == nullptr) return absl::OkStatus();
        ToProto(pools_->pool(0).layout(), response->mutable_geometry());
        // Without a sidecar (none, or none can start now) the target reads over gRPC.
        absl::StatusOr<UcxExposure> exposure =
            request.want_ucx() && ucx_ != nullptr
                ? ucx_->Exposure()
                : absl::StatusOr<UcxExposure>(absl::UnavailableError("no UCX"));
        if (exposure.ok()) {
          response->set_ucx_worker_address(exposure->worker_address);
          for (size_t r = 0; r < exposure->keys.size(); ++r) {
            v1::UcxRank* rank = response->add_ucx_ranks();
            rank->set_rank(static_cast<int32_t>(r));
            rank->set_remote_address(exposure->keys[r].remote_address);
            rank->set_rkey(exposure->keys[r].rkey);
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvPeerService::ReadExportedKv(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  const RpcAccount account(Rpc::kReadExportedKv, metrics_);
  account.Received(static_cast<int64_t>(raw_request->Length()));
  auto* writer = new ExportedKvWriter(exports_, pools_, account);
  writer->Start(AuthenticatePeer(context), *raw_request);
  return writer;
}

grpc::ServerUnaryReactor* KvPeerService::FinishExport(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* raw_request,
                                                      grpc::ByteBuffer* raw_response) {
  // A commit closes the sequence: table work, on an engine thread (any: the sequence is
  // frozen, so nothing of its own is queued that it could overtake).
  return EngineUnary<v1::FinishExportRequest, v1::FinishExportResponse>(
      UnaryCall(RpcAccount(Rpc::kFinishExport, metrics_), context, *raw_request),
      AuthenticatePeer(context), *raw_request, raw_response, executor_,
      [](const StepExecutor& executor, const v1::FinishExportRequest& request,
         const std::string& /*peer*/) {
        return executor.ShardOf(absl::StrCat(request.export_id()));
      },
      [this](const v1::FinishExportRequest& request, const std::string& /*peer*/,
             v1::FinishExportResponse* response) {
        ASSIGN_OR_RETURN(const ExportEnd end,
                         exports_->Finish(request.export_id(), request.commit()));
        if (end.now) {
          metrics_->ExportsEnded(end.committed ? ExportResult::kCommitted : ExportResult::kAborted,
                                 1);
          if (end.committed) metrics_->SequenceClosed(end.policy_preset, CloseReason::kHandedOff);
        }
        response->set_committed(end.committed);
        return absl::OkStatus();
      });
}

}  // namespace kvcm::server

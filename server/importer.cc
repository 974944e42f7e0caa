#include "server/importer.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/persist/snapshot.h"
#include "server/tls.h"
#include "server/translate.h"

namespace kvcm::server {
namespace {

namespace v1 = ::kvcache::v1;

// The most bytes one ReadExportedKv message carries (whole blocks; at least one).
constexpr int64_t kChunkBytes = int64_t{4} << 20;
// Commit attempts when the source's answer is lost (UNAVAILABLE, DEADLINE_EXCEEDED): a
// repeated FinishExport gets the same answer, so retrying cannot commit twice.
constexpr int kCommitAttempts = 3;
// Sources whose channels are kept (a decode node imports from its prefill nodes).
constexpr size_t kMaxChannels = 256;

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot be read"));
  return text.str();
}

// Runs `work` on the engine thread of sequence `id` and waits for it: the table work of an
// import runs there, in order with the sequence's other calls.
absl::Status OnEngine(StepExecutor* executor, absl::string_view id,
                      absl::AnyInvocable<void()> work) {
  struct Call {
    absl::AnyInvocable<void()> work;
    absl::Notification done;
  };
  Call call{std::move(work), {}};
  const StepExecutor::Task task{[](void* context, int32_t /*shard*/) {
                                  auto* c = static_cast<Call*>(context);
                                  c->work();
                                  c->done.Notify();
                                },
                                &call};
  if (absl::Status posted = executor->TryPost(executor->ShardOf(id), task); !posted.ok()) {
    return absl::Status(posted.code(), absl::StrCat("ImportSequence was not run: ", posted.message()));
  }
  call.done.WaitForNotification();
  return absl::OkStatus();
}

// A failed call to the source, named: UNAVAILABLE stays so (the source is down or gone
// mid-transfer); its own answers (NOT_FOUND, FAILED_PRECONDITION, ...) keep their code.
absl::Status FromSource(const std::string& source, absl::string_view call,
                        const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("source ", source, ": ", call, ": ", status.error_message()));
}

// The export's claims checked against the request and this node, before anything is
// leased: a forged or mismatched export is refused here.
absl::Status CheckExport(const std::string& source, const v1::ExportSequenceResponse& exported,
                         const SequenceRecord& record, const std::string& tenant,
                         const std::string& id, const KvPools* pools) {
  const auto mismatch = [&](absl::string_view what) {
    return absl::FailedPreconditionError(
        absl::StrCat("source ", source, ": the export of sequence '", id, "' ", what));
  };
  if (record.id != id || record.tenant != tenant) {
    return mismatch("describes another sequence or tenant");
  }
  const int32_t ranks = pools != nullptr ? pools->ranks() : 0;
  if (exported.pool_ranks() != ranks || static_cast<int32_t>(record.kv.size()) != ranks) {
    return mismatch(absl::StrCat("holds KV in ", exported.pool_ranks(),
                                 " pool(s) (its record: ", record.kv.size(), "); this kvcached has ",
                                 ranks, ": both need the same --tp_ranks pools, or none"));
  }
  if (ranks == 0) return absl::OkStatus();
  v1::KvBlockGeometry here;
  ToProto(pools->pool(0).layout(), &here);
  const v1::KvBlockGeometry& there = exported.geometry();
  if (there.tokens_per_block() != here.tokens_per_block() || there.layers() != here.layers() ||
      there.kv_heads() != here.kv_heads() || there.head_dim() != here.head_dim() ||
      there.dtype() != here.dtype() || there.block_bytes() != here.block_bytes()) {
    return mismatch(absl::StrCat(
        "has KV blocks of ", there.tokens_per_block(), " tokens x ", there.layers(), " layers x ",
        there.kv_heads(), " heads x ", there.head_dim(), " dims (", there.block_bytes(),
        " bytes); this kvcached's are ", here.tokens_per_block(), " x ", here.layers(), " x ",
        here.kv_heads(), " x ", here.head_dim(), " (", here.block_bytes(),
        " bytes): --kv_* flags must agree"));
  }
  return absl::OkStatus();
}

// Consecutive blocks on both sides read as one, up to kMaxReadBytes: reads stay many and
// bounded, so that several are in flight and each completes well within UCX's stall
// detection (a single 2 GiB get would look stalled on a same-host path).
constexpr int64_t kMaxReadBytes = int64_t{8} << 20;

void AppendUcxReads(const std::vector<int32_t>& source_blocks,
                    const std::vector<int32_t>& target_blocks, uint32_t key, int32_t rank,
                    uint64_t remote_base, int64_t block_bytes, std::vector<SidecarRead>* reads) {
  const size_t most = static_cast<size_t>(std::max<int64_t>(1, kMaxReadBytes / block_bytes));
  for (size_t i = 0; i < source_blocks.size();) {
    size_t n = 1;
    while (n < most && i + n < source_blocks.size() &&
           source_blocks[i + n] == source_blocks[i] + int32_t(n) &&
           target_blocks[i + n] == target_blocks[i] + int32_t(n)) {
      ++n;
    }
    reads->push_back(SidecarRead{
        key,
        remote_base + static_cast<uint64_t>(source_blocks[i]) * static_cast<uint64_t>(block_bytes),
        rank, target_blocks[i] * block_bytes, static_cast<int64_t>(n) * block_bytes});
    i += n;
  }
}

}  // namespace

absl::StatusOr<PeerCredentials> ReadPeerCredentials(const ServerOptions& options) {
  PeerCredentials credentials;
  if (!options.peer_token_file.empty()) {
    ASSIGN_OR_RETURN(std::string token, ReadWholeFile(options.peer_token_file, "--peer_token_file"));
    credentials.token = std::string(absl::StripAsciiWhitespace(token));
    if (credentials.token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--peer_token_file ", options.peer_token_file, ": no token in it"));
    }
  }
  if (!options.peer_ca_file.empty()) {
    ASSIGN_OR_RETURN(credentials.ca_pem,
                     ReadPem(options.peer_ca_file, "--peer_ca_file", PemKind::kCertificate));
    ASSIGN_OR_RETURN(credentials.cert_pem,
                     ReadPem(options.tls_cert_file, "--tls_cert_file", PemKind::kCertificate));
    ASSIGN_OR_RETURN(credentials.key_pem,
                     ReadPem(options.tls_key_file, "--tls_key_file", PemKind::kPrivateKey));
  }
  return credentials;
}

Importer::Importer(const ServerOptions& options, PeerCredentials credentials,
                   SequenceTable* table, KvPools* pools, StepExecutor* executor,
                   UcxSidecar* ucx, ServerMetrics* metrics)
    : options_(options),
      credentials_(std::move(credentials)),
      table_(table),
      pools_(pools),
      executor_(executor),
      ucx_(ucx),
      metrics_(metrics),
      bytes_in_flight_(options.max_import_bytes_in_flight, "--max_import_bytes_in_flight") {
  for (int32_t i = 0; i < options_.import_threads; ++i) threads_.emplace_back([this] { Loop(); });
}

Importer::~Importer() {
  Stop();
  for (std::thread& t : threads_) t.join();
}

void Importer::Stop() {
  std::deque<Job> dropped;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    dropped.swap(queue_);
    wake_.notify_all();
  }
  for (Job& job : dropped) {
    job.done(absl::UnavailableError("ImportSequence was not run: kvcached is shutting down"),
             v1::ImportSequenceResponse());
  }
}

absl::Status Importer::Submit(std::string tenant, v1::ImportSequenceRequest request, Done done) {
  MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError("ImportSequence was not run: kvcached is shutting down");
  }
  // Waiting means no import thread is free to take it: an idle thread takes one at once.
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queued_imports + idle_threads_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", request.sequence_id(), "': ", queue_.size(),
        " imports are already waiting (--max_queued_imports); retry later"));
  }
  queue_.push_back(Job{std::move(tenant), std::move(request), std::move(done)});
  wake_.notify_one();
  return absl::OkStatus();
}

void Importer::Loop() {
  while (true) {
    Job job;
    {
      MutexLock lock(&mu_);
      ++idle_threads_;
      while (queue_.empty() && !stopping_) mu_.Wait(&wake_);
      --idle_threads_;
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    v1::ImportSequenceResponse response;
    const absl::Status status = Run(job, &response);
    metrics_->ImportDone(status.ok(), response.transport(), response.kv_bytes());
    job.done(status, response);
  }
}

std::shared_ptr<grpc::Channel> Importer::ChannelTo(const std::string& source) {
  MutexLock lock(&mu_);
  if (auto it = channels_.find(source); it != channels_.end()) return it->second;
  if (channels_.size() >= kMaxChannels) channels_.clear();
  std::shared_ptr<grpc::ChannelCredentials> creds =
      credentials_.ca_pem.empty()
          ? grpc::InsecureChannelCredentials()
          : grpc::SslCredentials({credentials_.ca_pem, credentials_.key_pem, credentials_.cert_pem});
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(source, creds, args);
  channels_.emplace(source, channel);
  return channel;
}

void Importer::SetUp(grpc::ClientContext* context, absl::Time deadline) const {
  context->set_deadline(absl::ToChronoTime(deadline));
  if (!credentials_.token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", credentials_.token));
  }
}

bool Importer::UseUcx() const {
  return options_.kv_transfer == "ucx" && ucx_ != nullptr && pools_ != nullptr &&
         pools_->pool(0).storage().space() == MemorySpace::kHost;
}

absl::Status Importer::Run(const Job& job, v1::ImportSequenceResponse* response) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.import_timeout;
  const std::string& source = job.request.source();
  const std::string& id = job.request.sequence_id();
  RETURN_IF_ERROR(CheckSequenceId(id));
  if (source.empty() || source.size() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", id, "': source must be the address of the kvcached that holds it, "
        "host:port or unix:/path (1 to 1024 bytes; got ", source.size(), ")"));
  }
  std::unique_ptr<v1::KvPeer::Stub> stub = v1::KvPeer::NewStub(ChannelTo(source));
  v1::ExportSequenceResponse exported;
  {
    grpc::ClientContext context;
    SetUp(&context, deadline);
    v1::ExportSequenceRequest request;
    request.set_sequence_id(id);
    request.set_tenant(job.tenant);
    request.set_want_ucx(UseUcx());
    const grpc::Status status = stub->ExportSequence(&context, request, &exported);
    if (!status.ok()) return FromSource(source, "ExportSequence", status);
  }
  response->set_record_bytes(static_cast<int64_t>(exported.record().size()));
  const absl::Status imported = ImportExported(job, *stub, exported, deadline, response);
  if (imported.ok()) response->set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return imported;
}

absl::Status Importer::ImportExported(const Job& job, v1::KvPeer::Stub& stub,
                                      const v1::ExportSequenceResponse& exported,
                                      absl::Time deadline, v1::ImportSequenceResponse* response) {
  const std::string& source = job.request.source();
  const std::string& id = job.request.sequence_id();
  std::optional<SequenceTable::PendingImport> pending;
  SequenceRecord record;
  int64_t kv_bytes = 0;
  absl::Status status = Prepare(job, exported, &record, &pending, &kv_bytes);
  if (status.ok()) {
    absl::StatusOr<std::string> transport =
        CopyKv(stub, source, exported, record, pending->kv(), deadline);
    status = transport.status();
    if (transport.ok()) {
      response->set_transport(*transport);
      response->set_kv_bytes(*transport == "none" ? 0 : kv_bytes);
    }
  }
  // Until here the source still serves the sequence: give it back, and what was taken here.
  absl::StatusOr<bool> committed = status.ok()
                                       ? Commit(stub, source, exported.export_id(), deadline)
                                       : Abort(stub, exported.export_id());
  if (kv_bytes > 0) bytes_in_flight_.Give(kv_bytes);
  if (!status.ok() && !(committed.ok() && *committed)) return status;
  if (!committed.ok()) return committed.status();
  if (!*committed) {
    return absl::AbortedError(absl::StrCat("source ", source, ": the hand-off of sequence '",
                                           id, "' was aborted there; it still serves it"));
  }
  // Committed: the source has closed it, so it must become findable here whatever happens.
  Install(job, std::move(*pending), response);
  return absl::OkStatus();
}

absl::Status Importer::Prepare(const Job& job, const v1::ExportSequenceResponse& exported,
                               SequenceRecord* record,
                               std::optional<SequenceTable::PendingImport>* pending,
                               int64_t* kv_bytes) {
  const std::string& source = job.request.source();
  const std::string& id = job.request.sequence_id();
  absl::StatusOr<SequenceRecord> decoded = DecodeSequenceRecord(exported.record());
  if (!decoded.ok()) {
    return absl::DataLossError(absl::StrCat("source ", source, ": the export of sequence '", id,
                                            "' does not decode: ", decoded.status().message()));
  }
  *record = *std::move(decoded);
  RETURN_IF_ERROR(CheckExport(source, exported, *record, job.tenant, id, pools_));
  int64_t bytes = 0;
  for (const BlockLeaseState& lease : record->kv) {
    bytes += static_cast<int64_t>(lease.blocks.size()) * pools_->pool(0).layout().BlockBytes();
  }
  const ByteBudget* refused = nullptr;
  if (!bytes_in_flight_.TryTake(bytes, &refused)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence '", id, "': its ", bytes, " bytes of K/V: ", refused->Refusal(bytes),
        "; retry once imports in progress finish"));
  }
  *kv_bytes = bytes;
  absl::Status prepared;
  RETURN_IF_ERROR(OnEngine(executor_, id, [&] {
    absl::StatusOr<SequenceTable::PendingImport> built = table_->PrepareImport(*record);
    if (built.ok()) {
      pending->emplace(*std::move(built));
    } else {
      prepared = built.status();
    }
  }));
  if (prepared.ok()) return prepared;
  return absl::Status(prepared.code(), absl::StrCat("importing sequence '", id, "' from ", source,
                                                    ": ", prepared.message()));
}

absl::StatusOr<std::string> Importer::CopyKv(v1::KvPeer::Stub& stub, const std::string& source,
                                             const v1::ExportSequenceResponse& exported,
                                             const SequenceRecord& record,
                                             const std::vector<BlockLeaseState>& here,
                                             absl::Time deadline) {
  if (pools_ == nullptr) return std::string("none");
  // The record was checked: here[r] has as many blocks as the source's lease of rank r.
  const int32_t ranks = pools_->ranks();
  if (UseUcx() && !exported.ucx_worker_address().empty() && exported.ucx_ranks_size() == ranks) {
    std::vector<std::string> rkeys;
    std::vector<SidecarRead> reads;
    for (int32_t r = 0; r < ranks; ++r) {
      const v1::UcxRank& rank = exported.ucx_ranks(r);
      rkeys.push_back(rank.rkey());
      AppendUcxReads(record.kv[static_cast<size_t>(r)].blocks, here[static_cast<size_t>(r)].blocks,
                     static_cast<uint32_t>(r), r, rank.remote_address(),
                     pools_->pool(r).layout().BlockBytes(), &reads);
    }
    const absl::Status read = ucx_->Read(exported.ucx_worker_address(), rkeys, reads, deadline);
    if (!read.ok()) {
      return absl::Status(read.code(), absl::StrCat("source ", source,
                                                    ": reading its KV blocks over UCX: ",
                                                    read.message()));
    }
    return std::string("ucx");
  }
  for (int32_t r = 0; r < ranks; ++r) {
    RETURN_IF_ERROR(ReadOverGrpc(stub, source, exported.export_id(), r,
                                 here[static_cast<size_t>(r)].blocks, deadline));
  }
  return std::string("grpc");
}

absl::Status Importer::ReadOverGrpc(v1::KvPeer::Stub& stub, const std::string& source,
                                    uint64_t export_id, int32_t rank,
                                    const std::vector<int32_t>& target_blocks,
                                    absl::Time deadline) {
  BlockPool& pool = pools_->pool(rank);
  const int64_t block_bytes = pool.layout().BlockBytes();
  const int64_t blocks = static_cast<int64_t>(target_blocks.size());
  grpc::ClientContext context;
  SetUp(&context, deadline);
  v1::ReadExportedKvRequest request;
  request.set_export_id(export_id);
  request.set_rank(rank);
  request.set_first_block(0);
  request.set_block_count(blocks);
  request.set_max_chunk_bytes(kChunkBytes);
  std::unique_ptr<grpc::ClientReader<v1::ExportedKvChunk>> reader =
      stub.ReadExportedKv(&context, request);
  v1::ExportedKvChunk chunk;
  int64_t next = 0;
  absl::Status status;
  while (status.ok() && reader->Read(&chunk)) {
    const int64_t size = static_cast<int64_t>(chunk.data().size());
    const int64_t count = size / block_bytes;
    if (chunk.first_block() != next || size % block_bytes != 0 || count > blocks - next) {
      status = absl::DataLossError(absl::StrCat(
          "source ", source, ": rank ", rank, "'s KV stream sent blocks from ",
          chunk.first_block(), " (", size, " bytes) where block ", next, " was due"));
      break;
    }
    for (int64_t k = 0; k < count && status.ok(); ++k) {
      status = pool.mutable_storage().CopyIn(
          target_blocks[static_cast<size_t>(next + k)] * block_bytes,
          chunk.data().data() + k * block_bytes, block_bytes);
    }
    next += count;
  }
  if (!status.ok()) context.TryCancel();
  const grpc::Status finished = reader->Finish();
  RETURN_IF_ERROR(status);
  if (!finished.ok()) return FromSource(source, "ReadExportedKv", finished);
  if (next != blocks) {
    return absl::DataLossError(absl::StrCat("source ", source, ": rank ", rank, "'s KV stream ended after ",
                                            next, " of ", blocks, " blocks"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Importer::Commit(v1::KvPeer::Stub& stub, const std::string& source,
                                      uint64_t export_id, absl::Time deadline) {
  // The commit gets a moment even when the copy used up the deadline: giving up now would
  // waste a finished transfer.
  const absl::Time commit_deadline = std::max(deadline, absl::Now() + absl::Seconds(5));
  grpc::Status last;
  for (int attempt = 0; attempt < kCommitAttempts; ++attempt) {
    grpc::ClientContext context;
    SetUp(&context, commit_deadline);
    v1::FinishExportRequest request;
    request.set_export_id(export_id);
    request.set_commit(true);
    v1::FinishExportResponse answer;
    last = stub.FinishExport(&context, request, &answer);
    if (last.ok()) return answer.committed();
    if (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
        last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return FromSource(source, "FinishExport", last);
    }
  }
  // No answer: asking it to abort tells whether the commit was taken after all.
  absl::StatusOr<bool> committed = Abort(stub, export_id);
  if (committed.ok()) return *committed;
  // Neither answered: the source may have closed it (or died). Keeping it here risks a
  // second copy there, which serves nobody and is reclaimed when idle; dropping it would
  // risk losing the sequence.
  std::fprintf(stderr,
               "kvcached: source %s answered neither the commit nor the abort of export %llu "
               "(%s); the sequence is kept here\n",
               source.c_str(), static_cast<unsigned long long>(export_id),
               last.error_message().c_str());
  return true;
}

absl::StatusOr<bool> Importer::Abort(v1::KvPeer::Stub& stub, uint64_t export_id) {
  grpc::ClientContext context;
  SetUp(&context, absl::Now() + absl::Seconds(5));
  v1::FinishExportRequest request;
  request.set_export_id(export_id);
  request.set_commit(false);
  v1::FinishExportResponse answer;
  const grpc::Status status = stub.FinishExport(&context, request, &answer);
  if (!status.ok()) {
    // The source's lease on the export ends it anyway (--export_lease).
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }
  return answer.committed();
}

void Importer::Install(const Job& job, SequenceTable::PendingImport pending,
                       v1::ImportSequenceResponse* response) {
  const std::string& id = job.request.sequence_id();
  std::optional<SequenceTable::PendingImport> holder(std::move(pending));
  const auto install = [&] {
    const SequenceInfo installed = table_->CommitImport(std::move(*holder));
    metrics_->SequenceOpened(installed.policy.preset);
    absl::StatusOr<SequenceInfo> info = table_->Inspect(id, /*with_cache=*/true, job.tenant);
    ToProto(info.ok() ? *info : installed, absl::Now(), response->mutable_state());
  };
  // On its engine thread when it can be queued there; otherwise here (the table is
  // thread-safe): the source has closed it, so it is never dropped.
  if (!OnEngine(executor_, id, install).ok()) install();
}

}  // namespace kvcm::server

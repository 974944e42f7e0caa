// The C++ client of kvcached, for C++ model workers and tools.
//
//   auto client = kvcm::client::KvCacheClient::Connect({.address = "127.0.0.1:50051"});
//   auto state = (*client)->Open(OpenRequest("req-1", 4096, 0.9, "inertia"));
//   auto stream = (*client)->OpenStepStream();          // one per worker rank
//   kvcache::v1::StepBatch batch;                       // every sequence of this step
//   SetFloat32Scores(AddReport(&batch, "req-1", 1), scores, layers);
//   auto decisions = (*stream)->Step(batch);            // one Decision per report
//
// On the daemon's node, a ScoreRegion (clients/cpp/score_region.h) carries the scores in
// shared memory, or in a CUDA engine's device memory, instead of the request; a FOLDED sequence takes one row per step
// (FoldScores below) instead of one per layer.
//
// KvCacheClient is thread-safe; a StepStream carries one batch at a time (one per worker
// rank, used from one thread). Errors are absl::Status with the daemon's message.
#ifndef KVCM_CLIENTS_CPP_KVCACHE_CLIENT_H_
#define KVCM_CLIENTS_CPP_KVCACHE_CLIENT_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kernels/score_matrix.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcm::client {

namespace v1 = ::kvcache::v1;

struct ClientOptions {
  std::string address = "127.0.0.1:50051";
  // TLS: with a CA file (PEM) the channel is TLS and the server's certificate is verified
  // against it; a client certificate and key (PEM, both or neither) answer a daemon that
  // requires them (kvcached --tls_client_ca_file). `tls_server_name`: the name the
  // server's certificate must carry, when it is not the address's host.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Sent as "authorization: Bearer <auth_token>" on every call (kvcached
  // --auth_tokens_file), stubs' included; empty: none.
  std::string auth_token;
  absl::Duration connect_timeout = absl::Seconds(10);  // wait this long for the channel
  absl::Duration rpc_timeout = absl::Seconds(60);      // per unary call
  int64_t max_message_bytes = 256 << 20;
};

// One worker rank's step stream. Not thread-safe.
class StepStream {
 public:
  ~StepStream();

  // Sends one batch and waits for its decisions. A per-sequence failure is a Decision
  // with a non-zero code; an error here means the stream itself failed.
  absl::StatusOr<v1::DecisionBatch> Step(const v1::StepBatch& batch);

  // Sends the batch without waiting; pair every Send with one Receive (used by tensor-
  // parallel drivers that must let other ranks report before the reply can come).
  absl::Status Send(const v1::StepBatch& batch);
  absl::StatusOr<v1::DecisionBatch> Receive();

  // Half-closes and returns the call's final status.
  absl::Status Close();

 private:
  friend class KvCacheClient;
  StepStream(std::unique_ptr<grpc::ClientContext> context,
             std::unique_ptr<grpc::ClientReaderWriter<v1::StepBatch, v1::DecisionBatch>> stream);

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepBatch, v1::DecisionBatch>> stream_;
  bool closed_ = false;
};

// A channel to options.address with its TLS and bearer token (the token on every call,
// through an interceptor), not yet connected: for tools that hold their own stubs.
// INVALID_ARGUMENT for unreadable TLS files.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options);

class KvCacheClient {
 public:
  // Connects and waits until the channel is ready (UNAVAILABLE after connect_timeout).
  static absl::StatusOr<std::unique_ptr<KvCacheClient>> Connect(const ClientOptions& options);

  absl::StatusOr<v1::SequenceState> Open(const v1::OpenSequenceRequest& request);
  absl::StatusOr<v1::SequenceStats> Close(absl::string_view sequence_id);
  absl::StatusOr<v1::SequenceState> Inspect(absl::string_view sequence_id, bool include_cache);
  absl::StatusOr<std::vector<v1::SequenceState>> List();
  // Moves `sequence_id` from the kvcached at `source` ("host:port" or "unix:/path", as
  // this daemon reaches it) into this one (disaggregated serving, docs/DISAGGREGATION.md):
  // it is open here afterwards under the same id and tenant at the same step, and the
  // response's state carries its positions and, with KV pools, each rank's slot table
  // (kv_slots); decode on at state().last_step() + 1 against this daemon. A failed import
  // leaves nothing here and the source serving it. Errors as the RPC's (kvcache.proto):
  // NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, UNAVAILABLE, RESOURCE_EXHAUSTED.
  // `timeout`: for this call (a long sequence's K/V may take longer than rpc_timeout);
  // absl::ZeroDuration(): options.rpc_timeout.
  absl::StatusOr<v1::ImportSequenceResponse> ImportSequence(
      absl::string_view sequence_id, absl::string_view source,
      absl::Duration timeout = absl::ZeroDuration());
  // The unary step, for simple clients.
  absl::StatusOr<v1::DecisionBatch> Step(const v1::StepBatch& batch);
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStepStream();

  v1::KvCache::Stub& stub() { return *stub_; }

 private:
  KvCacheClient(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel);
  std::unique_ptr<grpc::ClientContext> UnaryContext() const;
  std::unique_ptr<grpc::ClientContext> UnaryContext(absl::Duration timeout) const;

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

// An OpenSequenceRequest with a compression ratio (or, if ratio < 0, `budget_tokens`)
// and a preset.
v1::OpenSequenceRequest OpenRequest(absl::string_view sequence_id, int64_t prefill_len,
                                    double compression_ratio, absl::string_view preset);

// `request` made to re-create a sequence the daemon lost (killed without a snapshot):
// decoding continues at last_step + 1 with `cached_positions` (ascending, the tokens whose
// K/V the worker holds) cached. docs/SPEC.md, "Resuming a sequence".
v1::OpenSequenceRequest WithResume(v1::OpenSequenceRequest request, int64_t last_step,
                                   std::span<const int64_t> cached_positions);

// Appends a report for (sequence, step) to the batch and returns it.
v1::StepReport* AddReport(v1::StepBatch* batch, absl::string_view sequence_id, int64_t step);

// Packs layer-major scores into a report. float16 / bfloat16 are encoded with
// round-to-nearest-even. head_count: 0 for pooled rows, else the heads summed.
void SetFloat32Scores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                      int32_t head_count = 0);
void SetFloat16Scores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                      int32_t head_count = 0);
void SetBFloat16Scores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                       int32_t head_count = 0);

// Packs scores in `dtype` (one of the three above, by the engine's dtype enum).
void SetScores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
               kernels::ScoreDtype dtype, int32_t head_count = 0);
// The wire value of an engine dtype.
v1::ScoreDtype ToProtoDtype(kernels::ScoreDtype dtype);

// Folded layout (docs/SPEC.md, "Folded reports"): a sequence opened with
// set_score_layout(SCORE_LAYOUT_FOLDED) and set_layers(K) takes one row per scoring step,
// its K layer rows folded with the weights the daemon returns in SequenceState.fold_weights:
//   row[i] = sum over l of weights.layer_weights(l) * rows[l * tokens + i], in double.
// rows: [K, tokens] f32 host (a tensor-parallel rank: its head sums). Returns [tokens] f32;
// send it with layers = 1. INVALID_ARGUMENT when rows is not K whole rows.
absl::StatusOr<std::vector<float>> FoldScores(std::span<const float> rows,
                                              const v1::FoldWeights& weights);

// Decision encodings (proto DecisionEncoding, chosen at open with set_decision_encoding):
// an OK Decision carries its evicted tokens as positions (`evicted`, mask_tokens == 0) or
// as a bit mask over the cache before eviction (`evicted_mask`, mask_tokens > 0). Either
// form is turned into both with the cache the worker tracks: `cache` is the sequence's
// cached positions before the step, ascending, then the step's new token ([cache_size
// + 1] int64, host; it starts as 0 .. prefill_len - 1, and after each step is the kept
// entries of the same span).
// The evicted positions, ascending (a positions decision's as they are). INVALID_ARGUMENT
// when a mask does not cover `cache` exactly: the tracking is out of step.
absl::StatusOr<std::vector<int64_t>> EvictedPositions(const v1::Decision& decision,
                                                      std::span<const int64_t> cache);
// The keep mask over `cache`: [cache.size()] of 1 (kept) or 0 (evicted). INVALID_ARGUMENT
// as above, and for an evicted position that is not in `cache`.
absl::StatusOr<std::vector<uint8_t>> KeepMask(const v1::Decision& decision,
                                              std::span<const int64_t> cache);

// The token a file holds (kvcache-replay's and kvcache-loadgen's --auth_token_file), its
// surrounding whitespace stripped. INVALID_ARGUMENT naming the file when it cannot be read
// or holds nothing; never the token.
absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path);

// What the CLI tools' --tls_ca_file, --tls_cert_file, --tls_key_file, --tls_server_name
// and --auth_token_file give: `options` with those TLS files and the file's token.
// INVALID_ARGUMENT as ReadAuthTokenFile.
absl::Status ApplySecurityFlags(const std::string& tls_ca_file, const std::string& tls_cert_file,
                                const std::string& tls_key_file,
                                const std::string& tls_server_name,
                                const std::string& auth_token_file, ClientOptions* options);

// The daemon's grpc::Status as an absl::Status (same code and message).
absl::Status FromGrpc(const grpc::Status& status);
// A Decision's status.
absl::Status DecisionStatus(const v1::Decision& decision);

}  // namespace kvcm::client

#endif  // KVCM_CLIENTS_CPP_KVCACHE_CLIENT_H_

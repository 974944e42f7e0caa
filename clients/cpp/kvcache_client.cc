#include "clients/cpp/kvcache_client.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/support/client_interceptor.h"
#include "kernels/half_float.h"
#include "wire/wire_dtype.h"

namespace kvcm::client {
namespace {

static_assert(std::endian::native == std::endian::little, "scores travel little-endian");

template <uint16_t (*Encode)(float)>
void SetHalfScores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                   int32_t head_count, v1::ScoreDtype dtype) {
  std::string* bytes = report->mutable_scores();
  bytes->resize(scores.size() * 2);
  auto* out = reinterpret_cast<unsigned char*>(bytes->data());
  for (size_t i = 0; i < scores.size(); ++i) {
    const uint16_t h = Encode(scores[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
  report->set_layers(layers);
  report->set_dtype(dtype);
  report->set_head_count(head_count);
}

// Checks that a mask decision's bits cover `cache` exactly.
absl::Status CheckMask(const v1::Decision& decision, std::span<const int64_t> cache) {
  const int64_t tokens = decision.mask_tokens();
  if (tokens != static_cast<int64_t>(cache.size()) ||
      decision.evicted_mask().size() != static_cast<size_t>((tokens + 7) / 8)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence '", decision.sequence_id(), "' step ", decision.step(), ": the mask has ",
        tokens, " tokens in ", decision.evicted_mask().size(), " bytes, the tracked cache ",
        cache.size(), " (cached + the new token); the tracking is out of step"));
  }
  return absl::OkStatus();
}

bool MaskBit(const std::string& mask, size_t i) {
  return (static_cast<unsigned char>(mask[i >> 3]) >> (i & 7)) & 1u;
}

}  // namespace

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

absl::Status DecisionStatus(const v1::Decision& decision) {
  if (decision.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(decision.code()), decision.message());
}

StepStream::StepStream(
    std::unique_ptr<grpc::ClientContext> context,
    std::unique_ptr<grpc::ClientReaderWriter<v1::StepBatch, v1::DecisionBatch>> stream)
    : context_(std::move(context)), stream_(std::move(stream)) {}

StepStream::~StepStream() {
  if (!closed_) {
    context_->TryCancel();
    (void)stream_->Finish();
  }
}

absl::Status StepStream::Send(const v1::StepBatch& batch) {
  if (closed_) return absl::FailedPreconditionError("the step stream is closed");
  if (!stream_->Write(batch)) {
    closed_ = true;
    absl::Status status = FromGrpc(stream_->Finish());
    return status.ok() ? absl::UnavailableError("the daemon ended the step stream") : status;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::DecisionBatch> StepStream::Receive() {
  if (closed_) return absl::FailedPreconditionError("the step stream is closed");
  v1::DecisionBatch reply;
  if (!stream_->Read(&reply)) {
    closed_ = true;
    absl::Status status = FromGrpc(stream_->Finish());
    return status.ok() ? absl::UnavailableError("the daemon ended the step stream") : status;
  }
  return reply;
}

absl::StatusOr<v1::DecisionBatch> StepStream::Step(const v1::StepBatch& batch) {
  if (absl::Status sent = Send(batch); !sent.ok()) return sent;
  return Receive();
}

absl::Status StepStream::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  stream_->WritesDone();
  v1::DecisionBatch ignored;
  while (stream_->Read(&ignored)) {
  }
  return FromGrpc(stream_->Finish());
}

KvCacheClient::KvCacheClient(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel)
    : options_(options), channel_(std::move(channel)), stub_(v1::KvCache::NewStub(channel_)) {}

namespace {

// Adds the bearer token to every call's initial metadata, so that calls made on stub()
// with the caller's own ClientContext carry it too.
class BearerTokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;
};

class BearerTokenInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(const std::string& token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new BearerTokenInterceptor(&header_);
  }

 private:
  const std::string header_;  // lives as long as the channel holds the factory
};

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot be read"));
  return text.str();
}

// Insecure credentials without a CA file; TLS with it.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS: a client certificate and its key go together");
  }
  if (options.tls_ca_file.empty()) {
    if (!options.tls_cert_file.empty() || !options.tls_server_name.empty()) {
      return absl::InvalidArgumentError(
          "TLS: a client certificate or server name needs the CA file too");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca = ReadFile(options.tls_ca_file, "TLS CA file");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *std::move(ca);
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadFile(options.tls_cert_file, "TLS certificate file");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile(options.tls_key_file, "TLS key file");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path, "auth token file");
  if (!text.ok()) return text.status();
  const absl::string_view token = absl::StripAsciiWhitespace(*text);
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("auth token file ", path, ": it is empty"));
  }
  return std::string(token);
}

absl::Status ApplySecurityFlags(const std::string& tls_ca_file, const std::string& tls_cert_file,
                                const std::string& tls_key_file,
                                const std::string& tls_server_name,
                                const std::string& auth_token_file, ClientOptions* options) {
  options->tls_ca_file = tls_ca_file;
  options->tls_cert_file = tls_cert_file;
  options->tls_key_file = tls_key_file;
  options->tls_server_name = tls_server_name;
  if (auth_token_file.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> token = ReadAuthTokenFile(auth_token_file);
  if (!token.ok()) return token.status();
  options->auth_token = *std::move(token);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ClientOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentialsFor(options);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // Batches of scores are megabytes: large frames, a large receive window.
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 4 << 20);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.auth_token.empty()) {
    interceptors.push_back(std::make_unique<BearerTokenInterceptorFactory>(options.auth_token));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      options.address, *credentials, args, std::move(interceptors));
}

absl::StatusOr<std::unique_ptr<KvCacheClient>> KvCacheClient::Connect(
    const ClientOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> made = MakeChannel(options);
  if (!made.ok()) return made.status();
  std::shared_ptr<grpc::Channel> channel = *std::move(made);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach kvcached at ", options.address,
                                               " within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  return std::unique_ptr<KvCacheClient>(new KvCacheClient(options, std::move(channel)));
}

std::unique_ptr<grpc::ClientContext> KvCacheClient::UnaryContext() const {
  return UnaryContext(options_.rpc_timeout);
}

std::unique_ptr<grpc::ClientContext> KvCacheClient::UnaryContext(absl::Duration timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return context;
}

absl::StatusOr<v1::SequenceState> KvCacheClient::Open(const v1::OpenSequenceRequest& request) {
  v1::OpenSequenceResponse response;
  absl::Status status = FromGrpc(stub_->OpenSequence(UnaryContext().get(), request, &response));
  if (!status.ok()) return status;
  return response.state();
}

absl::StatusOr<v1::SequenceStats> KvCacheClient::Close(absl::string_view sequence_id) {
  v1::CloseSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  v1::CloseSequenceResponse response;
  absl::Status status = FromGrpc(stub_->CloseSequence(UnaryContext().get(), request, &response));
  if (!status.ok()) return status;
  return response.stats();
}

absl::StatusOr<v1::SequenceState> KvCacheClient::Inspect(absl::string_view sequence_id,
                                                         bool include_cache) {
  v1::InspectSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  request.set_include_cache(include_cache);
  v1::InspectSequenceResponse response;
  absl::Status status =
      FromGrpc(stub_->InspectSequence(UnaryContext().get(), request, &response));
  if (!status.ok()) return status;
  return response.state();
}

absl::StatusOr<std::vector<v1::SequenceState>> KvCacheClient::List() {
  v1::ListSequencesResponse response;
  absl::Status status =
      FromGrpc(stub_->ListSequences(UnaryContext().get(), v1::ListSequencesRequest(), &response));
  if (!status.ok()) return status;
  return std::vector<v1::SequenceState>(response.sequences().begin(), response.sequences().end());
}

absl::StatusOr<v1::ImportSequenceResponse> KvCacheClient::ImportSequence(
    absl::string_view sequence_id, absl::string_view source, absl::Duration timeout) {
  v1::ImportSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  request.set_source(std::string(source));
  v1::ImportSequenceResponse response;
  const absl::Duration limit = timeout > absl::ZeroDuration() ? timeout : options_.rpc_timeout;
  absl::Status status =
      FromGrpc(stub_->ImportSequence(UnaryContext(limit).get(), request, &response));
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::DecisionBatch> KvCacheClient::Step(const v1::StepBatch& batch) {
  v1::DecisionBatch reply;
  absl::Status status = FromGrpc(stub_->Step(UnaryContext().get(), batch, &reply));
  if (!status.ok()) return status;
  return reply;
}

absl::StatusOr<std::unique_ptr<StepStream>> KvCacheClient::OpenStepStream() {
  auto context = std::make_unique<grpc::ClientContext>();
  auto stream = stub_->StepStream(context.get());
  if (stream == nullptr) return absl::UnavailableError("cannot open a step stream");
  return std::unique_ptr<StepStream>(new StepStream(std::move(context), std::move(stream)));
}

v1::OpenSequenceRequest OpenRequest(absl::string_view sequence_id, int64_t prefill_len,
                                    double compression_ratio, absl::string_view preset) {
  v1::OpenSequenceRequest request;
  request.set_sequence_id(std::string(sequence_id));
  request.set_prefill_len(prefill_len);
  request.set_compression_ratio(compression_ratio);
  request.mutable_policy()->set_preset(std::string(preset));
  return request;
}

v1::OpenSequenceRequest WithResume(v1::OpenSequenceRequest request, int64_t last_step,
                                   std::span<const int64_t> cached_positions) {
  v1::ResumeState* resume = request.mutable_resume();
  resume->set_last_step(last_step);
  resume->mutable_cached_positions()->Assign(cached_positions.begin(), cached_positions.end());
  return request;
}

v1::StepReport* AddReport(v1::StepBatch* batch, absl::string_view sequence_id, int64_t step) {
  v1::StepReport* report = batch->add_reports();
  report->set_sequence_id(std::string(sequence_id));
  report->set_step(step);
  return report;
}

void SetFloat32Scores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                      int32_t head_count) {
  report->set_scores(reinterpret_cast<const char*>(scores.data()), scores.size() * sizeof(float));
  report->set_layers(layers);
  report->set_dtype(v1::SCORE_DTYPE_FLOAT32);
  report->set_head_count(head_count);
}

void SetFloat16Scores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                      int32_t head_count) {
  SetHalfScores<kernels::FloatToFloat16>(report, scores, layers, head_count,
                                         v1::SCORE_DTYPE_FLOAT16);
}

void SetBFloat16Scores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
                       int32_t head_count) {
  SetHalfScores<kernels::FloatToBFloat16>(report, scores, layers, head_count,
                                          v1::SCORE_DTYPE_BFLOAT16);
}

}  // namespace kvcm::client

namespace kvcm::client {

void SetScores(v1::StepReport* report, std::span<const float> scores, int32_t layers,
               kernels::ScoreDtype dtype, int32_t head_count) {
  switch (dtype) {
    case kernels::ScoreDtype::kFloat32:
      return SetFloat32Scores(report, scores, layers, head_count);
    case kernels::ScoreDtype::kFloat16:
      return SetFloat16Scores(report, scores, layers, head_count);
    case kernels::ScoreDtype::kBFloat16:
      return SetBFloat16Scores(report, scores, layers, head_count);
  }
}

v1::ScoreDtype ToProtoDtype(kernels::ScoreDtype dtype) { return wire::ToProto(dtype); }

absl::StatusOr<std::vector<int64_t>> EvictedPositions(const v1::Decision& decision,
                                                      std::span<const int64_t> cache) {
  std::vector<int64_t> evicted;
  if (decision.mask_tokens() == 0) {
    evicted.assign(decision.evicted().begin(), decision.evicted().end());
    return evicted;
  }
  if (absl::Status s = CheckMask(decision, cache); !s.ok()) return s;
  const std::string& mask = decision.evicted_mask();
  for (size_t i = 0; i < cache.size(); ++i) {
    if (MaskBit(mask, i)) evicted.push_back(cache[i]);
  }
  return evicted;
}

absl::StatusOr<std::vector<uint8_t>> KeepMask(const v1::Decision& decision,
                                              std::span<const int64_t> cache) {
  std::vector<uint8_t> keep(cache.size(), 1);
  if (decision.mask_tokens() != 0) {
    if (absl::Status s = CheckMask(decision, cache); !s.ok()) return s;
    const std::string& mask = decision.evicted_mask();
    for (size_t i = 0; i < cache.size(); ++i) keep[i] = MaskBit(mask, i) ? 0 : 1;
    return keep;
  }
  // Positions, ascending: each one's index by binary search over the ascending cache.
  auto from = cache.begin();
  for (const int64_t position : decision.evicted()) {
    from = std::lower_bound(from, cache.end(), position);
    if (from == cache.end() || *from != position) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence '", decision.sequence_id(), "' step ", decision.step(),
          ": evicted position ", position,
          " is not in the tracked cache; the tracking is out of step"));
    }
    keep[static_cast<size_t>(from - cache.begin())] = 0;
  }
  return keep;
}

absl::StatusOr<std::vector<float>> FoldScores(std::span<const float> rows,
                                              const v1::FoldWeights& weights) {
  const auto layers = static_cast<size_t>(weights.layer_weights_size());
  if (layers == 0 || rows.size() % layers != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FoldScores: ", rows.size(), " scores are not whole rows of ", layers, " layers"));
  }
  const size_t tokens = rows.size() / layers;
  std::vector<double> sum(tokens, 0.0);
  for (size_t l = 0; l < layers; ++l) {
    const double w = weights.layer_weights(static_cast<int>(l));
    const float* row = rows.data() + l * tokens;
    for (size_t i = 0; i < tokens; ++i) sum[i] += w * static_cast<double>(row[i]);
  }
  return std::vector<float>(sum.begin(), sum.end());
}

}  // namespace kvcm::client

#include "server/server_options.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm::server {
namespace {

// INVALID_ARGUMENT: "--flag is value; rule".
template <typename T>
absl::Status Refuse(absl::string_view flag, const T& value, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " is ", value, "; ", rule));
}
absl::Status Refuse(absl::string_view flag, absl::Duration value, absl::string_view rule) {
  return Refuse(flag, absl::FormatDuration(value), rule);
}

// The sizes of what the daemon holds: sequences, streams, messages, memory.
absl::Status ValidateLimits(const ServerOptions& o) {
  if (o.max_sequences < 1) return Refuse("--max_sequences", o.max_sequences, "it must be >= 1");
  if (o.max_streams < 1) return Refuse("--max_streams", o.max_streams, "it must be >= 1");
  if (o.max_tp_world_size < 1) {
    return Refuse("--max_tp_world_size", o.max_tp_world_size, "it must be >= 1");
  }
  if (o.max_message_bytes < 1024 || o.max_message_bytes > (int64_t{1} << 31) - 1) {
    return Refuse("--max_message_bytes", o.max_message_bytes, "it must be 1024 to 2147483647");
  }
  if (o.max_sequence_tokens < 1 || o.max_sequence_tokens > (int64_t{1} << 40)) {
    return Refuse("--max_sequence_tokens", o.max_sequence_tokens, "it must be 1 to 2^40");
  }
  if (o.memory_limit_bytes < 1) {
    return Refuse("--memory_limit_bytes", o.memory_limit_bytes, "it must be >= 1");
  }
  if (o.max_connections < 0) {
    return Refuse("--max_connections", o.max_connections, "it must be >= 0");
  }
  if (o.tenant_max_sequences < 0) {
    return Refuse("--tenant_max_sequences", o.tenant_max_sequences, "it must be >= 0");
  }
  if (!(o.tenant_memory_share > 0 && o.tenant_memory_share <= 1)) {
    return Refuse("--tenant_memory_share", o.tenant_memory_share, "it must be in (0, 1]");
  }
  return absl::OkStatus();
}

// The step path: engine threads, back-pressure, tensor-parallel joins, score regions.
absl::Status ValidateStepPath(const ServerOptions& o) {
  if (o.engine_threads < 0 || o.engine_threads > 1024) {
    return Refuse("--engine_threads", o.engine_threads, "it must be 0 to 1024");
  }
  if (o.max_inflight_batches < 1 || o.max_inflight_batches > 1024) {
    return Refuse("--max_inflight_batches", o.max_inflight_batches, "it must be 1 to 1024");
  }
  if (o.max_pending_join_bytes < 0) {
    return Refuse("--max_pending_join_bytes", o.max_pending_join_bytes, "it must be >= 0");
  }
  if (o.max_score_regions < 1) {
    return Refuse("--max_score_regions", o.max_score_regions, "it must be >= 1");
  }
  if (o.max_created_score_region_bytes < 0) {
    return Refuse("--max_created_score_region_bytes", o.max_created_score_region_bytes,
                  "it must be >= 0");
  }
  return absl::OkStatus();
}

// KV events and the eviction-quality diagnostics.
absl::Status ValidateObservers(const ServerOptions& o) {
  if (o.kv_events_ring < 0 || o.kv_events_ring > (int64_t{1} << 24)) {
    return Refuse("--kv_events_ring", o.kv_events_ring, "it must be 0 to 16777216");
  }
  if (o.kv_events_max_subscribers < 1) {
    return Refuse("--kv_events_max_subscribers", o.kv_events_max_subscribers, "it must be >= 1");
  }
  if (o.diagnostics_every < 0) {
    return Refuse("--diagnostics_every", o.diagnostics_every, "it must be >= 0");
  }
  if (!(o.diagnostics_sample >= 0 && o.diagnostics_sample <= 1)) {
    return Refuse("--diagnostics_sample", o.diagnostics_sample, "it must be 0 to 1");
  }
  return absl::OkStatus();
}

// The intervals whose 0 means "never", and the probe's own timeout.
absl::Status ValidateTimeouts(const ServerOptions& o) {
  constexpr absl::string_view kNonNegative =
      "--stream_idle_timeout and --listener_probe_interval must be >= 0 (0: off)";
  if (o.stream_idle_timeout < absl::ZeroDuration()) {
    return Refuse("--stream_idle_timeout", o.stream_idle_timeout, kNonNegative);
  }
  if (o.listener_probe_interval < absl::ZeroDuration()) {
    return Refuse("--listener_probe_interval", o.listener_probe_interval, kNonNegative);
  }
  if (o.listener_probe_timeout <= absl::ZeroDuration()) {
    return Refuse("--listener_probe_timeout", o.listener_probe_timeout, "it must be > 0");
  }
  return absl::OkStatus();
}

// The hand-off's flags (ImportSequence and the KvPeer service).
absl::Status ValidateHandoff(const ServerOptions& o) {
  if (o.kv_transfer != "ucx" && o.kv_transfer != "grpc") {
    return Refuse("--kv_transfer", absl::StrCat("'", o.kv_transfer, "'"), "it must be ucx or grpc");
  }
  if (o.max_import_bytes_in_flight < 1) {
    return Refuse("--max_import_bytes_in_flight", o.max_import_bytes_in_flight, "it must be >= 1");
  }
  if (o.import_threads < 1 || o.import_threads > 64) {
    return Refuse("--import_threads", o.import_threads, "it must be 1 to 64");
  }
  if (o.max_queued_imports < 0) {
    return Refuse("--max_queued_imports", o.max_queued_imports, "it must be >= 0");
  }
  if (o.import_timeout <= absl::ZeroDuration()) {
    return Refuse("--import_timeout", o.import_timeout, "it must be > 0");
  }
  if (o.max_exports < 1) return Refuse("--max_exports", o.max_exports, "it must be >= 1");
  if (o.export_lease <= absl::ZeroDuration()) {
    return Refuse("--export_lease", o.export_lease, "it must be > 0");
  }
  if (!o.peer_ca_file.empty() && o.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--peer_ca_file needs TLS: give --tls_cert_file and --tls_key_file too (peers "
        "present certificates over TLS, and this daemon presents its own to sources)");
  }
  return absl::OkStatus();
}

// The flags that only make sense together with others (or with this build).
absl::Status ValidateCombinations(const ServerOptions& o) {
#ifndef KVCM_HAS_CUDA
  if (o.backend == KvBackend::kCuda) {
    return absl::InvalidArgumentError("--backend=cuda: this kvcached was built without CUDA");
  }
#endif
  // Device memory dies with the process, and workers map private host memory not at
  // all: such pools cannot be re-attached, so a snapshot could not keep its promise.
  if (!o.state_dir.empty() && o.pool_memory_bytes > 0 &&
      (o.backend == KvBackend::kCuda || !o.kv_shared_memory)) {
    return absl::InvalidArgumentError(
        "--state_dir needs host KV pools in shared memory (--backend=host "
        "--kv_shared_memory), or no pools: other pools do not survive the process");
  }
  if (!o.listen_group.empty() && !absl::StartsWith(o.listen, "unix:")) {
    return absl::InvalidArgumentError("--listen_group applies to a unix: --listen only");
  }
  if (absl::StartsWith(o.health_listen, "unix:")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--health_listen=", o.health_listen, ": give a host:port (it exists for probes "
        "that dial a TCP port)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ServerOptions::Validate() const {
  RETURN_IF_ERROR(ValidateLimits(*this));
  RETURN_IF_ERROR(ValidateStepPath(*this));
  RETURN_IF_ERROR(ValidateObservers(*this));
  RETURN_IF_ERROR(ValidateTimeouts(*this));
  RETURN_IF_ERROR(ValidateHandoff(*this));
  return ValidateCombinations(*this);
}

EngineBackend ServerOptions::ResolvedEngineBackend() const {
  if (engine_backend != EngineBackend::kAuto) return engine_backend;
  return backend == KvBackend::kCuda ? EngineBackend::kCuda : EngineBackend::kCpu;
}

absl::string_view EngineBackendName(EngineBackend backend) {
  switch (backend) {
    case EngineBackend::kAuto: return "auto";
    case EngineBackend::kCpu: return "cpu";
    case EngineBackend::kCuda: return "cuda";
    case EngineBackend::kEmulated: return "emulated";
  }
  return "auto";
}

std::optional<EngineBackend> ParseEngineBackend(absl::string_view name) {
  for (EngineBackend b : {EngineBackend::kAuto, EngineBackend::kCpu, EngineBackend::kCuda,
                          EngineBackend::kEmulated}) {
    if (name == EngineBackendName(b)) return b;
  }
  return std::nullopt;
}

absl::string_view KvBackendName(KvBackend backend) {
  return backend == KvBackend::kCuda ? "cuda" : "host";
}

std::optional<KvBackend> ParseKvBackend(absl::string_view name) {
  if (name == "host") return KvBackend::kHost;
  if (name == "cuda") return KvBackend::kCuda;
  return std::nullopt;
}

absl::StatusOr<KvBackend> KvBackendFromFlag(absl::string_view name) {
  if (std::optional<KvBackend> backend = ParseKvBackend(name)) return *backend;
  return Refuse("--backend", absl::StrCat("'", name, "'"), "it must be host or cuda");
}

absl::StatusOr<EngineBackend> EngineBackendFromFlag(absl::string_view name) {
  if (std::optional<EngineBackend> engine = ParseEngineBackend(name)) return *engine;
  return Refuse("--engine_backend", absl::StrCat("'", name, "'"),
                "it must be auto, cpu, cuda or emulated");
}

absl::StatusOr<kernels::KvDtype> KvDtypeFromFlag(absl::string_view name) {
  if (name == "float16") return kernels::KvDtype::kFloat16;
  if (name == "bfloat16") return kernels::KvDtype::kBFloat16;
  if (name == "float32") return kernels::KvDtype::kFloat32;
  return Refuse("--kv_dtype", absl::StrCat("'", name, "'"),
                "it must be float16, bfloat16 or float32");
}

}  // namespace kvcm::server

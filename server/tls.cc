#include "server/tls.h"

#include <poll.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/security/server_credentials.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/ssl.h"

namespace kvcm::server {
namespace {

enum class PemKind { kCertificate, kPrivateKey };

// The PEM text of `path`, checked to hold at least one certificate (or a private key).
absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag,
                                    PemKind kind) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot be read"));
  }
  const std::string pem = text.str();
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  bool ok = false;
  if (kind == PemKind::kCertificate) {
    X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
    ok = cert != nullptr;
    X509_free(cert);
  } else {
    EVP_PKEY* key = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
    ok = key != nullptr;
    EVP_PKEY_free(key);
  }
  BIO_free(bio);
  ERR_clear_error();
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", path, ": holds no PEM ",
        kind == PemKind::kCertificate ? "certificate" : "private key"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }
  if (options.tls_cert_file.empty()) {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs TLS: give --tls_cert_file and --tls_key_file too");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert =
      ReadPem(options.tls_cert_file, "--tls_cert_file", PemKind::kCertificate);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key =
      ReadPem(options.tls_key_file, "--tls_key_file", PemKind::kPrivateKey);
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!options.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadPem(options.tls_client_ca_file, "--tls_client_ca_file", PemKind::kCertificate);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::Status TlsHandshake(int fd, absl::Time deadline) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx == nullptr) return absl::InternalError("TLS probe: SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);
  // gRPC's server insists on ALPN "h2".
  static constexpr unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_CTX_set_alpn_protos(ctx, kAlpn, sizeof(kAlpn));
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fd);
  absl::Status status;
  while (true) {
    const int rc = SSL_connect(ssl);
    if (rc == 1) break;
    const int err = SSL_get_error(ssl, rc);
    if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
      char why[256] = "the connection was closed";
      if (const unsigned long e = ERR_get_error(); e != 0) ERR_error_string_n(e, why, sizeof why);
      status = absl::UnavailableError(absl::StrCat("TLS handshake failed: ", why));
      break;
    }
    pollfd p{fd, static_cast<short>(err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0 || poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30))) <= 0) {
      status = absl::DeadlineExceededError("no TLS handshake by the probe's deadline");
      break;
    }
  }
  ERR_clear_error();
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  return status;
}

}  // namespace kvcm::server

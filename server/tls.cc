#include "server/tls.h"

#include <poll.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/security/server_credentials.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/ssl.h"
#include "openssl/x509_vfy.h"

namespace kvcm::server {

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
  if (!options.peer_ca_file.empty()) {
    // Peers' certificates verify too; which CA issued one is checked per KvPeer call
    // (IssuedBy). Without a client CA, workers may still come without a certificate.
    absl::StatusOr<std::string> peer_ca =
        ReadPem(options.peer_ca_file, "--peer_ca_file", PemKind::kCertificate);
    if (!peer_ca.ok()) return peer_ca.status();
    ssl.pem_root_certs = absl::StrCat(ssl.pem_root_certs, "\n", *peer_ca);
    if (options.tls_client_ca_file.empty()) {
      ssl.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
    }
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

namespace {

// Every certificate in `pem`, in order (empty when none parses).
std::vector<X509*> ReadCertificates(const std::string& pem) {
  std::vector<X509*> certs;
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  if (bio == nullptr) return certs;
  while (X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) certs.push_back(cert);
  BIO_free(bio);
  ERR_clear_error();  // the read that ended the loop
  return certs;
}

}  // namespace

bool IssuedBy(const std::string& cert_pem, const std::string& ca_pem) {
  std::vector<X509*> chain = ReadCertificates(cert_pem);
  std::vector<X509*> roots = ReadCertificates(ca_pem);
  bool verified = false;
  X509_STORE* store = X509_STORE_new();
  STACK_OF(X509)* intermediates = sk_X509_new_null();
  X509_STORE_CTX* context = X509_STORE_CTX_new();
  if (!chain.empty() && !roots.empty() && store != nullptr && intermediates != nullptr &&
      context != nullptr) {
    for (X509* root : roots) X509_STORE_add_cert(store, root);
    for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(intermediates, chain[i]);
    if (X509_STORE_CTX_init(context, store, chain[0], intermediates) == 1) {
      verified = X509_verify_cert(context) == 1;
    }
  }
  X509_STORE_CTX_free(context);
  sk_X509_free(intermediates);  // the certificates are freed below
  X509_STORE_free(store);       // drops its own references to the roots
  for (X509* cert : chain) X509_free(cert);
  for (X509* root : roots) X509_free(root);
  ERR_clear_error();
  return verified;
}

}  // namespace kvcm::server

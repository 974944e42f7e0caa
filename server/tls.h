// TLS for kvcached's gRPC port: the server credentials built from the PEM files the flags
// name, and the TLS handshake the listener's self-probe performs.
#ifndef KVCM_SERVER_TLS_H_
#define KVCM_SERVER_TLS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "server/server_options.h"

namespace kvcm::server {

enum class PemKind { kCertificate, kPrivateKey };
// The PEM text of `path`, checked to hold at least one certificate (or a private key);
// INVALID_ARGUMENT naming `flag` and the file otherwise.
absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag,
                                    PemKind kind);

// Insecure credentials without tls_cert_file; otherwise TLS with that certificate chain and
// key, and with tls_client_ca_file a client certificate required and verified against it.
// INVALID_ARGUMENT naming the flag and the file when one is missing, unreadable or holds
// no PEM certificate (key), or when only one of cert and key is given.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerOptions& options);

// Whether the leaf certificate `cert_pem` (the first certificate in it; the rest are taken
// as intermediates) chains to a certificate of `ca_pem` and is valid now: a peer kvcached's
// client certificate checked against --peer_ca_file. False for anything that does not
// parse.
bool IssuedBy(const std::string& cert_pem, const std::string& ca_pem);

// Completes a TLS 1.3 client handshake on connected socket `fd` (non-blocking) by
// `deadline`, without verifying the server (it is this daemon). OK once the server's
// Finished arrived: its accept path and TLS handshaker are alive. A TLS 1.3 client
// finishes before the server judges its (absent) certificate, so this holds under mTLS.
absl::Status TlsHandshake(int fd, absl::Time deadline);

}  // namespace kvcm::server

#endif  // KVCM_SERVER_TLS_H_

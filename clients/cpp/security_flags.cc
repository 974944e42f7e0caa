#include "clients/cpp/security_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_ca_file, "",
          "TLS to kvcached: PEM CA certificate(s) that signed the daemon's certificate");
ABSL_FLAG(std::string, tls_cert_file, "",
          "mTLS: this client's PEM certificate (with --tls_key_file)");
ABSL_FLAG(std::string, tls_key_file, "", "mTLS: this client's PEM private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: the name the daemon's certificate must carry, when not --server's host");
ABSL_FLAG(std::string, auth_token_file, "",
          "a file holding the bearer token sent to kvcached (kept off the command line)");

namespace kvcm::client {

absl::Status ApplySecurityFlagsFromCommandLine(ClientOptions* options) {
  return ApplySecurityFlags(absl::GetFlag(FLAGS_tls_ca_file), absl::GetFlag(FLAGS_tls_cert_file),
                            absl::GetFlag(FLAGS_tls_key_file),
                            absl::GetFlag(FLAGS_tls_server_name),
                            absl::GetFlag(FLAGS_auth_token_file), options);
}

}  // namespace kvcm::client

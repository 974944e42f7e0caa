// The command-line flags of the C++ tools (kvcache-replay, kvcache-loadgen) that connect
// to a kvcached with TLS and a bearer token: --tls_ca_file, --tls_cert_file,
// --tls_key_file, --tls_server_name, --auth_token_file. A tool that links this defines
// them; one place so that every tool spells and explains them alike.
#ifndef KVCM_CLIENTS_CPP_SECURITY_FLAGS_H_
#define KVCM_CLIENTS_CPP_SECURITY_FLAGS_H_

#include "absl/status/status.h"
#include "clients/cpp/kvcache_client.h"

namespace kvcm::client {

// `options` with what those flags say (ApplySecurityFlags). INVALID_ARGUMENT as
// ReadAuthTokenFile.
absl::Status ApplySecurityFlagsFromCommandLine(ClientOptions* options);

}  // namespace kvcm::client

#endif  // KVCM_CLIENTS_CPP_SECURITY_FLAGS_H_

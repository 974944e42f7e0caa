// BearerTokens: the tenants kvcached knows, by bearer token (--auth_tokens_file), and the
// check each kvcache.v1 call goes through. The file holds one "token tenant" pair a line,
// or "token tenant peer" for a peer credential: another kvcached that may call the
// daemon-to-daemon service (KvPeer: a hand-off's export); blank lines and lines starting
// with '#' are skipped. A token is compared against every
// known token in constant time, and is never logged nor put in an error.
//
// Thread-safe: Reload swaps the whole set under the mutex; a call authenticated before
// a reload keeps its tenant.
#ifndef KVCM_SERVER_AUTH_H_
#define KVCM_SERVER_AUTH_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/base/mutex.h"

namespace kvcm::server {

struct TokenEntry {
  std::string token;
  std::string tenant;
  bool peer = false;  // the 'peer' role: may call KvPeer
};
// In file order.
using TokenSet = std::vector<TokenEntry>;

// Parses the text of a tokens file. INVALID_ARGUMENT naming `path` and the line number of
// the first malformed line (not two fields; a tenant of bytes other than printable
// ASCII; a token twice), never its contents; an empty set is an error too.
absl::StatusOr<TokenSet> ParseTokens(absl::string_view text, absl::string_view path);
// Reads and parses `path` (INVALID_ARGUMENT when it cannot be read).
absl::StatusOr<TokenSet> ReadTokensFile(const std::string& path);

class BearerTokens {
 public:
  explicit BearerTokens(TokenSet tokens) : tokens_(std::move(tokens)) {}

  // The tenant of an `authorization` metadata value "Bearer <token>"; UNAUTHENTICATED
  // when it is missing, malformed or the token is unknown (same message for all three).
  absl::StatusOr<std::string> TenantOf(absl::string_view authorization) const;
  // The whole entry of that token (its tenant and role); UNAUTHENTICATED as TenantOf.
  absl::StatusOr<TokenEntry> Find(absl::string_view authorization) const;
  // Whether any token has the peer role.
  bool HasPeer() const;

  // Replaces the set with `tokens`: calls from now on are checked against it.
  void Replace(TokenSet tokens);
  size_t size() const;

 private:
  mutable Mutex mu_;
  TokenSet tokens_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm::server

#endif  // KVCM_SERVER_AUTH_H_

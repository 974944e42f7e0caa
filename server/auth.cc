#include "server/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cache_manager/base/status_macros.h"
#include "absl/strings/strip.h"

namespace kvcm::server {
namespace {

// Whether `a` equals `b`, in a time that depends on their lengths only.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = a.size() < b.size() ? a.size() : b.size();
  for (size_t i = 0; i < n; ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

// Tenant names go into error messages and logs as they are: printable ASCII only.
bool IsTenantName(absl::string_view name) {
  for (const char c : name) {
    if (c < '!' || c > '~') return false;
  }
  return !name.empty() && name.size() <= 128;
}

}  // namespace

absl::StatusOr<TokenSet> ParseTokens(absl::string_view text, absl::string_view path) {
  TokenSet tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const auto malformed = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_tokens_file ", path, ": line ",
                                                     line_number, ": ", why));
    };
    if (fields.size() != 2 && fields.size() != 3) {
      return malformed(absl::StrCat("expected 'token tenant' or 'token tenant peer', found ",
                                    fields.size(), " field(s)"));
    }
    if (fields.size() == 3 && fields[2] != "peer") {
      return malformed("the third field, when given, must be the role 'peer'");
    }
    if (!IsTenantName(fields[1])) {
      return malformed("the tenant must be 1 to 128 printable ASCII characters");
    }
    for (const TokenEntry& entry : tokens) {
      if (entry.token == fields[0]) return malformed("this token is already on an earlier line");
    }
    tokens.push_back({std::string(fields[0]), std::string(fields[1]), fields.size() == 3});
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file ", path, ": no token in the file"));
  }
  return tokens;
}

absl::StatusOr<TokenSet> ReadTokensFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file ", path, ": cannot be read"));
  }
  return ParseTokens(text.str(), path);
}

absl::StatusOr<std::string> BearerTokens::TenantOf(absl::string_view authorization) const {
  ASSIGN_OR_RETURN(const TokenEntry entry, Find(authorization));
  return entry.tenant;
}

absl::StatusOr<TokenEntry> BearerTokens::Find(absl::string_view authorization) const {
  const absl::Status refused = absl::UnauthenticatedError(
      "this call needs a known bearer token (metadata 'authorization: Bearer <token>')");
  if (!absl::ConsumePrefix(&authorization, "Bearer ")) return refused;
  ReaderMutexLock lock(&mu_);
  // Every token is compared, so the time says nothing of which one (nearly) matched.
  const TokenEntry* found = nullptr;
  for (const TokenEntry& entry : tokens_) {
    if (ConstantTimeEquals(entry.token, authorization)) found = &entry;
  }
  if (found == nullptr) return refused;
  return *found;
}

bool BearerTokens::HasPeer() const {
  ReaderMutexLock lock(&mu_);
  for (const TokenEntry& entry : tokens_) {
    if (entry.peer) return true;
  }
  return false;
}

void BearerTokens::Replace(TokenSet tokens) {
  MutexLock lock(&mu_);
  tokens_ = std::move(tokens);
}

size_t BearerTokens::size() const {
  ReaderMutexLock lock(&mu_);
  return tokens_.size();
}

}  // namespace kvcm::server

#include "cache_manager/persist/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"

namespace kvcm {
namespace {

// How many values each enum a snapshot stores has, which the reader accepts. Derived from the
// enums: each switch lists every enumerator with no default, so a new one fails the build here
// (-Wswitch is an error) rather than making the snapshots that hold it unreadable.
template <typename E>
constexpr uint8_t CountOf(E last) {
  return static_cast<uint8_t>(static_cast<uint8_t>(last) + 1);
}
constexpr uint8_t CountAggregation(Aggregation e = Aggregation::kRandom) {
  switch (e) {
    case Aggregation::kEma:
    case Aggregation::kCumulative:
    case Aggregation::kSingleStep:
    case Aggregation::kRecency:
    case Aggregation::kRandom:
      break;
  }
  return CountOf(Aggregation::kRandom);
}
constexpr uint8_t CountRefresh(Refresh e = Refresh::kScoreFree) {
  switch (e) {
    case Refresh::kEveryStep:
    case Refresh::kLazy:
    case Refresh::kScoreFree:
      break;
  }
  return CountOf(Refresh::kScoreFree);
}
constexpr uint8_t CountScoreLayout(ScoreLayout e = ScoreLayout::kFolded) {
  switch (e) {
    case ScoreLayout::kPerLayer:
    case ScoreLayout::kFolded:
      break;
  }
  return CountOf(ScoreLayout::kFolded);
}
constexpr uint8_t CountDecisionEncoding(DecisionEncoding e = DecisionEncoding::kAuto) {
  switch (e) {
    case DecisionEncoding::kPositions:
    case DecisionEncoding::kMask:
    case DecisionEncoding::kAuto:
      break;
  }
  return CountOf(DecisionEncoding::kAuto);
}
constexpr uint8_t CountScoreDtype(kernels::ScoreDtype e = kernels::ScoreDtype::kBFloat16) {
  switch (e) {
    case kernels::ScoreDtype::kFloat32:
    case kernels::ScoreDtype::kFloat16:
    case kernels::ScoreDtype::kBFloat16:
      break;
  }
  return CountOf(kernels::ScoreDtype::kBFloat16);
}
constexpr uint8_t CountKvDtype(kernels::KvDtype e = kernels::KvDtype::kBFloat16) {
  switch (e) {
    case kernels::KvDtype::kFloat32:
    case kernels::KvDtype::kFloat16:
    case kernels::KvDtype::kBFloat16:
      break;
  }
  return CountOf(kernels::KvDtype::kBFloat16);
}

// Each is stored as one byte.
static_assert(std::is_same_v<std::underlying_type_t<Aggregation>, uint8_t> &&
              std::is_same_v<std::underlying_type_t<Refresh>, uint8_t> &&
              std::is_same_v<std::underlying_type_t<ScoreLayout>, uint8_t> &&
              std::is_same_v<std::underlying_type_t<DecisionEncoding>, uint8_t> &&
              std::is_same_v<std::underlying_type_t<kernels::ScoreDtype>, uint8_t> &&
              std::is_same_v<std::underlying_type_t<kernels::KvDtype>, uint8_t>);

template <typename E>
constexpr uint8_t kEnumCount = 0;  // not a stored enum
template <>
constexpr uint8_t kEnumCount<Aggregation> = CountAggregation();
template <>
constexpr uint8_t kEnumCount<Refresh> = CountRefresh();
template <>
constexpr uint8_t kEnumCount<ScoreLayout> = CountScoreLayout();
template <>
constexpr uint8_t kEnumCount<DecisionEncoding> = CountDecisionEncoding();
template <>
constexpr uint8_t kEnumCount<kernels::ScoreDtype> = CountScoreDtype();
template <>
constexpr uint8_t kEnumCount<kernels::KvDtype> = CountKvDtype();

static_assert(std::endian::native == std::endian::little,
              "the snapshot format is little-endian and written with memcpy");

// magic, version, flags, payload bytes, CRC32C.
constexpr size_t kHeaderBytes = sizeof(kSnapshotMagic) + 4 + 4 + 8 + 4;

std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? 0x82F63B78u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    char raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));
    out_.append(raw, sizeof(T));
  }
  void PutString(absl::string_view s) {
    Put<uint64_t>(s.size());
    out_.append(s.data(), s.size());
  }
  template <typename T>
  void PutVector(const std::vector<T>& v) {
    Put<uint64_t>(v.size());
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  // `version`: the format version of the bytes, for fields that later versions added.
  explicit Reader(absl::string_view in, uint32_t version = kSnapshotVersion)
      : in_(in), version_(version) {}
  uint32_t version() const { return version_; }

  template <typename T>
  absl::Status Get(absl::string_view what, T* value) {
    if (in_.size() < sizeof(T)) return Truncated(what);
    std::memcpy(value, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return absl::OkStatus();
  }
  absl::Status GetString(absl::string_view what, std::string* s) {
    uint64_t n = 0;
    RETURN_IF_ERROR(Get(what, &n));
    if (n > in_.size()) return Truncated(what);
    s->assign(in_.data(), static_cast<size_t>(n));
    in_.remove_prefix(static_cast<size_t>(n));
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status GetVector(absl::string_view what, std::vector<T>* v) {
    uint64_t n = 0;
    RETURN_IF_ERROR(Get(what, &n));
    // Checked against what is left before allocating: a damaged count is an error.
    if (n > in_.size() / sizeof(T)) return Truncated(what);
    v->resize(static_cast<size_t>(n));
    std::memcpy(v->data(), in_.data(), static_cast<size_t>(n) * sizeof(T));
    in_.remove_prefix(static_cast<size_t>(n) * sizeof(T));
    return absl::OkStatus();
  }
  // An enum stored as one byte, below kEnumCount<E>.
  template <typename E>
  absl::Status GetEnum(absl::string_view what, E* value) {
    uint8_t raw = 0;
    RETURN_IF_ERROR(Get(what, &raw));
    if (raw >= kEnumCount<E>) {
      return absl::DataLossError(absl::StrCat("snapshot: ", what, " is ", raw, ", not a known value"));
    }
    *value = static_cast<E>(raw);
    return absl::OkStatus();
  }
  size_t left() const { return in_.size(); }

 private:
  absl::Status Truncated(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat("snapshot: truncated at ", what));
  }
  absl::string_view in_;
  uint32_t version_;
};

template <typename E>
void PutEnum(Writer& w, E value) {
  static_assert(kEnumCount<E> > 0, "not an enum the snapshot stores");
  w.Put<uint8_t>(static_cast<uint8_t>(value));
}

void PutPolicy(Writer& w, const Policy& p) {
  PutEnum(w, p.aggregation);
  w.Put<double>(p.alpha);
  PutEnum(w, p.refresh);
  w.Put<int64_t>(p.refresh_interval);
  w.Put<int64_t>(p.protect_sinks);
  w.Put<int64_t>(p.protect_recent);
  w.Put<uint64_t>(p.seed);
  w.Put<int64_t>(p.span_pool);  // since version 2
  w.PutString(p.preset);
}

absl::Status GetPolicy(Reader& r, Policy* p) {
  RETURN_IF_ERROR(r.GetEnum("policy aggregation", &p->aggregation));
  RETURN_IF_ERROR(r.Get("policy alpha", &p->alpha));
  RETURN_IF_ERROR(r.GetEnum("policy refresh", &p->refresh));
  RETURN_IF_ERROR(r.Get("policy refresh_interval", &p->refresh_interval));
  RETURN_IF_ERROR(r.Get("policy protect_sinks", &p->protect_sinks));
  RETURN_IF_ERROR(r.Get("policy protect_recent", &p->protect_recent));
  RETURN_IF_ERROR(r.Get("policy seed", &p->seed));
  p->span_pool = 0;  // version 1 has none: pooling did not exist
  if (r.version() >= 2) RETURN_IF_ERROR(r.Get("policy span_pool", &p->span_pool));
  return r.GetString("policy preset", &p->preset);
}

void PutStats(Writer& w, const SequenceStats& s) {
  for (int64_t v : {s.steps, s.scoring_steps, s.skipped_scoring_steps, s.ignored_score_reports,
                    s.tokens_evicted}) {
    w.Put<int64_t>(v);
  }
}

absl::Status GetStats(Reader& r, SequenceStats* s) {
  for (int64_t* v : {&s->steps, &s->scoring_steps, &s->skipped_scoring_steps,
                     &s->ignored_score_reports, &s->tokens_evicted}) {
    RETURN_IF_ERROR(r.Get("sequence stats", v));
  }
  return absl::OkStatus();
}

void PutLayout(Writer& w, const kernels::KvBlockLayout& l) {
  for (int64_t v : {l.tokens_per_block, l.layers, l.kv_heads, l.head_dim}) w.Put<int64_t>(v);
  PutEnum(w, l.dtype);
}

absl::Status GetLayout(Reader& r, kernels::KvBlockLayout* l) {
  for (int64_t* v : {&l->tokens_per_block, &l->layers, &l->kv_heads, &l->head_dim}) {
    RETURN_IF_ERROR(r.Get("pool layout", v));
  }
  return r.GetEnum("pool dtype", &l->dtype);
}

void PutSequence(Writer& w, const SequenceRecord& s) {
  w.PutString(s.tenant);
  w.PutString(s.id);
  const SequenceOptions& o = s.options;
  w.Put<int64_t>(o.prefill_len);
  w.Put<int64_t>(s.budget);
  PutPolicy(w, o.policy);
  PutEnum(w, o.score_layout);
  w.Put<int64_t>(o.layers);
  PutEnum(w, o.decision_encoding);
  w.Put<int32_t>(s.tp_world_size);
  PutEnum(w, s.score_dtype);
  const SequenceProgress empty;
  const SequenceProgress& p = o.resume.has_value() ? *o.resume : empty;
  w.Put<int64_t>(p.last_step);
  w.PutVector(p.positions);
  w.PutVector(p.momentum);
  PutStats(w, p.stats);
  w.PutString(p.rng_state);
  w.Put<uint32_t>(static_cast<uint32_t>(s.kv.size()));
  for (const BlockLeaseState& lease : s.kv) {
    w.PutVector(lease.blocks);
    w.PutVector(lease.slots);
  }
}

absl::Status GetSequence(Reader& r, SequenceRecord* s) {
  RETURN_IF_ERROR(r.GetString("sequence tenant", &s->tenant));
  RETURN_IF_ERROR(r.GetString("sequence id", &s->id));
  SequenceOptions& o = s->options;
  RETURN_IF_ERROR(r.Get("prefill_len", &o.prefill_len));
  RETURN_IF_ERROR(r.Get("budget", &s->budget));
  o.budget = BudgetSpec::Tokens(s->budget);
  RETURN_IF_ERROR(GetPolicy(r, &o.policy));
  RETURN_IF_ERROR(r.GetEnum("score_layout", &o.score_layout));
  RETURN_IF_ERROR(r.Get("layers", &o.layers));
  RETURN_IF_ERROR(r.GetEnum("decision_encoding", &o.decision_encoding));
  RETURN_IF_ERROR(r.Get("tp_world_size", &s->tp_world_size));
  RETURN_IF_ERROR(r.GetEnum("score_dtype", &s->score_dtype));
  SequenceProgress& p = o.resume.emplace();
  RETURN_IF_ERROR(r.Get("last_step", &p.last_step));
  RETURN_IF_ERROR(r.GetVector("positions", &p.positions));
  RETURN_IF_ERROR(r.GetVector("momentum", &p.momentum));
  RETURN_IF_ERROR(GetStats(r, &p.stats));
  RETURN_IF_ERROR(r.GetString("rng_state", &p.rng_state));
  uint32_t ranks = 0;
  RETURN_IF_ERROR(r.Get("kv rank count", &ranks));
  // Each rank takes at least its two counts.
  if (ranks > r.left() / 16) return absl::DataLossError("snapshot: truncated at kv leases");
  s->kv.resize(ranks);
  for (BlockLeaseState& lease : s->kv) {
    RETURN_IF_ERROR(r.GetVector("kv blocks", &lease.blocks));
    RETURN_IF_ERROR(r.GetVector("kv slots", &lease.slots));
  }
  return absl::OkStatus();
}

absl::Status SystemError(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

}  // namespace

uint32_t Crc32c(absl::string_view bytes) {
  static const std::array<uint32_t, 256> table = MakeCrc32cTable();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : bytes) crc = table[(crc ^ b) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::string EncodeSnapshot(const EngineSnapshot& snapshot) {
  Writer payload;
  payload.Put<int64_t>(snapshot.pid);
  payload.Put<uint32_t>(static_cast<uint32_t>(snapshot.pools.size()));
  for (const PoolSnapshot& pool : snapshot.pools) {
    payload.Put<int32_t>(pool.rank);
    payload.PutString(pool.shm_name);
    payload.Put<int64_t>(pool.bytes);
    PutLayout(payload, pool.layout);
    payload.PutVector(pool.free_blocks);
  }
  payload.Put<uint64_t>(snapshot.sequences.size());
  for (const SequenceRecord& sequence : snapshot.sequences) PutSequence(payload, sequence);
  const std::string body = payload.Take();

  Writer file;
  std::string out(kSnapshotMagic, sizeof(kSnapshotMagic));
  file.Put<uint32_t>(kSnapshotVersion);
  file.Put<uint32_t>(0);  // flags
  file.Put<uint64_t>(body.size());
  file.Put<uint32_t>(Crc32c(body));
  out += file.Take();
  out += body;
  return out;
}

absl::StatusOr<EngineSnapshot> DecodeSnapshot(absl::string_view bytes) {
  if (bytes.size() < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("snapshot: ", bytes.size(),
                                            " bytes, shorter than its ", kHeaderBytes,
                                            "-byte header"));
  }
  if (std::memcmp(bytes.data(), kSnapshotMagic, sizeof(kSnapshotMagic)) != 0) {
    return absl::DataLossError("snapshot: the file does not start with the magic KVCMSNAP");
  }
  Reader header(bytes.substr(sizeof(kSnapshotMagic), kHeaderBytes - sizeof(kSnapshotMagic)));
  uint32_t version = 0, flags = 0, crc = 0;
  uint64_t payload_bytes = 0;
  RETURN_IF_ERROR(header.Get("version", &version));
  RETURN_IF_ERROR(header.Get("flags", &flags));
  RETURN_IF_ERROR(header.Get("payload size", &payload_bytes));
  RETURN_IF_ERROR(header.Get("checksum", &crc));
  if (version < kOldestSnapshotVersion || version > kSnapshotVersion) {
    return absl::DataLossError(absl::StrCat("snapshot: version ", version,
                                            "; this kvcached reads versions ",
                                            kOldestSnapshotVersion, " to ", kSnapshotVersion));
  }
  if (flags != 0) return absl::DataLossError(absl::StrCat("snapshot: unknown flags ", flags));
  const absl::string_view body = bytes.substr(kHeaderBytes);
  if (payload_bytes != body.size()) {
    return absl::DataLossError(absl::StrCat("snapshot: the header says ", payload_bytes,
                                            " payload bytes, the file holds ", body.size(),
                                            " (truncated or appended to)"));
  }
  if (const uint32_t actual = Crc32c(body); actual != crc) {
    return absl::DataLossError(absl::StrCat("snapshot: checksum mismatch (header ", crc,
                                            ", payload ", actual, ")"));
  }
  Reader r(body, version);
  EngineSnapshot snapshot;
  RETURN_IF_ERROR(r.Get("pid", &snapshot.pid));
  uint32_t pools = 0;
  RETURN_IF_ERROR(r.Get("pool count", &pools));
  if (pools > r.left() / 8) return absl::DataLossError("snapshot: truncated at pools");
  snapshot.pools.resize(pools);
  for (PoolSnapshot& pool : snapshot.pools) {
    RETURN_IF_ERROR(r.Get("pool rank", &pool.rank));
    RETURN_IF_ERROR(r.GetString("pool shm name", &pool.shm_name));
    RETURN_IF_ERROR(r.Get("pool bytes", &pool.bytes));
    RETURN_IF_ERROR(GetLayout(r, &pool.layout));
    RETURN_IF_ERROR(r.GetVector("pool free blocks", &pool.free_blocks));
  }
  uint64_t sequences = 0;
  RETURN_IF_ERROR(r.Get("sequence count", &sequences));
  if (sequences > r.left() / 16) return absl::DataLossError("snapshot: truncated at sequences");
  snapshot.sequences.resize(static_cast<size_t>(sequences));
  for (SequenceRecord& sequence : snapshot.sequences) RETURN_IF_ERROR(GetSequence(r, &sequence));
  if (r.left() != 0) {
    return absl::DataLossError(absl::StrCat("snapshot: ", r.left(), " bytes after the last sequence"));
  }
  return snapshot;
}

absl::Status WriteSnapshotFile(const std::string& path, const EngineSnapshot& snapshot) {
  const std::string bytes = EncodeSnapshot(snapshot);
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return SystemError("cannot create", tmp);
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status error = SystemError("cannot write", tmp);
      close(fd);
      unlink(tmp.c_str());
      return error;
    }
    written += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    absl::Status error = SystemError("cannot fsync", tmp);
    close(fd);
    unlink(tmp.c_str());
    return error;
  }
  close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status error = SystemError("cannot rename onto", path);
    unlink(tmp.c_str());
    return error;
  }
  // The rename is durable only once the directory is.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return absl::OkStatus();
}

absl::StatusOr<EngineSnapshot> ReadSnapshotFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no snapshot at '", path, "'"));
    return SystemError("cannot open", path);
  }
  std::string bytes;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status error = SystemError("cannot read", path);
      close(fd);
      return error;
    }
    if (n == 0) break;
    bytes.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return DecodeSnapshot(bytes);
}

std::string EncodeSequenceRecord(const SequenceRecord& record) {
  Writer payload;
  PutSequence(payload, record);
  const std::string body = payload.Take();
  Writer header;
  header.Put<uint32_t>(kSnapshotVersion);
  header.Put<uint32_t>(Crc32c(body));
  std::string out(kSequenceRecordMagic, sizeof(kSequenceRecordMagic));
  out += header.Take();
  out += body;
  return out;
}

absl::StatusOr<SequenceRecord> DecodeSequenceRecord(absl::string_view bytes) {
  constexpr size_t kRecordHeaderBytes = sizeof(kSequenceRecordMagic) + 4 + 4;
  if (bytes.size() < kRecordHeaderBytes ||
      std::memcmp(bytes.data(), kSequenceRecordMagic, sizeof(kSequenceRecordMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(
        "sequence record: ", bytes.size(), " bytes that do not start with the magic KVCMSREC"));
  }
  Reader header(bytes.substr(sizeof(kSequenceRecordMagic), 8));
  uint32_t version = 0, crc = 0;
  RETURN_IF_ERROR(header.Get("version", &version));
  RETURN_IF_ERROR(header.Get("checksum", &crc));
  if (version < kOldestSnapshotVersion || version > kSnapshotVersion) {
    return absl::DataLossError(absl::StrCat("sequence record: version ", version,
                                            "; this kvcached reads versions ",
                                            kOldestSnapshotVersion, " to ", kSnapshotVersion));
  }
  const absl::string_view body = bytes.substr(kRecordHeaderBytes);
  if (const uint32_t actual = Crc32c(body); actual != crc) {
    return absl::DataLossError(absl::StrCat("sequence record: checksum mismatch (header ", crc,
                                            ", payload ", actual, ")"));
  }
  Reader r(body, version);
  SequenceRecord record;
  RETURN_IF_ERROR(GetSequence(r, &record));
  if (r.left() != 0) {
    return absl::DataLossError(absl::StrCat("sequence record: ", r.left(), " bytes after it"));
  }
  return record;
}

}  // namespace kvcm

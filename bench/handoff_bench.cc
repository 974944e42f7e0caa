// kvcache-handoff-bench: the disaggregated hand-off (docs/DISAGGREGATION.md) end to end,
// between real kvcached processes on loopback, against a plain memcpy of the same bytes.
//
// One source daemon and a target per --transports value (by default one --kv_transfer=ucx,
// one --kv_transfer=grpc), all with one host pool in POSIX shared memory of the issue's
// geometry: 8 layers, 8 KV heads, head dim 128, float16, 16 tokens a block (32 KiB a token,
// 512 KiB a block). Each repetition, for each transport:
//   full    a 65,536-token prefill opened at the source (2 GiB of K/V) and imported at once,
//           before any step: what moving the whole prefill costs;
//   step1   the same prefill opened at rho = 0.9 with folded reports, decode step 1 taken
//           at the source (one folded row over L0 + 1 tokens; it evicts down to
//           B = floor(0.1 L0) and compacts), then imported: what the hand-off moves.
// Before each import the worker's part is played: every block the sequence holds is
// written through a mapping of the source pool (DescribeKvPools), so the pages are real
// and differ block to block; after it, sampled tokens are compared byte for byte between
// the source (read before the import) and the target (at the slots the import answers).
// A mismatch ends the run with exit code 1. A transport whose import fails is reported as
// failed in the table (with the error and the last line of the source's log), the others
// go on against a fresh source, and the run exits 1 at the end.
//
// Reported, medians over --repetitions: bytes moved (kv_bytes + record_bytes), the
// ImportSequence call's wall time at the client and the daemon's own `seconds` (export to
// commit), and a memcpy of the same number of bytes (two buffers allocated and touched
// once, copied several times per repetition) for the bandwidth ratios.
//
// Run: build/bin/kvcache-handoff-bench --repetitions=5 --out=/tmp/handoff.md
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_manager/base/status_macros.h"
#include "clients/cpp/kvcache_client.h"
#include "kernels/kv_compaction.h"
#include "tests/server/daemon_process.h"

ABSL_FLAG(int32_t, repetitions, 5, "hand-offs of each case and transport; medians reported");
ABSL_FLAG(std::string, out, "", "also write the markdown table to this file");
ABSL_FLAG(int64_t, prefill, 65536, "prompt tokens L0");
ABSL_FLAG(double, compression_ratio, 0.9, "rho: step 1 keeps floor((1 - rho) L0) tokens");
ABSL_FLAG(int32_t, samples, 64, "tokens compared byte for byte after each import");
ABSL_FLAG(int32_t, memcpy_copies, 3, "memcpy timings per size and repetition");
ABSL_FLAG(std::vector<std::string>, transports, std::vector<std::string>({"ucx", "grpc"}),
          "the targets' --kv_transfer values, one target daemon each");

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DaemonProcess;

const kernels::KvBlockLayout kLayout{16, 8, 8, 128, kernels::KvDtype::kFloat16};

// The pool holds the whole prefill and step 1's new token, with a few blocks to spare.
std::vector<std::string> PoolFlags(int64_t prefill) {
  const int64_t blocks = (prefill + kLayout.tokens_per_block) / kLayout.tokens_per_block + 32;
  return {"--backend=host",
          "--tp_ranks=1",
          absl::StrCat("--kv_layers=", kLayout.layers),
          absl::StrCat("--kv_heads=", kLayout.kv_heads),
          absl::StrCat("--kv_head_dim=", kLayout.head_dim),
          "--kv_dtype=float16",
          absl::StrCat("--kv_tokens_per_block=", kLayout.tokens_per_block),
          "--kv_shared_memory",
          absl::StrCat("--pool_memory_bytes=", blocks * kLayout.BlockBytes()),
          "--import_timeout=5m"};
}

// This process's mapping of one rank's pool (shared memory, as DescribeKvPools names it).
class PoolMapping {
 public:
  static absl::StatusOr<std::unique_ptr<PoolMapping>> Map(const v1::KvPool& pool) {
    const int fd = shm_open(pool.shm_name().c_str(), O_RDWR, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat("shm_open('", pool.shm_name(), "')"));
    void* data =
        mmap(nullptr, static_cast<size_t>(pool.bytes()), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (data == MAP_FAILED) {
      return absl::InternalError(absl::StrCat("mmap('", pool.shm_name(), "')"));
    }
    return std::unique_ptr<PoolMapping>(new PoolMapping(static_cast<uint8_t*>(data), pool.bytes()));
  }
  ~PoolMapping() { munmap(data_, static_cast<size_t>(bytes_)); }

  uint8_t* Block(int64_t block) { return data_ + block * kLayout.BlockBytes(); }
  // Every layer's K and V of the token in `slot`, concatenated.
  std::string Token(int64_t slot) const {
    std::string out;
    for (int64_t layer = 0; layer < kLayout.layers; ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        out.append(reinterpret_cast<const char*>(data_ + kLayout.Offset(slot, layer, kv)),
                   static_cast<size_t>(kLayout.TokenBytes()));
      }
    }
    return out;
  }

 private:
  PoolMapping(uint8_t* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_;
  int64_t bytes_;
};

absl::StatusOr<std::unique_ptr<PoolMapping>> MapRankZero(client::KvCacheClient& client) {
  grpc::ClientContext context;
  v1::DescribeKvPoolsResponse pools;
  RETURN_IF_ERROR(client::FromGrpc(
      client.stub().DescribeKvPools(&context, v1::DescribeKvPoolsRequest(), &pools)));
  if (pools.pools_size() != 1 || pools.pools(0).shm_name().empty()) {
    return absl::FailedPreconditionError("the daemon should have one shared-memory pool");
  }
  return PoolMapping::Map(pools.pools(0));
}

struct Daemon {
  std::unique_ptr<DaemonProcess> process;
  std::unique_ptr<client::KvCacheClient> client;
  std::unique_ptr<PoolMapping> pool;
};

absl::StatusOr<Daemon> StartDaemon(const std::vector<std::string>& flags) {
  Daemon d;
  ASSIGN_OR_RETURN(d.process, DaemonProcess::Start(flags));
  d.client = d.process->Connect();
  if (d.client == nullptr) return absl::UnavailableError("could not connect to kvcached");
  ASSIGN_OR_RETURN(d.pool, MapRankZero(*d.client));
  return d;
}

// What a worker writes: block contents taken from a random buffer at an offset that
// depends on the block and the hand-off, so that no two blocks (nor two hand-offs) hold
// the same bytes and a token landing in the wrong slot is seen.
class KvWriter {
 public:
  KvWriter() : random_(size_t{8} << 20) {
    std::mt19937_64 generator(20261202);
    for (size_t i = 0; i + 8 <= random_.size(); i += 8) {
      const uint64_t word = generator();
      std::memcpy(random_.data() + i, &word, 8);
    }
  }
  void FillBlock(PoolMapping& pool, int64_t block, uint64_t salt) const {
    const uint64_t windows = (random_.size() - static_cast<size_t>(kLayout.BlockBytes())) / 64;
    const uint64_t window = (static_cast<uint64_t>(block) * 2654435761u + salt * 40503u) % windows;
    std::memcpy(pool.Block(block), random_.data() + window * 64,
                static_cast<size_t>(kLayout.BlockBytes()));
  }

 private:
  std::vector<uint8_t> random_;
};

struct Measurement {
  int64_t kept_tokens = 0;
  int64_t kv_bytes = 0;
  int64_t record_bytes = 0;
  double wall_seconds = 0;    // ImportSequence at the client
  double daemon_seconds = 0;  // the response's `seconds`
  std::string transport;
  int64_t Bytes() const { return kv_bytes + record_bytes; }
};

// The sampled tokens of `state` (indices into its cache order), with their bytes in `pool`.
struct Sample {
  std::vector<size_t> indices;
  std::vector<std::string> bytes;
};

Sample TakeSample(const v1::SequenceState& state, PoolMapping& pool, int32_t count) {
  Sample s;
  const auto& slots = state.kv_slots(0).slots();
  const size_t n = static_cast<size_t>(slots.size());
  for (int32_t i = 0; i < count && n > 0; ++i) {
    const size_t index =
        count == 1 ? 0 : (n - 1) * static_cast<size_t>(i) / static_cast<size_t>(count - 1);
    if (!s.indices.empty() && s.indices.back() == index) continue;
    s.indices.push_back(index);
    s.bytes.push_back(pool.Token(slots[static_cast<int>(index)]));
  }
  return s;
}

// A sample whose tokens mostly repeat one another says the worker's writes did not land
// (a comparison of zeros with zeros would prove nothing).
absl::Status CheckSampleWasWritten(const Sample& sample) {
  std::vector<std::string> distinct = sample.bytes;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  if (2 * distinct.size() < sample.bytes.size()) {
    return absl::InternalError(absl::StrCat("only ", distinct.size(), " of ", sample.bytes.size(),
                                            " sampled tokens differ: the source pool was not "
                                            "written"));
  }
  return absl::OkStatus();
}

absl::Status CheckSample(const Sample& sample, const v1::SequenceState& before,
                         const v1::SequenceState& after, PoolMapping& pool) {
  if (after.kv_slots_size() != 1 || after.positions_size() != before.positions_size() ||
      after.kv_slots(0).slots_size() != before.positions_size()) {
    return absl::DataLossError(
        absl::StrCat("imported ", after.positions_size(), " positions and ",
                     after.kv_slots_size() ? after.kv_slots(0).slots_size() : 0,
                     " slots; the source held ", before.positions_size()));
  }
  for (size_t i = 0; i < sample.indices.size(); ++i) {
    const int index = static_cast<int>(sample.indices[i]);
    if (after.positions(index) != before.positions(index)) {
      return absl::DataLossError(absl::StrCat("cache entry ", index, " is position ",
                                              after.positions(index), " at the target, ",
                                              before.positions(index), " at the source"));
    }
    if (pool.Token(after.kv_slots(0).slots(index)) != sample.bytes[i]) {
      return absl::DataLossError(absl::StrCat("the K/V of position ", before.positions(index),
                                              " differs between the source and the target"));
    }
  }
  return absl::OkStatus();
}

struct Case {
  std::string name;
  bool step_first;
};

// Opens `id` at the source, writes its K/V, takes step 1 if the case says so, has `target`
// import it, checks the sample, and closes it at the target.
absl::StatusOr<Measurement> HandOff(const Case& c, const std::string& id, Daemon& source,
                                    Daemon& target, const KvWriter& writer, uint64_t salt) {
  const int64_t prefill = absl::GetFlag(FLAGS_prefill);
  v1::OpenSequenceRequest open =
      client::OpenRequest(id, prefill, absl::GetFlag(FLAGS_compression_ratio), "inertia");
  open.set_score_layout(v1::SCORE_LAYOUT_FOLDED);
  open.set_layers(static_cast<int32_t>(kLayout.layers));
  RETURN_IF_ERROR(source.client->Open(open).status());
  ASSIGN_OR_RETURN(v1::SequenceState opened, source.client->Inspect(id, true));
  if (opened.kv_slots_size() != 1 || opened.kv_slots(0).slots_size() != prefill) {
    return absl::FailedPreconditionError(absl::StrCat(id, " was opened without a slot per token"));
  }
  // Every block the sequence holds, once per run of its slots (a block met again gets the
  // same bytes: they depend on the block and the salt only).
  int64_t last_block = -1;
  for (int64_t slot : opened.kv_slots(0).slots()) {
    const int64_t block = slot / kLayout.tokens_per_block;
    if (block != last_block) writer.FillBlock(*source.pool, block, salt);
    last_block = block;
  }
  if (c.step_first) {
    std::mt19937 random(static_cast<uint32_t>(salt));
    std::uniform_real_distribution<float> score(0.0f, 1.0f);
    std::vector<float> row(static_cast<size_t>(prefill + 1));  // one folded row
    for (float& s : row) s = score(random);
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, id, 1), row, 1);
    ASSIGN_OR_RETURN(v1::DecisionBatch decided, source.client->Step(batch));
    RETURN_IF_ERROR(client::DecisionStatus(decided.decisions(0)));
  }
  ASSIGN_OR_RETURN(v1::SequenceState before, source.client->Inspect(id, true));
  const Sample sample = TakeSample(before, *source.pool, absl::GetFlag(FLAGS_samples));
  RETURN_IF_ERROR(CheckSampleWasWritten(sample));

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ImportSequenceResponse> imported =
      target.client->ImportSequence(id, source.process->grpc_address(), absl::Minutes(5));
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  if (!imported.ok()) {
    return absl::Status(imported.status().code(),
                        absl::StrCat("import of ", id, ": ", imported.status().message()));
  }
  absl::Status checked = CheckSample(sample, before, imported->state(), *target.pool);
  if (!checked.ok()) return absl::DataLossError(absl::StrCat(id, ": ", checked.message()));
  RETURN_IF_ERROR(target.client->Close(id).status());
  Measurement m;
  m.kept_tokens = before.positions_size();
  m.kv_bytes = imported->kv_bytes();
  m.record_bytes = imported->record_bytes();
  m.wall_seconds = wall;
  m.daemon_seconds = imported->seconds();
  m.transport = imported->transport();
  return m;
}

// A plain copy between two buffers allocated and touched once.
class MemcpyFloor {
 public:
  explicit MemcpyFloor(int64_t bytes)
      : bytes_(bytes),
        from_(new char[static_cast<size_t>(bytes)]),
        to_(new char[static_cast<size_t>(bytes)]) {
    std::memset(from_.get(), 'k', static_cast<size_t>(bytes));
    std::memset(to_.get(), 0, static_cast<size_t>(bytes));
  }
  double Seconds(int64_t bytes) {
    bytes = std::min(bytes, bytes_);
    from_[static_cast<size_t>(bytes) / 2] = static_cast<char>(++round_);
    const absl::Time start = absl::Now();
    std::memcpy(to_.get(), from_.get(), static_cast<size_t>(bytes));
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (to_[static_cast<size_t>(bytes) / 2] != static_cast<char>(round_)) std::abort();
    return seconds;
  }

 private:
  const int64_t bytes_;
  std::unique_ptr<char[]> from_;
  std::unique_ptr<char[]> to_;
  int round_ = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return absl::StrCat(one, " ", five, " ", fifteen);
}

// `before` + the last non-empty line of `log` + `after`; "" for an empty log.
std::string LastLine(absl::string_view before, absl::string_view log, absl::string_view after) {
  while (!log.empty() && log.back() == '\n') log.remove_suffix(1);
  if (log.empty()) return "";
  const size_t newline = log.rfind('\n');
  return absl::StrCat(before, newline == log.npos ? log : log.substr(newline + 1), after);
}

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

struct Row {
  std::vector<Measurement> runs;
  std::vector<double> memcpy_seconds;
  std::string failure;  // why its transport stopped being measured; "" when it was not

  Measurement Median() const {
    Measurement m = runs.front();
    std::vector<double> wall, daemon;
    for (const Measurement& r : runs) {
      wall.push_back(r.wall_seconds);
      daemon.push_back(r.daemon_seconds);
    }
    m.wall_seconds = kvcm::Median(wall);
    m.daemon_seconds = kvcm::Median(daemon);
    return m;
  }
  std::string WallRange() const {
    double low = runs.front().wall_seconds, high = low;
    for (const Measurement& r : runs) {
      low = std::min(low, r.wall_seconds);
      high = std::max(high, r.wall_seconds);
    }
    return absl::StrFormat("%.3f to %.3f s", low, high);
  }
};

std::string Table(const std::map<std::string, Row>& rows, const std::vector<Case>& cases,
                  const std::vector<std::string>& transports, const std::string& load_before,
                  const std::string& load_after) {
  std::ostringstream out;
  out << absl::StrFormat(
      "L0 = %d tokens, rho = %.2f, %d B a token (%d layers, %d KV heads, dim %d, float16), "
      "%d-token blocks, 1 rank; medians of %d repetitions; load average %s before, %s after.\n\n",
      absl::GetFlag(FLAGS_prefill), absl::GetFlag(FLAGS_compression_ratio),
      kLayout.TokenFootprintBytes(), kLayout.layers, kLayout.kv_heads, kLayout.head_dim,
      kLayout.tokens_per_block, absl::GetFlag(FLAGS_repetitions), load_before, load_after);
  out << "| hand-off | transport | tokens | kv_bytes + record_bytes | ImportSequence (client) "
         "| range | daemon `seconds` | GB/s (client) | memcpy of the same bytes | GB/s | "
         "transport / memcpy |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Case& c : cases) {
    for (const std::string& transport : transports) {
      const Row& row = rows.at(c.name + "/" + transport);
      if (row.runs.empty()) {
        out << absl::StrFormat("| %s | %s | failed: %s ||||||||\n", c.name, transport, row.failure);
        continue;
      }
      const Measurement m = row.Median();
      const double copy = Median(row.memcpy_seconds);
      out << absl::StrFormat(
          "| %s | %s | %d | %s + %.1f KiB | %.3f s | %s | %.3f s | %.2f | %.3f s | %.2f | %.2fx "
          "|\n",
          c.name, m.transport, m.kept_tokens, Mib(m.kv_bytes), m.record_bytes / 1024.0,
          m.wall_seconds, row.WallRange(), m.daemon_seconds, m.Bytes() / m.wall_seconds / 1e9, copy,
          m.Bytes() / copy / 1e9, copy / m.wall_seconds);
    }
  }
  out << "\n| ratio | value | goal |\n|---|---:|---|\n";
  for (const std::string& transport : transports) {
    const Row& full = rows.at("full/" + transport);
    const Row& step1 = rows.at("step1/" + transport);
    if (full.runs.empty() || step1.runs.empty()) continue;
    out << absl::StrFormat(
        "| bytes after step 1 / bytes of the full hand-off (%s) | %.4f | <= 0.11 |\n", transport,
        static_cast<double>(step1.Median().Bytes()) / static_cast<double>(full.Median().Bytes()));
    break;  // the same bytes whichever transport moved them
  }
  for (const Case& c : cases) {
    for (const std::string& transport : transports) {
      const Row& row = rows.at(c.name + "/" + transport);
      const std::string value =
          row.runs.empty()
              ? "failed"
              : absl::StrFormat("%.3f", Median(row.memcpy_seconds) / row.Median().wall_seconds);
      out << absl::StrFormat("| %s bandwidth / memcpy bandwidth, %s | %s | %s |\n", transport,
                             c.name, value, transport == "ucx" ? ">= 0.5" : "(reported)");
    }
  }
  return out.str();
}

// The memcpy timings of one repetition, for every row measured in it.
void TimeCopies(std::map<std::string, Row>& rows, int32_t rep,
                std::unique_ptr<MemcpyFloor>& floor) {
  int64_t most = 0;
  for (const auto& [name, row] : rows) {
    if (static_cast<int32_t>(row.runs.size()) == rep + 1) {
      most = std::max(most, row.runs.back().Bytes());
    }
  }
  if (most == 0) return;
  if (floor == nullptr) floor = std::make_unique<MemcpyFloor>(most);
  for (auto& [name, row] : rows) {
    if (static_cast<int32_t>(row.runs.size()) != rep + 1) continue;
    for (int32_t i = 0; i < absl::GetFlag(FLAGS_memcpy_copies); ++i) {
      row.memcpy_seconds.push_back(floor->Seconds(row.runs.back().Bytes()));
    }
  }
}

absl::Status Run() {
  const int64_t prefill = absl::GetFlag(FLAGS_prefill);
  const std::vector<Case> cases = {{"full", false}, {"step1", true}};
  const std::vector<std::string> transports = absl::GetFlag(FLAGS_transports);
  if (transports.empty()) return absl::InvalidArgumentError("--transports names none");
  const std::string load_before = LoadAverage();
  ASSIGN_OR_RETURN(Daemon source, StartDaemon(PoolFlags(prefill)));
  std::map<std::string, Daemon> targets;
  std::map<std::string, Row> rows;
  for (const std::string& transport : transports) {
    std::vector<std::string> flags = PoolFlags(prefill);
    flags.push_back("--kv_transfer=" + transport);
    ASSIGN_OR_RETURN(targets[transport], StartDaemon(flags));
    for (const Case& c : cases) rows[c.name + "/" + transport];
  }
  const KvWriter writer;
  std::map<std::string, std::string> failed;  // transport -> the first failure
  std::unique_ptr<MemcpyFloor> floor;
  uint64_t salt = 0;
  for (int32_t rep = 0; rep < absl::GetFlag(FLAGS_repetitions); ++rep) {
    for (const Case& c : cases) {
      for (const std::string& transport : transports) {
        if (failed.contains(transport)) continue;
        const std::string id = absl::StrCat(c.name, "-", transport, "-", rep);
        absl::StatusOr<Measurement> measured =
            HandOff(c, id, source, targets.at(transport), writer, ++salt);
        if (measured.ok() && measured->transport != transport) {
          measured = absl::InternalError(absl::StrCat(id, " went over ", measured->transport));
        }
        if (!measured.ok()) {
          std::cerr << id << ": " << measured.status() << "\nsource's log:\n"
                    << source.process->Log() << "\ntarget's log:\n"
                    << targets.at(transport).process->Log() << "\n";
          // Bytes that arrived wrong end the run; a transport that fails is reported as
          // such, and the others measured on a fresh source (this one may be gone).
          if (measured.status().code() == absl::StatusCode::kDataLoss) return measured.status();
          failed[transport] =
              absl::StrCat(measured.status().ToString(),
                           LastLine(" (the source's log ends: ", source.process->Log(), ")"));
          for (const Case& other : cases) {
            rows[other.name + "/" + transport].failure = absl::StrCat(id, ": ", failed[transport]);
          }
          source = Daemon();
          ASSIGN_OR_RETURN(source, StartDaemon(PoolFlags(prefill)));
          continue;
        }
        const Measurement& m = *measured;
        std::cerr << absl::StrFormat("%s: %s in %.3f s (daemon %.3f s)\n", id, Mib(m.Bytes()),
                                     m.wall_seconds, m.daemon_seconds);
        rows[c.name + "/" + transport].runs.push_back(m);
      }
    }
    TimeCopies(rows, rep, floor);
  }
  floor.reset();
  const std::string table = Table(rows, cases, transports, load_before, LoadAverage());
  std::cout << table;
  if (!absl::GetFlag(FLAGS_out).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_out)) << table;
  }
  // Targets first: their importers' channels to the source would hold its drain.
  for (auto& [name, target] : targets) {
    target.client.reset();
    target.process->SignalAndWait(SIGTERM, absl::Seconds(30));
  }
  source.client.reset();
  source.process->SignalAndWait(SIGTERM, absl::Seconds(30));
  if (!failed.empty()) {
    return absl::UnavailableError(
        absl::StrCat(failed.size(), " transport(s) failed; first: ", failed.begin()->first, ": ",
                     failed.begin()->second));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = kvcm::Run();
  if (!status.ok()) {
    std::cerr << "kvcache-handoff-bench: " << status << "\n";
    return 1;
  }
  return 0;
}

// Snapshot: the engine's state written at a graceful stop and read at the next start, so
// that a restarted kvcached gives every open sequence exactly the decisions it would have
// got without the restart (docs/RELIABILITY.md, "Restart without loss").
//
// What it holds: per KV pool, its shared-memory name, size, layout and the order in which
// it hands out free blocks; per sequence, everything its next step depends on (options
// and resolved policy and budget, step counter, positions, momentum bits, statistics, the
// random policy's generator, folded layout, score dtype, TP world size, and each rank's
// block lease). A pending tensor-parallel step is not in it: the drain abandons those
// (ABORTED to the ranks that reported), so they are sent again with nothing changed.
//
// The file (little-endian):
//   magic "KVCMSNAP" | u32 version (kSnapshotVersion; kOldestSnapshotVersion and up are
//   read) | u32 flags (0) |
//   u64 payload bytes | u32 CRC32C of the payload | payload
// Every length inside the payload is checked against the bytes that remain before
// anything is allocated, so a damaged file is an error, never a huge allocation.
// Free functions; thread-compatible.
#ifndef KVCM_CACHE_MANAGER_PERSIST_SNAPSHOT_H_
#define KVCM_CACHE_MANAGER_PERSIST_SNAPSHOT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache_manager/kv/block_pool.h"
#include "cache_manager/table/sequence_record.h"
#include "kernels/kv_compaction.h"
#include "kernels/score_matrix.h"

namespace kvcm {

inline constexpr char kSnapshotMagic[8] = {'K', 'V', 'C', 'M', 'S', 'N', 'A', 'P'};
// The version written. Version 2 added the policy's span_pool (after its seed); version 1
// files and records are still read, their policies with span_pool 0 (off), which is what
// every version 1 daemon ran.
inline constexpr uint32_t kSnapshotVersion = 2;
inline constexpr uint32_t kOldestSnapshotVersion = 1;
// The file's name inside --state_dir.
inline constexpr char kSnapshotFileName[] = "kvcached.snapshot";

// CRC-32C (Castagnoli, reflected, as iSCSI and ext4 use it) of `bytes`.
uint32_t Crc32c(absl::string_view bytes);

struct PoolSnapshot {
  int32_t rank = 0;
  std::string shm_name;  // "/kvcached-<pid>-rank<r>"; empty: private memory (not re-attachable)
  int64_t bytes = 0;
  kernels::KvBlockLayout layout;
  std::vector<int32_t> free_blocks;  // BlockPool::FreeBlocks: the next one handed out last
};

struct EngineSnapshot {
  int64_t pid = 0;  // of the kvcached that wrote it
  std::vector<PoolSnapshot> pools;
  std::vector<SequenceRecord> sequences;
};

std::string EncodeSnapshot(const EngineSnapshot& snapshot);
// DATA_LOSS naming what is wrong (magic, version, checksum, a truncated or malformed
// field); nothing else.
absl::StatusOr<EngineSnapshot> DecodeSnapshot(absl::string_view bytes);

// One sequence's record alone, as a hand-off carries it from daemon to daemon:
//   magic "KVCMSREC" | u32 version (kSnapshotVersion) | u32 CRC32C of the payload | payload
// with the payload exactly a snapshot's per-sequence entry. Decoding checks every length
// against the bytes left, as DecodeSnapshot does: DATA_LOSS naming what is wrong.
inline constexpr char kSequenceRecordMagic[8] = {'K', 'V', 'C', 'M', 'S', 'R', 'E', 'C'};
std::string EncodeSequenceRecord(const SequenceRecord& record);
absl::StatusOr<SequenceRecord> DecodeSequenceRecord(absl::string_view bytes);

// Writes `snapshot` to `path` atomically: a temporary file beside it, fsynced, renamed
// over `path`, and the directory fsynced. INTERNAL with strerror's text on failure (the
// temporary file removed).
absl::Status WriteSnapshotFile(const std::string& path, const EngineSnapshot& snapshot);
// NOT_FOUND when there is no file; DATA_LOSS when it is not a whole, valid snapshot;
// INTERNAL when it cannot be read.
absl::StatusOr<EngineSnapshot> ReadSnapshotFile(const std::string& path);

}  // namespace kvcm

#endif  // KVCM_CACHE_MANAGER_PERSIST_SNAPSHOT_H_

#include "cache_manager/handoff/exports.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_manager/base/status_macros.h"
#include "cache_manager/persist/snapshot.h"

namespace kvcm {

ExportTable::ExportTable(SequenceTable* table, KvPools* pools, ExportOptions options)
    : table_(table),
      pools_(pools),
      options_(options),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()) {}

ExportTable::~ExportTable() {
  // Whatever is still frozen is served here again.
  MutexLock lock(&mu_);
  for (const auto& [export_id, e] : exports_) {
    table_->AbortExport(e.tenant, e.id, export_id).IgnoreError();
  }
}

absl::StatusOr<ExportTicket> ExportTable::Begin(absl::string_view tenant, absl::string_view id) {
  uint64_t export_id = 0;
  {
    MutexLock lock(&mu_);
    if (static_cast<int64_t>(exports_.size()) + starting_ >= options_.max_exports) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence '", id, "': this kvcached already has ", options_.max_exports,
          " hand-offs in progress (--max_exports); retry once some finish"));
    }
    ++starting_;
    export_id = next_id_++;
  }
  absl::StatusOr<SequenceTable::Exported> exported = table_->BeginExport(tenant, id, export_id);
  ExportTicket ticket;
  Export entry;
  if (exported.ok()) {
    ticket.export_id = export_id;
    ticket.record = EncodeSequenceRecord(exported->record);
    for (const BlockLeaseState& lease : exported->record.kv) ticket.blocks.push_back(lease.blocks);
    ticket.deadline = clock_->Now() + options_.lease;
    entry = Export{std::string(tenant), std::string(id), ticket.blocks, ticket.deadline,
                   std::move(exported->pin)};
  }
  MutexLock lock(&mu_);
  --starting_;
  if (!exported.ok()) return exported.status();
  exports_.emplace(export_id, std::move(entry));
  return ticket;
}

absl::Status ExportTable::CopyBlocks(uint64_t export_id, int32_t rank, int64_t first,
                                     int64_t count, std::string* out) const {
  ReaderMutexLock lock(&mu_);
  auto it = exports_.find(export_id);
  if (it == exports_.end()) {
    return absl::NotFoundError(absl::StrCat("export ", export_id, " is not in progress"));
  }
  const std::vector<std::vector<int32_t>>& blocks = it->second.blocks;
  if (pools_ == nullptr || rank < 0 || rank >= static_cast<int32_t>(blocks.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "export ", export_id, ": rank ", rank, " is not one of its ", blocks.size(),
        " KV ranks"));
  }
  const std::vector<int32_t>& lease = blocks[static_cast<size_t>(rank)];
  const int64_t held = static_cast<int64_t>(lease.size());
  if (first < 0 || count < 0 || first > held || count > held - first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "export ", export_id, " rank ", rank, ": blocks [", first, ", +", count,
        ") are outside its ", held, " blocks"));
  }
  const BlockPool& pool = pools_->pool(rank);
  const int64_t block_bytes = pool.layout().BlockBytes();
  const size_t start = out->size();
  out->resize(start + static_cast<size_t>(count * block_bytes));
  for (int64_t i = 0; i < count; ++i) {
    const int32_t block = lease[static_cast<size_t>(first + i)];
    RETURN_IF_ERROR(pool.storage().CopyOut(block * block_bytes,
                                           out->data() + start + i * block_bytes, block_bytes));
  }
  return absl::OkStatus();
}

void ExportTable::RememberLocked(uint64_t export_id, bool committed) {
  finished_[export_id] = committed;
  finished_order_.push_back(export_id);
  while (static_cast<int64_t>(finished_order_.size()) > options_.max_remembered) {
    finished_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
}

absl::StatusOr<ExportEnd> ExportTable::Finish(uint64_t export_id, bool commit) {
  MutexLock lock(&mu_);
  if (auto done = finished_.find(export_id); done != finished_.end()) {
    if (commit && !done->second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "export ", export_id, " was aborted (its ", absl::FormatDuration(options_.lease),
          " lease ran out, or the target gave it up): the source serves the sequence again"));
    }
    return ExportEnd{done->second, false, ""};
  }
  auto it = exports_.find(export_id);
  if (it == exports_.end()) {
    return absl::NotFoundError(absl::StrCat("export ", export_id, " is not known here"));
  }
  const Export e = std::move(it->second);
  exports_.erase(it);
  if (!commit) {
    // NOT_FOUND: its client closed it meanwhile; aborted either way.
    table_->AbortExport(e.tenant, e.id, export_id).IgnoreError();
    RememberLocked(export_id, false);
    return ExportEnd{false, true, ""};
  }
  absl::StatusOr<SequenceInfo> closed = table_->CommitExport(e.tenant, e.id, export_id);
  if (!closed.ok()) {
    RememberLocked(export_id, false);
    return absl::NotFoundError(absl::StrCat(
        "sequence '", e.id, "' was closed at the source while it was being handed off"));
  }
  RememberLocked(export_id, true);
  return ExportEnd{true, true, closed->policy.preset};
}

int64_t ExportTable::AbortExpired() {
  const absl::Time now = clock_->Now();
  MutexLock lock(&mu_);
  std::vector<uint64_t> expired;
  for (const auto& [export_id, e] : exports_) {
    if (e.deadline <= now) expired.push_back(export_id);
  }
  for (const uint64_t export_id : expired) {
    const Export& e = exports_.at(export_id);
    table_->AbortExport(e.tenant, e.id, export_id).IgnoreError();
    exports_.erase(export_id);
    RememberLocked(export_id, false);
  }
  return static_cast<int64_t>(expired.size());
}

int64_t ExportTable::in_progress() const {
  ReaderMutexLock lock(&mu_);
  return static_cast<int64_t>(exports_.size());
}

}  // namespace kvcm

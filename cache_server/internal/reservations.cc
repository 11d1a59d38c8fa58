// Puts: Reserve allocates arena space (evicting if needed) for a kReserved entry, Commit
// verifies the written bytes, writes them through to disk and makes the entry kCommitted, Abort
// (and the sweeper, via DropReservationLocked) forgets it.
#include <cstring>

#include "cache_server/internal/block_index.h"
#include "common/kv_block.h"

namespace sparsex::cache::internal {

absl::StatusOr<Reservation> CacheCore::Reserve(const Hash128& model, uint32_t layout,
                                               const BlockKey& key, uint64_t size, double cost,
                                               const std::string& client) {
  RETURN_IF_ERROR(CheckLayout(layout));
  RETURN_IF_ERROR(ValidateBlockKey(key));
  if (size < kKvBlockHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad_size: a block is at least ", kKvBlockHeaderBytes, " bytes, got ", size));
  }
  if (size > opt_.max_block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("oversized: block of ", size,
                                                   " bytes, max_block_bytes is ",
                                                   opt_.max_block_bytes));
  }
  if (!(cost >= 0)) return absl::InvalidArgumentError("bad_cost: cost must be >= 0");
  std::unique_lock<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    if (it->second.doomed) {
      return absl::AbortedError(
          absl::StrCat("block_being_removed: ", key.ToString(), " is being evicted; retry"));
    }
    return absl::AlreadyExistsError(absl::StrCat(
        it->second.state == Entry::State::kCommitted ? "committed: " : "put_in_progress: ",
        key.ToString()));
  }
  if (!client.empty()) {
    const uint64_t quota = opt_.max_client_reserved_bytes > 0
                               ? opt_.max_client_reserved_bytes
                               : std::max<uint64_t>(alloc_.capacity() / 4, opt_.max_block_bytes);
    const uint64_t held = reserved_by_client_.contains(client) ? reserved_by_client_[client] : 0;
    if (held + size > quota) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "client_quota: this client holds ", held, " reserved bytes; ", size, " more exceed ",
          "its quota of ", quota, " (commit or abort first)"));
    }
  }
  ASSIGN_OR_RETURN(uint64_t off, AllocateLocked(size));
  Entry e;
  e.state = Entry::State::kReserved;
  e.model_fp = model;
  e.layout_version = layout;
  e.size = size;
  e.cost = cost;
  e.offset = off;
  entries_[key] = e;
  const uint64_t id = next_id_++;
  reservations_[id] = {key, Clock::now() + std::chrono::milliseconds(opt_.reservation_timeout_ms),
                       false, client, size};
  if (!client.empty()) reserved_by_client_[client] += size;
  UpdateGauges();
  return Reservation{id, off, UnixMs() + opt_.reservation_timeout_ms};
}

absl::Status CacheCore::Commit(uint64_t id, uint64_t checksum, std::span<const uint8_t> inline_data,
                               bool has_inline) {
  BlockKey key;
  Entry snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto r = reservations_.find(id);
    if (r == reservations_.end()) return UnknownId(id, "reservation");
    if (r->second.committing) {
      return absl::AbortedError(absl::StrCat("commit_in_progress: reservation ", id));
    }
    r->second.committing = true;
    key = r->second.key;
    snapshot = entries_.at(key);
  }
  uint8_t* dst = arena_ + snapshot.offset;
  absl::Status st;
  if (has_inline) {
    if (inline_data.size() != snapshot.size) {
      st = absl::InvalidArgumentError(absl::StrCat("bad_size: inline data of ",
                                                   inline_data.size(), " bytes, reserved ",
                                                   snapshot.size));
    } else {
      std::memcpy(dst, inline_data.data(), snapshot.size);
    }
  }
  std::span<const uint8_t> bytes(dst, snapshot.size);
  double cost = snapshot.cost;
  if (st.ok() && KvBlockWireChecksum(bytes) != checksum) {
    st = absl::DataLossError(absl::StrCat("checksum_mismatch: bytes of ", key.ToString(),
                                          " do not match the commit checksum"));
  }
  if (st.ok()) st = CheckBlock(key, snapshot, bytes, &cost);
  // Write-through. A disk that is full or failing never fails the commit: the block is good
  // and in memory, so it is kept there only (the disk tier degrades until it recovers).
  bool on_disk = false;
  if (st.ok() && disk_ && opt_.write_through) {
    if (DiskWritable(snapshot.size)) {
      auto t0 = Clock::now();
      DiskMeta meta = MetaOf(snapshot);
      meta.checksum = checksum;
      meta.cost = cost;
      meta.commit_unix_ms = UnixMs();
      absl::Status ds = disk_->Put(key, meta, bytes);
      DiskWriteDone(snapshot.size);
      Observe(m_.disk_write_seconds, t0);
      if (ds.ok()) {
        on_disk = true;
      } else {
        DegradeDisk(std::string(ds.message()), snapshot.size);
      }
    }
    if (!on_disk) Inc(m_.memory_only_commits);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (auto r = reservations_.find(id); r != reservations_.end()) {
    ReleaseQuotaLocked(r->second);
    reservations_.erase(r);
  }
  Entry& e = entries_.at(key);
  if (!st.ok()) {
    alloc_.Free(e.offset, e.size);
    entries_.erase(key);
    Inc(m_.commits_failed);
    UpdateGauges();
    return st;
  }
  e.state = Entry::State::kCommitted;
  e.checksum = checksum;
  e.cost = cost;
  e.in_memory = true;
  e.commit_unix_ms = UnixMs();
  memory_policy_->Insert(key, e.size, e.cost);
  if (on_disk) {
    e.on_disk = true;
    disk_used_ += e.size;
    disk_policy_->Insert(key, e.size, 1);
    EnforceDiskCapacityLocked();
  }
  Inc(m_.bytes_in, static_cast<double>(snapshot.size));
  Inc(m_.commits_ok);
  UpdateGauges();
  return absl::OkStatus();
}

absl::Status CacheCore::Abort(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = reservations_.find(id);
  if (r == reservations_.end()) return UnknownId(id, "reservation");
  if (r->second.committing) {
    return absl::AbortedError(absl::StrCat("commit_in_progress: reservation ", id));
  }
  DropReservationLocked(r);
  UpdateGauges();
  return absl::OkStatus();
}

// Header of a committed block must describe exactly the reserved key, model and layout.
absl::Status CacheCore::CheckBlock(const BlockKey& key, const Entry& e,
                                   std::span<const uint8_t> bytes, double* cost) const {
  auto v = VerifyKvBlock(bytes);
  if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat("bad_block: ", v.status().message()));
  const KvBlockHeader& h = v->header;
  if (h.segment_fp != key.segment || h.layer_begin != key.layer_begin ||
      h.layer_end != key.layer_end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad_block: block header describes ", h.segment_fp.Hex(), "[", h.layer_begin, ",",
        h.layer_end, "), reserved ", key.ToString()));
  }
  if (h.model_fp != e.model_fp) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model_mismatch: block is for model ", h.model_fp.Hex(), ", reserved for ",
        e.model_fp.Hex()));
  }
  RETURN_IF_ERROR(CheckKvLayout(h, opt_.layout_version));
  if (*cost <= 0) {
    *cost = static_cast<double>(h.num_tokens) * (h.layer_end - h.layer_begin);
  }
  return absl::OkStatus();
}

void CacheCore::ReleaseQuotaLocked(const ReservationRec& r) {
  if (r.client.empty()) return;
  auto it = reserved_by_client_.find(r.client);
  if (it == reserved_by_client_.end()) return;
  it->second -= std::min(it->second, r.size);
  if (it->second == 0) reserved_by_client_.erase(it);
}

void CacheCore::DropReservationLocked(
    absl::flat_hash_map<uint64_t, ReservationRec>::iterator r) {
  ReleaseQuotaLocked(r->second);
  auto e = entries_.find(r->second.key);
  if (e != entries_.end() && e->second.state == Entry::State::kReserved) {
    alloc_.Free(e->second.offset, e->second.size);
    entries_.erase(e);
  }
  reservations_.erase(r);
}

}  // namespace sparsex::cache::internal

// The index of the block cache: construction, the entry transitions every lifecycle shares
// (visible / doomed / unpinned / removed), ids and request checks, and the two operations that
// only read or drop index entries, Lookup and Evict. See block_index.h for the whole map.
#include <algorithm>

#include "cache_server/internal/block_index.h"
#include "common/kv_block.h"

namespace sparsex::cache::internal {

CacheCore::CacheCore(const CacheOptions& o, uint8_t* arena, uint64_t arena_bytes)
    : opt_(o),
      arena_(arena),
      alloc_(std::min<uint64_t>(arena_bytes, o.memory_capacity_bytes), o.arena_alignment),
      memory_policy_(MakeEvictionPolicy(o.eviction)),
      disk_policy_(MakeEvictionPolicy(EvictionPolicyKind::kLru)) {
  opt_.max_block_bytes = std::min(opt_.max_block_bytes, alloc_.capacity());
}

absl::StatusOr<std::vector<LookupEntry>> CacheCore::Lookup(const Hash128& model, uint32_t layout,
                                                           std::span<const BlockKey> keys) {
  RETURN_IF_ERROR(CheckLayout(layout));
  RETURN_IF_ERROR(CheckKeys(keys));
  std::vector<LookupEntry> out(keys.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    const Entry* e = Visible(keys[i]);
    if (e == nullptr) {
      Inc(m_.lookups_miss);
      continue;
    }
    out[i].size = e->size;
    out[i].layout_version = e->layout_version;
    out[i].tier = e->in_memory ? Tier::kMemory : Tier::kDisk;
    if (e->model_fp != model) {
      out[i].code = absl::StatusCode::kFailedPrecondition;
      Inc(m_.lookups_miss);
      continue;
    }
    out[i].code = absl::StatusCode::kOk;
    Inc(e->in_memory ? m_.lookups_memory : m_.lookups_disk);
  }
  return out;
}

absl::StatusOr<uint32_t> CacheCore::Evict(std::span<const BlockKey> keys, bool all, bool corrupt) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t n = 0;
  if (all) {
    std::vector<BlockKey> victims;
    for (const auto& [k, e] : entries_) {
      if (e.state == Entry::State::kCommitted && !e.doomed) victims.push_back(k);
    }
    for (const auto& k : victims) n += DoomLocked(k) ? 1 : 0;
  }
  bool any = false;
  for (const auto& k : keys) {
    RETURN_IF_ERROR(ValidateBlockKey(k));
    const Entry* e = Visible(k);
    if (e == nullptr) continue;
    any = true;
    if (corrupt) {
      // A client's report is a hint: only the server's own check drops a block. The memory
      // copy is what a client reads; committed bytes do not change under mu_ (a pinned block
      // is as stable as an unpinned one). A block no longer in memory is verified when it is
      // read from disk again.
      const bool bad = e->in_memory &&
                       KvBlockWireChecksum({arena_ + e->offset, static_cast<size_t>(e->size)}) !=
                           e->checksum;
      if (!bad) {
        Inc(m_.corrupt_reports_refuted);
        continue;
      }
      Inc(m_.corrupt_reports_confirmed);
      Inc(m_.corrupt_memory);
    }
    n += DoomLocked(k) ? 1 : 0;
  }
  UpdateGauges();
  if (!keys.empty() && !any && !all) {
    return absl::NotFoundError(absl::StrCat("unknown_block: none of the ", keys.size(),
                                            " keys is cached"));
  }
  return n;
}

absl::Status CacheCore::CheckLayout(uint32_t layout) const {
  if (layout != opt_.layout_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout_mismatch: request layout version ", layout, ", server holds version ",
        opt_.layout_version));
  }
  return absl::OkStatus();
}

absl::Status CacheCore::CheckKeys(std::span<const BlockKey> keys) {
  if (keys.empty()) return absl::InvalidArgumentError("no_keys: request has no keys");
  for (const auto& k : keys) RETURN_IF_ERROR(ValidateBlockKey(k));
  return absl::OkStatus();
}

absl::Status CacheCore::UnknownId(uint64_t id, const char* what) const {
  if (expired_set_.contains(id)) {
    return absl::AbortedError(absl::StrCat(what, "_expired: ", what, " ", id, " expired"));
  }
  return absl::NotFoundError(absl::StrCat("unknown_", what, ": ", what, " ", id));
}

void CacheCore::RememberExpired(uint64_t id) {
  expired_set_.insert(id);
  expired_fifo_.push_back(id);
  while (expired_fifo_.size() > 100000) {
    expired_set_.erase(expired_fifo_.front());
    expired_fifo_.pop_front();
  }
}

const Entry* CacheCore::Visible(const BlockKey& k) const {
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.state != Entry::State::kCommitted ||
      it->second.doomed) {
    return nullptr;
  }
  return &it->second;
}

DiskMeta CacheCore::MetaOf(const Entry& e) {
  DiskMeta m;
  m.size = e.size;
  m.checksum = e.checksum;
  m.cost = e.cost;
  m.model_fp = e.model_fp;
  m.layout_version = e.layout_version;
  m.commit_unix_ms = e.commit_unix_ms;
  return m;
}

// Removes a block from every tier (must be unpinned and not promoting).
void CacheCore::RemoveEntryLocked(const BlockKey& k) {
  auto it = entries_.find(k);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (e.in_memory) {
    alloc_.Free(e.offset, e.size);
    memory_policy_->Erase(k, false);
  }
  if (e.on_disk) {
    DeleteFromDiskLocked(k);
    disk_policy_->Erase(k, false);
    disk_used_ -= e.size;
  }
  entries_.erase(it);
}

// Makes a block invisible; removes it now if unpinned, else on the last unpin.
bool CacheCore::DoomLocked(const BlockKey& k) {
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.state != Entry::State::kCommitted) return false;
  Entry& e = it->second;
  if (e.doomed) return false;
  e.doomed = true;
  if (e.pins == 0 && !e.promoting) RemoveEntryLocked(k);
  return true;
}

void CacheCore::UnpinLocked(const BlockKey& k) {
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.pins == 0) return;
  Entry& e = it->second;
  if (--e.pins == 0) {
    pinned_bytes_ -= e.size;
    if (e.doomed && !e.promoting) RemoveEntryLocked(k);
  }
}

}  // namespace sparsex::cache::internal

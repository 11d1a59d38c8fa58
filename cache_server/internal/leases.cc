// Leases: pinning blocks for readers (promoting disk-only blocks into memory first and
// verifying them), renewal, release, and Read of a leased block.
#include <algorithm>

#include "cache_server/internal/block_index.h"
#include "common/kv_block.h"

namespace sparsex::cache::internal {

absl::StatusOr<LeaseGrant> CacheCore::Lease(const Hash128& model, uint32_t layout,
                                            std::span<const BlockKey> keys, uint32_t ttl_ms,
                                            bool partial) {
  RETURN_IF_ERROR(CheckLayout(layout));
  RETURN_IF_ERROR(CheckKeys(keys));
  {
    absl::flat_hash_set<BlockKey> seen;
    for (const auto& k : keys) {
      if (!seen.insert(k).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("duplicate_key: ", k.ToString(), " appears twice in one lease"));
      }
    }
  }
  ASSIGN_OR_RETURN(uint32_t ttl, CheckTtl(ttl_ms));
  LeaseRec rec;
  rec.keys.assign(keys.begin(), keys.end());
  rec.blocks.resize(keys.size());
  std::vector<size_t> promote;
  std::unique_lock<std::mutex> lock(mu_);
  auto fail = [&](absl::Status s) {
    for (const auto& k : rec.pinned) UnpinLocked(k);
    for (size_t i : promote) AbandonPromotionLocked(keys[i]);
    promo_cv_.notify_all();
    UpdateGauges();
    return s;
  };
  for (size_t i = 0; i < keys.size(); ++i) {
    const BlockKey& k = keys[i];
    auto it = entries_.find(k);
    while (it != entries_.end() && it->second.promoting) {
      promo_cv_.wait(lock);
      it = entries_.find(k);
    }
    LeasedBlock& b = rec.blocks[i];
    if (it == entries_.end() || it->second.state != Entry::State::kCommitted ||
        it->second.doomed) {
      Inc(m_.misses);
      b.code = absl::StatusCode::kNotFound;
      if (!partial) {
        return fail(absl::NotFoundError(absl::StrCat("unknown_block: ", k.ToString())));
      }
      continue;
    }
    Entry& e = it->second;
    if (e.model_fp != model) {
      Inc(m_.misses);
      b.code = absl::StatusCode::kFailedPrecondition;
      if (!partial) {
        return fail(absl::FailedPreconditionError(absl::StrCat(
            "model_mismatch: ", k.ToString(), " was stored for model ", e.model_fp.Hex(),
            ", request is for ", model.Hex())));
      }
      continue;
    }
    if (!e.in_memory) {
      // Marked first: eviction inside AllocateLocked never touches promoting entries.
      e.promoting = true;
      auto off = AllocateLocked(e.size);
      if (!off.ok()) {
        e.promoting = false;
        promo_cv_.notify_all();
        b.code = off.status().code();
        if (!partial) return fail(off.status());
        continue;
      }
      e.offset = *off;
      promote.push_back(i);
      b.tier = Tier::kDisk;
    } else {
      b.tier = Tier::kMemory;
      memory_policy_->Touch(k);
    }
    Entry& ep = entries_.at(k);
    if (ep.pins++ == 0) pinned_bytes_ += ep.size;
    rec.pinned.push_back(k);
    b.code = absl::StatusCode::kOk;
    b.offset = ep.offset;
    b.size = ep.size;
    b.checksum = ep.checksum;
  }
  if (!promote.empty()) {
    lock.unlock();
    std::vector<absl::Status> results(promote.size());
    for (size_t j = 0; j < promote.size(); ++j) {
      const LeasedBlock& b = rec.blocks[promote[j]];
      results[j] = ReadFromDisk(keys[promote[j]], b.offset, b.size, b.checksum);
    }
    lock.lock();
    bool failed = false;
    for (size_t j = 0; j < promote.size(); ++j) {
      const BlockKey& k = keys[promote[j]];
      LeasedBlock& b = rec.blocks[promote[j]];
      Entry& e = entries_.at(k);
      e.promoting = false;
      if (results[j].ok()) {
        e.in_memory = true;
        memory_policy_->Insert(k, e.size, e.cost);
        Inc(m_.promotions);
        continue;
      }
      // Corrupt (or unreadable) on disk: drop it everywhere, report a miss.
      Inc(m_.misses);
      Inc(m_.corrupt_disk);
      b = LeasedBlock{};
      b.code = absl::StatusCode::kNotFound;
      auto pin = std::find(rec.pinned.begin(), rec.pinned.end(), k);
      if (pin != rec.pinned.end()) rec.pinned.erase(pin);
      alloc_.Free(e.offset, e.size);
      if (--e.pins == 0) pinned_bytes_ -= e.size;
      e.doomed = true;
      if (e.pins == 0) RemoveEntryLocked(k);
      failed = true;
    }
    promote.clear();
    promo_cv_.notify_all();
    if (failed && !partial) {
      return fail(absl::NotFoundError(
          "unknown_block: a requested block failed verification on disk and was dropped"));
    }
  }
  LeaseGrant g;
  for (const auto& b : rec.blocks) {
    if (b.code != absl::StatusCode::kOk) continue;
    Inc(b.tier == Tier::kMemory ? m_.hits_memory : m_.hits_disk);
    Inc(m_.bytes_out, static_cast<double>(b.size));
  }
  if (!rec.pinned.empty()) {
    g.id = next_id_++;
    g.expires_unix_ms = UnixMs() + ttl;
    rec.deadline = Clock::now() + std::chrono::milliseconds(ttl);
    g.blocks = rec.blocks;
    leases_[g.id] = std::move(rec);
  } else {
    g.blocks = std::move(rec.blocks);
  }
  UpdateGauges();
  return g;
}

absl::StatusOr<uint64_t> CacheCore::RenewLease(uint64_t id, uint32_t ttl_ms) {
  ASSIGN_OR_RETURN(uint32_t ttl, CheckTtl(ttl_ms));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return UnknownId(id, "lease");
  it->second.deadline = Clock::now() + std::chrono::milliseconds(ttl);
  return UnixMs() + ttl;
}

absl::Status CacheCore::ReleaseLease(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return UnknownId(id, "lease");
  for (const auto& k : it->second.pinned) UnpinLocked(k);
  leases_.erase(it);
  UpdateGauges();
  return absl::OkStatus();
}

absl::StatusOr<std::string> CacheCore::Read(uint64_t id, uint32_t index) {
  LeasedBlock b;
  BlockKey key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) return UnknownId(id, "lease");
    if (index >= it->second.blocks.size()) {
      return absl::InvalidArgumentError(absl::StrCat("bad_index: lease ", id, " has ",
                                                     it->second.blocks.size(), " blocks"));
    }
    b = it->second.blocks[index];
    key = it->second.keys[index];
    if (b.code != absl::StatusCode::kOk) {
      return absl::NotFoundError(absl::StrCat("unknown_block: ", key.ToString()));
    }
  }
  // Pinned by the lease: the range stays valid without the lock.
  std::string out(reinterpret_cast<const char*>(arena_ + b.offset), b.size);
  if (KvBlockWireChecksum(KvBlockBytes(out)) != b.checksum) {
    std::lock_guard<std::mutex> lock(mu_);
    Inc(m_.corrupt_memory);
    DoomLocked(key);
    return absl::NotFoundError(absl::StrCat("unknown_block: ", key.ToString(),
                                            " failed verification in memory and was dropped"));
  }
  return out;
}

absl::StatusOr<uint32_t> CacheCore::CheckTtl(uint32_t ttl_ms) const {
  if (ttl_ms == 0) return opt_.default_lease_ms;
  if (ttl_ms > opt_.max_lease_ms) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad_ttl: ttl_ms ", ttl_ms, " above max_lease_ms ", opt_.max_lease_ms));
  }
  return ttl_ms;
}

void CacheCore::AbandonPromotionLocked(const BlockKey& k) {
  auto it = entries_.find(k);
  if (it == entries_.end() || !it->second.promoting) return;
  alloc_.Free(it->second.offset, it->second.size);
  it->second.promoting = false;
  if (it->second.pins == 0 && it->second.doomed) RemoveEntryLocked(k);
}

}  // namespace sparsex::cache::internal

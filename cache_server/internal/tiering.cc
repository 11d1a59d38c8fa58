// The tiers and the background work: opening the disk tier (rebuilding the index from it) and
// shutting down (write-back flush), arena allocation with memory eviction and spill, disk
// capacity, verified disk reads, the post-restart warm loader, the sweeper that reclaims
// expired reservations and leases, and the disk tier's health.
//
// Disk health: before each disk write the free space of the disk's filesystem is
// checked against disk_reserve_bytes; a write that would go below it, or a write that fails,
// degrades the disk tier: nothing more is written to it, commits keep their blocks in memory
// only (and succeed), evicting such a block drops it, deletes are queued (a delete writes to
// RocksDB too, and the disk may be full to the last byte; a failed one is queued as well). The
// sweeper re-checks every disk_recheck_ms; once the free space is back above the reserve
// (+1/8) and the store is writable again (DiskStore::Recover), the queued deletes run and the
// tier is written again. Blocks committed while degraded reach the disk when they are
// evicted (spill) or at a clean shutdown.
#include <algorithm>
#include <cstdio>

#include "cache_server/internal/block_index.h"
#include "common/kv_block.h"

namespace sparsex::cache::internal {

absl::Status CacheCore::Init(metrics::Registry* reg) {
  RegisterMetrics(reg);
  DiskStoreOptions dso;
  dso.backend = opt_.disk_backend;
  dso.path = opt_.disk_path;
  dso.sync = opt_.sync_writes;
  // RocksDB must never meet a full disk itself (a failed WAL append is fatal to it, see
  // rocksdb_store.cc): the reserve has a floor, and the memtable (so the WAL between flushes,
  // and what one flush writes) stays a quarter of it.
  opt_.disk_reserve_bytes = std::max(opt_.disk_reserve_bytes, kMinDiskReserveBytes);
  dso.write_buffer_bytes =
      std::clamp<uint64_t>(opt_.disk_reserve_bytes / 4, uint64_t{1} << 20, uint64_t{128} << 20);
  dso.reserve_bytes = opt_.disk_reserve_bytes;
  ASSIGN_OR_RETURN(disk_, OpenDiskStore(dso));
  if (disk_ && disk_->read_only()) {
    DegradeDisk("disk_full: the disk tier was too full to open for writing; serving its blocks "
                "read-only");
  }
  if (disk_) {
    std::vector<std::pair<uint64_t, BlockKey>> order;
    std::vector<BlockKey> stale;
    RETURN_IF_ERROR(disk_->ForEachMeta([&](const BlockKey& k, const DiskMeta& m) {
      if (m.layout_version != opt_.layout_version || !ValidateBlockKey(k).ok() ||
          m.size == 0) {
        stale.push_back(k);
        return;
      }
      Entry e;
      e.state = Entry::State::kCommitted;
      e.model_fp = m.model_fp;
      e.layout_version = m.layout_version;
      e.size = m.size;
      e.checksum = m.checksum;
      e.cost = m.cost;
      e.on_disk = true;
      e.commit_unix_ms = m.commit_unix_ms;
      entries_[k] = e;
      disk_used_ += m.size;
      order.emplace_back(m.commit_unix_ms, k);
    }));
    for (const auto& k : stale) DeleteFromDiskLocked(k);
    std::sort(order.begin(), order.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [t, k] : order) disk_policy_->Insert(k, entries_[k].size, 1);
    warm_order_.reserve(order.size());
    for (auto it = order.rbegin(); it != order.rend(); ++it) warm_order_.push_back(it->second);
  }
  UpdateGauges();
  sweeper_ = std::thread([this] { SweepLoop(); });
  warm_ = std::thread([this] { WarmLoad(); });
  return absl::OkStatus();
}

CacheCore::~CacheCore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  if (warm_.joinable()) warm_.join();
  // Write-back mode, and blocks committed while the disk tier was degraded: persist what is
  // only in memory, as long as the disk takes it.
  if (disk_) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [k, e] : entries_) {
      if (e.state == Entry::State::kCommitted && e.in_memory && !e.on_disk && !e.doomed) {
        if (!DiskWritable(e.size)) break;
        absl::Status s = disk_->Put(k, MetaOf(e), {arena_ + e.offset, e.size});
        DiskWriteDone(e.size);
        if (!s.ok()) {
          DegradeDisk(std::string(s.message()), e.size);
          break;
        }
      }
    }
  }
}

// Allocates arena space, evicting unpinned memory copies in policy order as needed.
absl::StatusOr<uint64_t> CacheCore::AllocateLocked(uint64_t size) {
  for (;;) {
    if (auto off = alloc_.Allocate(size)) return *off;
    bool evicted = false;
    const uint64_t need = alloc_.Rounded(size);
    memory_policy_->ForEachCandidate([&](const BlockKey& k) {
      auto it = entries_.find(k);
      if (it == entries_.end()) return false;
      Entry& e = it->second;
      if (e.pins > 0 || e.promoting || e.state != Entry::State::kCommitted || !e.in_memory) {
        return false;
      }
      EvictFromMemoryLocked(k);
      evicted = true;
      return alloc_.largest_free() >= need;
    });
    if (!evicted) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "out_of_capacity: no room for ", size, " bytes: ", alloc_.used(), " of ",
          alloc_.capacity(), " bytes in use, the rest is leased or being written"));
    }
  }
}

// Drops the memory copy of a committed, unpinned block; spills it first when it is not on
// disk yet (write-back), or forgets it when there is no disk tier.
void CacheCore::EvictFromMemoryLocked(const BlockKey& k) {
  Entry& e = entries_.at(k);
  if (!e.on_disk && disk_ && DiskWritable(e.size)) {
    auto t0 = Clock::now();
    DiskMeta meta = MetaOf(e);
    absl::Status s = disk_->Put(k, meta, {arena_ + e.offset, e.size});
    DiskWriteDone(e.size);
    Observe(m_.disk_write_seconds, t0);
    if (s.ok()) {
      e.on_disk = true;
      disk_used_ += e.size;
      disk_policy_->Insert(k, e.size, 1);
      Inc(m_.spills);
    } else {
      DegradeDisk(std::string(s.message()), e.size);
    }
  }
  Inc(m_.evictions_memory);
  memory_policy_->Erase(k, /*evicted=*/true);
  alloc_.Free(e.offset, e.size);
  e.in_memory = false;
  if (!e.on_disk) {
    entries_.erase(k);
  } else {
    EnforceDiskCapacityLocked();
  }
}

void CacheCore::EnforceDiskCapacityLocked() {
  if (opt_.disk_capacity_bytes == 0 || !disk_) return;
  while (disk_used_ > opt_.disk_capacity_bytes) {
    bool removed = false;
    disk_policy_->ForEachCandidate([&](const BlockKey& k) {
      auto it = entries_.find(k);
      if (it == entries_.end()) return false;
      Entry& e = it->second;
      if (e.pins > 0 || e.promoting || !e.on_disk) return false;
      DeleteFromDiskLocked(k);
      disk_policy_->Erase(k, true);
      disk_used_ -= e.size;
      e.on_disk = false;
      Inc(m_.evictions_disk);
      if (!e.in_memory) entries_.erase(it);
      removed = true;
      return true;
    });
    if (!removed) return;
  }
}

absl::Status CacheCore::ReadFromDisk(const BlockKey& k, uint64_t offset, uint64_t size,
                                     uint64_t checksum) {
  auto t0 = Clock::now();
  std::span<uint8_t> dst(arena_ + offset, size);
  absl::Status s = disk_ ? disk_->Read(k, dst) : absl::NotFoundError("no disk tier");
  Observe(m_.disk_read_seconds, t0);
  if (!s.ok()) return s;
  if (KvBlockWireChecksum(dst) != checksum) {
    return absl::DataLossError("checksum mismatch on disk read");
  }
  auto v = VerifyKvBlock(dst);
  if (!v.ok()) return v.status();
  if (v->header.segment_fp != k.segment || v->header.layer_begin != k.layer_begin ||
      v->header.layer_end != k.layer_end) {
    return absl::DataLossError("disk block header does not match its key");
  }
  return absl::OkStatus();
}

// After a restart: bring the most recently committed disk blocks back into free memory.
void CacheCore::WarmLoad() {
  uint64_t budget = std::min(opt_.warm_load_bytes, alloc_.capacity());
  for (const BlockKey& k : warm_order_) {
    uint64_t off = 0, size = 0, checksum = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      auto it = entries_.find(k);
      if (it == entries_.end()) continue;
      Entry& e = it->second;
      if (e.in_memory || e.promoting || e.doomed || e.state != Entry::State::kCommitted) {
        continue;
      }
      if (e.size > budget) continue;
      auto o = alloc_.Allocate(e.size);  // never evicts
      if (!o) break;
      e.promoting = true;
      e.offset = *o;
      off = *o;
      size = e.size;
      checksum = e.checksum;
      budget -= size;
    }
    absl::Status s = ReadFromDisk(k, off, size, checksum);
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_.at(k);
    e.promoting = false;
    if (s.ok()) {
      e.in_memory = true;
      memory_policy_->Insert(k, e.size, e.cost);
    } else {
      Inc(m_.corrupt_disk);
      alloc_.Free(e.offset, e.size);
      e.doomed = true;
      if (e.pins == 0) RemoveEntryLocked(k);
    }
    promo_cv_.notify_all();
    UpdateGauges();
  }
  warm_order_.clear();
  warm_done_.store(true);
}

void CacheCore::Sweep() {
  std::lock_guard<std::mutex> lock(mu_);
  SweepLocked();
}

void CacheCore::SweepLocked() {
  const auto now = Clock::now();
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    auto cur = it++;
    if (cur->second.deadline <= now && !cur->second.committing) {
      RememberExpired(cur->first);
      Inc(m_.reclaimed);
      DropReservationLocked(cur);
    }
  }
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto cur = it++;
    if (cur->second.deadline <= now) {
      for (const auto& k : cur->second.pinned) UnpinLocked(k);
      RememberExpired(cur->first);
      Inc(m_.leases_expired);
      leases_.erase(cur);
    }
  }
  UpdateGauges();
}

void CacheCore::SweepLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    stop_cv_.wait_for(lock,
                      std::chrono::milliseconds(std::max<uint32_t>(1, opt_.sweep_interval_ms)));
    if (stop_) break;
    SweepLocked();
    if (disk_ && disk_degraded_.load() && Clock::now() >= next_disk_check_) {
      next_disk_check_ =
          Clock::now() + std::chrono::milliseconds(std::max<uint32_t>(1, opt_.disk_recheck_ms));
      lock.unlock();  // statvfs, RocksDB recovery and deletes: not under mu_
      RecheckDisk();
      lock.lock();
    }
  }
}

bool CacheCore::DiskWritable(uint64_t bytes) {
  if (!disk_ || disk_degraded_.load()) return false;
  auto free = disk_->FreeBytes();
  if (free.ok() && *free != UINT64_MAX) Set(m_.disk_free_bytes, static_cast<double>(*free));
  // Admitted writes in flight are not in the free space yet: count them as used.
  const uint64_t inflight = disk_inflight_.fetch_add(bytes) + bytes;
  if (!free.ok()) return true;  // cannot tell: let the write itself decide
  if (*free < opt_.disk_reserve_bytes || *free - opt_.disk_reserve_bytes < inflight) {
    disk_inflight_.fetch_sub(bytes);
    DegradeDisk(absl::StrCat("disk_full: ", *free, " bytes free on the disk tier's filesystem, ",
                             inflight, " to write, ", opt_.disk_reserve_bytes,
                             " kept in reserve"),
                bytes);
    return false;
  }
  return true;
}

void CacheCore::DegradeDisk(const std::string& why, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(disk_mu_);
  disk_status_ = why;
  disk_refused_bytes_ = std::max(disk_refused_bytes_, bytes);
  if (disk_degraded_.exchange(true)) return;
  Set(m_.disk_degraded, 1);
  Inc(m_.disk_degradations);
  std::fprintf(stderr, "sparsex-cache-server: disk tier degraded to memory-only: %s\n",
               why.c_str());
}

void CacheCore::DeleteFromDiskLocked(const BlockKey& k) {
  if (!disk_) return;
  // While degraded the disk may be full to the last byte (another process took the reserve).
  // A delete appends to RocksDB's WAL too, and a failed WAL append is fatal to this RocksDB
  // (rocksdb_store.cc): queue it, RecheckDisk runs it before the disk is written again.
  if (disk_degraded_.load()) {
    if (pending_deletes_.size() < 100000) pending_deletes_.push_back(k);
    return;
  }
  absl::Status s = disk_->Delete(k);
  if (s.ok()) return;
  // Bounded: a delete that is lost leaves a valid block on disk, which at worst comes back
  // after a restart (and is verified when read).
  if (pending_deletes_.size() < 100000) pending_deletes_.push_back(k);
  DegradeDisk(std::string(s.message()));
}

DiskHealth CacheCore::disk_health() const {
  std::lock_guard<std::mutex> lock(disk_mu_);
  DiskHealth h;
  h.degraded = disk_degraded_.load();
  if (h.degraded) h.status = disk_status_;
  return h;
}

void CacheCore::RecheckDisk() {
  if (!disk_ || !disk_degraded_.load()) return;
  auto free = disk_->FreeBytes();
  if (!free.ok()) return;
  if (*free != UINT64_MAX) Set(m_.disk_free_bytes, static_cast<double>(*free));
  // Room for the reserve, 1/8 more (no flapping at the edge) and the largest write refused.
  uint64_t want = 0;
  {
    std::lock_guard<std::mutex> lock(disk_mu_);
    want = opt_.disk_reserve_bytes + opt_.disk_reserve_bytes / 8 + disk_refused_bytes_;
  }
  if (*free < want) {
    std::lock_guard<std::mutex> lock(disk_mu_);
    disk_status_ = absl::StrCat("disk_full: ", *free,
                                " bytes free on the disk tier's filesystem, waiting for ", want);
    return;
  }
  if (absl::Status s = disk_->Recover(); !s.ok()) {
    std::lock_guard<std::mutex> lock(disk_mu_);
    disk_status_ = absl::StrCat("disk_recovering: ", s.message());
    return;
  }
  for (;;) {
    std::vector<BlockKey> deletes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_deletes_.empty()) {
        // Under mu_, so that no delete is queued after this (DeleteFromDiskLocked queues while
        // degraded): it would wait for the next recovery and could then delete a newer copy.
        std::lock_guard<std::mutex> dl(disk_mu_);
        disk_status_.clear();
        disk_refused_bytes_ = 0;
        disk_degraded_.store(false);
        Set(m_.disk_degraded, 0);
        break;
      }
      deletes.swap(pending_deletes_);
    }
    for (size_t i = 0; i < deletes.size(); ++i) {
      if (absl::Status s = disk_->Delete(deletes[i]); !s.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          pending_deletes_.insert(pending_deletes_.end(), deletes.begin() + i, deletes.end());
        }
        std::lock_guard<std::mutex> lock(disk_mu_);
        disk_status_ = absl::StrCat("disk_recovering: ", s.message());
        return;
      }
    }
  }
  std::fprintf(stderr, "sparsex-cache-server: disk tier writable again (%llu bytes free)\n",
               static_cast<unsigned long long>(*free));
}

}  // namespace sparsex::cache::internal

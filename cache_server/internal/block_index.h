// The state behind BlockCache (cache_server/block_cache.h), internal to cache_server/: the index
// of blocks (entries and their state machine), the reservation and lease tables, the two tiers
// the blocks live in, the background threads, and the one mutex that guards all of it.
// BlockCache is a facade over CacheCore; nothing outside cache_server/ includes this.
//
// Why one class whose members are defined per lifecycle in separate files, rather than a class
// per lifecycle: every operation runs under the one mu_ and, inside that critical section,
// moves the other lifecycles' state (Reserve and a promoting Lease evict other blocks through
// AllocateLocked; a failed promotion or a corrupt Read dooms entries other leases may pin; the
// sweeper drops reservations and unpins leases). Classes per lifecycle would each need all the
// others' state (or locks of their own, which would change behaviour). So the state and the
// declarations stay here, and the definitions are cut by lifecycle:
//   block_index.cc    construction; entries and their transitions (Visible, DoomLocked,
//                     UnpinLocked, RemoveEntryLocked); ids and request checks; Lookup, Evict
//   reservations.cc   Reserve / Commit / Abort, commit-time block verification
//   leases.cc         Lease (with disk -> memory promotion), RenewLease, ReleaseLease, Read
//   tiering.cc        opening the disk tier (index rebuild) and shutdown (write-back flush);
//                     arena allocation with memory eviction and spill; disk capacity; disk
//                     reads; the warm loader and the sweeper threads; the disk tier's health
//                     (degraded to memory-only when full or failing, and back)
//   cache_metrics.cc  metric registration, gauges, Stats (CacheMetrics: cache_metrics.h)
//
// Entry state machine (BlockKey -> Entry in entries_):
//   absent --Reserve--> kReserved --Commit ok--> kCommitted
//   kReserved --Commit failed / Abort / reclaimed by the sweeper--> absent
//   kCommitted: in_memory and/or on_disk; `promoting` while a disk -> memory copy is in flight;
//   `doomed` (Evict, corruption) makes it invisible at once; it is removed then if unpinned and
//   not promoting, else on the last unpin (or when the promotion ends).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "cache_client/block_key.h"
#include "cache_client/types.h"
#include "cache_server/arena_allocator.h"
#include "cache_server/block_cache.h"
#include "cache_server/disk_store.h"
#include "cache_server/eviction.h"
#include "cache_server/internal/cache_metrics.h"
#include "cache_server/options.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex::metrics {
class Registry;
}

namespace sparsex::cache::internal {

using Clock = std::chrono::steady_clock;

inline uint64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Entry {
  enum class State : uint8_t { kReserved, kCommitted };
  State state = State::kReserved;
  Hash128 model_fp;
  uint32_t layout_version = 0;
  uint64_t size = 0;
  uint64_t checksum = 0;
  double cost = 0;
  bool in_memory = false;  // arena bytes at `offset` are valid (or being written: reserved)
  uint64_t offset = 0;
  bool on_disk = false;
  bool promoting = false;  // disk -> memory copy in flight (arena range allocated)
  bool doomed = false;     // evicted while pinned: invisible, removed on the last unpin
  uint32_t pins = 0;
  uint64_t commit_unix_ms = 0;
};

struct ReservationRec {
  BlockKey key;
  Clock::time_point deadline;
  bool committing = false;
  std::string client;  // who reserved (its quota), "" for in-process callers
  uint64_t size = 0;
};

struct LeaseRec {
  std::vector<BlockKey> pinned;     // one entry per pin taken
  std::vector<BlockKey> keys;       // request order (for Read)
  std::vector<LeasedBlock> blocks;  // request order
  Clock::time_point deadline;
};

class CacheCore {
 public:
  CacheCore(const CacheOptions& o, uint8_t* arena, uint64_t arena_bytes);
  // Stops the threads; in write-back mode writes memory-only blocks to disk (tiering.cc).
  ~CacheCore();

  // Opens the disk tier, rebuilds the index from it, starts the sweeper and the warm loader.
  absl::Status Init(metrics::Registry* reg);

  // The operations behind BlockCache's methods of the same names (contracts: block_cache.h).
  // block_index.cc
  absl::StatusOr<std::vector<LookupEntry>> Lookup(const Hash128& model, uint32_t layout,
                                                  std::span<const BlockKey> keys);
  absl::StatusOr<uint32_t> Evict(std::span<const BlockKey> keys, bool all, bool corrupt);
  // reservations.cc
  absl::StatusOr<Reservation> Reserve(const Hash128& model, uint32_t layout,
                                      const BlockKey& key, uint64_t size, double cost,
                                      const std::string& client);
  // A reservation's bytes leave its client's quota (mu_ held).
  void ReleaseQuotaLocked(const ReservationRec& r);
  absl::Status Commit(uint64_t id, uint64_t checksum, std::span<const uint8_t> inline_data,
                      bool has_inline);
  absl::Status Abort(uint64_t id);
  // leases.cc
  absl::StatusOr<LeaseGrant> Lease(const Hash128& model, uint32_t layout,
                                   std::span<const BlockKey> keys, uint32_t ttl_ms,
                                   bool partial);
  absl::StatusOr<uint64_t> RenewLease(uint64_t id, uint32_t ttl_ms);
  absl::Status ReleaseLease(uint64_t id);
  absl::StatusOr<std::string> Read(uint64_t id, uint32_t index);
  // tiering.cc
  void Sweep();
  bool WarmLoadDone() const { return warm_done_.load(); }
  DiskHealth disk_health() const;
  void RecheckDisk();
  // cache_metrics.cc
  CacheStats Stats() const;

 private:
  // ---- block_index.cc: the index. *Locked: mu_ held.
  absl::Status CheckLayout(uint32_t layout) const;
  static absl::Status CheckKeys(std::span<const BlockKey> keys);
  absl::Status UnknownId(uint64_t id, const char* what) const;
  void RememberExpired(uint64_t id);
  const Entry* Visible(const BlockKey& k) const;
  static DiskMeta MetaOf(const Entry& e);
  void RemoveEntryLocked(const BlockKey& k);
  bool DoomLocked(const BlockKey& k);
  void UnpinLocked(const BlockKey& k);

  // ---- reservations.cc
  absl::Status CheckBlock(const BlockKey& key, const Entry& e, std::span<const uint8_t> bytes,
                          double* cost) const;
  void DropReservationLocked(absl::flat_hash_map<uint64_t, ReservationRec>::iterator r);

  // ---- leases.cc
  absl::StatusOr<uint32_t> CheckTtl(uint32_t ttl_ms) const;
  void AbandonPromotionLocked(const BlockKey& k);

  // ---- tiering.cc
  absl::StatusOr<uint64_t> AllocateLocked(uint64_t size);
  void EvictFromMemoryLocked(const BlockKey& k);
  void EnforceDiskCapacityLocked();
  absl::Status ReadFromDisk(const BlockKey& k, uint64_t offset, uint64_t size,
                            uint64_t checksum);
  // Disk health. DiskWritable: whether a write of `bytes` may go to disk now (not degraded,
  // and the filesystem keeps disk_reserve_bytes free after it and the other writes in
  // flight); degrades when it would not. When true, the write counts as in flight until
  // DiskWriteDone. Neither takes mu_ (Commit writes outside it, a spill inside it).
  bool DiskWritable(uint64_t bytes);
  void DiskWriteDone(uint64_t bytes) { disk_inflight_.fetch_sub(bytes); }
  // `bytes`: the write that did not go to disk (recovery waits for room for it too).
  void DegradeDisk(const std::string& why, uint64_t bytes = 0);
  // Deletes from the disk tier; a delete that fails (store not writable) is retried when the
  // disk recovers.
  void DeleteFromDiskLocked(const BlockKey& k);
  void WarmLoad();
  void SweepLocked();
  void SweepLoop();

  // ---- cache_metrics.cc
  void RegisterMetrics(metrics::Registry* reg);
  void UpdateGauges();

  CacheOptions opt_;
  uint8_t* arena_;
  CacheMetrics m_;

  mutable std::mutex mu_;
  std::condition_variable promo_cv_, stop_cv_;
  bool stop_ = false;
  ArenaAllocator alloc_;
  std::unique_ptr<EvictionPolicy> memory_policy_;  // committed blocks in memory
  std::unique_ptr<EvictionPolicy> disk_policy_;    // blocks on disk (LRU by commit)
  std::unique_ptr<DiskStore> disk_;
  uint64_t disk_used_ = 0;
  uint64_t pinned_bytes_ = 0;  // bytes of entries with pins > 0
  std::unordered_map<BlockKey, Entry, absl::Hash<BlockKey>> entries_;
  absl::flat_hash_map<uint64_t, ReservationRec> reservations_;
  absl::flat_hash_map<std::string, uint64_t> reserved_by_client_;  // uncommitted bytes
  absl::flat_hash_map<uint64_t, LeaseRec> leases_;
  absl::flat_hash_set<uint64_t> expired_set_;
  std::deque<uint64_t> expired_fifo_;
  uint64_t next_id_ = 1;
  std::vector<BlockKey> warm_order_;  // most recent first
  std::atomic<bool> warm_done_{false};
  // Disk tier health: degraded = not written (full below the reserve, or failing).
  std::atomic<bool> disk_degraded_{false};
  mutable std::mutex disk_mu_;  // guards disk_status_; taken after mu_, never before it
  std::string disk_status_;
  uint64_t disk_refused_bytes_ = 0;  // largest write refused while degraded (disk_mu_)
  std::atomic<uint64_t> disk_inflight_{0};  // bytes admitted by DiskWritable, not yet written
  Clock::time_point next_disk_check_{};
  std::vector<BlockKey> pending_deletes_;  // under mu_
  std::thread sweeper_, warm_;
};

}  // namespace sparsex::cache::internal

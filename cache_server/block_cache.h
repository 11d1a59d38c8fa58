// The tiered block store behind the cache server's RPCs, without any RPC or transport code:
// a capacity-bounded host-memory arena in front of a DiskStore (RocksDB).
//
// Life of a block:
//   Reserve -> (bytes written into the arena by the data plane, or inline) -> Commit: checksum
//   and KV block header verified, written to disk (write-through), then visible. A reservation
//   not committed within reservation_timeout_ms is reclaimed by the sweeper.
//   Lease pins blocks (promoting disk-only blocks into memory first, verifying them); pinned
//   blocks are never evicted; ReleaseLease or lease expiry unpins.
//   Memory eviction (LRU or cost-aware) drops the memory copy (spilling to disk first in
//   write-back mode); a disk block failing its checksum is reported as a miss, dropped and
//   counted in sparsex_cache_corrupt_blocks_total.
//   Disk full or failing: the disk tier is degraded, commits are kept in memory only (they
//   still succeed) until the disk has room again (CacheOptions::disk_reserve_bytes).
//
//   ASSIGN_OR_RETURN(auto cache, BlockCache::Open(opts, arena, arena_bytes, &registry));
//   ASSIGN_OR_RETURN(Reservation r, cache->Reserve(model, kKvLayoutVersion, key, size, 0));
//   memcpy(arena + r.offset, block, size);
//   RETURN_IF_ERROR(cache->Commit(r.id, KvBlockWireChecksum(block), {}, false));
//   ASSIGN_OR_RETURN(LeaseGrant g, cache->Lease(model, kKvLayoutVersion, keys, 0, true));
//   ... read arena + g.blocks[i].offset ...
//   RETURN_IF_ERROR(cache->ReleaseLease(g.id));
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_client/block_key.h"
#include "cache_client/types.h"
#include "cache_server/options.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex::metrics {
class Registry;
}

namespace sparsex::cache {

struct LeasedBlock {
  absl::StatusCode code = absl::StatusCode::kNotFound;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t checksum = 0;
  Tier tier = Tier::kNone;  // where it was found
};

// State of the disk tier (Health.disk_degraded / disk_status).
struct DiskHealth {
  bool degraded = false;  // not written: commits stay in memory only
  std::string status;     // why ("" when not degraded)
};

struct LeaseGrant {
  uint64_t id = 0;  // 0 when nothing was leased (partial request, all absent)
  uint64_t expires_unix_ms = 0;
  std::vector<LeasedBlock> blocks;
};

class BlockCache {
 public:
  // `arena` (arena_bytes long) must outlive the cache; `registry` may be null. Opens the disk
  // tier, rebuilds the index from it and starts the sweeper and the warm loader.
  static absl::StatusOr<std::unique_ptr<BlockCache>> Open(const CacheOptions& options,
                                                          uint8_t* arena, uint64_t arena_bytes,
                                                          metrics::Registry* registry);
  // Stops background work; in write-back mode writes memory-only blocks to disk.
  ~BlockCache();

  // FAILED_PRECONDITION when layout_version differs from the server's. Per key: kOk,
  // kNotFound, or kFailedPrecondition (present for another model).
  absl::StatusOr<std::vector<LookupEntry>> Lookup(const Hash128& model_fp,
                                                  uint32_t layout_version,
                                                  std::span<const BlockKey> keys);

  // client: who reserves, for the per-client quota (ServerOptions' max_client_reserved_bytes);
  // "" (in-process callers) has none.
  absl::StatusOr<Reservation> Reserve(const Hash128& model_fp, uint32_t layout_version,
                                      const BlockKey& key, uint64_t size, double cost,
                                      const std::string& client = "");
  // `inline_data` replaces a data-plane write when `has_inline`.
  absl::Status Commit(uint64_t reservation_id, uint64_t checksum,
                      std::span<const uint8_t> inline_data, bool has_inline);
  absl::Status Abort(uint64_t reservation_id);

  // ttl_ms 0: default. Blocks are returned in request order.
  absl::StatusOr<LeaseGrant> Lease(const Hash128& model_fp, uint32_t layout_version,
                                   std::span<const BlockKey> keys, uint32_t ttl_ms,
                                   bool partial);
  // New expiry (unix ms). ABORTED "lease_expired" / NOT_FOUND.
  absl::StatusOr<uint64_t> RenewLease(uint64_t lease_id, uint32_t ttl_ms);
  absl::Status ReleaseLease(uint64_t lease_id);
  // Copy of leased block `index`, verified (a corrupt block is dropped: NOT_FOUND).
  absl::StatusOr<std::string> Read(uint64_t lease_id, uint32_t index);

  // Removes blocks from every tier; leased ones become invisible at once and go when
  // released. NOT_FOUND if keys were given and none exists.
  // `corrupt`: the caller found them corrupt. A hint, not an order: each block's memory copy
  // is verified here (XXH3 against the commit checksum) and only a block that fails is
  // dropped and counted as corrupt; one that verifies stays (the damage was on the caller's
  // side or on the way), and so does a block no longer in memory (every disk read is
  // verified anyway). Returns the number dropped.
  absl::StatusOr<uint32_t> Evict(std::span<const BlockKey> keys, bool all, bool corrupt);

  CacheStats Stats() const;
  DiskHealth disk_health() const;
  // Checks now whether a degraded disk tier can be written again (the sweeper does this every
  // disk_recheck_ms).
  void RecheckDisk();
  // Reclaims expired reservations and leases now (the sweeper does this periodically).
  void Sweep();
  // True once the post-restart warm load has finished.
  bool WarmLoadDone() const;

  class Impl;

 private:
  explicit BlockCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsex::cache

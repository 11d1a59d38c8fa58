// Plain types shared by the cache client and the cache server (the server's store fills them,
// the client hands them to callers): where a block lives, lookup results, reservations, stats.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace sparsex::cache {

enum class Tier { kNone = 0, kMemory = 1, kDisk = 2 };
const char* TierName(Tier t);

struct LookupEntry {
  absl::StatusCode code = absl::StatusCode::kNotFound;  // kOk when present
  Tier tier = Tier::kNone;
  uint64_t size = 0;
  uint32_t layout_version = 0;
};

struct Reservation {
  uint64_t id = 0;
  uint64_t offset = 0;
  uint64_t deadline_unix_ms = 0;
};

struct CacheStats {
  uint64_t memory_capacity_bytes = 0, memory_used_bytes = 0, memory_blocks = 0;
  uint64_t disk_used_bytes = 0, disk_blocks = 0;
  uint64_t hits_memory = 0, hits_disk = 0, misses = 0;
  uint64_t evictions = 0, corrupt_blocks = 0;
  uint64_t active_leases = 0, active_reservations = 0, reclaimed_reservations = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
};

}  // namespace sparsex::cache

// Plain types shared by the cache client and the cache server (the server's store fills them,
// the client hands them to callers): where a block lives, lookup results, reservations, stats.
#pragma once

#include <cstdint>
#include <string>

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
  // Server incarnation whose arena `offset` refers to (0: unknown / not reported).
  uint64_t instance_id = 0;
};

struct CacheStats {
  uint64_t memory_capacity_bytes = 0, memory_used_bytes = 0, memory_blocks = 0;
  uint64_t disk_used_bytes = 0, disk_blocks = 0;
  uint64_t hits_memory = 0, hits_disk = 0, misses = 0;
  uint64_t evictions = 0, corrupt_blocks = 0;
  uint64_t active_leases = 0, active_reservations = 0, reclaimed_reservations = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  // Disk tier not written (full below its reserve, or failing): commits stay in memory only.
  bool disk_degraded = false;
  uint64_t memory_only_commits = 0;      // commits kept in memory only while degraded
  uint64_t corrupt_reports_refuted = 0;  // client corruption reports whose block verified
};

// What Health reports about one server (CacheClient::GetHealth).
struct ServerHealth {
  bool serving = false;
  std::string server_id;
  uint64_t uptime_ms = 0;
  uint64_t instance_id = 0;  // changes on every restart of the server process
  bool disk_degraded = false;
  std::string disk_status;  // why the disk tier is degraded ("" when it is not)
};

}  // namespace sparsex::cache

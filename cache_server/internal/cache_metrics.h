// The Prometheus metrics of the block cache (sparsex_cache_*), internal to cache_server/: the
// handles CacheCore updates, and null-safe helpers so the cache also runs without a registry
// (every handle stays null then). Registration, the gauges and Stats are CacheCore members
// defined in cache_metrics.cc, next to the metric names and help texts.
#pragma once

#include <chrono>

#include "common/metrics/metrics.h"

namespace sparsex::cache::internal {

struct CacheMetrics {
  metrics::Counter* hits_memory = nullptr;
  metrics::Counter* hits_disk = nullptr;
  metrics::Counter* misses = nullptr;
  metrics::Counter* lookups_memory = nullptr;
  metrics::Counter* lookups_disk = nullptr;
  metrics::Counter* lookups_miss = nullptr;
  metrics::Counter* bytes_in = nullptr;
  metrics::Counter* bytes_out = nullptr;
  metrics::Counter* evictions_memory = nullptr;
  metrics::Counter* evictions_disk = nullptr;
  metrics::Counter* spills = nullptr;
  metrics::Counter* promotions = nullptr;
  metrics::Counter* corrupt_memory = nullptr;
  metrics::Counter* corrupt_disk = nullptr;
  metrics::Counter* reclaimed = nullptr;
  metrics::Counter* leases_expired = nullptr;
  metrics::Counter* commits_ok = nullptr;
  metrics::Counter* commits_failed = nullptr;
  metrics::Gauge* capacity_memory = nullptr;
  metrics::Gauge* capacity_disk = nullptr;
  metrics::Gauge* used_memory = nullptr;
  metrics::Gauge* used_disk = nullptr;
  metrics::Gauge* blocks_memory = nullptr;
  metrics::Gauge* blocks_disk = nullptr;
  metrics::Gauge* leases = nullptr;
  metrics::Gauge* reservations = nullptr;
  metrics::Gauge* pinned_bytes = nullptr;
  metrics::Gauge* disk_degraded = nullptr;
  metrics::Gauge* disk_free_bytes = nullptr;
  metrics::Counter* memory_only_commits = nullptr;
  metrics::Counter* disk_degradations = nullptr;
  metrics::Counter* corrupt_reports_confirmed = nullptr;
  metrics::Counter* corrupt_reports_refuted = nullptr;
  metrics::Histogram* disk_read_seconds = nullptr;
  metrics::Histogram* disk_write_seconds = nullptr;
};

inline void Inc(metrics::Counter* c, double v = 1) {
  if (c != nullptr) c->Inc(v);
}
inline void Set(metrics::Gauge* g, double v) {
  if (g != nullptr) g->Set(v);
}
inline void Observe(metrics::Histogram* h, std::chrono::steady_clock::time_point since) {
  if (h != nullptr) {
    h->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count());
  }
}

}  // namespace sparsex::cache::internal

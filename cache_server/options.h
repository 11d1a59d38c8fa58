// Options of the cache server, as plain structs. Every field documents its default; the
// sparsex-cache-server binary exposes each as a --flag of the same name (see docs/cache_server.md).
#pragma once

#include <cstdint>
#include <string>

#include "cache_client/transport.h"
#include "common/fingerprint.h"
#include "proto/grpc_tls.h"

namespace sparsex::cache {

enum class EvictionPolicyKind {
  kLru,        // least recently used first
  kCostAware,  // GreedyDual-Size: evict the lowest (inflation + recompute cost / bytes) first
};

// Smallest CacheOptions::disk_reserve_bytes: room for RocksDB's smallest memtable (1 MiB)
// four times over.
inline constexpr uint64_t kMinDiskReserveBytes = 4ull << 20;

struct CacheOptions {
  // Bytes of the host-memory arena (registered with the data plane; pinned on GPU hosts).
  // Default: 1 GiB.
  uint64_t memory_capacity_bytes = 1ull << 30;
  // Largest encoded block a put may reserve; larger puts get INVALID_ARGUMENT "oversized".
  // Clamped to memory_capacity_bytes. Default: 256 MiB.
  uint64_t max_block_bytes = 256ull << 20;
  // Allocation granularity of the arena. Default: 256.
  uint64_t arena_alignment = 256;
  // Memory-tier eviction order. Default: kLru.
  EvictionPolicyKind eviction = EvictionPolicyKind::kLru;

  // Disk tier backend: "rocksdb", "memory" (a process-local map, for tests) or "none".
  // Default: "rocksdb" ("none" in a build without RocksDB).
  std::string disk_backend = SPARSEX_WITH_ROCKSDB ? "rocksdb" : "none";
  // Directory of the RocksDB database (created if missing). Required for "rocksdb".
  // Default: "" (error).
  std::string disk_path;
  // Disk bytes kept before the least recently used disk blocks are dropped; 0 = unbounded.
  // Default: 0.
  uint64_t disk_capacity_bytes = 0;
  // Free bytes kept on the disk tier's filesystem. A disk write that would leave less is not
  // attempted: the server degrades to memory-only (commits still succeed, kept in memory;
  // sparsex_cache_disk_degraded 1, Health.disk_degraded) and goes back to the disk once the
  // free space is above the reserve again (checked every disk_recheck_ms). A disk write that
  // fails (ENOSPC, I/O error) degrades the same way. RocksDB's memtable is a quarter of this
  // (at most 128 MiB), so its flushes always find room and RocksDB itself never hits a full
  // disk through the cache's writes (a failed WAL append is fatal to the packaged RocksDB).
  // At least kMinDiskReserveBytes: smaller values are raised to it. Default: 512 MiB.
  uint64_t disk_reserve_bytes = 512ull << 20;
  // Period of the check that leaves the degraded state. Default: 1000 ms.
  uint32_t disk_recheck_ms = 1000;
  // true: a commit writes the block to disk before it returns, so every committed block
  // survives kill -9 of the server; memory eviction then only drops the memory copy.
  // false: blocks reach disk when evicted from memory (spill) or at clean shutdown.
  // Default: true.
  bool write_through = true;
  // fsync the RocksDB WAL on every commit (survives power loss, not only process death).
  // Default: false.
  bool sync_writes = false;
  // Bytes of the most recently committed disk blocks loaded back into memory after a
  // restart, in the background. Clamped to memory_capacity_bytes. Default: 256 MiB.
  uint64_t warm_load_bytes = 256ull << 20;

  // Lease time-to-live when a request asks for 0. Default: 30000 ms.
  uint32_t default_lease_ms = 30000;
  // Longest lease a request may ask for (INVALID_ARGUMENT above). Default: 600000 ms.
  uint32_t max_lease_ms = 600000;
  // A reservation not committed within this time is reclaimed (its client is presumed dead).
  // Default: 30000 ms.
  uint32_t reservation_timeout_ms = 30000;
  // Reserved-but-uncommitted bytes one client (one gRPC peer connection) may hold at once;
  // beyond, Reserve is RESOURCE_EXHAUSTED "client_quota" at once instead of taking the arena
  // space every other client's puts need until the reservation timeout. 0: a quarter of the
  // memory capacity, at least one max_block_bytes. Default: 0
  uint64_t max_client_reserved_bytes = 0;
  // Period of the sweeper that reclaims expired reservations and leases. Default: 100 ms.
  uint32_t sweep_interval_ms = 100;
  // KV layout version the server accepts (FAILED_PRECONDITION "layout_mismatch" otherwise).
  // Default: kKvLayoutVersion.
  uint32_t layout_version = kKvLayoutVersion;
};

struct ServerOptions {
  // Address the gRPC and metrics servers bind to. Default: "127.0.0.1".
  std::string address = "127.0.0.1";
  // gRPC port; 0 picks a free one (reported by CacheServer::grpc_port() and the ready file).
  // Default: 0.
  int grpc_port = 0;
  // Prometheus /metrics and /healthz port; 0 picks a free one, -1 disables. Default: 0.
  int metrics_port = 0;
  // Name of this member in the cluster (stats, health, logs). Default: "" (= "host:port").
  std::string server_id;
  // Largest gRPC message (inline commits and reads). Default: 64 MiB.
  int max_message_bytes = 64 << 20;
  CacheOptions cache;
  TransportOptions transport;
  // Mutual TLS on the gRPC listener: only clients with a certificate of the cluster CA (the
  // workers, the cache CLI with one) are served. Default: none (plaintext).
  TlsFiles tls;
  // Plaintext is refused unless this is set and `address` is on loopback (a local test cluster).
  // Default: false.
  bool insecure_loopback = false;
};

}  // namespace sparsex::cache

// Disk tier: a persistent map BlockKey -> (DiskMeta, encoded block) behind a small interface.
// Backends: "rocksdb" (the real one; values in blob files, metadata in its own column family
// so a restart rebuilds the index without reading values) and "memory" (process-local, for
// tests and for running without a disk).
//
//   DiskStoreOptions o; o.backend = "rocksdb"; o.path = "/var/lib/sparsex/cache";
//   ASSIGN_OR_RETURN(std::unique_ptr<DiskStore> db, OpenDiskStore(o));
//   RETURN_IF_ERROR(db->Put(key, meta, bytes));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "cache_client/block_key.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex::cache {

// What the index needs to know about a stored block without reading it.
struct DiskMeta {
  uint64_t size = 0;       // encoded block bytes
  uint64_t checksum = 0;   // XXH3-64 of the encoded block
  double cost = 0;         // recompute cost (eviction)
  Hash128 model_fp;
  uint32_t layout_version = 0;
  uint64_t commit_unix_ms = 0;

  bool operator==(const DiskMeta&) const = default;
};

std::string EncodeDiskMeta(const DiskMeta& m);
absl::StatusOr<DiskMeta> DecodeDiskMeta(std::string_view s);

struct DiskStoreOptions {
  // "rocksdb", "memory" or "none" (OpenDiskStore returns nullptr). Default: "rocksdb".
  std::string backend = "rocksdb";
  // RocksDB directory, created if missing. Default: "" (required for rocksdb).
  std::string path;
  // fsync the WAL on every write. Default: false.
  bool sync = false;
  // RocksDB memtable size (and so the WAL between flushes, and the blob bytes one flush
  // writes). Keep it well below the free space the cache keeps in reserve, so that a flush
  // always finds room. Default: 128 MiB.
  uint64_t write_buffer_bytes = 128ull << 20;
  // Free bytes the filesystem must keep beyond what opening for writing uses (RocksDB replays
  // its WAL into new files): with less, an existing store is opened read-only (its blocks are
  // served) until Recover() finds the room. Default: 0.
  uint64_t reserve_bytes = 0;
};

class DiskStore {
 public:
  virtual ~DiskStore() = default;
  virtual std::string name() const = 0;
  // Atomically stores value and meta (replacing any previous version).
  virtual absl::Status Put(const BlockKey& k, const DiskMeta& meta,
                           std::span<const uint8_t> value) = 0;
  // Reads the value into `dst`, which must be exactly its size: NOT_FOUND if absent,
  // DATA_LOSS if the stored value has another size.
  virtual absl::Status Read(const BlockKey& k, std::span<uint8_t> dst) = 0;
  // Removes value and meta; OK if absent.
  virtual absl::Status Delete(const BlockKey& k) = 0;
  // Visits every stored meta (order unspecified). Malformed meta records are deleted.
  virtual absl::Status ForEachMeta(
      const std::function<void(const BlockKey&, const DiskMeta&)>& fn) = 0;

  // Bytes an unprivileged writer can still use on the store's filesystem (statvfs);
  // UINT64_MAX for stores without a filesystem.
  virtual absl::StatusOr<uint64_t> FreeBytes() { return UINT64_MAX; }
  // Makes the store writable again after write errors (RocksDB: clears a background error
  // such as "no space", or reopens read-write a store that had to be opened read-only). OK
  // when it already is; an error (e.g. BUSY while RocksDB recovers by itself) to retry later.
  virtual absl::Status Recover() { return absl::OkStatus(); }
  // Opened read-only (the disk was too full to open it for writing); Recover() reopens it.
  virtual bool read_only() const { return false; }
};

// nullptr (and OK) for backend "none"; INVALID_ARGUMENT for an unknown backend;
// UNIMPLEMENTED for "rocksdb" in a build without RocksDB.
absl::StatusOr<std::unique_ptr<DiskStore>> OpenDiskStore(const DiskStoreOptions& options);

namespace internal {
absl::StatusOr<std::unique_ptr<DiskStore>> OpenRocksDbStore(const DiskStoreOptions& options);
std::unique_ptr<DiskStore> NewMemoryDiskStore();
}  // namespace internal

}  // namespace sparsex::cache

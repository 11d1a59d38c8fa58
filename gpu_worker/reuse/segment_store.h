// Local segment store: host-memory, capacity-bounded, LRU with use counts (VictimLocked). Holds each segment's KV
// position-independent (per layer: K before RoPE, and V), keyed by the segment fingerprint.
// Every 16-token block of every layer carries an XXH3 checksum verified on use: a mismatch
// drops the entry and reports a miss, so corrupt KV is never served.
//
//   SegmentStore store({.capacity_bytes = 1 << 30});
//   store.Put(fp, std::move(kv));
//   std::shared_ptr<const SegmentKv> kv = store.Get(fp);   // nullptr on miss or corruption
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex {

struct SegmentKv {
  int n_tokens = 0, n_layers = 0, kv_dim = 0;
  std::vector<std::vector<float>> k, v;  // [n_layers][n_tokens * kv_dim], K before RoPE
  std::vector<uint64_t> checksums;       // [n_layers * n_blocks], K then V bytes of each block
  size_t bytes() const;
};

// A segment's KV in bf16 (the upper halves of fp32, as the cluster's bf16 wire and a GPU's
// tiers hold it): what a cluster fetch hands to the engine's tier without the fp32 store.
struct SegmentKvBf16 {
  int n_tokens = 0, n_layers = 0, kv_dim = 0;
  std::vector<std::vector<uint16_t>> k, v;  // [n_layers][n_tokens * kv_dim], K before RoPE
  size_t bytes() const {
    return static_cast<size_t>(2) * n_layers * n_tokens * kv_dim * sizeof(uint16_t);
  }
};

// Computes (or checks) the per-block checksums of kv.
void SealSegmentKv(SegmentKv& kv, int block_tokens = 16);
bool VerifySegmentKv(const SegmentKv& kv, int block_tokens = 16);

struct SegmentStoreOptions {
  size_t capacity_bytes = size_t{1} << 30;  // host memory for segment KV. Default: 1 GiB
};

struct SegmentStoreStats {
  int64_t hits = 0, misses = 0, corrupt = 0, evictions = 0, puts = 0;
  size_t bytes = 0;
  int64_t entries = 0;
};

class SegmentStore {
 public:
  explicit SegmentStore(const SegmentStoreOptions& opts) : opts_(opts) {}
  // Seals the checksums and inserts, evicting least recently used entries to fit. A segment
  // larger than the whole capacity is refused (ResourceExhausted).
  absl::Status Put(const Hash128& fp, SegmentKv kv);
  std::shared_ptr<const SegmentKv> Get(const Hash128& fp);
  bool Contains(const Hash128& fp) const;
  // Contains, with the checksums checked (a corrupt entry is dropped and counted) and without
  // counting a hit or touching the LRU order: lets tensor-parallel ranks agree on a hit first.
  bool Verify(const Hash128& fp);
  void Erase(const Hash128& fp);
  SegmentStoreStats stats() const;

 private:
  struct Entry {
    std::shared_ptr<SegmentKv> kv;
    std::list<Hash128>::iterator lru;
    int64_t uses = 0;  // hits since it was stored
  };
  // The entry to evict: of the kEvictionWindow least recently used, the one with the fewest
  // uses (the oldest among equals). Plain LRU lets a burst of one-off segments push out the
  // popular ones; counting uses keeps what saves the most recompute (segments are similar in
  // size, so uses approximate saving per byte).
  static constexpr int kEvictionWindow = 8;
  Hash128 VictimLocked() const;
  void EraseLocked(const Hash128& fp);
  // The entry when present and its checksums hold; a corrupt one is dropped and counted.
  Entry* FindVerifiedLocked(const Hash128& fp);
  SegmentStoreOptions opts_;
  mutable std::mutex mu_;
  absl::flat_hash_map<Hash128, Entry> map_;
  std::list<Hash128> lru_;  // front = least recently used
  SegmentStoreStats stats_;
};

}  // namespace sparsex

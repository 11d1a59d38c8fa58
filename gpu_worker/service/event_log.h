// The worker's cache events: what its segment store holds, as a log of stored / removed /
// cleared events with sequence numbers (strictly increasing per instance), a bounded buffer of
// recent events for subscribers that resume, and a snapshot (Replay) for those that cannot.
// The router's cluster index follows these events, so it never guesses.
//
// Exact-prefix KV blocks of the paged cache are entries of tier GPU (published as BLOCK_STORED /
// BLOCK_REMOVED), reported by the engine's block manager as they are registered and evicted.
//
// Evictions inside the SegmentStore (LRU, corrupt entries dropped on read) are not reported by
// the store itself: Reconcile() notices them from the store's counters and checks the entries
// it knows about, emitting SEGMENT_REMOVED for each one that is gone.
//
//   CacheEventLog log("instance-1234", 65536);
//   log.Stored(fp, 120, Tier::kHost);
//   log.Reconcile(store);
//   std::vector<CacheEventRecord> ev;
//   if (!log.WaitAfter(last_seq, 200ms, &ev)) { /* too old: send a snapshot */ }
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/hash.h"
#include "gpu_worker/reuse/segment_store.h"

namespace sparsex::service {

enum class EventKind { kStored = 1, kRemoved = 2, kCleared = 3 };
enum class EventTier { kGpu = 1, kHost = 2, kCluster = 3 };

struct CacheEventRecord {
  uint64_t seq = 0;
  EventKind kind = EventKind::kStored;
  Hash128 fp;
  int num_tokens = 0;
  EventTier tier = EventTier::kHost;
};

struct CacheEntryRecord {
  Hash128 fp;
  int num_tokens = 0;
  EventTier tier = EventTier::kHost;
};

class CacheEventLog {
 public:
  // `buffer` recent events are kept for resuming subscribers. Default capacity: 65536.
  explicit CacheEventLog(std::string instance_id, size_t buffer = 65536);

  const std::string& instance_id() const { return instance_id_; }

  // Idempotent: storing a known entry or removing an unknown one emits nothing.
  void Stored(const Hash128& fp, int num_tokens, EventTier tier = EventTier::kHost);
  void Removed(const Hash128& fp);
  void Cleared();
  // Emits SEGMENT_REMOVED for known entries the store no longer holds (cheap when the store's
  // eviction/corruption counters have not moved since the last call).
  void Reconcile(const SegmentStore& store);

  uint64_t last_seq() const;
  // Every entry held, and the seq it is current at.
  std::vector<CacheEntryRecord> Snapshot(uint64_t* seq) const;
  // Events with seq > after (up to `max`), waiting up to `timeout` for the first one. Returns
  // false when events after `after` are no longer buffered (the caller needs a snapshot).
  bool WaitAfter(uint64_t after, std::chrono::milliseconds timeout,
                 std::vector<CacheEventRecord>* out, size_t max = 4096) const;
  // Wakes every waiter (shutdown).
  void NotifyAll() const { cv_.notify_all(); }

 private:
  void AppendLocked(EventKind kind, const Hash128& fp, int n, EventTier tier);
  std::string instance_id_;
  size_t capacity_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t seq_ = 0;
  std::deque<CacheEventRecord> recent_;
  absl::flat_hash_map<Hash128, CacheEntryRecord> entries_;
  int64_t seen_evictions_ = 0, seen_corrupt_ = 0;
};

}  // namespace sparsex::service

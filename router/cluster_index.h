// The router's view of the cluster: which segments each worker holds (built only from the
// workers' cache events: snapshots, then stored/removed/cleared events applied in sequence
// order, a gap forcing a new snapshot), each worker's load, and the routing policy that weighs
// reusable tokens against load.
//
//   ClusterIndex index;
//   index.ApplySnapshot("w1", "inst-a", 42, entries);
//   if (!index.ApplyEvent("w1", "inst-a", ev)) { /* gap or restart: resubscribe */ }
//   int reusable = index.ReusableTokens("w1", fps);
//   RouteDecision d = ChooseWorker(candidates, prompt_tokens, weights);
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/hash.h"

namespace sparsex::router {

// Routing weights: a worker's estimated cost for a request, in token units, is
//   new_token_weight * (prompt_tokens - reusable_tokens)        what it must compute
// + load_token_weight * max(running_tokens, inflight_tokens)  work already there
// + request_weight * (queue_depth + inflight)                 per-request overhead
// + kv_weight * prompt_tokens * kv_usage^2                    memory pressure
// and the cheapest healthy, unsaturated worker wins.
struct RoutingWeights {
  double new_token_weight = 1.0;   // cost of one token to compute. Default: 1
  double load_token_weight = 0.5;  // cost of one token of load already on the worker. Default: 0.5
  double request_weight = 16.0;    // cost per queued or in-flight request. Default: 16
  double kv_weight = 1.0;          // KV pressure factor. Default: 1
  // A worker with this many requests in flight from this router takes no more. Default: 64
  int max_inflight_per_worker = 64;
  // Spread guard: never pick a worker with more than this many in-flight requests above the
  // least loaded healthy worker, whatever its reuse. Default: 4
  int max_inflight_imbalance = 4;
};

struct WorkerLoadInfo {
  int queue_depth = 0, running = 0;
  int64_t running_tokens = 0;
  int kv_blocks_total = 0, kv_blocks_free = 0;
  bool draining = false;
  int max_queue = 0;  // 0: unknown
  bool reuse_disabled = false;  // the worker's correctness gate turned reuse off
  double kv_usage() const {
    return kv_blocks_total > 0 ? 1.0 - static_cast<double>(kv_blocks_free) / kv_blocks_total
                               : 0.0;
  }
};

struct RouteCandidate {
  std::string id;
  bool healthy = true;
  int reusable_tokens = 0;  // prompt tokens whose segments the worker holds
  int inflight = 0;         // requests this router has in flight there
  int64_t inflight_tokens = 0;
  WorkerLoadInfo load;
};

struct RouteDecision {
  int index = -1;               // into the candidates; -1: none
  bool all_saturated = false;   // healthy workers exist but all are full (shed load)
  double cost = 0;
  std::string reason;           // "reuse" (won with reusable tokens) | "load" | "only"
};

RouteDecision ChooseWorker(std::span<const RouteCandidate> candidates, int prompt_tokens,
                           const RoutingWeights& w);

struct IndexEntry {
  Hash128 fp;
  int num_tokens = 0;
  bool block = false;  // an exact-prefix KV block (BLOCK_* events), not a segment
};

class ClusterIndex {
 public:
  // Replaces everything known about the worker.
  void ApplySnapshot(const std::string& worker, const std::string& instance, uint64_t seq,
                     std::span<const IndexEntry> entries);
  enum class EventKind { kStored, kRemoved, kCleared };
  // Applies one event. false (nothing applied) when the instance differs or seq is not the next
  // one: the caller resubscribes and gets a snapshot.
  bool ApplyEvent(const std::string& worker, const std::string& instance, uint64_t seq,
                  EventKind kind, const Hash128& fp, int num_tokens, bool block = false);
  void UpdateLoad(const std::string& worker, const WorkerLoadInfo& load);
  void RemoveWorker(const std::string& worker);

  // Tokens of `segments` (segment fingerprints and prefix-block hashes) the worker holds.
  int ReusableTokens(const std::string& worker, std::span<const IndexEntry> segments) const;
  size_t Segments(const std::string& worker) const;  // segments only, not prefix blocks
  bool HeldAnywhere(const Hash128& segment) const;   // some worker holds this segment
  uint64_t LastSeq(const std::string& worker) const;
  std::string Instance(const std::string& worker) const;
  WorkerLoadInfo Load(const std::string& worker) const;

 private:
  struct Worker {
    std::string instance;
    uint64_t seq = 0;
    absl::flat_hash_map<Hash128, int> segments;
    absl::flat_hash_map<Hash128, int> blocks;  // exact-prefix KV blocks
    WorkerLoadInfo load;
  };
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Worker> workers_;
};

}  // namespace sparsex::router

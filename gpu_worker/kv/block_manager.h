// Paged KV cache bookkeeping (host side): a pool of fixed-size blocks, reference counts,
// chained prefix hashes for exact-prefix reuse across requests, and LRU eviction of cached
// blocks nobody references. The KV bytes themselves live in the backend's KvPool, indexed by
// block id; this class only decides which block holds what.
//
//   BlockManager bm({.block_size = 16, .num_blocks = 1024}, model_fp);
//   PrefixMatch m = bm.MatchPrefix(tokens);     // refs the matched blocks
//   ASSIGN_OR_RETURN(int b, bm.Allocate());     // ResourceExhausted when all blocks are in use
//   bm.Register(b, hash);                       // full block: now findable by later requests
//   bm.Release(b);                              // refcount 0: stays cached (LRU) if registered
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex {

struct KvCacheOptions {
  int block_size = 16;    // tokens per block. Default: 16
  int num_blocks = 4096;  // blocks in the pool. Default: 4096
  bool enable_prefix_caching = true;  // register full blocks for exact-prefix reuse. Default: on
};

struct PrefixMatch {
  std::vector<int32_t> blocks;  // referenced; caller releases them
  std::vector<Hash128> hashes;  // exact hash of every full block of the query (matched or not)
  int exact_blocks = 0;         // leading matched blocks that are exact (the rest approximate)
  int matched_tokens() const { return static_cast<int>(blocks.size()); }  // in blocks
};

struct BlockStats {
  int64_t allocated = 0, prefix_hit_blocks = 0, prefix_queried_blocks = 0, evictions = 0;
};

class BlockManager {
 public:
  BlockManager(const KvCacheOptions& opts, const Hash128& model_fp);

  int block_size() const { return opts_.block_size; }
  int num_blocks() const { return opts_.num_blocks; }
  // Blocks that can be handed out now (free or evictable).
  int available() const { return static_cast<int>(free_.size() + lru_.size()); }
  int cached() const { return static_cast<int>(lru_.size()); }
  const BlockStats& stats() const { return stats_; }

  // Hashes of the full blocks of tokens (chained, salted with the model fingerprint). Blocks
  // from index approx_from on (>= 0) are hashed in the approximate namespace: KV computed with
  // segment reuse, which only a request that accepts approximate KV may match.
  // `scope` roots the chain (FingerprintOptions::prefix_scope): blocks of two scopes never match.
  std::vector<Hash128> BlockHashes(std::span<const int32_t> tokens, int approx_from = -1,
                                   const Hash128& scope = {}) const;
  // Longest run of leading full blocks already cached; each returned block is referenced. With
  // allow_approximate the run may continue into approximate blocks after its exact ones (a
  // chat turn continuing the previous turn's reuse-computed KV); without it, never.
  PrefixMatch MatchPrefix(std::span<const int32_t> tokens, bool allow_approximate = false,
                          const Hash128& scope = {});
  // A fresh block with refcount 1, evicting the least recently used cached block if needed.
  absl::StatusOr<int32_t> Allocate();
  // Allocates n blocks, all or nothing.
  absl::StatusOr<std::vector<int32_t>> AllocateN(int n);
  void Ref(int32_t block);
  void Release(int32_t block);
  void ReleaseAll(std::span<const int32_t> blocks);
  // Makes a full block findable by its chained hash. A hash already held by another block keeps
  // the existing one (this block stays private and is freed on release).
  void Register(int32_t block, const Hash128& hash);
  // Drops every cached-but-unreferenced block (e.g. on model reload).
  void ClearCached();
  // Called with (hash, true) when a block becomes findable by its prefix hash and (hash, false)
  // when it stops being findable (evicted or cleared): the worker publishes these as cache
  // events so the router's index follows the exact-prefix cache too. Default: none
  using EventHook = std::function<void(const Hash128& hash, bool stored)>;
  void SetEventHook(EventHook hook) { hook_ = std::move(hook); }

 private:
  struct Block {
    int32_t refs = 0;
    bool registered = false;
    Hash128 hash;
    std::list<int32_t>::iterator lru_it;
    bool in_lru = false;
  };
  KvCacheOptions opts_;
  Hash128 model_fp_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;
  std::list<int32_t> lru_;  // front = least recently used
  absl::flat_hash_map<Hash128, int32_t> by_hash_;
  BlockStats stats_;
  EventHook hook_;
};

}  // namespace sparsex

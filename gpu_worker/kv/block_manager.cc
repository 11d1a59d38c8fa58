#include "gpu_worker/kv/block_manager.h"

#include "common/fingerprint.h"

namespace sparsex {

BlockManager::BlockManager(const KvCacheOptions& opts, const Hash128& model_fp)
    : opts_(opts), model_fp_(model_fp), blocks_(opts.num_blocks) {
  free_.reserve(opts.num_blocks);
  for (int32_t b = opts.num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

namespace {

// The parent an approximate chain starts from: a different parent makes every later hash of the
// chain differ from the exact chain's, so exact lookups can never match approximate KV.
Hash128 ApproximateParent(const Hash128& parent) {
  return Hash128{parent.hi ^ 0x6170707278696d61ULL, parent.lo ^ 0x7465206b76206e73ULL};
}

}  // namespace

std::vector<Hash128> BlockManager::BlockHashes(std::span<const int32_t> tokens,
                                               int approx_from, const Hash128& scope) const {
  std::vector<Hash128> out;
  Hash128 parent = scope;
  const size_t bs = opts_.block_size;
  for (size_t i = 0; i + bs <= tokens.size(); i += bs) {
    if (approx_from >= 0 && static_cast<int>(i / bs) == approx_from) {
      parent = ApproximateParent(parent);
    }
    parent = PrefixBlockHash(model_fp_, parent, tokens.subspan(i, bs));
    out.push_back(parent);
  }
  return out;
}

PrefixMatch BlockManager::MatchPrefix(std::span<const int32_t> tokens, bool allow_approximate,
                                      const Hash128& scope) {
  PrefixMatch m;
  m.hashes = BlockHashes(tokens, -1, scope);
  if (!opts_.enable_prefix_caching) return m;
  const size_t bs = opts_.block_size;
  Hash128 parent = scope;
  bool approximate = false;
  for (size_t i = 0; i < m.hashes.size(); ++i) {
    if (!approximate) {
      auto it = by_hash_.find(m.hashes[i]);
      if (it != by_hash_.end()) {
        Ref(it->second);
        m.blocks.push_back(it->second);
        parent = m.hashes[i];
        continue;
      }
      if (!allow_approximate) break;
      approximate = true;
      m.exact_blocks = static_cast<int>(m.blocks.size());
      parent = ApproximateParent(parent);
    }
    parent = PrefixBlockHash(model_fp_, parent, tokens.subspan(i * bs, bs));
    auto it = by_hash_.find(parent);
    if (it == by_hash_.end()) break;
    Ref(it->second);
    m.blocks.push_back(it->second);
  }
  if (!approximate) m.exact_blocks = static_cast<int>(m.blocks.size());
  stats_.prefix_queried_blocks += static_cast<int64_t>(m.hashes.size());
  stats_.prefix_hit_blocks += static_cast<int64_t>(m.blocks.size());
  return m;
}

absl::StatusOr<int32_t> BlockManager::Allocate() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    Block& blk = blocks_[b];
    blk.in_lru = false;
    by_hash_.erase(blk.hash);
    blk.registered = false;
    ++stats_.evictions;
    if (hook_) hook_(blk.hash, false);
  } else {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache pool exhausted: all ", opts_.num_blocks, " blocks of ", opts_.block_size,
        " tokens are in use by running requests"));
  }
  blocks_[b].refs = 1;
  ++stats_.allocated;
  return b;
}

absl::StatusOr<std::vector<int32_t>> BlockManager::AllocateN(int n) {
  if (n > available()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache pool exhausted: need ", n, " blocks, ", available(), " of ", opts_.num_blocks,
        " available"));
  }
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    ASSIGN_OR_RETURN(int32_t b, Allocate());
    out.push_back(b);
  }
  return out;
}

void BlockManager::Ref(int32_t b) {
  Block& blk = blocks_[b];
  if (blk.in_lru) {
    lru_.erase(blk.lru_it);
    blk.in_lru = false;
  }
  ++blk.refs;
}

void BlockManager::Release(int32_t b) {
  Block& blk = blocks_[b];
  if (blk.refs <= 0) return;
  if (--blk.refs > 0) return;
  if (blk.registered) {
    blk.lru_it = lru_.insert(lru_.end(), b);
    blk.in_lru = true;
  } else {
    free_.push_back(b);
  }
}

void BlockManager::ReleaseAll(std::span<const int32_t> blocks) {
  // Reverse order: a sequence's tail blocks become the least recently used, so eviction takes
  // them before the shared prefix blocks they depend on.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) Release(*it);
}

void BlockManager::Register(int32_t b, const Hash128& hash) {
  if (!opts_.enable_prefix_caching) return;
  Block& blk = blocks_[b];
  if (blk.registered) return;
  auto [it, inserted] = by_hash_.try_emplace(hash, b);
  if (!inserted) return;
  blk.registered = true;
  blk.hash = hash;
  if (hook_) hook_(hash, true);
}

void BlockManager::ClearCached() {
  for (int32_t b : lru_) {
    Block& blk = blocks_[b];
    by_hash_.erase(blk.hash);
    blk.registered = false;
    blk.in_lru = false;
    free_.push_back(b);
    if (hook_) hook_(blk.hash, false);
  }
  lru_.clear();
}

}  // namespace sparsex

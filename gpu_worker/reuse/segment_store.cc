#include "gpu_worker/reuse/segment_store.h"

#include <cstring>

#include "common/thread_pool.h"

namespace sparsex {

size_t SegmentKv::bytes() const {
  return static_cast<size_t>(2) * n_layers * n_tokens * kv_dim * sizeof(float);
}

namespace {

std::vector<uint64_t> Checksums(const SegmentKv& kv, int bt) {
  const int nb = (kv.n_tokens + bt - 1) / bt;
  std::vector<uint64_t> out(static_cast<size_t>(kv.n_layers) * nb);
  auto layers = [&](int64_t lo, int64_t hi) {
    for (int64_t l = lo; l < hi; ++l) {
      for (int b = 0; b < nb; ++b) {
        const size_t off = static_cast<size_t>(b) * bt * kv.kv_dim;
        const size_t len =
            static_cast<size_t>(std::min(bt, kv.n_tokens - b * bt)) * kv.kv_dim * sizeof(float);
        const uint64_t hk = Hash64(kv.k[l].data() + off, len, static_cast<uint64_t>(l));
        out[l * nb + b] = Hash64(kv.v[l].data() + off, len, hk);
      }
    }
  };
  // An 8B model's segment is ~1 GiB (tens to hundreds of ms of hashing on one core, paid on
  // every put and every use); small ones stay on the calling thread.
  if (kv.bytes() >= (size_t{64} << 20)) ParallelFor(kv.n_layers, layers);
  else layers(0, kv.n_layers);
  return out;
}

}  // namespace

void SealSegmentKv(SegmentKv& kv, int bt) { kv.checksums = Checksums(kv, bt); }

bool VerifySegmentKv(const SegmentKv& kv, int bt) {
  if (static_cast<int>(kv.k.size()) != kv.n_layers || static_cast<int>(kv.v.size()) != kv.n_layers) {
    return false;
  }
  const size_t n = static_cast<size_t>(kv.n_tokens) * kv.kv_dim;
  for (int l = 0; l < kv.n_layers; ++l) {
    if (kv.k[l].size() != n || kv.v[l].size() != n) return false;
  }
  return Checksums(kv, bt) == kv.checksums;
}

absl::Status SegmentStore::Put(const Hash128& fp, SegmentKv kv) {
  if (static_cast<int>(kv.k.size()) != kv.n_layers || kv.n_tokens <= 0) {
    return absl::InvalidArgumentError("segment KV is empty or inconsistent");
  }
  SealSegmentKv(kv);
  const size_t need = kv.bytes();
  std::lock_guard<std::mutex> l(mu_);
  if (need > opts_.capacity_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("segment of ", need,
                                                     " bytes exceeds the store capacity of ",
                                                     opts_.capacity_bytes));
  }
  EraseLocked(fp);
  while (stats_.bytes + need > opts_.capacity_bytes && !lru_.empty()) {
    EraseLocked(VictimLocked());
    ++stats_.evictions;
  }
  Entry e;
  e.kv = std::make_shared<SegmentKv>(std::move(kv));
  e.lru = lru_.insert(lru_.end(), fp);
  map_.emplace(fp, std::move(e));
  stats_.bytes += need;
  ++stats_.entries;
  ++stats_.puts;
  return absl::OkStatus();
}

SegmentStore::Entry* SegmentStore::FindVerifiedLocked(const Hash128& fp) {
  auto it = map_.find(fp);
  if (it == map_.end()) return nullptr;
  if (VerifySegmentKv(*it->second.kv)) return &it->second;
  // Corrupt data is dropped and never served: the caller recomputes.
  ++stats_.corrupt;
  EraseLocked(fp);
  return nullptr;
}

std::shared_ptr<const SegmentKv> SegmentStore::Get(const Hash128& fp) {
  std::shared_ptr<SegmentKv> kv;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = map_.find(fp);
    if (it == map_.end()) {
      ++stats_.misses;
      return nullptr;
    }
    kv = it->second.kv;
  }
  // Checksums outside the lock: an 8B model's 2000-token segment is 0.5 GB (tens of ms of
  // hashing), which the engine thread's Contains and Put must not wait for. Stored KV is never
  // modified in place, so the shared entry can be read unlocked.
  const bool intact = VerifySegmentKv(*kv);
  std::lock_guard<std::mutex> l(mu_);
  auto it = map_.find(fp);
  const bool same = it != map_.end() && it->second.kv == kv;
  if (!intact) {
    // Corrupt data is dropped and never served: the caller recomputes.
    ++stats_.corrupt;
    ++stats_.misses;
    if (same) EraseLocked(fp);
    return nullptr;
  }
  if (same) {
    lru_.splice(lru_.end(), lru_, it->second.lru);
    ++it->second.uses;
  }
  ++stats_.hits;
  return kv;
}

bool SegmentStore::Verify(const Hash128& fp) {
  std::lock_guard<std::mutex> l(mu_);
  return FindVerifiedLocked(fp) != nullptr;
}

Hash128 SegmentStore::VictimLocked() const {
  Hash128 victim = lru_.front();
  int64_t fewest = map_.at(victim).uses;
  int seen = 0;
  for (auto it = lru_.begin(); it != lru_.end() && seen < kEvictionWindow; ++it, ++seen) {
    const int64_t u = map_.at(*it).uses;
    if (u < fewest) {
      fewest = u;
      victim = *it;
    }
  }
  return victim;
}

bool SegmentStore::Contains(const Hash128& fp) const {
  std::lock_guard<std::mutex> l(mu_);
  return map_.contains(fp);
}

void SegmentStore::Erase(const Hash128& fp) {
  std::lock_guard<std::mutex> l(mu_);
  EraseLocked(fp);
}

void SegmentStore::EraseLocked(const Hash128& fp) {
  auto it = map_.find(fp);
  if (it == map_.end()) return;
  stats_.bytes -= it->second.kv->bytes();
  --stats_.entries;
  lru_.erase(it->second.lru);
  map_.erase(it);
}

SegmentStoreStats SegmentStore::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

}  // namespace sparsex

#include "gpu_worker/service/event_log.h"

namespace sparsex::service {

CacheEventLog::CacheEventLog(std::string instance_id, size_t buffer)
    : instance_id_(std::move(instance_id)), capacity_(buffer < 16 ? 16 : buffer) {}

void CacheEventLog::AppendLocked(EventKind kind, const Hash128& fp, int n, EventTier tier) {
  CacheEventRecord e{++seq_, kind, fp, n, tier};
  recent_.push_back(e);
  while (recent_.size() > capacity_) recent_.pop_front();
}

void CacheEventLog::Stored(const Hash128& fp, int num_tokens, EventTier tier) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (entries_.contains(fp)) return;
    entries_[fp] = CacheEntryRecord{fp, num_tokens, tier};
    AppendLocked(EventKind::kStored, fp, num_tokens, tier);
  }
  cv_.notify_all();
}

void CacheEventLog::Removed(const Hash128& fp) {
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = entries_.find(fp);
    if (it == entries_.end()) return;
    const CacheEntryRecord e = it->second;
    entries_.erase(it);
    AppendLocked(EventKind::kRemoved, fp, e.num_tokens, e.tier);
  }
  cv_.notify_all();
}

void CacheEventLog::Cleared() {
  {
    std::lock_guard<std::mutex> l(mu_);
    entries_.clear();
    AppendLocked(EventKind::kCleared, Hash128{}, 0, EventTier::kHost);
  }
  cv_.notify_all();
}

void CacheEventLog::Reconcile(const SegmentStore& store) {
  const SegmentStoreStats st = store.stats();
  std::vector<Hash128> gone;
  {
    std::lock_guard<std::mutex> l(mu_);
    // Exact-prefix blocks (tier GPU) are reported by the block manager itself, not the store.
    int64_t host_entries = 0;
    for (const auto& [fp, e] : entries_) host_entries += e.tier != EventTier::kGpu;
    if (st.evictions == seen_evictions_ && st.corrupt == seen_corrupt_ &&
        host_entries <= st.entries) {
      return;
    }
    seen_evictions_ = st.evictions;
    seen_corrupt_ = st.corrupt;
    for (const auto& [fp, e] : entries_) {
      if (e.tier != EventTier::kGpu && !store.Contains(fp)) gone.push_back(fp);
    }
  }
  for (const Hash128& fp : gone) Removed(fp);
}

uint64_t CacheEventLog::last_seq() const {
  std::lock_guard<std::mutex> l(mu_);
  return seq_;
}

std::vector<CacheEntryRecord> CacheEventLog::Snapshot(uint64_t* seq) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<CacheEntryRecord> out;
  out.reserve(entries_.size());
  for (const auto& [fp, e] : entries_) out.push_back(e);
  *seq = seq_;
  return out;
}

bool CacheEventLog::WaitAfter(uint64_t after, std::chrono::milliseconds timeout,
                              std::vector<CacheEventRecord>* out, size_t max) const {
  std::unique_lock<std::mutex> l(mu_);
  if (after > seq_) return false;  // from another instance or the future
  cv_.wait_for(l, timeout, [&] { return seq_ > after; });
  if (seq_ == after) return true;
  if (recent_.empty() || recent_.front().seq > after + 1) return false;
  const size_t start = static_cast<size_t>(after + 1 - recent_.front().seq);
  for (size_t i = start; i < recent_.size() && out->size() < max; ++i) out->push_back(recent_[i]);
  return true;
}

}  // namespace sparsex::service

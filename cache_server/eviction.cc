#include "cache_server/eviction.h"

#include <list>
#include <set>
#include <tuple>

#include "absl/container/flat_hash_map.h"

namespace sparsex::cache {
namespace {

class LruPolicy final : public EvictionPolicy {
 public:
  void Insert(const BlockKey& k, uint64_t, double) override {
    auto it = index_.find(k);
    if (it != index_.end()) {
      order_.splice(order_.end(), order_, it->second);
      return;
    }
    order_.push_back(k);
    index_[k] = std::prev(order_.end());
  }
  void Touch(const BlockKey& k) override {
    auto it = index_.find(k);
    if (it != index_.end()) order_.splice(order_.end(), order_, it->second);
  }
  void Erase(const BlockKey& k, bool) override {
    auto it = index_.find(k);
    if (it == index_.end()) return;
    order_.erase(it->second);
    index_.erase(it);
  }
  void ForEachCandidate(const std::function<bool(const BlockKey&)>& fn) override {
    for (auto it = order_.begin(); it != order_.end();) {
      auto next = std::next(it);
      const BlockKey k = *it;  // fn may erase *it
      if (fn(k)) return;
      it = next;
    }
  }
  size_t size() const override { return index_.size(); }

 private:
  std::list<BlockKey> order_;  // front: least recently used
  absl::flat_hash_map<BlockKey, std::list<BlockKey>::iterator> index_;
};

// GreedyDual-Size: priority H = L + cost / bytes; evict the smallest H and set L to it, so
// blocks that are cheap to recompute per byte go first and untouched blocks age.
class CostAwarePolicy final : public EvictionPolicy {
 public:
  void Insert(const BlockKey& k, uint64_t bytes, double cost) override {
    Erase(k, false);
    Item it{bytes == 0 ? 1 : bytes, cost > 0 ? cost : 1.0, 0, seq_++};
    it.h = inflation_ + it.cost / static_cast<double>(it.bytes) * kScale;
    order_.insert({it.h, it.seq, k});
    items_[k] = it;
  }
  void Touch(const BlockKey& k) override {
    auto f = items_.find(k);
    if (f == items_.end()) return;
    Item& it = f->second;
    order_.erase({it.h, it.seq, k});
    it.h = inflation_ + it.cost / static_cast<double>(it.bytes) * kScale;
    it.seq = seq_++;
    order_.insert({it.h, it.seq, k});
  }
  void Erase(const BlockKey& k, bool evicted) override {
    auto f = items_.find(k);
    if (f == items_.end()) return;
    if (evicted && f->second.h > inflation_) inflation_ = f->second.h;
    order_.erase({f->second.h, f->second.seq, k});
    items_.erase(f);
  }
  void ForEachCandidate(const std::function<bool(const BlockKey&)>& fn) override {
    for (auto it = order_.begin(); it != order_.end();) {
      auto next = std::next(it);
      const BlockKey k = std::get<2>(*it);
      if (fn(k)) return;
      it = next;
    }
  }
  size_t size() const override { return items_.size(); }

 private:
  static constexpr double kScale = 1 << 20;  // cost per MiB, keeps H in a sane range
  struct Item {
    uint64_t bytes;
    double cost;
    double h;
    uint64_t seq;
  };
  struct Less {
    bool operator()(const std::tuple<double, uint64_t, BlockKey>& a,
                    const std::tuple<double, uint64_t, BlockKey>& b) const {
      if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
      return std::get<1>(a) < std::get<1>(b);
    }
  };
  double inflation_ = 0;
  uint64_t seq_ = 0;
  std::set<std::tuple<double, uint64_t, BlockKey>, Less> order_;
  absl::flat_hash_map<BlockKey, Item> items_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionPolicyKind kind) {
  switch (kind) {
    case EvictionPolicyKind::kCostAware: return std::make_unique<CostAwarePolicy>();
    case EvictionPolicyKind::kLru: break;
  }
  return std::make_unique<LruPolicy>();
}

}  // namespace sparsex::cache

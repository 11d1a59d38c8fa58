#include "router/cluster_index.h"

#include <algorithm>
#include <limits>

namespace sparsex::router {

RouteDecision ChooseWorker(std::span<const RouteCandidate> c, int prompt_tokens,
                           const RoutingWeights& w) {
  RouteDecision d;
  int healthy = 0, min_inflight = std::numeric_limits<int>::max();
  for (const RouteCandidate& x : c) {
    if (!x.healthy || x.load.draining) continue;
    ++healthy;
    min_inflight = std::min(min_inflight, x.inflight);
  }
  if (healthy == 0) return d;
  double best = std::numeric_limits<double>::infinity(), best_no_reuse = best;
  int best_reuse = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    const RouteCandidate& x = c[i];
    if (!x.healthy || x.load.draining) continue;
    if (x.inflight >= w.max_inflight_per_worker) continue;
    if (x.load.max_queue > 0 && x.load.queue_depth >= x.load.max_queue) continue;
    if (x.inflight > min_inflight + w.max_inflight_imbalance) continue;
    const int reusable = std::clamp(x.reusable_tokens, 0, prompt_tokens);
    const double load_tokens =
        static_cast<double>(std::max<int64_t>(x.load.running_tokens, x.inflight_tokens));
    const double kv = x.load.kv_usage();
    const double base = w.load_token_weight * load_tokens +
                        w.request_weight * (x.load.queue_depth + x.inflight) +
                        w.kv_weight * prompt_tokens * kv * kv;
    const double cost = w.new_token_weight * (prompt_tokens - reusable) + base;
    const double cost_no_reuse = w.new_token_weight * prompt_tokens + base;
    if (cost < best || (cost == best && reusable > best_reuse)) {
      best = cost;
      best_reuse = reusable;
      d.index = static_cast<int>(i);
    }
    best_no_reuse = std::min(best_no_reuse, cost_no_reuse);
  }
  if (d.index < 0) {
    d.all_saturated = true;
    return d;
  }
  d.cost = best;
  // "reuse" when reuse changed the choice (without it another worker would have been cheaper).
  d.reason = healthy == 1 ? "only" : (best_reuse > 0 && best < best_no_reuse ? "reuse" : "load");
  return d;
}

void ClusterIndex::ApplySnapshot(const std::string& worker, const std::string& instance,
                                 uint64_t seq, std::span<const IndexEntry> entries) {
  std::lock_guard<std::mutex> l(mu_);
  Worker& w = workers_[worker];
  w.instance = instance;
  w.seq = seq;
  w.segments.clear();
  w.blocks.clear();
  for (const IndexEntry& e : entries) (e.block ? w.blocks : w.segments)[e.fp] = e.num_tokens;
}

bool ClusterIndex::ApplyEvent(const std::string& worker, const std::string& instance,
                              uint64_t seq, EventKind kind, const Hash128& fp, int num_tokens,
                              bool block) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end() || it->second.instance != instance) return false;
  Worker& w = it->second;
  if (seq <= w.seq) return true;  // already applied (duplicate delivery)
  if (seq != w.seq + 1) return false;
  w.seq = seq;
  auto& map = block ? w.blocks : w.segments;
  switch (kind) {
    case EventKind::kStored: map[fp] = num_tokens; break;
    case EventKind::kRemoved: map.erase(fp); break;
    case EventKind::kCleared:
      w.segments.clear();
      w.blocks.clear();
      break;
  }
  return true;
}

void ClusterIndex::UpdateLoad(const std::string& worker, const WorkerLoadInfo& load) {
  std::lock_guard<std::mutex> l(mu_);
  workers_[worker].load = load;
}

void ClusterIndex::RemoveWorker(const std::string& worker) {
  std::lock_guard<std::mutex> l(mu_);
  workers_.erase(worker);
}

int ClusterIndex::ReusableTokens(const std::string& worker,
                                 std::span<const IndexEntry> segments) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  int n = 0;
  for (const IndexEntry& s : segments) {
    if ((s.block ? it->second.blocks : it->second.segments).contains(s.fp)) n += s.num_tokens;
  }
  return n;
}

bool ClusterIndex::HeldAnywhere(const Hash128& segment) const {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& [id, w] : workers_) {
    if (w.segments.contains(segment)) return true;
  }
  return false;
}

size_t ClusterIndex::Segments(const std::string& worker) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.segments.size();
}

uint64_t ClusterIndex::LastSeq(const std::string& worker) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.seq;
}

std::string ClusterIndex::Instance(const std::string& worker) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? "" : it->second.instance;
}

WorkerLoadInfo ClusterIndex::Load(const std::string& worker) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? WorkerLoadInfo{} : it->second.load;
}

}  // namespace sparsex::router

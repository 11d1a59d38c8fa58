#include "gpu_worker/reuse/selector.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace sparsex {
namespace {

// Scales v to sum 1 (or leaves zeros).
std::vector<float> Normalized(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += std::max(0.0f, x);
  std::vector<float> out(v.size(), 0.0f);
  if (s <= 0) return out;
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(std::max(0.0f, v[i]) / s);
  return out;
}

class SparsexSelector final : public Selector {
 public:
  explicit SparsexSelector(const SparsexWeights& w) : w_(w) {}
  std::string name() const override { return "sparsex"; }
  bool needs_attention_stats() const override { return true; }
  bool needs_kv_deviation() const override { return w_.deviation > 0; }
  std::vector<float> Score(const SelectionInput& in) const override {
    // Two views of the missing cross-segment attention: how much a reused token's own query
    // reaches outside its segment (its KV was computed without that context), and how much the
    // new tokens read from it (errors there reach the answer directly). Each is normalised to a
    // distribution so neither dominates by scale.
    std::vector<float> a = Normalized(in.cross_mass), b = Normalized(in.new_recv);
    std::vector<float> c = Normalized(in.kv_deviation);
    std::vector<float> s(a.size());
    for (size_t i = 0; i < s.size(); ++i) {
      s[i] = w_.cross * a[i] + w_.recv * b[i] + (c.empty() ? 0.0f : w_.deviation * c[i]);
    }
    return s;
  }

 private:
  SparsexWeights w_;
};

class CacheBlendSelector final : public Selector {
 public:
  std::string name() const override { return "cacheblend"; }
  bool needs_kv_deviation() const override { return true; }
  std::vector<float> Score(const SelectionInput& in) const override { return in.kv_deviation; }
};

class EpicSelector final : public Selector {
 public:
  std::string name() const override { return "epic"; }
  std::vector<float> Score(const SelectionInput& in) const override {
    // Earlier tokens of each segment first (EPIC/LegoLink recompute each chunk's head).
    std::vector<float> s(in.offset.size());
    for (size_t i = 0; i < s.size(); ++i) s[i] = 1.0f / (1.0f + in.offset[i]);
    return s;
  }
};

class RandomSelector final : public Selector {
 public:
  std::string name() const override { return "random"; }
  std::vector<float> Score(const SelectionInput& in) const override {
    std::mt19937_64 rng(in.seed);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<float> s(in.segment.size());
    for (float& x : s) x = u(rng);
    return s;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Selector>> CreateSelector(const std::string& name,
                                                          const SparsexWeights& w) {
  if (name == "sparsex") return std::unique_ptr<Selector>(new SparsexSelector(w));
  if (name == "cacheblend") return std::unique_ptr<Selector>(new CacheBlendSelector());
  if (name == "epic") return std::unique_ptr<Selector>(new EpicSelector());
  if (name == "random") return std::unique_ptr<Selector>(new RandomSelector());
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown selector '", name, "' (expected sparsex, cacheblend, epic or random)"));
}

std::vector<int32_t> ApplyBudget(const std::vector<float>& score, const BudgetOptions& b) {
  const int n = static_cast<int>(score.size());
  const bool fixed = b.mode == BudgetOptions::Mode::kFixed;
  const float r = std::clamp(fixed ? b.ratio : b.max_ratio, 0.0f, 1.0f);
  const int cap = std::min(n, static_cast<int>(std::lround(r * n)));
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  // Only the best `cap` tokens can be kept: a partial sort instead of ranking every token (a
  // 32K-token prompt keeps ~15%). Ties go by token order, as a stable sort would give, so the
  // selection is deterministic.
  std::partial_sort(idx.begin(), idx.begin() + cap, idx.end(), [&](int x, int y) {
    return score[x] > score[y] || (score[x] == score[y] && x < y);
  });
  int keep = cap;
  if (!fixed) {
    double total = 0;
    for (float s : score) total += std::max(0.0f, s);
    keep = 0;
    double acc = 0;
    while (keep < cap && total > 0 && acc < b.target_mass * total) {
      acc += std::max(0.0f, score[idx[keep]]);
      ++keep;
    }
  }
  idx.resize(keep);
  return idx;
}

}  // namespace sparsex

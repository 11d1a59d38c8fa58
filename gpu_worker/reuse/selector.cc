#include "gpu_worker/reuse/selector.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/json_depth.h"

namespace sparsex {
namespace {

class SparsexSelector final : public Selector {
 public:
  SparsexSelector(const SparsexWeights& w, std::string name) : w_(w), name_(std::move(name)) {}
  std::string name() const override { return name_; }
  bool needs_attention_stats() const override { return true; }
  bool needs_kv_deviation() const override { return w_.deviation > 0; }
  std::vector<float> Score(const SelectionInput& in) const override {
    // Two views of the missing cross-segment attention: how much a reused token's own query
    // reaches outside its segment (its KV was computed without that context), and how much the
    // new tokens read from it (errors there reach the answer directly). Each is normalised to a
    // distribution so neither dominates by scale. One output vector and one temporary: this
    // runs on the host between the full and the sparse layers of a 32K prefill, where each
    // fresh 128 KiB vector costs its page faults (the eight this took before: ~2.4 ms of the
    // build machine's 3.3 ms score, bench-timed).
    const size_t n = in.cross_mass.size();
    const bool has_dev = !in.kv_deviation.empty();
    // The staleness term uses the deviation's norm: the square root of the squared distance
    // the executor measures.
    auto dev_norm = [&](size_t i) { return std::sqrt(std::max(0.0f, in.kv_deviation[i])); };
    double sa = 0, sb = 0, sc = 0, sd = 0;
    for (size_t i = 0; i < n; ++i) {
      sa += std::max(0.0f, in.cross_mass[i]);
      sb += std::max(0.0f, in.new_recv[i]);
      if (has_dev) {
        sc += std::max(0.0f, in.kv_deviation[i]);
        sd += dev_norm(i);
      }
    }
    // x's share of a distribution's sum (negative values count 0; all 0 when the sum is not
    // positive).
    auto norm = [](float x, double sum) {
      return sum > 0 ? static_cast<float>(std::max(0.0f, x) / sum) : 0.0f;
    };
    std::vector<float> s(n);
    std::vector<float> p(w_.product > 0 ? n : 0);
    double sp = 0;
    for (size_t i = 0; i < n; ++i) {
      const float a = norm(in.cross_mass[i], sa), b = norm(in.new_recv[i], sb);
      s[i] = w_.cross * a + w_.recv * b + (has_dev ? w_.deviation * norm(in.kv_deviation[i], sc)
                                                   : 0.0f);
      if (w_.product > 0) {
        // The error a new token reads from a stale reused token is about its attention to it
        // times how far the token's K/V are off: the new tokens' attention times the
        // staleness (cross-segment mass, and the deviation's norm).
        p[i] = b * (w_.cross * a + (has_dev ? w_.deviation * norm(dev_norm(i), sd) : 0.0f));
        sp += std::max(0.0f, p[i]);
      }
    }
    if (w_.product > 0) {
      for (size_t i = 0; i < n; ++i) s[i] += w_.product * norm(p[i], sp);
    }
    if (w_.successor_window > 0 && w_.successor_weight != 0) {
      // Successor prior: + the mean score of the preceding tokens of the same segment (reused
      // tokens of a segment are contiguous and in offset order). Last token first, so each
      // reads its predecessors' scores before the prior changes them.
      for (size_t i = n; i-- > 0;) {
        double sum = 0;
        int cnt = 0;
        for (int k = 1; k <= w_.successor_window && static_cast<int>(i) - k >= 0; ++k) {
          const size_t j = i - k;
          if (in.segment[j] != in.segment[i]) break;
          sum += s[j];
          ++cnt;
        }
        if (cnt > 0) s[i] += w_.successor_weight * static_cast<float>(sum / cnt);
      }
    }
    return s;
  }

 private:
  SparsexWeights w_;
  std::string name_;
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

// How many tokens the budget keeps for these scores (fixed: the ratio; adaptive: the smallest
// set holding the target mass, within the cap).
size_t BudgetCount(const std::vector<float>& score, const BudgetOptions& b) {
  if (b.mode == BudgetOptions::Mode::kFixed) {
    const int n = static_cast<int>(score.size());
    return static_cast<size_t>(
        std::min(n, static_cast<int>(std::lround(std::clamp(b.ratio, 0.0f, 1.0f) * n))));
  }
  return ApplyBudget(score, b).size();
}

// Indices sorted by score, best first; ties by index (deterministic).
std::vector<int32_t> ByScore(const std::vector<float>& score, std::vector<int32_t> idx) {
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) {
    return score[x] > score[y] || (score[x] == score[y] && x < y);
  });
  return idx;
}

// A³-style (Zhou et al., arXiv 2511.17560): the reused tokens the question attends to most are
// recomputed, ranked over all segments together. Signal: attention the new tokens (the
// question) pay to each reused token in the full layers, averaged over layers and heads.
class A3Selector final : public Selector {
 public:
  std::string name() const override { return "a3"; }
  bool needs_attention_stats() const override { return true; }
  std::vector<float> Score(const SelectionInput& in) const override { return in.new_recv; }
};

// ProphetKV-style (Wang et al., ICML 2026, arXiv 2602.02579): the user query's attention in the
// full layers decides both how the budget is split over the reused segments (each gets a share
// proportional to the query attention mass it receives, largest remainder, at most its size)
// and which tokens inside a segment are recomputed (its top tokens by query attention), so
// globally salient tokens of one segment cannot crowd out the query-relevant tokens of others.
class ProphetKvSelector final : public Selector {
 public:
  std::string name() const override { return "prophetkv"; }
  bool needs_attention_stats() const override { return true; }
  std::vector<float> Score(const SelectionInput& in) const override { return in.new_recv; }
  std::vector<int32_t> Rank(const SelectionInput& in, const BudgetOptions& b) const override {
    const std::vector<float>& q = in.new_recv;
    const size_t keep = BudgetCount(q, b);
    std::map<int32_t, std::vector<int32_t>> members;  // segment -> its tokens
    std::map<int32_t, double> mass;
    double total = 0;
    for (size_t i = 0; i < q.size(); ++i) {
      members[in.segment[i]].push_back(static_cast<int32_t>(i));
      mass[in.segment[i]] += std::max(0.0f, q[i]);
      total += std::max(0.0f, q[i]);
    }
    // Quotas: floor of the proportional share, then the remaining tokens one at a time to the
    // segments with the largest remainders that still have room.
    std::map<int32_t, size_t> quota;
    std::vector<std::pair<double, int32_t>> rem;
    size_t given = 0;
    for (const auto& [s, toks] : members) {
      const double share = total > 0 ? mass[s] / total : 1.0 / members.size();
      const double want = share * static_cast<double>(keep);
      quota[s] = std::min(toks.size(), static_cast<size_t>(std::floor(want)));
      given += quota[s];
      rem.push_back({want - std::floor(want), s});
    }
    std::sort(rem.begin(), rem.end(), [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    while (given < keep) {
      bool any = false;
      for (const auto& [r, s] : rem) {
        if (given == keep) break;
        if (quota[s] < members[s].size()) {
          ++quota[s];
          ++given;
          any = true;
        }
      }
      if (!any) break;
    }
    std::vector<int32_t> kept;
    for (const auto& [s, toks] : members) {
      std::vector<int32_t> ranked = ByScore(q, toks);
      kept.insert(kept.end(), ranked.begin(), ranked.begin() + quota[s]);
    }
    return ByScore(q, kept);  // best first, for per-layer ratios
  }
};

// 16-token blocks of the reused tokens, each inside one segment and aligned to its start, in
// token order (reused tokens of one segment are contiguous and in offset order), with the mean
// score of their tokens.
struct Block {
  std::vector<int32_t> tokens;
  float mean = 0;
};
constexpr int kBlock = 16;
std::vector<Block> Blocks(const SelectionInput& in, const std::vector<float>& s) {
  std::vector<Block> out;
  std::pair<int32_t, int32_t> cur{-1, -1};
  for (size_t i = 0; i < s.size(); ++i) {
    const std::pair<int32_t, int32_t> key{in.segment[i], in.offset[i] / kBlock};
    if (out.empty() || key != cur) out.emplace_back();
    cur = key;
    out.back().tokens.push_back(static_cast<int32_t>(i));
  }
  for (Block& bl : out) {
    double sum = 0;
    for (int32_t i : bl.tokens) sum += s[i];
    bl.mean = static_cast<float>(sum / bl.tokens.size());
  }
  return out;
}

// Whole 16-token blocks of each segment (aligned to the segment start): blocks ranked by the
// mean score of their tokens, taken in that order while they fit in the token budget (a block
// that does not fit is skipped for a smaller one further down).
class BlockSelector final : public Selector {
 public:
  explicit BlockSelector(std::unique_ptr<Selector> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name() + ":block"; }
  bool needs_attention_stats() const override { return inner_->needs_attention_stats(); }
  bool needs_kv_deviation() const override { return inner_->needs_kv_deviation(); }
  std::vector<float> Score(const SelectionInput& in) const override {
    std::vector<float> s = inner_->Score(in);
    std::vector<float> out(s.size());
    for (const Block& bl : Blocks(in, s)) {
      for (int32_t i : bl.tokens) out[i] = bl.mean;
    }
    return out;
  }
  std::vector<int32_t> Rank(const SelectionInput& in, const BudgetOptions& b) const override {
    const std::vector<float> s = inner_->Score(in);
    const size_t keep = BudgetCount(s, b);
    std::vector<Block> blocks = Blocks(in, s);
    std::stable_sort(blocks.begin(), blocks.end(),
                     [](const Block& x, const Block& y) { return x.mean > y.mean; });
    std::vector<int32_t> kept;
    for (const Block& bl : blocks) {
      if (kept.size() + bl.tokens.size() > keep) continue;
      kept.insert(kept.end(), bl.tokens.begin(), bl.tokens.end());
      if (kept.size() == keep) break;
    }
    return kept;
  }

 private:
  std::unique_ptr<Selector> inner_;
};

// Token selection with a contiguity prior: each token's score plus the mean score of its
// 16-token block, so of two equally scored tokens the one among important neighbours goes
// first (the block result of docs/fidelity.md: contiguous recomputed rows have lower KL).
class SmoothSelector final : public Selector {
 public:
  explicit SmoothSelector(std::unique_ptr<Selector> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name() + ":smooth"; }
  bool needs_attention_stats() const override { return inner_->needs_attention_stats(); }
  bool needs_kv_deviation() const override { return inner_->needs_kv_deviation(); }
  std::vector<float> Score(const SelectionInput& in) const override {
    std::vector<float> s = inner_->Score(in);
    std::vector<float> out = s;
    for (const Block& bl : Blocks(in, s)) {
      for (int32_t i : bl.tokens) out[i] += bl.mean;
    }
    return out;
  }

 private:
  std::unique_ptr<Selector> inner_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Selector>> CreateSelector(const std::string& name,
                                                          const SparsexWeights& w) {
  const std::string kBlockSuffix = ":block";
  if (name.size() > kBlockSuffix.size() &&
      name.compare(name.size() - kBlockSuffix.size(), kBlockSuffix.size(), kBlockSuffix) == 0) {
    ASSIGN_OR_RETURN(std::unique_ptr<Selector> inner,
                     CreateSelector(name.substr(0, name.size() - kBlockSuffix.size()), w));
    return std::unique_ptr<Selector>(new BlockSelector(std::move(inner)));
  }
  const std::string kSmoothSuffix = ":smooth";
  if (name.size() > kSmoothSuffix.size() &&
      name.compare(name.size() - kSmoothSuffix.size(), kSmoothSuffix.size(), kSmoothSuffix) == 0) {
    ASSIGN_OR_RETURN(std::unique_ptr<Selector> inner,
                     CreateSelector(name.substr(0, name.size() - kSmoothSuffix.size()), w));
    return std::unique_ptr<Selector>(new SmoothSelector(std::move(inner)));
  }
  if (name == "sparsex") return std::unique_ptr<Selector>(new SparsexSelector(w, name));
  if (name == "sparsex-sum") {
    SparsexWeights sum = w;
    sum.product = 0;
    sum.successor_window = 0;
    return std::unique_ptr<Selector>(new SparsexSelector(sum, name));
  }
  if (name == "cacheblend") return std::unique_ptr<Selector>(new CacheBlendSelector());
  if (name == "epic") return std::unique_ptr<Selector>(new EpicSelector());
  if (name == "random") return std::unique_ptr<Selector>(new RandomSelector());
  if (name == "prophetkv") return std::unique_ptr<Selector>(new ProphetKvSelector());
  if (name == "a3") return std::unique_ptr<Selector>(new A3Selector());
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown selector '", name,
      "' (expected sparsex, sparsex-sum, cacheblend, epic, random, prophetkv or a3, optionally "
      "with ':block' or ':smooth')"));
}

std::vector<int32_t> ApplyBudget(const std::vector<float>& score, const BudgetOptions& b) {
  const int n = static_cast<int>(score.size());
  const bool fixed = b.mode == BudgetOptions::Mode::kFixed;
  const float r = std::clamp(fixed ? b.ratio : b.max_ratio, 0.0f, 1.0f);
  const int cap = std::min(n, static_cast<int>(std::lround(r * n)));
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  // Only the best `cap` tokens can be kept: selected in linear time, then only they are sorted
  // (a 32K-token prompt keeps ~15%; a heap-based partial sort cost ~1 ms more of host time
  // between the full and the sparse layers). Ties go by token order, as a stable sort would
  // give: the order is total, so the kept set and its order are deterministic.
  const auto better = [&](int x, int y) {
    return score[x] > score[y] || (score[x] == score[y] && x < y);
  };
  if (cap < n) std::nth_element(idx.begin(), idx.begin() + cap, idx.end(), better);
  std::sort(idx.begin(), idx.begin() + cap, better);
  int keep = cap;
  if (!fixed) {
    double total = 0;
    for (float s : score) total += std::max(0.0f, s);
    // adaptive: until the kept mass reaches target_mass; quality: until the predicted drop
    // (slope x uncovered share) is at most target_drop, i.e. the kept share reaches
    // 1 - target_drop / slope.
    double want = b.target_mass;
    if (b.mode == BudgetOptions::Mode::kQuality) {
      want = b.drop_per_uncovered > 0 ? 1.0 - b.target_drop / b.drop_per_uncovered : 0.0;
    }
    keep = 0;
    double acc = 0;
    while (keep < cap && total > 0 && acc < want * total) {
      acc += std::max(0.0f, score[idx[keep]]);
      ++keep;
    }
  }
  idx.resize(keep);
  return idx;
}

double UncoveredShare(const std::vector<float>& score, const std::vector<int32_t>& kept) {
  double total = 0, in = 0;
  for (float s : score) total += std::max(0.0f, s);
  for (int32_t i : kept) in += std::max(0.0f, score[i]);
  return total > 0 ? std::clamp(1.0 - in / total, 0.0, 1.0) : 1.0;
}

float QualityCalibration::SlopeFor(int F, float fallback) const {
  int best = -1;
  for (int f = 0; f < static_cast<int>(drop_per_uncovered.size()); ++f) {
    if (drop_per_uncovered[f] < 0) continue;
    if (best < 0 || std::abs(f - F) < std::abs(best - F)) best = f;
  }
  return best < 0 ? fallback : drop_per_uncovered[best];
}

absl::StatusOr<QualityCalibration> ParseQualityCalibration(const std::string& text) {
  // {"selector": "sparsex", "model_fingerprint": "<hex>", "drop_per_uncovered": {"1": 0.04}}
  if (absl::Status s = CheckJsonLimits(text, size_t{1} << 20); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("quality calibration: ", s.message()));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("drop_per_uncovered") ||
      !j["drop_per_uncovered"].is_object()) {
    return absl::InvalidArgumentError(
        "quality calibration: expected {\"drop_per_uncovered\": {\"<F>\": slope, ...}}");
  }
  QualityCalibration c;
  if (j.contains("selector") && j["selector"].is_string()) c.selector = j["selector"];
  if (j.contains("model_fingerprint") && j["model_fingerprint"].is_string()) {
    c.model_fingerprint = j["model_fingerprint"];
  }
  for (const auto& [k, v] : j["drop_per_uncovered"].items()) {
    int F = -1;
    try {
      F = std::stoi(k);
    } catch (...) {
    }
    if (F < 0 || F > 4096 || !v.is_number() || v.get<double>() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quality calibration: bad entry '", k, "' (F >= 0, slope > 0)"));
    }
    if (static_cast<int>(c.drop_per_uncovered.size()) <= F) c.drop_per_uncovered.resize(F + 1, -1);
    c.drop_per_uncovered[F] = v.get<float>();
  }
  return c;
}

absl::StatusOr<QualityCalibration> LoadQualityCalibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read quality calibration ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<QualityCalibration> c = ParseQualityCalibration(ss.str());
  if (!c.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", c.status().message()));
  return c;
}

}  // namespace sparsex

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "gpu_worker/reuse/segment_store.h"
#include "gpu_worker/reuse/selector.h"
#include "gtest/gtest.h"
#include "tests/gpu_worker/segment_faults.h"

namespace sparsex {
namespace {

TEST(Budget, FixedRatioKeepsTheTopShare) {
  std::vector<float> s = {0.1f, 0.9f, 0.3f, 0.7f, 0.0f, 0.5f, 0.2f, 0.8f, 0.4f, 0.6f};
  BudgetOptions b;
  b.ratio = 0.3f;
  EXPECT_EQ(ApplyBudget(s, b), (std::vector<int32_t>{1, 7, 3}));
  b.ratio = 0.0f;
  EXPECT_TRUE(ApplyBudget(s, b).empty());
  b.ratio = 1.0f;
  EXPECT_EQ(ApplyBudget(s, b).size(), s.size());
}

TEST(Budget, AdaptiveCoversTargetMassWithinTheCap) {
  // One dominant token holds 80% of the mass: adaptive keeps just it for a 0.5 target.
  std::vector<float> s(10, 0.2f / 9);
  s[4] = 0.8f;
  BudgetOptions b;
  b.mode = BudgetOptions::Mode::kAdaptive;
  b.target_mass = 0.5f;
  b.max_ratio = 0.5f;
  EXPECT_EQ(ApplyBudget(s, b), (std::vector<int32_t>{4}));
  // Flat scores need many tokens; the cap stops at 30%.
  std::vector<float> flat(10, 1.0f);
  b.target_mass = 0.9f;
  b.max_ratio = 0.3f;
  EXPECT_EQ(ApplyBudget(flat, b).size(), 3u);
}

// The partial ranking equals the prefix of a full stable ranking, ties in token order
// included (scores drawn from a few values so ties are common).
TEST(Budget, PartialRankingIsTheStableRankingsPrefix) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(0, 20);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> s(1000 + trial * 37);
    for (float& x : s) x = 0.05f * level(rng);
    std::vector<int32_t> ref(s.size());
    std::iota(ref.begin(), ref.end(), 0);
    std::stable_sort(ref.begin(), ref.end(), [&](int x, int y) { return s[x] > s[y]; });
    BudgetOptions b;
    b.ratio = 0.15f;
    const std::vector<int32_t> got = ApplyBudget(s, b);
    ASSERT_EQ(got.size(), static_cast<size_t>(std::lround(0.15 * s.size())));
    EXPECT_TRUE(std::equal(got.begin(), got.end(), ref.begin())) << "trial " << trial;
    b.mode = BudgetOptions::Mode::kAdaptive;
    b.target_mass = 0.4f;
    b.max_ratio = 0.5f;
    const std::vector<int32_t> adaptive = ApplyBudget(s, b);
    EXPECT_TRUE(std::equal(adaptive.begin(), adaptive.end(), ref.begin())) << "trial " << trial;
    EXPECT_GT(adaptive.size(), 0u);
  }
}

TEST(Selectors, EachRanksByItsOwnSignal) {
  SelectionInput in;
  in.segment = {0, 0, 0, 1, 1, 1};
  in.offset = {0, 1, 2, 0, 1, 2};
  in.cross_mass = {0, 0, 5, 0, 0, 0};
  in.new_recv = {0, 0, 0, 0, 5, 0};
  in.kv_deviation = {0, 9, 0, 0, 0, 0};
  auto top = [&](const std::string& name) {
    auto sel = CreateSelector(name);
    EXPECT_TRUE(sel.ok());
    BudgetOptions b;
    b.ratio = 0.5f;
    return ApplyBudget((*sel)->Score(in), b);
  };
  auto sx = top("sparsex");  // cross, recv and deviation tokens all rank first
  EXPECT_EQ(std::set<int32_t>(sx.begin(), sx.end()), (std::set<int32_t>{1, 2, 4}));
  EXPECT_EQ(top("cacheblend")[0], 1);
  auto ep = top("epic");  // segment heads first
  EXPECT_EQ(std::set<int32_t>(ep.begin(), ep.begin() + 2), (std::set<int32_t>{0, 3}));
  EXPECT_EQ(top("random").size(), 3u);
  EXPECT_FALSE(CreateSelector("bogus").ok());
}

// The sparsex score of docs/fidelity.md ("Selector score"): the product term ranks first, among
// tokens of equal additive score, the ones the new tokens read AND whose K/V are stale; the
// successor prior pulls in the tokens right after important ones, never across a segment
// boundary. "sparsex-sum" is the additive score alone (the default before).
TEST(Selectors, SparsexProductAndSuccessorPrior) {
  SelectionInput in;
  in.segment = {0, 0, 0, 0};
  in.offset = {0, 1, 2, 3};
  in.cross_mass = {0, 0, 0, 0};
  // Additive scores all 0.5: token 0 is read but not stale, token 1 stale but not read,
  // tokens 2 and 3 both.
  in.new_recv = {1.0f, 0.0f, 0.5f, 0.5f};
  in.kv_deviation = {0.0f, 1.0f, 0.5f, 0.5f};
  BudgetOptions b;
  b.ratio = 0.5f;
  SparsexWeights w;
  w.successor_window = 0;
  auto sx = CreateSelector("sparsex", w);
  ASSERT_TRUE(sx.ok());
  EXPECT_EQ((*sx)->Rank(in, b), (std::vector<int32_t>{2, 3}));
  auto sum = CreateSelector("sparsex-sum");
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ((*sum)->name(), "sparsex-sum");
  EXPECT_EQ((*sum)->Rank(in, b), (std::vector<int32_t>{0, 1}));  // all tie: token order
  w.product = 0;
  auto no_product = CreateSelector("sparsex", w);
  ASSERT_TRUE(no_product.ok());
  EXPECT_EQ((*no_product)->Score(in), (*sum)->Score(in));

  // Successor prior (window 2, the default): segment 0 = tokens 0-5, segment 1 = tokens 6-9;
  // the new tokens read tokens 2 and 5 only. Tokens 3 and 4 follow token 2 and get half its
  // score (the mean over their two predecessors); token 6 follows token 5 but starts segment 1.
  SelectionInput s2;
  for (int i = 0; i < 10; ++i) {
    s2.segment.push_back(i < 6 ? 0 : 1);
    s2.offset.push_back(i < 6 ? i : i - 6);
  }
  s2.cross_mass.assign(10, 0.0f);
  s2.new_recv.assign(10, 0.0f);
  s2.new_recv[2] = s2.new_recv[5] = 1.0f;
  auto prior = CreateSelector("sparsex");
  ASSERT_TRUE(prior.ok());
  EXPECT_EQ((*prior)->Rank(s2, b), (std::vector<int32_t>{2, 5, 3, 4, 0}));
  EXPECT_EQ((*sum)->Rank(s2, b), (std::vector<int32_t>{2, 5, 0, 1, 3}));
  EXPECT_TRUE(CreateSelector("sparsex-sum:block").ok());
}

// The sparsex score against its definition written out with one vector per term (how
// selector.cc computed it before it was fused into two passes for the host's sake): equal to
// the bit, with and without the deviation, the product term and the successor prior.
TEST(Selectors, SparsexScoreMatchesItsDefinition) {
  auto normalized = [](const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s += std::max(0.0f, x);
    std::vector<float> out(v.size(), 0.0f);
    for (size_t i = 0; i < v.size() && s > 0; ++i) {
      out[i] = static_cast<float>(std::max(0.0f, v[i]) / s);
    }
    return out;
  };
  auto reference = [&](const SelectionInput& in, const SparsexWeights& w) {
    const std::vector<float> a = normalized(in.cross_mass), b = normalized(in.new_recv);
    const std::vector<float> c = normalized(in.kv_deviation);
    const size_t n = a.size();
    std::vector<float> s(n);
    for (size_t i = 0; i < n; ++i) {
      s[i] = w.cross * a[i] + w.recv * b[i] + (c.empty() ? 0.0f : w.deviation * c[i]);
    }
    if (w.product > 0) {
      std::vector<float> d = in.kv_deviation;
      for (float& x : d) x = std::sqrt(std::max(0.0f, x));
      d = normalized(d);
      std::vector<float> p(n);
      for (size_t i = 0; i < n; ++i) {
        p[i] = b[i] * (w.cross * a[i] + (d.empty() ? 0.0f : w.deviation * d[i]));
      }
      p = normalized(p);
      for (size_t i = 0; i < n; ++i) s[i] += w.product * p[i];
    }
    std::vector<float> out = s;
    for (size_t i = 0; i < n && w.successor_window > 0 && w.successor_weight != 0; ++i) {
      double sum = 0;
      int cnt = 0;
      for (int k = 1; k <= w.successor_window && static_cast<int>(i) - k >= 0; ++k) {
        if (in.segment[i - k] != in.segment[i]) break;
        sum += s[i - k];
        ++cnt;
      }
      if (cnt > 0) out[i] += w.successor_weight * static_cast<float>(sum / cnt);
    }
    return out;
  };
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-0.1f, 1.0f);
  for (int trial = 0; trial < 24; ++trial) {
    SelectionInput in;
    for (int seg = 0; seg < 1 + trial % 5; ++seg) {
      for (int o = 0; o < 300 + 17 * seg; ++o) {
        in.segment.push_back(seg);
        in.offset.push_back(o);
        in.cross_mass.push_back(u(rng));
        in.new_recv.push_back(trial % 6 == 0 ? 0.0f : u(rng) * u(rng));  // no new-token signal
        if (trial % 3 != 0) in.kv_deviation.push_back(u(rng));
      }
    }
    SparsexWeights w;
    if (trial % 4 == 1) w.product = 0;
    if (trial % 4 == 2) w.successor_window = 5;
    if (trial % 4 == 3) w.successor_weight = 0;
    auto sel = CreateSelector("sparsex", w);
    ASSERT_TRUE(sel.ok());
    const std::vector<float> want = reference(in, w), got = (*sel)->Score(in);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "trial " << trial << " token " << i;
    }
  }
}

// ProphetKV-style: the budget is split over segments by their share of the new tokens'
// attention, then each segment keeps its own top tokens; A³-style ranks all tokens together.
TEST(Selectors, QueryAwareBaselines) {
  SelectionInput in;
  // Segment 0 holds 75% of the query attention (one dominant token), segment 1 25%.
  in.segment = {0, 0, 0, 0, 1, 1, 1, 1};
  in.offset = {0, 1, 2, 3, 0, 1, 2, 3};
  in.new_recv = {0.60f, 0.10f, 0.04f, 0.01f, 0.09f, 0.08f, 0.05f, 0.03f};
  in.cross_mass.assign(8, 0.0f);
  BudgetOptions b;
  b.ratio = 0.5f;  // 4 tokens: 3 to segment 0, 1 to segment 1
  auto pk = CreateSelector("prophetkv");
  ASSERT_TRUE(pk.ok());
  EXPECT_EQ((*pk)->Rank(in, b), (std::vector<int32_t>{0, 1, 4, 2}));
  auto a3 = CreateSelector("a3");
  ASSERT_TRUE(a3.ok());
  EXPECT_EQ((*a3)->Rank(in, b), (std::vector<int32_t>{0, 1, 4, 5}));
  // A segment never gets more than it has; the rest goes to the others.
  b.ratio = 1.0f;
  EXPECT_EQ((*pk)->Rank(in, b).size(), 8u);
  b.ratio = 0.0f;
  EXPECT_TRUE((*pk)->Rank(in, b).empty());
}

// Block granularity: whole 16-token blocks of a segment (aligned to its start), by mean score,
// as many as fit in the token budget.
TEST(Selectors, BlockGranularKeepsWholeBlocks) {
  SelectionInput in;
  // Segment 0: 40 tokens (blocks of 16, 16, 8); segment 1: 20 tokens (16, 4).
  for (int i = 0; i < 40; ++i) {
    in.segment.push_back(0);
    in.offset.push_back(i);
  }
  for (int i = 0; i < 20; ++i) {
    in.segment.push_back(1);
    in.offset.push_back(i);
  }
  in.new_recv.assign(60, 0.0f);
  in.new_recv[20] = 1.0f;  // segment 0, block 1 (tokens 16-31)
  in.new_recv[58] = 0.5f;  // segment 1, block 1 (tokens 56-59, 4 tokens)
  in.new_recv[45] = 0.4f;  // segment 1, block 0 (tokens 40-55): mean 0.025
  in.cross_mass.assign(60, 0.0f);
  auto sel = CreateSelector("a3:block");
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ((*sel)->name(), "a3:block");
  BudgetOptions b;
  // 21 tokens: block (1,1) first (mean 0.125 over 4 tokens), then (0,1) (mean 0.0625 over 16);
  // no other block fits in the last token.
  b.ratio = 0.35f;
  std::vector<int32_t> kept = (*sel)->Rank(in, b);
  std::vector<int32_t> want;
  for (int i = 56; i < 60; ++i) want.push_back(i);
  for (int i = 16; i < 32; ++i) want.push_back(i);
  EXPECT_EQ(kept, want);
  EXPECT_FALSE(CreateSelector("bogus:block").ok());
  EXPECT_FALSE(CreateSelector(":block").ok());
  // ':smooth' keeps token granularity but adds each token's block mean: tokens 44 and 58 tie
  // at 0.5 (token order puts 44 first); 58's block is richer (mean 0.125 vs 0.05625), so with
  // the contiguity prior it goes first.
  in.new_recv[44] = 0.5f;
  b.ratio = 3.0f / 60;
  auto plain = CreateSelector("a3");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->Rank(in, b), (std::vector<int32_t>{20, 44, 58}));
  auto sm = CreateSelector("a3:smooth");
  ASSERT_TRUE(sm.ok());
  EXPECT_EQ((*sm)->name(), "a3:smooth");
  EXPECT_EQ((*sm)->Rank(in, b), (std::vector<int32_t>{20, 58, 44}));
}

SegmentKv MakeKv(int n, int layers, int dim, float v) {
  SegmentKv kv;
  kv.n_tokens = n;
  kv.n_layers = layers;
  kv.kv_dim = dim;
  kv.k.assign(layers, std::vector<float>(n * dim, v));
  kv.v.assign(layers, std::vector<float>(n * dim, -v));
  return kv;
}

// Eviction takes, among the least recently used entries, the one used least: a popular segment
// that was not touched for a while survives a newer one that was never reused.
TEST(QualityCalibration, ParsesTheModelAndRefusesBadFiles) {
  auto c = ParseQualityCalibration(
      R"({"selector": "sparsex", "model_fingerprint": "8fa7d654353b45a8f6cacbc13e2d9a46",
          "drop_per_uncovered": {"1": 0.08, "2": 0.06}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_fingerprint, "8fa7d654353b45a8f6cacbc13e2d9a46");
  EXPECT_FLOAT_EQ(c->SlopeFor(2, 1.0f), 0.06f);
  auto old = ParseQualityCalibration(R"({"drop_per_uncovered": {"2": 0.06}})");
  ASSERT_TRUE(old.ok());
  EXPECT_TRUE(old->model_fingerprint.empty());  // not recorded: accepted for any model
  EXPECT_FALSE(ParseQualityCalibration(R"({"drop_per_uncovered": {"x": 0.06}})").ok());
  EXPECT_FALSE(ParseQualityCalibration(std::string(5000, '[') + std::string(5000, ']')).ok());
}

TEST(SegmentStore, EvictionPrefersTheLeastUsedOfTheOldest) {
  const size_t one = MakeKv(20, 2, 8, 0).bytes();
  SegmentStore store({.capacity_bytes = 3 * one});
  Hash128 a = HashBytes128("a", 1), b = HashBytes128("b", 1), c = HashBytes128("c", 1),
          d = HashBytes128("d", 1);
  ASSERT_TRUE(store.Put(a, MakeKv(20, 2, 8, 1)).ok());
  for (int i = 0; i < 3; ++i) ASSERT_NE(store.Get(a), nullptr);
  ASSERT_TRUE(store.Put(b, MakeKv(20, 2, 8, 2)).ok());
  ASSERT_TRUE(store.Put(c, MakeKv(20, 2, 8, 3)).ok());
  // LRU order a, b, c; uses a 3, b 0, c 0: b goes (plain LRU would drop a).
  ASSERT_TRUE(store.Put(d, MakeKv(20, 2, 8, 4)).ok());
  EXPECT_TRUE(store.Contains(a));
  EXPECT_FALSE(store.Contains(b));
  EXPECT_TRUE(store.Contains(c));
  EXPECT_TRUE(store.Contains(d));
}

TEST(SegmentStore, CapacityLruAndChecksums) {
  const size_t one = MakeKv(20, 2, 8, 0).bytes();
  SegmentStore store({.capacity_bytes = 3 * one});
  Hash128 a = HashBytes128("a", 1), b = HashBytes128("b", 1), c = HashBytes128("c", 1),
          d = HashBytes128("d", 1);
  ASSERT_TRUE(store.Put(a, MakeKv(20, 2, 8, 1)).ok());
  ASSERT_TRUE(store.Put(b, MakeKv(20, 2, 8, 2)).ok());
  ASSERT_TRUE(store.Put(c, MakeKv(20, 2, 8, 3)).ok());
  ASSERT_NE(store.Get(a), nullptr);  // a becomes most recently used
  ASSERT_TRUE(store.Put(d, MakeKv(20, 2, 8, 4)).ok());
  EXPECT_FALSE(store.Contains(b));  // least recently used went
  EXPECT_TRUE(store.Contains(a));
  EXPECT_LE(store.stats().bytes, 3 * one);
  EXPECT_EQ(store.stats().evictions, 1);
  auto got = store.Get(d);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->k[1][5], 4.0f);
  EXPECT_EQ(got->v[0][0], -4.0f);
  // Corruption: detected on use, reported as a miss, entry dropped.
  ASSERT_TRUE(testing::CorruptStoredSegment(store, c));
  EXPECT_EQ(store.Get(c), nullptr);
  EXPECT_EQ(store.stats().corrupt, 1);
  EXPECT_FALSE(store.Contains(c));
  // Too large for the whole store: refused, nothing evicted.
  EXPECT_EQ(store.Put(HashBytes128("big", 3), MakeKv(100, 2, 8, 1)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Contains(a));
}

}  // namespace
}  // namespace sparsex

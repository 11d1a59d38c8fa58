// Segment reuse with sparse recompute on the real stories260K model.
#include "gpu_worker/reuse/reuse_prefill.h"

#include "common/bf16.h"
#include "common/fingerprint.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include "tests/gpu_worker/test_util.h"
#include "tests/gpu_worker/segment_faults.h"

namespace sparsex {
namespace {

class ReuseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadStories260K();
    ASSERT_NE(model_, nullptr);
    EngineOptions eo;
    eo.kv.num_blocks = 512;
    eo.kv.enable_prefix_caching = false;
    auto e = Engine::Create(*model_, eo);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    store_ = std::make_unique<SegmentStore>(SegmentStoreOptions{});
    reuse_ = std::make_unique<ReuseEngine>(engine_.get(), store_.get(), ReuseOptions{});
  }
  std::vector<int32_t> Enc(const std::string& s) { return model_->tokenizer().Encode(s, false); }

  // What a bf16 cluster fetch of segment `seg` (stored now) delivers, and the same KV rounded
  // to bf16 in fp32 (what a store holding the fetched values would give).
  std::tuple<Hash128, SegmentKvBf16, SegmentKv> Fetchable(const PromptSegment& seg) {
    EXPECT_TRUE(reuse_->EnsureStored(seg.tokens).ok());
    const Hash128 fp = reuse_->Fingerprint(seg.tokens, ReuseOptions{}.encoding);
    auto kv = store_->Get(fp);
    EXPECT_NE(kv, nullptr);
    SegmentKvBf16 b;
    SegmentKv r;
    if (kv == nullptr) return {fp, b, r};
    b.n_tokens = r.n_tokens = kv->n_tokens;
    b.n_layers = r.n_layers = kv->n_layers;
    b.kv_dim = r.kv_dim = kv->kv_dim;
    for (int l = 0; l < kv->n_layers; ++l) {
      auto& bk = b.k.emplace_back();
      auto& bv = b.v.emplace_back();
      auto& rk = r.k.emplace_back();
      auto& rv = r.v.emplace_back();
      for (float x : kv->k[l]) {
        bk.push_back(ToBf16(x));
        rk.push_back(FromBf16(bk.back()));
      }
      for (float x : kv->v[l]) {
        bv.push_back(ToBf16(x));
        rv.push_back(FromBf16(bv.back()));
      }
    }
    return {fp, std::move(b), std::move(r)};
  }

  // Logits of a plain full prefill of the same segments.
  std::vector<float> Full(const std::vector<PromptSegment>& segs, bool add_bos = true) {
    ReuseOptions o;
    o.enable_reuse = false;
    auto r = reuse_->Prefill(segs, add_bos, &o);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    engine_->Release(r->seq);
    return r->logits;
  }
  ReusePrefillResult Run(const std::vector<PromptSegment>& segs, const ReuseOptions& o,
                         bool add_bos = true) {
    return RunOn(*reuse_, segs, &o, add_bos);
  }
  // The same on another reuse engine over the fixture's engine (other tiers or stores).
  ReusePrefillResult RunOn(ReuseEngine& re, const std::vector<PromptSegment>& segs,
                           const ReuseOptions* o = nullptr, bool add_bos = true) {
    auto r = re.Prefill(segs, add_bos, o);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    engine_->Release(r->seq);
    return std::move(*r);
  }
  // Layer l of a streamed segment arrives from `from`, K then V (as a fetch's decode hands it).
  static void Arrive(StreamedSegment& in, const SegmentKvBf16& from, int l) {
    std::span<uint16_t> k = in.Half(l, 0);
    ASSERT_EQ(k.size(), from.k[l].size());
    std::copy(from.k[l].begin(), from.k[l].end(), k.begin());
    in.HalfDone(l);
    std::span<uint16_t> v = in.Half(l, 1);
    ASSERT_EQ(v.size(), from.v[l].size());
    std::copy(from.v[l].begin(), from.v[l].end(), v.begin());
    in.HalfDone(l);
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<SegmentStore> store_;
  std::unique_ptr<ReuseEngine> reuse_;
  const std::string kDocA = "Lily went to the park with her mom. They saw a big red ball and played "
                            "with it all day long until the sun went down.";
  const std::string kDocB = "Tom had a little dog named Max. Max liked to run and jump in the "
                            "garden, and he barked at the birds in the tall tree.";
  const std::string kDocC = "One day, a bird flew into the kitchen.";
  const std::string kQ = " What did they do next? They";
};

TEST_F(ReuseTest, FullRecomputeEqualsFullPrefillForEverySelector) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kDocC)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  const std::vector<float> full = Full(segs);
  for (const char* sel : {"sparsex", "cacheblend", "epic", "random", "prophetkv", "a3",
                          "sparsex:block", "sparsex:smooth"}) {
    for (int F : {0, 1, 2}) {
      ReuseOptions o;
      o.selector = sel;
      o.full_layers = F;
      o.budget.ratio = 1.0f;
      ReusePrefillResult r = Run(segs, o);
      EXPECT_GT(r.stats.reused_tokens, 0);
      EXPECT_LT(testing::MaxAbsDiff(full, r.logits), 1e-4) << sel << " F=" << F;
      EXPECT_NEAR(r.stats.compute_share, 1.0, 1e-9);
    }
  }
}

TEST_F(ReuseTest, LayerFKvIsRefreshedForEveryReusedToken) {
  // With one sparse layer (F = L - 1) and nothing selected, the last row's attention at layer F
  // reads every token's K/V there: refreshed from the exact input the full layers computed,
  // the logits are full prefill's; left stale (the option off), they are not. The projection
  // counts in the compute share either way.
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kDocC)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  const std::vector<float> full = Full(segs);
  const int L = model_->config().n_layers;
  for (const char* sel : {"sparsex", "a3", "random"}) {
    ReuseOptions o;
    o.selector = sel;
    o.full_layers = L - 1;
    o.budget.ratio = 0.0f;
    ReusePrefillResult fresh = Run(segs, o);
    EXPECT_GT(fresh.stats.reused_tokens, 0);
    EXPECT_EQ(fresh.stats.selected_tokens, 0);
    EXPECT_LT(testing::MaxAbsDiff(full, fresh.logits), 1e-4) << sel;
    const int n = fresh.stats.prompt_tokens - fresh.stats.prefix_tokens;
    const double phi = engine_->runner().ProjectionCost();
    EXPECT_GT(phi, 0.0);
    EXPECT_LT(phi, 0.5);
    EXPECT_NEAR(fresh.stats.projected_token_layers, phi * n, 1e-6);
    EXPECT_NEAR(fresh.stats.compute_share,
                ((L - 1.0) * n + fresh.stats.new_tokens + phi * n) / (L * n), 1e-9);
    o.refresh_first_sparse_kv = false;
    ReusePrefillResult stale = Run(segs, o);
    EXPECT_GT(testing::MaxAbsDiff(full, stale.logits), 1e-3) << sel;
    // Only the selectors that rank by the deviation still project.
    EXPECT_EQ(stale.stats.projected_token_layers > 0, std::string(sel) == "sparsex") << sel;
  }
}

TEST_F(ReuseTest, KvAssembledAheadOrLayerByLayerGivesTheSameLogits) {
  // ReuseOptions::assemble_kv_ahead only moves the device-tier segments' KV assembly of every
  // sparse layer to the selection: the same writes in the same per-layer order, so the logits
  // are identical, with layer F refreshed or assembled too, at several ratios.
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kDocC)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  for (bool refresh : {true, false}) {
    for (float ratio : {0.0f, 0.15f, 0.5f}) {
      ReuseOptions o;
      o.budget.ratio = ratio;
      o.refresh_first_sparse_kv = refresh;
      ReusePrefillResult ahead = Run(segs, o);
      EXPECT_GT(ahead.stats.reused_tokens, 0);
      o.assemble_kv_ahead = false;
      ReusePrefillResult by_layer = Run(segs, o);
      EXPECT_EQ(testing::MaxAbsDiff(ahead.logits, by_layer.logits), 0.0)
          << "refresh " << refresh << " ratio " << ratio;
    }
  }
}

TEST_F(ReuseTest, NaiveReuseEqualsExactKvWhenTheEncodingContextMatches) {
  // A segment stored after a fixed prefix and reused right after that same prefix at its new
  // position has exactly the KV full prefill computes: naive reuse (F=0, r=0) must match full
  // prefill. This checks assembly and RoPE re-alignment at a shifted position.
  std::vector<int32_t> a = Enc(kDocA);
  std::string ctx = "prefix:";
  ctx += std::to_string(model_->tokenizer().bos_id());
  for (int32_t t : a) ctx += " " + std::to_string(t);
  ReuseOptions o;
  o.encoding = ctx;
  o.full_layers = 0;
  o.budget.ratio = 0.0f;
  std::vector<int32_t> b = Enc(kDocB);
  ASSERT_TRUE(reuse_->EnsureStored(b, &o).ok());
  std::vector<PromptSegment> segs = {{a, false}, {b}, {Enc(kQ), false}};
  ReusePrefillResult r = Run(segs, o);
  EXPECT_EQ(r.stats.reused_tokens, static_cast<int>(b.size()));
  EXPECT_EQ(r.stats.selected_tokens, 0);
  EXPECT_LT(testing::MaxAbsDiff(Full(segs), r.logits), 1e-4);
  // The same with "bos" encoding and the segment right after BOS.
  ReuseOptions ob = o;
  ob.encoding = "bos";
  ASSERT_TRUE(reuse_->EnsureStored(b, &ob).ok());
  std::vector<PromptSegment> segs2 = {{b}, {Enc(kQ), false}};
  EXPECT_LT(testing::MaxAbsDiff(Full(segs2), Run(segs2, ob).logits), 1e-4);
  // And "none" without BOS: the segment at position 0 is exactly its standalone encoding.
  ReuseOptions on = o;
  on.encoding = "none";
  ASSERT_TRUE(reuse_->EnsureStored(b, &on).ok());
  EXPECT_LT(testing::MaxAbsDiff(Full(segs2, false), Run(segs2, on, false).logits), 1e-4);
}

TEST_F(ReuseTest, NaiveReuseDiffersWhenContextIsMissingAndRecomputeHelps) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  const std::vector<float> full = Full(segs);
  ReuseOptions naive;
  naive.full_layers = 0;
  naive.budget.ratio = 0;
  ReuseOptions half;
  half.full_layers = 1;
  half.budget.ratio = 0.5f;
  const float dn = testing::MaxAbsDiff(full, Run(segs, naive).logits);
  const float dh = testing::MaxAbsDiff(full, Run(segs, half).logits);
  EXPECT_GT(dn, 1e-3);  // reuse really is approximate without the cross-segment attention
  EXPECT_LT(dh, dn);
}

TEST_F(ReuseTest, EdgeCasesRunAndCount) {
  std::vector<int32_t> a = Enc(kDocA), b = Enc(kDocB), c = Enc(kDocC);
  for (auto* t : {&a, &b, &c}) ASSERT_TRUE(reuse_->EnsureStored(*t).ok());
  ASSERT_TRUE(reuse_->EnsureStored({a[0]}).ok());  // one-token segment
  ReuseOptions o;  // defaults
  // Reordered segments: every document is found.
  ReusePrefillResult r1 = Run({{c}, {a}, {b}, {Enc(kQ), false}}, o);
  EXPECT_EQ(r1.stats.segments_hit, 3);
  EXPECT_EQ(r1.stats.reused_tokens, static_cast<int>(a.size() + b.size() + c.size()));
  // The same segment twice in one prompt, an empty and a one-token segment.
  ReusePrefillResult r2 = Run({{a}, {}, {std::vector<int32_t>{a[0]}}, {a}, {Enc(kQ), false}}, o);
  EXPECT_EQ(r2.stats.segments_hit, 3);
  EXPECT_EQ(r2.stats.reused_tokens, static_cast<int>(2 * a.size() + 1));
  // 100% hits: the last token is still computed (its logits are the answer), BOS too.
  ReusePrefillResult r3 = Run({{a}, {b}}, o);
  EXPECT_EQ(r3.stats.new_tokens, 2);
  EXPECT_EQ(r3.stats.reused_tokens, static_cast<int>(a.size() + b.size()) - 1);
  EXPECT_EQ(r3.logits.size(), static_cast<size_t>(model_->config().vocab_size));
  // Segments longer than a block and not block-aligned are the norm here.
  EXPECT_GT(a.size(), 16u);
  EXPECT_NE((a.size() + 1) % 16, 0u);
  // Over the context length: a clear error.
  std::vector<int32_t> huge(model_->config().max_seq_len, a[0]);
  auto bad = reuse_->Prefill({{huge}, {a}}, true, &o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("context length"), std::string::npos);
  EXPECT_EQ(engine_->blocks().available(), engine_->blocks().num_blocks());
}

TEST_F(ReuseTest, ExactPrefixPlusReusedSegments) {
  EngineOptions eo;  // prefix caching on
  auto e = Engine::Create(*model_, eo);
  ASSERT_TRUE(e.ok());
  ReuseEngine re(e->get(), store_.get(), {});
  std::vector<int32_t> a = Enc(kDocA), b = Enc(kDocB), c = Enc(kDocC);
  ReuseOptions o;
  // First request computes a, b (stored) and registers its blocks as prefix.
  auto r0 = re.Prefill({{a}, {b}, {Enc(kQ), false}}, true, &o);
  ASSERT_TRUE(r0.ok()) << r0.status();
  (*e)->Release(r0->seq);
  EXPECT_EQ(r0->stats.segments_missed, 2);
  // Follow-up: same start (exact prefix over a's full blocks), then b and c reused/new.
  auto r1 = re.Prefill({{a}, {c}, {b}, {Enc(kQ), false}}, true, &o);
  ASSERT_TRUE(r1.ok()) << r1.status();
  (*e)->Release(r1->seq);
  EXPECT_EQ(r1->stats.prefix_tokens, static_cast<int>((1 + a.size()) / 16 * 16));
  EXPECT_GT(r1->stats.prefix_tokens, 0);
  EXPECT_GE(r1->stats.segments_hit, 1);  // b from the store (a's tail too if it spans blocks)
  // Only exact blocks were registered by r1 (those before its first approximated token), so
  // with full recompute the answer is exact despite the mix.
  o.budget.ratio = 1.0f;
  auto r2 = re.Prefill({{a}, {c}, {b}, {Enc(kQ), false}}, true, &o);
  ASSERT_TRUE(r2.ok());
  (*e)->Release(r2->seq);
  EXPECT_LT(testing::MaxAbsDiff(Full({{a}, {c}, {b}, {Enc(kQ), false}}), r2->logits), 1e-4);
}

// A conversation: each turn re-sends the history plus a new message. The last turn's tail lies
// past the exact prefix (its partial block); it is computed, not reused approximately, so every
// turn's blocks stay exact and the next turn's exact prefix covers the whole history.
TEST_F(ReuseTest, ConversationKeepsItsExactPrefixGrowing) {
  EngineOptions eo;  // prefix caching on
  auto e = Engine::Create(*model_, eo);
  ASSERT_TRUE(e.ok());
  ReuseEngine re(e->get(), store_.get(), {});
  const std::vector<std::vector<int32_t>> turns = {Enc(kDocA), Enc(kDocB), Enc(kDocC),
                                                   Enc(kQ + std::string(" Tom ran home."))};
  std::vector<PromptSegment> history;
  int prev_tokens = 0;  // prompt length of the previous turn (BOS included)
  for (size_t t = 0; t < turns.size(); ++t) {
    history.push_back({turns[t], true});
    auto r = re.Prefill(history, true, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    (*e)->Release(r->seq);
    const int n = r->stats.prompt_tokens;
    EXPECT_EQ(r->stats.exact_tokens, n) << "turn " << t;
    EXPECT_EQ(r->stats.reused_tokens, 0) << "turn " << t;
    // Every full block of the previous turn's prompt is an exact hit now.
    EXPECT_EQ(r->stats.prefix_tokens, t == 0 ? 0 : (prev_tokens - 1) / 16 * 16) << "turn " << t;
    prev_tokens = n;
  }
}

// With register_approximate_prefix a reuse request's blocks past its exact KV go to the
// approximate namespace: the next turn (same prompt + more) continues on them instead of running
// reuse over its whole history again, while a request with reuse off never sees them.
TEST_F(ReuseTest, ApproximatePrefixServesTheNextTurnButNeverAPlainRequest) {
  EngineOptions eo;  // prefix caching on
  auto e = Engine::Create(*model_, eo);
  ASSERT_TRUE(e.ok());
  std::vector<int32_t> a = Enc(kDocA), b = Enc(kDocB), c = Enc(kDocC), q = Enc(kQ);
  for (const auto& s : {a, b}) ASSERT_TRUE(reuse_->EnsureStored(s).ok());
  ReuseEngine re(e->get(), store_.get(), {});
  ReuseOptions o;
  o.register_approximate_prefix = true;
  std::vector<PromptSegment> turn1 = {{b}, {a}, {c}};
  auto r1 = re.Prefill(turn1, true, &o);
  ASSERT_TRUE(r1.ok()) << r1.status();
  ASSERT_LT(r1->stats.exact_tokens, r1->stats.prompt_tokens);  // b, a reused approximately
  const std::vector<float> turn1_logits = r1->logits;
  (*e)->Release(r1->seq);
  std::vector<PromptSegment> turn2 = turn1;
  turn2.push_back({q, false});
  auto r2 = re.Prefill(turn2, true, &o);
  ASSERT_TRUE(r2.ok()) << r2.status();
  (*e)->Release(r2->seq);
  // Every full block of turn 1's prompt is a prefix hit; nothing before it is recomputed.
  EXPECT_EQ(r2->stats.prefix_tokens, (r1->stats.prompt_tokens - 1) / 16 * 16);
  EXPECT_LE(r2->stats.exact_tokens, r1->stats.exact_tokens);
  EXPECT_EQ(r2->stats.reused_tokens, 0);
  // Reuse off: only exact blocks match, so the answer equals a cold full prefill.
  ReuseOptions off;
  off.enable_reuse = false;
  off.register_prefix = false;  // leaves no exact blocks for the check below
  auto r3 = re.Prefill(turn2, true, &off);
  ASSERT_TRUE(r3.ok()) << r3.status();
  (*e)->Release(r3->seq);
  EXPECT_LE(r3->stats.prefix_tokens, r1->stats.exact_tokens);
  EXPECT_LT(testing::MaxAbsDiff(Full(turn2), r3->logits), 1e-4);
  // Without the option the same reuse request does not match the approximate blocks.
  ReuseOptions strict;
  auto r4 = re.Prefill(turn2, true, &strict);
  ASSERT_TRUE(r4.ok()) << r4.status();
  (*e)->Release(r4->seq);
  EXPECT_LE(r4->stats.prefix_tokens, r1->stats.exact_tokens);
  EXPECT_GT(r4->stats.reused_tokens, 0);
  (void)turn1_logits;
}

// With a device tier a store keeps the KV in backend memory (no host copy on the request's
// path); SpillOne later copies it to the host store, equal to a direct host store's copy.
TEST_F(ReuseTest, DeviceTierStoreSpillsToTheHostStoreUnchanged) {
  std::vector<int32_t> a = Enc(kDocA), b = Enc(kDocB);
  SegmentStore host(SegmentStoreOptions{});
  ReuseEngine tiered(engine_.get(), &host, {}, size_t{64} << 20);
  ASSERT_TRUE(tiered.EnsureStored(a).ok());
  ASSERT_TRUE(tiered.EnsureStored(b).ok());
  const Hash128 fa = tiered.Fingerprint(a, "none"), fb = tiered.Fingerprint(b, "none");
  EXPECT_FALSE(host.Contains(fa));  // in the device tier only
  EXPECT_TRUE(tiered.Holds(fa));
  EXPECT_EQ(tiered.unspilled(), 2u);
  // Served from the device tier before any spill.
  auto r = tiered.Prefill({{b}, {a}, {Enc(kQ), false}});
  ASSERT_TRUE(r.ok()) << r.status();
  engine_->Release(r->seq);
  EXPECT_EQ(r->stats.segments_device_hit, 2);
  EXPECT_TRUE(r->missing.empty());
  // Spill both, oldest first; then nothing is left.
  auto s1 = tiered.SpillOne();
  ASSERT_TRUE(s1.ok() && s1->has_value());
  EXPECT_EQ((*s1)->first, fa);
  EXPECT_EQ((*s1)->second, static_cast<int>(a.size()));
  auto s2 = tiered.SpillOne();
  ASSERT_TRUE(s2.ok() && s2->has_value());
  EXPECT_EQ((*s2)->first, fb);
  auto s3 = tiered.SpillOne();
  ASSERT_TRUE(s3.ok());
  EXPECT_FALSE(s3->has_value());
  // The spilled KV equals the host path's encoding of the same segment.
  ASSERT_TRUE(reuse_->EnsureStored(a).ok());
  auto direct = store_->Get(fa);
  auto spilled = host.Get(fa);
  ASSERT_NE(direct, nullptr);
  ASSERT_NE(spilled, nullptr);
  ASSERT_EQ(direct->n_layers, spilled->n_layers);
  float m = 0;
  for (int l = 0; l < direct->n_layers; ++l) {
    m = std::max(m, testing::MaxAbsDiff(direct->k[l], spilled->k[l]));
    m = std::max(m, testing::MaxAbsDiff(direct->v[l], spilled->v[l]));
  }
  EXPECT_LT(m, 1e-6);
  // A segment too large for the tier goes straight to the host store.
  SegmentStore host2(SegmentStoreOptions{});
  ReuseEngine tiny(engine_.get(), &host2, {}, 16);
  ASSERT_TRUE(tiny.EnsureStored(a).ok());
  EXPECT_TRUE(host2.Contains(fa));
  EXPECT_EQ(tiny.unspilled(), 0u);
}

TEST_F(ReuseTest, PerLayerRatiosAndAdaptiveBudget) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kDocC)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  ReuseOptions o;
  o.full_layers = 2;
  o.budget.ratio = 0.5f;
  o.layer_ratios = {0.5f, 0.25f, 0.0f};  // layers 2, 3, 4
  ReusePrefillResult r = Run(segs, o);
  const int n = r.stats.prompt_tokens - r.stats.prefix_tokens;
  const int reused = r.stats.reused_tokens, fresh = r.stats.new_tokens;
  const int64_t expect = 2LL * n + (std::lround(0.5 * reused) + fresh) +
                         (std::lround(0.25 * reused) + fresh) + fresh;
  EXPECT_EQ(r.stats.computed_token_layers, expect);
  EXPECT_LT(r.stats.exact_tokens, r.stats.prompt_tokens);
  o.layer_ratios = {0.1f, 0.5f};  // increasing: rejected
  EXPECT_FALSE(reuse_->Prefill(segs, true, &o).ok());
  ReuseOptions a;
  a.budget.mode = BudgetOptions::Mode::kAdaptive;
  a.budget.target_mass = 0.5f;
  a.budget.max_ratio = 0.3f;
  ReusePrefillResult ra = Run(segs, a);
  EXPECT_GT(ra.stats.selected_tokens, 0);
  EXPECT_LE(ra.stats.selected_tokens, std::lround(0.3 * ra.stats.reused_tokens));
}

TEST_F(ReuseTest, DeviceTierServesRepeatsWithIdenticalResults) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  ReuseEngine tiered(engine_.get(), store_.get(), {}, size_t{64} << 20);
  auto a = tiered.Prefill(segs);
  ASSERT_TRUE(a.ok());
  engine_->Release(a->seq);
  EXPECT_EQ(a->stats.segments_device_hit, 0);
  EXPECT_GT(tiered.device_tier().bytes(), 0u);
  std::swap(segs[0], segs[1]);  // reordered: still device hits
  auto b = tiered.Prefill(segs);
  ASSERT_TRUE(b.ok());
  engine_->Release(b->seq);
  EXPECT_EQ(b->stats.segments_device_hit, 2);
  EXPECT_LT(testing::MaxAbsDiff(Run(segs, ReuseOptions{}).logits, b->logits), 1e-6);
  // A tier too small for a segment still serves the request (from the host store).
  ReuseEngine tiny(engine_.get(), store_.get(), {}, 16);
  auto c = tiny.Prefill(segs);
  ASSERT_TRUE(c.ok());
  engine_->Release(c->seq);
  EXPECT_EQ(c->stats.segments_hit, 2);
  EXPECT_EQ(tiny.device_tier().bytes(), 0u);
}

// A cluster fetch hands segments over in bf16 (ReuseEngine::OfferFetched): the next prefill
// finds them in the device tier, with the same logits as the same bf16 values served from the
// host store; they count as held before that, and reach the store through SpillOne.
TEST_F(ReuseTest, FetchedBf16SegmentsServeFromTheDeviceTier) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
  SegmentStore rounded(SegmentStoreOptions{}), empty(SegmentStoreOptions{});
  ReuseEngine fetched(engine_.get(), &empty, {}, size_t{64} << 20);
  std::vector<Hash128> fps;
  for (int i = 0; i < 2; ++i) {
    auto [fp, b, r] = Fetchable(segs[i]);
    fps.push_back(fp);
    ASSERT_TRUE(rounded.Put(fp, std::move(r)).ok());
    EXPECT_FALSE(fetched.Holds(fp));
    fetched.OfferFetched(fp, std::move(b));
    EXPECT_TRUE(fetched.Holds(fp));  // held from the offer on: not fetched twice
  }
  const ReusePrefillResult a = RunOn(fetched, segs);
  EXPECT_EQ(a.stats.segments_device_hit, 2);
  EXPECT_EQ(fetched.unspilled(), 2u);
  ReuseEngine from_store(engine_.get(), &rounded, {}, size_t{64} << 20);
  const ReusePrefillResult b = RunOn(from_store, segs);
  EXPECT_EQ(b.stats.segments_device_hit, 0);
  EXPECT_EQ(b.stats.segments_hit, 2);
  EXPECT_EQ(testing::MaxAbsDiff(a.logits, b.logits), 0.0);
  // The idle-time spill copies them into the host store.
  for (int guard = 0; guard < 100 && fetched.unspilled() > 0; ++guard) {
    ASSERT_TRUE(fetched.SpillOne().ok());
  }
  for (const Hash128& fp : fps) EXPECT_TRUE(empty.Contains(fp));
  // Without a tier nothing is taken.
  EXPECT_FALSE(reuse_->TakesFetched());
  EXPECT_TRUE(fetched.TakesFetched());
}

// Segments a streaming fetch is still filling (ReuseEngine::OfferStreamed): the prefill plans
// them as hits, runs its full layers before any sparse layer's blocks are there, gives the
// iteration back while a layer is missing, and reads each layer once it arrived; the answer is
// the one from the same values in a store, and the tier keeps the segments afterwards. The same
// with the segments in the engine's block (NewStreamedSegment with stream_pinned_bytes: pinned
// memory on a GPU, which the copies read directly), which they give back when they go.
TEST_F(ReuseTest, StreamedSegmentsAreReadLayerByLayerAsTheyArrive) {
  for (const bool block : {false, true}) {
    SCOPED_TRACE(block ? "segments in the engine's block" : "pageable segments");
    std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
    SegmentStore rounded(SegmentStoreOptions{}), empty(SegmentStoreOptions{});
    ReuseOptions so;
    if (block) so.stream_pinned_bytes = size_t{8} << 20;
    ReuseEngine streamed(engine_.get(), &empty, so, size_t{64} << 20);
    EXPECT_EQ(streamed.stream_pinned_capacity(), block ? size_t{8} << 20 : 0);
    const int L = model_->config().n_layers;
    std::vector<SegmentKvBf16> data;
    std::vector<std::shared_ptr<StreamedSegment>> in;
    for (int i = 0; i < 2; ++i) {
      auto [fp, b, r] = Fetchable(segs[i]);
      ASSERT_TRUE(rounded.Put(fp, std::move(r)).ok());
      in.push_back(block ? streamed.NewStreamedSegment(b.n_tokens)
                         : std::make_shared<StreamedSegment>(b.n_tokens, b.n_layers, b.kv_dim));
      EXPECT_EQ(in.back()->in_block(), block);
      data.push_back(std::move(b));
      EXPECT_FALSE(streamed.Holds(fp));
      streamed.OfferStreamed(fp, in.back());
      EXPECT_TRUE(streamed.Holds(fp));
    }
    auto arrive = [&](int l) {  // layer l of every segment
      for (int i = 0; i < 2; ++i) Arrive(*in[i], data[i], l);
    };
    const int F = ReuseOptions{}.full_layers;
    ASSERT_LT(F, L);
    ASSERT_TRUE(streamed.BeginPrefill(segs, true, nullptr).ok());
    std::optional<ReusePrefillResult> a;
    for (int l = F; l <= L; ++l) {
      // Layer l is missing: the step returns without the result (the full layers ran first).
      auto step = streamed.PrefillStep(INT64_MAX);
      ASSERT_TRUE(step.ok()) << step.status();
      if (l == L) {
        ASSERT_TRUE(step->has_value());
        a = std::move(**step);
        break;
      }
      EXPECT_FALSE(step->has_value()) << "layer " << l;
      arrive(l);
    }
    ASSERT_TRUE(a.has_value());
    engine_->Release(a->seq);
    EXPECT_EQ(a->stats.segments_streamed, 2);
    EXPECT_EQ(a->stats.segments_hit, 2);
    EXPECT_EQ(a->stats.stream_restarts, 0);
    // Every sparse layer was asked for before it arrived: the time until it did is counted, and
    // so is the staging of the arrived ones.
    EXPECT_GT(a->stats.stream_wait_ms, 0.0);
    EXPECT_GT(a->stats.stream_upload_ms, 0.0);
    // Layers [0, F) arrive last here: the tier keeps the segments only complete, by
    // AdoptFetched once they are.
    EXPECT_EQ(streamed.unspilled(), 0u);
    for (int l = 0; l < F; ++l) arrive(l);
    EXPECT_TRUE(streamed.HasFetched());
    EXPECT_EQ(streamed.AdoptFetched(), 2);
    EXPECT_EQ(streamed.unspilled(), 2u);
    ReuseEngine from_store(engine_.get(), &rounded, {}, size_t{64} << 20);
    const ReusePrefillResult b = RunOn(from_store, segs);
    EXPECT_EQ(b.stats.segments_hit, 2);
    EXPECT_EQ(testing::MaxAbsDiff(a->logits, b.logits), 0.0);
    // From the tier now, the same answer.
    const ReusePrefillResult c = RunOn(streamed, segs);
    EXPECT_EQ(c.stats.segments_device_hit, 2);
    EXPECT_EQ(testing::MaxAbsDiff(a->logits, c.logits), 0.0);
    // The tier holds copies: the segments' memory goes back to the block with them.
    EXPECT_EQ(streamed.stream_pinned_used() > 0, block);
    in.clear();
    EXPECT_EQ(streamed.stream_pinned_used(), 0u);
  }
}

// The engine's block for streamed segments is bounded: a segment that does not fit gets
// pageable memory (the fetch goes on, uploads staged as before), and freed ranges are reused.
TEST_F(ReuseTest, StreamedSegmentsTakePageableMemoryWhenTheBlockIsFull) {
  SegmentStore empty(SegmentStoreOptions{});
  const int L = model_->config().n_layers, kd = engine_->runner().kv_dim();
  const int n = 100;
  const size_t one = StreamedSegment::Bytes(n, L, kd);
  ReuseOptions so;
  const size_t align = HostArena::kAlign;
  so.stream_pinned_bytes = 2 * ((one + align - 1) / align * align);
  ReuseEngine e(engine_.get(), &empty, so, size_t{64} << 20);
  auto a = e.NewStreamedSegment(n), b = e.NewStreamedSegment(n), c = e.NewStreamedSegment(n);
  EXPECT_TRUE(a->in_block());
  EXPECT_TRUE(b->in_block());
  EXPECT_FALSE(c->in_block());
  EXPECT_EQ(c->Half(0, 0).size(), static_cast<size_t>(n) * kd);
  a.reset();
  auto d = e.NewStreamedSegment(n);
  EXPECT_TRUE(d->in_block());
  EXPECT_EQ(e.NewStreamedSegment(0)->in_block(), false);
}

// A streamed segment that fails mid-pass (its later layers will not come): the prefill starts
// over without it and computes its tokens; the answer is the one with only the other segment
// reusable.
TEST_F(ReuseTest, AStreamedSegmentThatFailsIsRecomputed) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
  SegmentStore only_a(SegmentStoreOptions{}), empty(SegmentStoreOptions{});
  ReuseEngine streamed(engine_.get(), &empty, {}, size_t{64} << 20);
  const int L = model_->config().n_layers;
  const int F = ReuseOptions{}.full_layers;
  ASSERT_LT(F + 1, L);
  auto [fa, ba, ra] = Fetchable(segs[0]);
  auto [fb, bb, rb] = Fetchable(segs[1]);
  ASSERT_TRUE(only_a.Put(fa, std::move(ra)).ok());
  auto sa = std::make_shared<StreamedSegment>(ba.n_tokens, L, ba.kv_dim);
  auto sb = std::make_shared<StreamedSegment>(bb.n_tokens, L, bb.kv_dim);
  streamed.OfferStreamed(fa, sa);
  streamed.OfferStreamed(fb, sb);
  for (int l = 0; l < L; ++l) {  // A whole, B up to layer F only
    Arrive(*sa, ba, l);
    if (l <= F) Arrive(*sb, bb, l);
  }
  ASSERT_TRUE(streamed.BeginPrefill(segs, true, nullptr).ok());
  auto step = streamed.PrefillStep(INT64_MAX);  // the full layers; B's layers come later
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->has_value());
  sb->Fail();
  EXPECT_FALSE(streamed.Holds(fb));
  std::optional<ReusePrefillResult> a;
  for (int guard = 0; guard < 10 && !a; ++guard) {
    auto s = streamed.PrefillStep(INT64_MAX);
    ASSERT_TRUE(s.ok()) << s.status();
    if (s->has_value()) a = std::move(**s);
  }
  ASSERT_TRUE(a.has_value());
  engine_->Release(a->seq);
  EXPECT_EQ(a->stats.stream_restarts, 1);
  // A, complete by the restart, went into the tier as the new pass began (AdoptFetched) and
  // B, failed, was dropped there.
  EXPECT_EQ(a->stats.segments_hit, 1);
  EXPECT_EQ(a->stats.segments_device_hit, 1);
  EXPECT_EQ(a->stats.segments_streamed, 0);
  EXPECT_TRUE(streamed.Holds(fa));
  EXPECT_FALSE(streamed.HasFetched());
  ReuseEngine ref(engine_.get(), &only_a, {}, size_t{64} << 20);
  const ReusePrefillResult b = RunOn(ref, segs);
  EXPECT_EQ(b.stats.segments_hit, 1);
  EXPECT_EQ(testing::MaxAbsDiff(a->logits, b.logits), 0.0);
}

// The scheduler runs a reuse prefill in slices between other sequences' decode steps: any
// slicing gives the unsliced result bit for bit, and a dropped prefill frees its blocks.
TEST_F(ReuseTest, SlicedPrefillEqualsTheWholePassAndAbortFreesItsBlocks) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kDocC)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  std::swap(segs[0], segs[2]);
  const ReusePrefillResult whole = Run(segs, ReuseOptions{});
  ASSERT_GT(whole.stats.reused_tokens, 0);
  const int free0 = engine_->blocks().available();
  // Another sequence decodes between the slices, as in the scheduler.
  auto other = engine_->Admit(Enc(kDocB));
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(engine_->Prefill(*other).ok());
  for (int64_t slice : {int64_t{1}, int64_t{40}, int64_t{400}}) {
    ASSERT_TRUE(reuse_->BeginPrefill(segs).ok());
    std::optional<ReusePrefillResult> r;
    int steps = 0;
    while (!r) {
      auto st = reuse_->PrefillStep(slice);
      ASSERT_TRUE(st.ok()) << st.status();
      r = std::move(*st);
      ++steps;
      ASSERT_TRUE(engine_->Step(*other, 5).ok());
    }
    EXPECT_FALSE(reuse_->prefilling());
    // The smallest slices run the full layers in chunks of kMinFullLayerRows rows and each
    // sparse layer whole; the largest more than one layer at a time.
    const int L = model_->config().n_layers, F = ReuseOptions{}.full_layers;
    const int64_t rows = whole.stats.prompt_tokens - whole.stats.prefix_tokens;
    const int64_t chunk = ReuseEngine::kMinFullLayerRows;
    ASSERT_GT(rows, chunk);  // the full layers are split
    if (slice == 1) EXPECT_EQ(steps, F * ((rows + chunk - 1) / chunk) + (L - F));
    if (slice == 40) EXPECT_GT(steps, L);
    if (slice == 400) EXPECT_LT(steps, L);
    EXPECT_EQ(r->logits, whole.logits) << "slice " << slice;
    EXPECT_EQ(r->stats.selected_tokens, whole.stats.selected_tokens);
    EXPECT_EQ(r->stats.computed_token_layers, whole.stats.computed_token_layers);
    EXPECT_EQ(r->stats.exact_tokens, whole.stats.exact_tokens);
    engine_->Release(r->seq);
  }
  // Dropped after one slice (a cancelled request), or replaced by the next BeginPrefill.
  const int free1 = engine_->blocks().available();
  ASSERT_TRUE(reuse_->BeginPrefill(segs).ok());
  EXPECT_LT(engine_->blocks().available(), free1);
  ASSERT_TRUE(reuse_->PrefillStep(1).ok());
  reuse_->AbortPrefill();
  EXPECT_EQ(engine_->blocks().available(), free1);
  ASSERT_TRUE(reuse_->BeginPrefill(segs).ok());
  ASSERT_TRUE(reuse_->BeginPrefill(segs).ok());
  reuse_->AbortPrefill();
  EXPECT_EQ(engine_->blocks().available(), free1);
  EXPECT_FALSE(reuse_->PrefillStep(1).ok());  // nothing in progress
  engine_->Release(*other);
  EXPECT_EQ(engine_->blocks().available(), free0);
}

TEST_F(ReuseTest, HostTierServesRepeatsWithIdenticalResults) {
  std::vector<PromptSegment> segs = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
  for (auto& s : segs) ASSERT_TRUE(reuse_->EnsureStored(s.tokens).ok());
  ReuseOptions o;
  o.profile = true;
  ReuseEngine host(engine_.get(), store_.get(), o, 0, size_t{64} << 20);
  auto a = host.Prefill(segs);
  ASSERT_TRUE(a.ok()) << a.status();
  engine_->Release(a->seq);
  EXPECT_EQ(a->stats.segments_host_hit, 0);
  EXPECT_GT(host.host_tier().bytes(), 0u);
  std::swap(segs[0], segs[1]);
  auto b = host.Prefill(segs);
  ASSERT_TRUE(b.ok());
  engine_->Release(b->seq);
  EXPECT_EQ(b->stats.segments_host_hit, 2);
  EXPECT_EQ(b->stats.segments_device_hit, 0);
  EXPECT_LT(testing::MaxAbsDiff(Run(segs, ReuseOptions{}).logits, b->logits), 1e-6);
  // The profile covers the phases of the pass.
  EXPECT_GT(b->stats.full_ms + b->stats.sparse_ms, 0.0);
}

TEST_F(ReuseTest, CorruptStoredSegmentIsAMissAndRecomputed) {
  std::vector<int32_t> a = Enc(kDocA), b = Enc(kDocB);
  ASSERT_TRUE(reuse_->EnsureStored(a).ok());
  ASSERT_TRUE(reuse_->EnsureStored(b).ok());
  ASSERT_TRUE(testing::CorruptStoredSegment(*store_, reuse_->Fingerprint(a, "none")));
  ASSERT_TRUE(testing::CorruptStoredSegment(*store_, reuse_->Fingerprint(b, "none")));
  std::vector<PromptSegment> segs = {{a}, {b}, {Enc(kQ), false}};
  ReuseOptions o;
  o.store_new_segments = false;
  ReusePrefillResult r = Run(segs, o);
  EXPECT_EQ(r.stats.segments_corrupt, 2);
  EXPECT_EQ(r.stats.reused_tokens, 0);
  EXPECT_LT(testing::MaxAbsDiff(Full(segs), r.logits), 1e-4);  // everything recomputed: exact
  EXPECT_EQ(store_->stats().corrupt, 2);
}

TEST_F(ReuseTest, FingerprintsArePositionIndependentAndSalted) {
  std::vector<int32_t> a = Enc(kDocA);
  EXPECT_EQ(reuse_->Fingerprint(a, "none"), reuse_->Fingerprint(a, "none"));
  EXPECT_NE(reuse_->Fingerprint(a, "none"), reuse_->Fingerprint(a, "bos"));
  auto a2 = a;
  a2.pop_back();
  EXPECT_NE(reuse_->Fingerprint(a, "none"), reuse_->Fingerprint(a2, "none"));
  EXPECT_NE(SegmentFingerprint(HashBytes128("m1", 2), a, "none"),
            SegmentFingerprint(HashBytes128("m2", 2), a, "none"));
}

TEST(Chunking, DeterministicAndContentDefined) {
  std::vector<int32_t> doc(400);
  for (int i = 0; i < 400; ++i) doc[i] = (i * 7919 + 13) % 500;
  ChunkingOptions o{.min_tokens = 8, .avg_tokens = 32, .max_tokens = 96};
  auto c1 = ChunkTokens(doc, o);
  EXPECT_EQ(c1, ChunkTokens(doc, o));
  int covered = 0;
  for (auto [b, e] : c1) {
    EXPECT_EQ(b, covered);
    EXPECT_LE(e - b, 96);
    covered = e;
  }
  EXPECT_EQ(covered, 400);
  // The same content after a different prefix is cut at the same places once resynchronised.
  std::vector<int32_t> shifted = {1, 2, 3, 4, 5};
  shifted.insert(shifted.end(), doc.begin(), doc.end());
  auto c2 = ChunkTokens(shifted, o);
  std::set<int> ends1, ends2;
  for (auto [b, e] : c1) ends1.insert(e);
  for (auto [b, e] : c2) ends2.insert(e - 5);
  int common = 0;
  for (int e : ends1) common += ends2.count(e);
  EXPECT_GE(common, static_cast<int>(ends1.size()) - 2);
}

}  // namespace
}  // namespace sparsex

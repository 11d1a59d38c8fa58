// Identity-complete KV keys: every field that changes a token sequence's KV, or the tokens a
// text becomes, is in every key (KvIdentity, model/prompt.h; the scope per key). For each field
// a paired test through the tiers: the same identity hits, a different one misses, in the
// worker's segment tiers (a reuse prefill over a shared host store; the device tier belongs to
// one engine and so to one identity) and the cluster tier (a real cache server).
#include <memory>
#include <string>
#include <vector>

#include "common/fingerprint.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "gpu_worker/service/kv_tier.h"
#include "gtest/gtest.h"
#include "model/model.h"
#include "model/prompt.h"
#include "tests/gpu_worker/test_util.h"
#include "tests/service/test_util.h"

namespace sparsex {
namespace {

struct Variant {
  const char* field;
  KvIdentityFields fields;
  Hash128 scope;
};

KvIdentityFields Base() {
  KvIdentityFields f;
  f.model_fp = Hash128{1, 2};
  f.tokenizer_fp = Hash128{3, 4};
  f.chat_template = "{{ messages }}";
  f.kv_dtype = "f32";
  return f;
}

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  auto add = [&](const char* name, auto mutate, Hash128 scope = {}) {
    Variant x{name, Base(), scope};
    mutate(x.fields);
    v.push_back(x);
  };
  // model_fp carries the weights and the configuration, RoPE included (model_loader_test's
  // fingerprint tests show a changed weight byte or RoPE base changes it).
  add("weights / configuration", [](KvIdentityFields& f) { f.model_fp.lo ^= 1; });
  add("tokenizer", [](KvIdentityFields& f) { f.tokenizer_fp.hi ^= 1; });
  add("chat template", [](KvIdentityFields& f) { f.chat_template += " "; });
  add("KV dtype", [](KvIdentityFields& f) { f.kv_dtype = "bf16"; });
  add("adapter", [](KvIdentityFields& f) { f.adapter = "lora-a"; });
  add("tenant scope", [](KvIdentityFields&) {}, Hash128{7, 7});
  return v;
}

TEST(KvIdentity, EveryFieldChangesTheIdentity) {
  const Hash128 base = KvIdentity(Base());
  EXPECT_EQ(KvIdentity(Base()), base) << "deterministic";
  for (const Variant& v : Variants()) {
    if (v.scope == Hash128{}) {
      EXPECT_NE(KvIdentity(v.fields), base) << v.field;
    } else {
      EXPECT_NE(ScopedModelFingerprint(base, v.scope), base) << v.field;
    }
  }
}

// The worker's segment tiers: an engine whose identity differs finds nothing another engine
// stored in a shared host store; an engine of the same identity finds all of it.
TEST(KvIdentity, WorkerTiersHitOnlyTheSameIdentity) {
  auto model = testing::LoadStories260K();
  if (model == nullptr) GTEST_SKIP() << "stories260K not found under $SPARSEX_MODELS";
  SegmentStore store(SegmentStoreOptions{});
  auto engine_for = [&](const Hash128& id) {
    EngineOptions eo;
    eo.kv.num_blocks = 256;
    eo.kv.enable_prefix_caching = false;
    eo.kv_identity = id;
    auto e = Engine::Create(*model, eo);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  };
  const std::string doc = "Lily had a big red ball. She liked to play with it in the park.";
  auto segments = [&](const Hash128& scope) {
    PromptSegment d, q;
    d.tokens = model->tokenizer().Encode(doc, false);
    d.scope = scope;
    q.tokens = model->tokenizer().Encode(" Then she", false);
    q.cacheable = false;
    return std::vector<PromptSegment>{d, q};
  };
  const Hash128 base = KvIdentity(Base());
  {
    auto e = engine_for(base);
    ReuseEngine writer(e.get(), &store, ReuseOptions{});
    auto r = writer.Prefill(segments({}));
    ASSERT_TRUE(r.ok()) << r.status();
    e->Release(r->seq);
  }
  auto hits = [&](const Hash128& id, const Hash128& scope) {
    auto e = engine_for(id);
    ReuseEngine reader(e.get(), &store, ReuseOptions{});
    auto r = reader.Prefill(segments(scope));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return -1;
    e->Release(r->seq);
    return r->stats.segments_hit;
  };
  EXPECT_EQ(hits(base, {}), 1) << "same identity";
  for (const Variant& v : Variants()) {
    const Hash128 id = v.scope == Hash128{} ? KvIdentity(v.fields) : base;
    EXPECT_EQ(hits(id, v.scope), 0) << v.field;
  }
}

// The cluster tier (cache server + RocksDB-shaped keys): a tier connected under another
// identity, hashing the same tokens, fetches nothing.
TEST(KvIdentity, ClusterTierHitsOnlyTheSameIdentity) {
  auto server = service::testutil::StartMemoryCacheServer();
  ASSERT_TRUE(server.ok()) << server.status();
  constexpr int kLayers = 2, kDim = 4, kTokens = 6;
  SegmentKv kv;
  kv.n_tokens = kTokens;
  kv.n_layers = kLayers;
  kv.kv_dim = kDim;
  for (int l = 0; l < kLayers; ++l) {
    kv.k.emplace_back(kTokens * kDim, 0.5f + l);
    kv.v.emplace_back(kTokens * kDim, -0.5f - l);
  }
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9, 10};
  auto key = [&](const Hash128& id, const Hash128& scope) {
    return SegmentFingerprint(ScopedModelFingerprint(id, scope), tokens, "none");
  };
  auto tier_for = [&](const Hash128& id) {
    service::ClusterTierOptions t;
    t.servers = {(*server)->grpc_address()};
    auto tier = service::ClusterKvTier::Connect(t, id, kLayers, kDim);
    EXPECT_TRUE(tier.ok()) << tier.status();
    return std::move(*tier);
  };
  const Hash128 base = KvIdentity(Base());
  ASSERT_TRUE(tier_for(base)->Put(key(base, {}), kv).ok());
  auto fetched = [&](const Hash128& id, const Hash128& scope) {
    SegmentStore store(SegmentStoreOptions{});
    auto tier = tier_for(id);
    std::vector<service::SegmentRef> refs = {{key(id, scope), kTokens}};
    return tier->FetchMissing(refs, &store).fetched;
  };
  EXPECT_EQ(fetched(base, {}), 1) << "same identity";
  for (const Variant& v : Variants()) {
    const Hash128 id = v.scope == Hash128{} ? KvIdentity(v.fields) : base;
    EXPECT_EQ(fetched(id, v.scope), 0) << v.field;
  }
}

}  // namespace
}  // namespace sparsex

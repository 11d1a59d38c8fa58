// Tensor parallelism without GPUs: N CPU-backend shards in one process, one thread per rank,
// all-reducing through host memory, must equal the unsharded model.
#include "gpu_worker/engine/tensor_parallel.h"

#include <cmath>
#include <thread>

#include "gpu_worker/engine/engine.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "tests/gpu_worker/reference_generate.h"
#include "tests/gpu_worker/test_util.h"

namespace sparsex {
namespace {

float MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST(TensorParallel, InProcessAllReduceSums) {
  auto g = CreateInProcessGroup(3);
  std::vector<std::vector<float>> v = {{1, 2}, {10, 20}, {100, 200}};
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] {
      for (int it = 0; it < 50; ++it) {  // repeated collectives must not interleave
        std::vector<float> x = v[r];
        ASSERT_TRUE(g[r]->AllReduceSumHost(x).ok());
        ASSERT_EQ(x, (std::vector<float>{111, 222}));
      }
    });
  }
  for (auto& t : ts) t.join();
}

TEST(TensorParallel, ShardedLogitsAndGreedyEqualUnsharded) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  std::vector<int32_t> prompt = model->tokenizer().Encode("Once upon a time, Lily", true);
  auto ref_engine = Engine::Create(*model, {});
  ASSERT_TRUE(ref_engine.ok());
  GenerateRequest req{prompt, {.max_tokens = 64}};
  auto ref = sparsex::testing::Generate(**ref_engine, req, nullptr);
  ASSERT_TRUE(ref.ok());
  auto seq = (*ref_engine)->Admit(prompt);
  auto ref_logits = (*ref_engine)->Prefill(*seq);
  ASSERT_TRUE(ref_logits.ok());
  (*ref_engine)->Release(*seq);

  for (int tp : {2, 4}) {
    auto group = CreateInProcessGroup(tp);
    std::vector<std::vector<float>> logits(tp);
    std::vector<std::vector<int32_t>> tokens(tp);
    std::vector<std::thread> ts;
    for (int r = 0; r < tp; ++r) {
      ts.emplace_back([&, r] {
        EngineOptions o;
        o.tp = {.rank = r, .size = tp, .comm = group[r].get()};
        auto e = Engine::Create(*model, o);
        ASSERT_TRUE(e.ok()) << e.status();
        EXPECT_EQ((*e)->runner().kv_dim(), model->config().n_kv_heads / tp * model->config().head_dim);
        auto s = (*e)->Admit(prompt);
        ASSERT_TRUE(s.ok());
        auto lg = (*e)->Prefill(*s);
        ASSERT_TRUE(lg.ok()) << lg.status();
        logits[r] = *lg;
        (*e)->Release(*s);
        auto g = sparsex::testing::Generate(**e, req, nullptr);
        ASSERT_TRUE(g.ok());
        tokens[r] = g->tokens;
      });
    }
    for (auto& t : ts) t.join();
    for (int r = 0; r < tp; ++r) {
      EXPECT_LT(MaxDiff(*ref_logits, logits[r]), 1e-4) << "tp=" << tp << " rank " << r;
      EXPECT_EQ(tokens[r], ref->tokens) << "tp=" << tp << " rank " << r;
    }
  }
}

TEST(TensorParallel, ReusePrefillSelectsIdenticallyOnEveryRank) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  const Tokenizer& tok = model->tokenizer();
  std::vector<PromptSegment> segs = {
      {tok.Encode("Lily went to the park with her mom. They saw a big red ball.", false)},
      {tok.Encode("Tom had a little dog named Max. Max liked to run and jump.", false)},
      {tok.Encode(" What did they do next?", false), false}};
  auto run = [&](Engine* e, ReusePrefillResult* out) {
    SegmentStore store({});
    ReuseEngine re(e, &store, {});
    for (auto& s : segs) ASSERT_TRUE(re.EnsureStored(s.tokens).ok());
    auto r = re.Prefill(segs);
    ASSERT_TRUE(r.ok()) << r.status();
    e->Release(r->seq);
    *out = std::move(*r);
  };
  auto ref_engine = Engine::Create(*model, {});
  ASSERT_TRUE(ref_engine.ok());
  ReusePrefillResult ref;
  run(ref_engine->get(), &ref);
  const int tp = 2;
  auto group = CreateInProcessGroup(tp);
  std::vector<ReusePrefillResult> res(tp);
  std::vector<std::thread> ts;
  for (int r = 0; r < tp; ++r) {
    ts.emplace_back([&, r] {
      EngineOptions o;
      o.tp = {.rank = r, .size = tp, .comm = group[r].get()};
      auto e = Engine::Create(*model, o);
      ASSERT_TRUE(e.ok());
      run(e->get(), &res[r]);
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < tp; ++r) {
    EXPECT_EQ(res[r].stats.selected_tokens, ref.stats.selected_tokens);
    EXPECT_EQ(res[r].stats.computed_token_layers, ref.stats.computed_token_layers);
    EXPECT_LT(MaxDiff(ref.logits, res[r].logits), 1e-4);
  }
}

TEST(TensorParallel, RejectsDegreesThatDoNotDivideTheHeads) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  EXPECT_FALSE(ShardModel(*model, 0, 3).ok());
}

}  // namespace
}  // namespace sparsex

// EngineGroup: N CPU ranks driven in lockstep from one thread give the unsharded engine's greedy
// tokens through the group's building blocks; size 1 is the plain engine on the caller's thread.
#include "gpu_worker/engine/engine_group.h"

#include <mutex>
#include <set>
#include <thread>

#include "tests/gpu_worker/engine_group_util.h"
#include "tests/gpu_worker/reference_generate.h"
#include "tests/gpu_worker/test_util.h"
#include "tests/gpu_worker/segment_faults.h"

namespace sparsex {
namespace {

using testing::Greedy;

TEST(EngineGroup, RanksInLockstepMatchTheUnshardedEngine) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> prompt = model->tokenizer().Encode("Once upon a time, Lily", true);
  EngineOptions o;
  o.kv.num_blocks = 256;
  auto ref = Engine::Create(*model, o);
  ASSERT_TRUE(ref.ok());
  GenerateRequest req;
  req.prompt = prompt;
  req.sampling.max_tokens = 48;
  req.sampling.ignore_eos = true;
  auto want = sparsex::testing::Generate(**ref, req, nullptr);
  ASSERT_TRUE(want.ok());
  for (int tp : {1, 2, 4}) {
    o.tp.size = tp;
    auto g = EngineGroup::Create(*model, o);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_EQ((*g)->size(), tp);
    EXPECT_EQ(Greedy(**g, prompt, 48), want->tokens) << "tp " << tp;
    // Again: the prompt's blocks are now an exact cached prefix on every rank.
    EXPECT_EQ(Greedy(**g, prompt, 48), want->tokens) << "tp " << tp << " (prefix hit)";
    EXPECT_EQ((*g)->engine().blocks().available(), (*g)->engine().blocks().num_blocks());
    EXPECT_EQ((*g)->divergences(), 0);
    // Each rank on its own thread, rank 0 on the caller's.
    std::mutex mu;
    std::set<std::thread::id> ids;
    std::thread::id rank0;
    (*g)->RunOnAll([&](int r) {
      std::lock_guard<std::mutex> l(mu);
      ids.insert(std::this_thread::get_id());
      if (r == 0) rank0 = std::this_thread::get_id();
    });
    EXPECT_EQ(static_cast<int>(ids.size()), tp);
    EXPECT_EQ(rank0, std::this_thread::get_id());
  }
}

// Two prompts' chunks beside a decode row in one pass on every rank (the scheduler's short
// prompts prefilled together): each prompt gets the unsharded engine's next-token logits, and the
// ranks' block tables and logits stay alike. The decode row's token is drawn by the group
// (rank 0's logits, DrawToken) every other pass and taken from its logits otherwise: the
// unsharded engine's greedy tokens either way.
TEST(EngineGroup, ChunksOfSeveralSequencesInOnePassMatchTheUnshardedEngine) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  const char* prompts[] = {"Tom had a little dog named Max.", "The sun"};
  EngineOptions o;
  o.kv.num_blocks = 256;
  o.kv.enable_prefix_caching = false;
  auto ref = Engine::Create(*model, o);
  ASSERT_TRUE(ref.ok());
  std::vector<std::vector<float>> want;
  for (const char* p : prompts) {
    auto s = (*ref)->Admit(model->tokenizer().Encode(p, true));
    ASSERT_TRUE(s.ok());
    auto lg = (*ref)->Prefill(*s);
    ASSERT_TRUE(lg.ok());
    want.push_back(std::move(*lg));
  }
  for (int tp : {2, 4}) {
    o.tp.size = tp;
    auto g = EngineGroup::Create(*model, o);
    ASSERT_TRUE(g.ok()) << g.status();
    const std::vector<int32_t> d_prompt = model->tokenizer().Encode("Once upon a time", true);
    auto d = (*g)->Admit(d_prompt);
    ASSERT_TRUE(d.ok());
    auto dl = (*g)->Prefill(*d);
    ASSERT_TRUE(dl.ok());
    std::vector<Sequence*> dec = {&*d};
    std::vector<int32_t> tok = {Argmax(*dl)};
    std::vector<Sequence> ps;
    for (const char* p : prompts) {
      auto s = (*g)->Admit(model->tokenizer().Encode(p, true));
      ASSERT_TRUE(s.ok());
      ps.push_back(std::move(*s));
    }
    std::vector<std::vector<float>> got(ps.size());
    const std::vector<RowDraw> greedy(1);
    int pass = 0;
    for (bool more = true; more; ++pass) {
      std::vector<Engine::ChunkRef> chunks;
      for (Sequence& s : ps) {
        const int total = static_cast<int>(s.tokens.size());
        if (s.computed < total) chunks.push_back({&s, std::min(total, s.computed + 5)});
      }
      const bool draw = pass % 2 == 1;
      auto m = (*g)->StepWithChunks(dec, tok, chunks,
                                    draw ? std::span<const RowDraw>(greedy) : std::span<const RowDraw>());
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_EQ(m->decode_drawn.size(), draw ? 1u : 0u);
      ASSERT_EQ(m->decode.size(), draw ? 0u : 1u);
      tok[0] = draw ? m->decode_drawn[0] : Argmax(m->decode[0]);
      more = false;
      for (size_t j = 0; j < chunks.size(); ++j) {
        const size_t i = static_cast<size_t>(chunks[j].seq - ps.data());
        if (!m->prefill[j].empty()) got[i] = std::move(m->prefill[j]);
        more = more || chunks[j].end < static_cast<int>(ps[i].tokens.size());
      }
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_LT(testing::MaxAbsDiff(got[i], want[i]), 1e-3) << "tp " << tp << " " << prompts[i];
      (*g)->Release(ps[i]);
    }
    // A plain decode step drawn by the group (StepBatchDraw), then the decode row's tokens
    // against the unsharded engine's greedy ones.
    auto r = (*g)->StepBatchDraw(dec, tok, greedy);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->drawn.size(), 1u);
    EXPECT_TRUE(r->logits.empty());
    std::vector<int32_t> decoded(d->tokens.begin() + static_cast<int64_t>(d_prompt.size()),
                                 d->tokens.end());
    decoded.push_back(r->drawn[0]);
    GenerateRequest req;
    req.prompt = d_prompt;
    req.sampling.max_tokens = static_cast<int>(decoded.size());
    req.sampling.ignore_eos = true;
    auto ref_d = sparsex::testing::Generate(**ref, req, nullptr);
    ASSERT_TRUE(ref_d.ok());
    EXPECT_EQ(decoded, ref_d->tokens) << "tp " << tp;
    (*g)->Release(*d);
    EXPECT_EQ((*g)->divergences(), 0);
  }
}

TEST(EngineGroup, ReusePrefillKeepsRankStoresInStep) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  const Tokenizer& tok = model->tokenizer();
  const std::vector<PromptSegment> segs = {
      {tok.Encode("Lily went to the park with her mom. They saw a big red ball.", false)},
      {tok.Encode("Tom had a little dog named Max. Max liked to run and jump.", false)},
      {tok.Encode(" What did they do next?", false), false}};
  const std::vector<PromptSegment> swapped = {segs[1], segs[0], segs[2]};
  auto run = [&](int tp, std::vector<std::unique_ptr<SegmentStore>>* stores) {
    std::vector<SegmentStore*> ptrs;
    for (int r = 0; r < tp; ++r) {
      stores->push_back(std::make_unique<SegmentStore>(SegmentStoreOptions{}));
      ptrs.push_back(stores->back().get());
    }
    EngineOptions o;
    o.kv.num_blocks = 256;
    o.tp.size = tp;
    auto g = EngineGroup::Create(*model, o, ptrs);
    EXPECT_TRUE(g.ok()) << g.status();
    std::vector<ReusePrefillResult> out;
    for (const auto* p : {&segs, &swapped}) {
      auto r = (*g)->ReusePrefill(*p);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) break;
      (*g)->Release(r->seq);
      out.push_back(std::move(*r));
    }
    return out;
  };
  std::vector<std::unique_ptr<SegmentStore>> s1, s2;
  auto ref = run(1, &s1);
  auto got = run(2, &s2);
  ASSERT_EQ(ref.size(), 2u);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].stats.segments_hit, 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(got[i].stats.selected_tokens, ref[i].stats.selected_tokens);
    float diff = 0;
    for (size_t j = 0; j < ref[i].logits.size(); ++j) {
      diff = std::max(diff, std::abs(ref[i].logits[j] - got[i].logits[j]));
    }
    EXPECT_LT(diff, 1e-4) << "request " << i;
  }
  EXPECT_EQ(s2[0]->stats().entries, s1[0]->stats().entries);
  EXPECT_EQ(s2[1]->stats().entries, s1[0]->stats().entries);

  // A segment that only one rank still holds is dropped on every rank before the prefill (a
  // hit on one rank and a recompute on the other would run different collectives).
  std::vector<SegmentStore*> ptrs = {s2[0].get(), s2[1].get()};
  EngineOptions o;
  o.kv.num_blocks = 256;
  o.tp.size = 2;
  auto g = EngineGroup::Create(*model, o, ptrs);
  ASSERT_TRUE(g.ok());
  const Hash128 fp = (*g)->reuse().Fingerprint(segs[0].tokens, "none");
  ASSERT_TRUE(s2[1]->Contains(fp));
  s2[1]->Erase(fp);
  auto r = (*g)->ReusePrefill(swapped);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stats.segments_hit, 1);
  (*g)->Release(r->seq);

  // A segment corrupted on one rank only: found corrupt before the prefill, dropped everywhere,
  // recomputed by every rank alike (no divergence, no hang).
  const Hash128 fp1 = (*g)->reuse().Fingerprint(segs[1].tokens, "none");
  ASSERT_TRUE(s2[0]->Contains(fp1) && s2[1]->Contains(fp1));
  ASSERT_TRUE(testing::CorruptStoredSegment(*s2[1], fp1));
  auto c = (*g)->ReusePrefill(swapped);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(s2[1]->stats().corrupt, 1);
  (*g)->Release(c->seq);
}

TEST(EngineGroup, RefusesBadDegreesAndStoreCounts) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  EngineOptions o;
  o.kv.num_blocks = 64;
  for (int tp : {0, 3, 8}) {
    o.tp.size = tp;
    auto g = EngineGroup::Create(*model, o);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << tp;
  }
  SegmentStore a({});
  o.tp.size = 2;
  EXPECT_EQ(EngineGroup::Create(*model, o, {&a}).status().code(),
            absl::StatusCode::kInvalidArgument);
#if !SPARSEX_WITH_NCCL
  o.backend.kind = "cuda";
  EXPECT_EQ(EngineGroup::Create(*model, o).status().code(), absl::StatusCode::kUnimplemented);
#endif
}

}  // namespace
}  // namespace sparsex

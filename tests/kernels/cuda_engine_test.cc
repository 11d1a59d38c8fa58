// End-to-end on the GPU: the real stories260K model loaded into the CUDA backend generates the
// same greedy tokens as the CPU reference, and its logits stay close. Skips without a device.
#include <cmath>
#include <memory>

#include "testing/models_dir.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "gtest/gtest.h"
#include "tests/gpu_worker/reference_generate.h"

namespace sparsex {
namespace {

std::unique_ptr<Model> LoadStories() {
  auto m = LoadModel(sparsex::testing::ModelsDir() + "/stories260K/stories260K.gguf");
  EXPECT_TRUE(m.ok()) << "cannot load the test model (set $SPARSEX_MODELS, now resolving to "
                      << sparsex::testing::ModelsDir() << "): " << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

GenerateResult Greedy(Engine& e, const std::vector<int32_t>& prompt, int n) {
  GenerateRequest req;
  req.prompt = prompt;
  req.sampling.max_tokens = n;
  req.sampling.ignore_eos = true;
  auto r = sparsex::testing::Generate(e, req, [](const TokenEvent&) { return true; });
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : GenerateResult{};
}

TEST(CudaEngine, Stories260KGreedyMatchesCpuFor64Tokens) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  EngineOptions co, go;
  go.backend.kind = "cuda";
  auto cpu = Engine::Create(*model, co);
  auto gpu = Engine::Create(*model, go);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  for (const char* text : {"", "Once upon a time, there was a little dog named Max. He"}) {
    std::vector<int32_t> prompt = model->tokenizer().Encode(text, /*add_bos=*/true);
    GenerateResult c = Greedy(**cpu, prompt, 64);
    GenerateResult g = Greedy(**gpu, prompt, 64);
    ASSERT_EQ(c.tokens.size(), 64u);
    EXPECT_EQ(g.tokens, c.tokens) << "prompt '" << text << "'\ncpu: " << c.text
                                  << "\ngpu: " << g.text;
  }
}

TEST(CudaEngine, Stories260KPrefillLogitsClose) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  EngineOptions co, go;
  go.backend.kind = "cuda";
  auto cpu = Engine::Create(*model, co);
  auto gpu = Engine::Create(*model, go);
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  std::vector<int32_t> p = model->tokenizer().Encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park with her friends and her big red ball.",
      true);
  auto sc = (*cpu)->Admit(p);
  auto sg = (*gpu)->Admit(p);
  ASSERT_TRUE(sc.ok() && sg.ok());
  auto lc = (*cpu)->Prefill(*sc);
  auto lg = (*gpu)->Prefill(*sg);
  ASSERT_TRUE(lc.ok()) << lc.status();
  ASSERT_TRUE(lg.ok()) << lg.status();
  ASSERT_EQ(lc->size(), lg->size());
  double num = 0, den = 0;
  for (size_t i = 0; i < lc->size(); ++i) {
    const double d = (*lg)[i] - (*lc)[i];
    num += d * d;
    den += (*lc)[i] * (*lc)[i];
  }
  EXPECT_LT(std::sqrt(num / den), 3e-2);
  EXPECT_EQ(Argmax(*lg), Argmax(*lc));
}

// A CUDA engine whose every run computes what it is asked (no prefix-cache hits).
absl::StatusOr<std::unique_ptr<Engine>> CudaEngineWithoutPrefixCache(const Model& model) {
  EngineOptions go;
  go.backend.kind = "cuda";
  go.kv.enable_prefix_caching = false;
  return Engine::Create(model, go);
}

TEST(CudaEngine, BatchedDecodeMatchesOneSequenceAtATime) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  auto gpu = CudaEngineWithoutPrefixCache(*model);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const char* texts[] = {"Once upon a time", "Tom had a dog named Max. One day",
                         "The sun was hot and the birds sang in the tall green trees. Lily"};
  std::vector<Sequence> seqs;
  std::vector<int32_t> next;
  for (const char* t : texts) {
    auto s = (*gpu)->Admit(model->tokenizer().Encode(t, true));
    ASSERT_TRUE(s.ok());
    auto lg = (*gpu)->Prefill(*s);
    ASSERT_TRUE(lg.ok());
    next.push_back(Argmax(*lg));
    seqs.push_back(std::move(*s));
  }
  std::vector<std::vector<int32_t>> batched(3);
  for (int step = 0; step < 24; ++step) {
    std::vector<Sequence*> ptrs = {&seqs[0], &seqs[1], &seqs[2]};
    auto lg = (*gpu)->StepBatch(ptrs, next);
    ASSERT_TRUE(lg.ok()) << lg.status();
    for (int i = 0; i < 3; ++i) {
      batched[i].push_back(next[i]);
      next[i] = Argmax((*lg)[i]);
    }
  }
  for (int i = 0; i < 3; ++i) {
    (*gpu)->Release(seqs[i]);
    GenerateResult one = Greedy(**gpu, model->tokenizer().Encode(texts[i], true), 24);
    EXPECT_EQ(one.tokens, batched[i]) << texts[i];
  }
}

// Several prompts' chunks and the decode rows of running sequences in one forward pass (the
// scheduler's short prompts prefilled together; Engine::StepWithChunks): each prompt's
// next-token logits stay close to its own Prefill's, each decoding sequence's to StepBatch's.
TEST(CudaEngine, ChunksOfSeveralSequencesWithDecodeRowsMatchSeparatePasses) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  auto gpu = CudaEngineWithoutPrefixCache(*model);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  Engine& e = **gpu;
  auto rel = [](const std::vector<float>& x, const std::vector<float>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      num += (x[i] - ref[i]) * (x[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    return x.size() == ref.size() ? std::sqrt(num / den) : 1e9;
  };
  const char* decoding[] = {"Once upon a time", "Tom had a dog named Max. One day"};
  const char* prompts[] = {"Lily went to the park with her mom and saw a big red ball.", "The sun",
                           "Tom and Sam built a tall tower of blocks, and then the cat came in "
                           "and knocked it down."};
  const size_t n = std::size(prompts);
  std::vector<Sequence> a, b;  // twins: a steps in the chunks' passes, b in StepBatch
  std::vector<int32_t> next;
  for (const char* t : decoding) {
    for (auto* v : {&a, &b}) {
      auto s = e.Admit(model->tokenizer().Encode(t, true));
      ASSERT_TRUE(s.ok());
      auto lg = e.Prefill(*s);
      ASSERT_TRUE(lg.ok()) << lg.status();
      if (v == &a) next.push_back(Argmax(*lg));
      v->push_back(std::move(*s));
    }
  }
  std::vector<Sequence> ps;
  std::vector<std::vector<float>> ref(n), got(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<int32_t> p = model->tokenizer().Encode(prompts[i], true);
    auto s = e.Admit(p);
    ASSERT_TRUE(s.ok());
    auto lg = e.Prefill(*s);
    ASSERT_TRUE(lg.ok()) << lg.status();
    ref[i] = std::move(*lg);
    e.Release(*s);
    s = e.Admit(p);
    ASSERT_TRUE(s.ok());
    ps.push_back(std::move(*s));
  }
  std::vector<Sequence*> ap, bp;
  for (Sequence& s : a) ap.push_back(&s);
  for (Sequence& s : b) bp.push_back(&s);
  // Up to 12 tokens of every unfinished prompt per pass: the prompts end in different passes.
  for (int pass = 0;; ++pass) {
    std::vector<size_t> which;
    const std::vector<Engine::ChunkRef> chunks = testing::NextChunks(ps, 12, &which);
    if (chunks.empty()) break;
    auto m = e.StepWithChunks(ap, next, chunks);
    ASSERT_TRUE(m.ok()) << m.status();
    auto sep = e.StepBatch(bp, next);
    ASSERT_TRUE(sep.ok()) << sep.status();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_LT(rel(m->decode[i], (*sep)[i]), 3e-2) << "sequence " << i << " pass " << pass;
      next[i] = Argmax((*sep)[i]);
    }
    for (size_t j = 0; j < chunks.size(); ++j) {
      if (!m->prefill[j].empty()) got[which[j]] = std::move(m->prefill[j]);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_LT(rel(got[i], ref[i]), 3e-2) << prompts[i];
    if (!got[i].empty()) {
      EXPECT_EQ(Argmax(got[i]), Argmax(ref[i])) << prompts[i];
    }
  }
  for (auto* v : {&a, &b, &ps})
    for (Sequence& s : *v) e.Release(s);
}

TEST(CudaEngine, ReuseFromPinnedHostTierEqualsDeviceTier) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  auto gpu = CudaEngineWithoutPrefixCache(*model);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  SegmentStore store({});
  auto enc = [&](const char* t) { return model->tokenizer().Encode(t, false); };
  std::vector<PromptSegment> segs = {
      {enc("Lily went to the park with her mom. They saw a big red ball.")},
      {enc("Tom had a little dog named Max. Max liked to run and jump.")},
      {enc(" What did they do next? They"), false}};
  ReuseEngine dev(gpu->get(), &store, {}, size_t{64} << 20, 0);
  ReuseEngine host(gpu->get(), &store, {}, 0, size_t{64} << 20);
  // Stored through the engine without a device tier: into the host store both engines read.
  for (auto& s : segs) ASSERT_TRUE(host.EnsureStored(s.tokens).ok());
  std::vector<float> ref;
  for (int round = 0; round < 2; ++round) {
    auto a = dev.Prefill(segs);
    auto b = host.Prefill(segs);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    (*gpu)->Release(a->seq);
    (*gpu)->Release(b->seq);
    EXPECT_EQ(b->stats.segments_host_hit, round == 0 ? 0 : 2);
    EXPECT_EQ(a->logits, b->logits) << "round " << round;
  }
  EXPECT_GT(host.host_tier().bytes(), 0u);
  // A store with a device tier keeps the bf16 KV captured on the GPU (no fp32 round trip, which
  // is lossless for bf16): the same logits, and the spilled host copy equals the host path's.
  SegmentStore store2({});
  ReuseEngine captured(gpu->get(), &store2, {}, size_t{64} << 20, 0);
  for (auto& s : segs) ASSERT_TRUE(captured.EnsureStored(s.tokens).ok());
  EXPECT_EQ(captured.unspilled(), 3u);  // the question too (EnsureStored was asked)
  auto c = captured.Prefill(segs);
  ASSERT_TRUE(c.ok()) << c.status();
  (*gpu)->Release(c->seq);
  EXPECT_EQ(c->stats.segments_device_hit, 2);
  auto d = dev.Prefill(segs);
  ASSERT_TRUE(d.ok()) << d.status();
  (*gpu)->Release(d->seq);
  EXPECT_EQ(c->logits, d->logits);
  while (true) {
    auto sp = captured.SpillOne();
    ASSERT_TRUE(sp.ok()) << sp.status();
    if (!sp->has_value()) break;
    auto x = store.Get((*sp)->first), y = store2.Get((*sp)->first);
    ASSERT_NE(x, nullptr);
    ASSERT_NE(y, nullptr);
    for (int l = 0; l < x->n_layers; ++l) {
      EXPECT_EQ(x->k[l], y->k[l]) << "layer " << l;
      EXPECT_EQ(x->v[l], y->v[l]) << "layer " << l;
    }
  }
}

// ---- decode graphs (Backend::BeginGraph) on the tensor-core attention shapes ----

std::unique_ptr<Model> Small() {
  auto m = LoadModel("synthetic:small");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Decodes `steps` tokens for each prompt, all sequences in one StepBatch per step: greedy, or
// the tokens of `force` (teacher forcing). Returns the tokens fed; appends every step's logits
// (one vector per sequence) to *logits when given.
std::vector<std::vector<int32_t>> BatchedDecode(Engine& e,
                                                const std::vector<std::vector<int32_t>>& prompts,
                                                int steps,
                                                const std::vector<std::vector<int32_t>>* force,
                                                std::vector<std::vector<float>>* logits) {
  std::vector<Sequence> seqs;
  std::vector<int32_t> next;
  for (const auto& p : prompts) {
    auto s = e.Admit(p);
    EXPECT_TRUE(s.ok()) << s.status();
    auto lg = e.Prefill(*s);
    EXPECT_TRUE(lg.ok()) << lg.status();
    next.push_back(Argmax(*lg));
    seqs.push_back(std::move(*s));
  }
  std::vector<std::vector<int32_t>> out(prompts.size());
  std::vector<Sequence*> ptrs;
  for (Sequence& s : seqs) ptrs.push_back(&s);
  for (int step = 0; step < steps; ++step) {
    if (force != nullptr) {
      for (size_t i = 0; i < seqs.size(); ++i) next[i] = (*force)[i][step];
    }
    auto lg = e.StepBatch(ptrs, next);
    EXPECT_TRUE(lg.ok()) << lg.status();
    if (!lg.ok()) break;
    for (size_t i = 0; i < seqs.size(); ++i) {
      out[i].push_back(next[i]);
      next[i] = Argmax((*lg)[i]);
      if (logits != nullptr) logits->push_back((*lg)[i]);
    }
  }
  for (Sequence& s : seqs) e.Release(s);
  return out;
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 3 + (i * 37 + salt * 101) % 990;
  return p;
}

TEST(CudaGraphs, ReplayedDecodeStepsEqualTheirFirstRecordedRun) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = Small();
  ASSERT_NE(model, nullptr);
  auto gpu = CudaEngineWithoutPrefixCache(*model);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  Backend& be = (*gpu)->runner().backend();
  // Three sequences of different lengths; the longest crosses the 256-key bucket, so a new
  // graph is captured on the way. The first run records (launching one by one until a step's
  // launches recur); the second run of the same steps replays captured graphs throughout: the
  // same tokens and bit-identical logits show that a replay reads each step's new positions,
  // slots and tables.
  const std::vector<std::vector<int32_t>> prompts = {Prompt(230, 1), Prompt(40, 2),
                                                     Prompt(120, 3)};
  std::vector<std::vector<float>> l1, l2;
  const auto s0 = be.graph_stats();
  const auto t1 = BatchedDecode(**gpu, prompts, 48, nullptr, &l1);
  const auto s1 = be.graph_stats();
  const auto t2 = BatchedDecode(**gpu, prompts, 48, nullptr, &l2);
  const auto s2 = be.graph_stats();
  EXPECT_EQ(t1, t2);
  EXPECT_EQ(l1, l2);
  EXPECT_GE(s1.captured - s0.captured, 2);  // one per bucket
  EXPECT_GE(s1.replayed - s0.replayed, 36);
  EXPECT_EQ(s2.captured, s1.captured);      // nothing new to capture
  EXPECT_EQ(s2.replayed - s1.replayed, 48);
}

TEST(CudaGraphs, GraphDecodeMatchesPlainLaunches) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = Small();
  ASSERT_NE(model, nullptr);
  EngineOptions go;
  go.backend.kind = "cuda";
  go.kv.enable_prefix_caching = false;
  auto with = Engine::Create(*model, go);
  go.graphs = false;
  auto without = Engine::Create(*model, go);
  ASSERT_TRUE(with.ok() && without.ok());
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 4), Prompt(17, 5)};
  std::vector<std::vector<float>> lw, lo;
  const auto tw = BatchedDecode(**with, prompts, 40, nullptr, &lw);
  const auto to = BatchedDecode(**without, prompts, 40, &tw, &lo);  // the same tokens fed
  EXPECT_GT((*with)->runner().backend().graph_stats().replayed, 30);
  EXPECT_EQ((*without)->runner().backend().graph_stats().scopes, 0);
  // The recorded launches plan the key split for a bucket of lengths, so float sums may round
  // differently: every step's logits agree closely.
  ASSERT_EQ(lw.size(), lo.size());
  int same_top = 0;
  for (size_t i = 0; i < lw.size(); ++i) {
    double num = 0, den = 0;
    for (size_t j = 0; j < lw[i].size(); ++j) {
      num += (lw[i][j] - lo[i][j]) * (lw[i][j] - lo[i][j]);
      den += lo[i][j] * lo[i][j];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-2) << "step/sequence " << i;
    same_top += Argmax(lw[i]) == Argmax(lo[i]);
  }
  EXPECT_GE(same_top, static_cast<int>(lw.size()) * 9 / 10);
}

// The decode steps' gate_up + SwiGLU as one kernel (CudaBackendOptions::fused_swiglu, the
// default) against the two kernels, for every small-n variant: the same tokens and
// bit-identical logits through recorded and replayed graphs.
TEST(CudaGraphs, FusedSwiGluDecodeEqualsSeparateKernels) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device in this process";
  auto model = Small();
  ASSERT_NE(model, nullptr);
  const std::vector<std::vector<int32_t>> prompts = {Prompt(70, 6), Prompt(9, 7), Prompt(33, 8)};
  for (int variant = 0; variant < 5; ++variant) {
    std::vector<std::vector<int32_t>> tokens[2];
    std::vector<std::vector<float>> logits[2];
    for (int fused = 0; fused < 2; ++fused) {
      EngineOptions go;
      go.backend.kind = "cuda";
      go.backend.cuda.small_n_variant = variant;
      go.backend.cuda.fused_swiglu = fused == 1;
      go.kv.enable_prefix_caching = false;
      auto e = Engine::Create(*model, go);
      ASSERT_TRUE(e.ok()) << e.status();
      tokens[fused] = BatchedDecode(**e, prompts, 20, nullptr, &logits[fused]);
      EXPECT_GT((*e)->runner().backend().graph_stats().replayed, 10);
    }
    EXPECT_EQ(tokens[0], tokens[1]) << "variant " << variant;
    EXPECT_TRUE(logits[0] == logits[1]) << "variant " << variant;
  }
}

}  // namespace
}  // namespace sparsex

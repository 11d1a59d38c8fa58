// End-to-end engine tests on the real stories260K model.
#include "testing/models_dir.h"
#include "gpu_worker/engine/engine.h"

#include <cmath>
#include <fstream>
#include <random>
#include <span>
#include <sstream>

#include "tests/gpu_worker/reference_generate.h"
#include "tests/gpu_worker/test_util.h"

namespace sparsex {
namespace {

std::vector<int32_t> ReadIds(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << "missing oracle " << path;
  std::vector<int32_t> ids;
  int32_t x;
  while (f >> x) ids.push_back(x);
  return ids;
}

// An engine whose sequences never share blocks (two copies of one prompt stay independent).
absl::StatusOr<std::unique_ptr<Engine>> EngineWithoutPrefixCache(const Model& model) {
  EngineOptions eo;
  eo.kv.enable_prefix_caching = false;
  return Engine::Create(model, eo);
}

// Admits and prefills each text twice (into *a and *b: one copy per way of stepping them) and
// returns the greedy next token of each.
std::vector<int32_t> PrefillTwice(Engine& e, const Model& model, std::span<const char* const> texts,
                                  std::vector<Sequence>* a, std::vector<Sequence>* b) {
  std::vector<int32_t> tok;
  for (const char* t : texts) {
    for (auto* v : {a, b}) {
      auto s = e.Admit(model.tokenizer().Encode(t, true));
      EXPECT_TRUE(s.ok());
      if (!s.ok()) return {};
      auto lg = e.Prefill(*s);
      EXPECT_TRUE(lg.ok());
      if (!lg.ok()) return {};
      if (v == a) tok.push_back(Argmax(*lg));
      v->push_back(std::move(*s));
    }
  }
  return tok;
}

// The layer's gate_up + SwiGLU is one backend operation (Backend::MatMulSwiGLU); on the CPU
// reference it must equal MatMul then SwiGLU bit for bit, so the engine's CPU path is unchanged.
TEST(CpuBackend, MatMulSwiGLUEqualsMatMulThenSwiGLU) {
  auto be = CreateCpuBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  struct Shape {
    int64_t n, half, k;
  };
  for (Shape s : {Shape{1, 172, 64}, Shape{8, 37, 200}, Shape{67, 512, 256}}) {
    std::vector<float> xh(s.n * s.k), wh(2 * s.half * s.k);
    for (float& v : xh) v = d(rng);
    for (float& v : wh) v = d(rng) * 0.2f;
    auto x = (*be)->Alloc(s.n, s.k), w = (*be)->Alloc(2 * s.half, s.k);
    auto gu = (*be)->Alloc(s.n, 2 * s.half), a = (*be)->Alloc(s.n, s.half),
         b = (*be)->Alloc(s.n, s.half);
    ASSERT_TRUE(x.ok() && w.ok() && gu.ok() && a.ok() && b.ok());
    ASSERT_TRUE((*be)->Upload(xh, *x).ok());
    ASSERT_TRUE((*be)->Upload(wh, *w).ok());
    ASSERT_TRUE((*be)->MatMulSwiGLU(*x, *w, *a).ok());
    ASSERT_TRUE((*be)->MatMul(*x, *w, *gu).ok());
    ASSERT_TRUE((*be)->SwiGLU(*gu, *b).ok());
    std::vector<float> fa(s.n * s.half), fb(s.n * s.half);
    ASSERT_TRUE((*be)->Download(*a, fa).ok());
    ASSERT_TRUE((*be)->Download(*b, fb).ok());
    EXPECT_EQ(fa, fb) << s.n << " x " << s.k << " -> " << s.half;
    EXPECT_FALSE((*be)->MatMulSwiGLU(*x, *w, *gu).ok());  // out must be [n, half]
    for (auto* t : {&*x, &*w, &*gu, &*a, &*b}) (*be)->Free(*t);
  }
}

TEST(Engine, GreedyFromBosReproducesTheOracle) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = Engine::Create(*model, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<int32_t> oracle = ReadIds(sparsex::testing::ModelsDir() + "/stories260K/expected_greedy_t0.ids");
  ASSERT_EQ(oracle.size(), 345u);
  GenerateRequest req;
  req.prompt = {model->tokenizer().bos_id()};
  req.sampling.max_tokens = 1000;
  std::string streamed;
  auto r = sparsex::testing::Generate(**engine, req, [&](const TokenEvent& e) {
    streamed += e.text;
    return true;
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, oracle);
  EXPECT_EQ(r->finish_reason, "stop");
  EXPECT_EQ(streamed, r->text);
  EXPECT_EQ(r->text.rfind("Once upon a time, there was a little girl named Lily.", 0), 0u);
}

TEST(Engine, PrefixCacheHitGivesTheSameLogitsAsACold) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto cold = Engine::Create(*model, {});
  auto warm = Engine::Create(*model, {});
  ASSERT_TRUE(cold.ok() && warm.ok());
  std::vector<int32_t> p = model->tokenizer().Encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in "
      "the park. One day, she saw a big, red ball.", true);
  ASSERT_GT(p.size(), 32u);
  // Warm up the warm engine's prefix cache with the same prompt and another ending.
  auto first = p;
  first.back() = 300;
  auto s0 = (*warm)->Admit(first);
  ASSERT_TRUE(s0.ok());
  ASSERT_TRUE((*warm)->Prefill(*s0).ok());
  (*warm)->RegisterPrefix(*s0);
  (*warm)->Release(*s0);

  auto sc = (*cold)->Admit(p);
  auto sw = (*warm)->Admit(p);
  ASSERT_TRUE(sc.ok() && sw.ok());
  EXPECT_EQ(sc->cached_prefix, 0);
  EXPECT_EQ(sw->cached_prefix, static_cast<int>((p.size() - 1) / 16 * 16));
  auto lc = (*cold)->Prefill(*sc);
  auto lw = (*warm)->Prefill(*sw);
  ASSERT_TRUE(lc.ok() && lw.ok());
  ASSERT_EQ(lc->size(), lw->size());
  float maxdiff = 0;
  for (size_t i = 0; i < lc->size(); ++i) maxdiff = std::max(maxdiff, std::abs((*lc)[i] - (*lw)[i]));
  EXPECT_LT(maxdiff, 1e-4);
}

TEST(Engine, PagedAttentionEqualsContiguous) {
  auto be = CreateCpuBackend();
  ASSERT_TRUE(be.ok());
  Backend& b = **be;
  const int H = 4, KV = 2, hd = 8, ctx = 37, bs = 4, nblocks = 16;
  auto pool_c = b.AllocKvPool(1, nblocks, bs, KV * hd);
  auto pool_p = b.AllocKvPool(1, nblocks, bs, KV * hd);
  ASSERT_TRUE(pool_c.ok() && pool_p.ok());
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> kv(ctx * KV * hd * 2), q(ctx * H * hd);
  for (float& x : kv) x = nd(rng);
  for (float& x : q) x = nd(rng);
  auto kt = *b.Alloc(ctx, 2 * KV * hd);
  ASSERT_TRUE(b.Upload(kv, kt).ok());
  std::vector<int32_t> contiguous(ctx), paged(ctx);
  std::vector<int32_t> perm = {9, 3, 14, 0, 7, 11, 5, 2, 12, 1};  // scattered block table
  for (int p = 0; p < ctx; ++p) {
    contiguous[p] = p;
    paged[p] = perm[p / bs] * bs + p % bs;
  }
  ASSERT_TRUE(b.WriteKv(*pool_c, 0, kt, 0, kt, KV * hd, contiguous).ok());
  ASSERT_TRUE(b.WriteKv(*pool_p, 0, kt, 0, kt, KV * hd, paged).ok());
  auto qt = *b.Alloc(ctx, H * hd);
  ASSERT_TRUE(b.Upload(q, qt).ok());
  std::vector<int32_t> pos(ctx);
  for (int i = 0; i < ctx; ++i) pos[i] = i;
  auto oc = *b.Alloc(ctx, H * hd), op = *b.Alloc(ctx, H * hd);
  AttentionArgs a{.n_heads = H, .n_kv_heads = KV, .head_dim = hd, .q_pos = pos};
  a.ctx_slots = contiguous;
  ASSERT_TRUE(b.Attention(qt, *pool_c, 0, a, oc).ok());
  a.ctx_slots = paged;
  ASSERT_TRUE(b.Attention(qt, *pool_p, 0, a, op).ok());
  std::vector<float> vc(ctx * H * hd), vp(ctx * H * hd);
  ASSERT_TRUE(b.Download(oc, vc).ok());
  ASSERT_TRUE(b.Download(op, vp).ok());
  for (size_t i = 0; i < vc.size(); ++i) ASSERT_FLOAT_EQ(vc[i], vp[i]) << i;
  // Naive reference for one row: softmax over positions 0..pos of q.k / sqrt(hd).
  const int row = 20, h = 3, kvh = h / (H / KV);
  std::vector<double> sc(row + 1);
  double mx = -1e30, sum = 0;
  for (int j = 0; j <= row; ++j) {
    double d = 0;
    for (int t = 0; t < hd; ++t) d += q[row * H * hd + h * hd + t] * kv[j * 2 * KV * hd + kvh * hd + t];
    sc[j] = d / std::sqrt(static_cast<double>(hd));
    mx = std::max(mx, sc[j]);
  }
  for (double& s : sc) sum += (s = std::exp(s - mx));
  for (int t = 0; t < hd; ++t) {
    double o = 0;
    for (int j = 0; j <= row; ++j) o += sc[j] / sum * kv[j * 2 * KV * hd + KV * hd + kvh * hd + t];
    EXPECT_NEAR(vc[row * H * hd + h * hd + t], o, 1e-5);
  }
  for (Tensor* t : {&kt, &qt, &oc, &op}) b.Free(*t);
  b.FreeKvPool(*pool_c);
  b.FreeKvPool(*pool_p);
}

TEST(Engine, PromptOverContextLengthAndBadIdsAreClearErrors) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = Engine::Create(*model, {});
  ASSERT_TRUE(engine.ok());
  GenerateRequest req;
  req.prompt.assign(model->config().max_seq_len + 1, 300);
  auto r = sparsex::testing::Generate(**engine, req, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("context length"), std::string::npos);
  req.prompt = {1, 5000};
  r = sparsex::testing::Generate(**engine, req, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("vocabulary"), std::string::npos);
  req.prompt = {1};
  req.sampling.top_p = 0;
  EXPECT_FALSE(sparsex::testing::Generate(**engine, req, nullptr).ok());
}

TEST(Engine, PoolExhaustionIsReportedNotCrashed) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  EngineOptions o;
  o.kv.num_blocks = 2;  // 32 tokens
  auto engine = Engine::Create(*model, o);
  ASSERT_TRUE(engine.ok());
  GenerateRequest req;
  req.prompt.assign(40, 300);
  auto r = sparsex::testing::Generate(**engine, req, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  // The pool is intact afterwards: a short request still runs.
  req.prompt = {1, 403};
  req.sampling.max_tokens = 4;
  EXPECT_TRUE(sparsex::testing::Generate(**engine, req, nullptr).ok());
}

TEST(Engine, SeededSamplingIsReproducibleAndCancellable) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = Engine::Create(*model, {});
  ASSERT_TRUE(engine.ok());
  GenerateRequest req;
  req.prompt = model->tokenizer().Encode("Once upon a time", true);
  req.sampling = {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 42, .max_tokens = 24};
  auto a = sparsex::testing::Generate(**engine, req, nullptr);
  auto b = sparsex::testing::Generate(**engine, req, nullptr);  // second run also hits the prefix cache
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  int n = 0;
  auto c = sparsex::testing::Generate(**engine, req, [&](const TokenEvent&) { return ++n < 3; });
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->finish_reason, "cancelled");
  EXPECT_EQ(c->tokens.size(), 3u);
  EXPECT_EQ((*engine)->blocks().available(), (*engine)->blocks().num_blocks());
}

TEST(Engine, BatchedDecodeStepEqualsSteppingEachSequence) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = EngineWithoutPrefixCache(*model);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  const char* texts[] = {"Once upon a time", "Tom had a dog named Max. One day",
                         "The sun was hot and the birds sang in the tall green trees. Lily"};
  std::vector<Sequence> a, b;
  std::vector<int32_t> tok = PrefillTwice(e, *model, texts, &a, &b);
  ASSERT_EQ(tok.size(), std::size(texts));
  for (int step = 0; step < 20; ++step) {
    std::vector<Sequence*> ptrs = {&a[0], &a[1], &a[2]};
    auto batched = e.StepBatch(ptrs, tok);
    ASSERT_TRUE(batched.ok()) << batched.status();
    for (int i = 0; i < 3; ++i) {
      auto one = e.Step(b[i], tok[i]);
      ASSERT_TRUE(one.ok());
      EXPECT_LT(testing::MaxAbsDiff(*one, (*batched)[i]), 1e-4) << "sequence " << i << " step " << step;
      tok[i] = Argmax((*batched)[i]);
    }
  }
  // Not fully computed, or a token count that does not match: clear errors, nothing changed.
  const size_t len = a[0].tokens.size();
  a[0].tokens.push_back(5);
  std::vector<Sequence*> one = {&a[0]};
  std::vector<int32_t> t1 = {7};
  EXPECT_EQ(e.StepBatch(one, t1).status().code(), absl::StatusCode::kFailedPrecondition);
  a[0].tokens.pop_back();
  EXPECT_EQ(e.StepBatch(one, tok).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a[0].tokens.size(), len);
  for (auto* v : {&a, &b})
    for (Sequence& s : *v) e.Release(s);
}

// A prefill chunk riding in the decode step's forward pass (the scheduler's mixed iterations):
// the decoding sequences get what StepBatch gives them, the prefilled one what Prefill gives.
TEST(Engine, MixedChunkAndDecodeStepEqualsSeparatePasses) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = EngineWithoutPrefixCache(*model);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  const char* texts[] = {"Once upon a time", "Tom had a dog named Max. One day"};
  const std::vector<int32_t> prompt = model->tokenizer().Encode(
      "The sun was hot and the birds sang in the tall green trees. Lily and Tom went to the "
      "pond to see the ducks, and they took some bread with them.", true);
  std::vector<Sequence> a, b;  // a: mixed passes, b: separate ones
  std::vector<int32_t> tok = PrefillTwice(e, *model, texts, &a, &b);
  ASSERT_EQ(tok.size(), std::size(texts));
  auto pa = e.Admit(prompt);
  auto pb = e.Admit(prompt);
  ASSERT_TRUE(pa.ok() && pb.ok());
  auto whole = e.Prefill(*pb);  // the prefilled sequence's reference
  ASSERT_TRUE(whole.ok());
  const int total = static_cast<int>(prompt.size());
  for (int end = 9; pa->computed < total; end = std::min(total, end + 9)) {
    std::vector<Sequence*> ptrs = {&a[0], &a[1]};
    const Engine::ChunkRef chunk[] = {{&*pa, end}};
    auto m = e.StepWithChunks(ptrs, tok, chunk);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(pa->computed, end);
    std::vector<Sequence*> bp = {&b[0], &b[1]};
    auto sep = e.StepBatch(bp, tok);
    ASSERT_TRUE(sep.ok());
    for (int i = 0; i < 2; ++i) {
      EXPECT_LT(testing::MaxAbsDiff(m->decode[i], (*sep)[i]), 1e-4) << "sequence " << i << " end " << end;
      tok[i] = Argmax(m->decode[i]);
    }
    ASSERT_EQ(m->prefill.size(), 1u);
    if (end < total) {
      EXPECT_TRUE(m->prefill[0].empty());
    } else {
      EXPECT_LT(testing::MaxAbsDiff(m->prefill[0], *whole), 1e-4);
    }
  }
  // A chunk that does not advance, or the prefilled sequence also decoding: clear errors.
  std::vector<Sequence*> ptrs = {&a[0]};
  std::vector<int32_t> t1 = {tok[0]};
  const Engine::ChunkRef done[] = {{&*pa, total}}, decoding[] = {{&a[0], total}};
  EXPECT_EQ(e.StepWithChunks(ptrs, t1, done).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.StepWithChunks(ptrs, t1, decoding).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (auto* v : {&a, &b})
    for (Sequence& s : *v) e.Release(s);
  e.Release(*pa);
  e.Release(*pb);
}

// Decode steps whose rows are drawn on the backend (StepBatchDraw, and the decode rows of a
// mixed step), one greedy and one at a temperature, both, the first or neither drawn: the
// same tokens as the host's DrawToken of StepBatch's logits, the undrawn rows' logits as
// StepBatch's, and a mixed step's completed chunk still gets its logits.
TEST(Engine, DecodeStepsDrawOnTheBackend) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = EngineWithoutPrefixCache(*model);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  const char* texts[] = {"Once upon a time", "Tom had a dog named Max. One day"};
  std::vector<Sequence> a, b;  // a: reduced on the backend, b: logits on the host
  std::vector<int32_t> tok = PrefillTwice(e, *model, texts, &a, &b);
  ASSERT_EQ(tok.size(), std::size(texts));
  std::vector<int32_t> tok_b = tok;
  std::vector<RowDraw> draws(2);
  draws[1].inv_temperature = 1.25f;
  draws[1].seed = 42;
  for (int step = 0; step < 12; ++step) {
    std::vector<Sequence*> pa = {&a[0], &a[1]}, pb = {&b[0], &b[1]};
    draws[1].counter = static_cast<uint64_t>(step);
    const size_t k = 2 - step % 3;  // rows drawn on the backend: 2, 1, 0
    std::vector<RowDraw> three(3);
    EXPECT_FALSE(e.StepBatchDraw(pa, tok, three).ok());  // more draws than sequences
    auto r = e.StepBatchDraw(pa, tok, std::span<const RowDraw>(draws).first(k));
    auto lg = e.StepBatch(pb, tok_b);
    ASSERT_TRUE(r.ok() && lg.ok());
    ASSERT_EQ(r->drawn.size(), k);
    ASSERT_EQ(r->logits.size(), 2 - k);
    for (size_t i = 0; i < 2; ++i) {
      tok_b[i] = DrawToken((*lg)[i], draws[i]);
      if (i < k) {
        tok[i] = r->drawn[i];
      } else {
        EXPECT_EQ(r->logits[i - k], (*lg)[i]) << "sequence " << i << " step " << step;
        tok[i] = DrawToken(r->logits[i - k], draws[i]);
      }
      EXPECT_EQ(tok[i], tok_b[i]) << "sequence " << i << " step " << step;
      EXPECT_EQ(a[i].tokens, b[i].tokens);
      EXPECT_EQ(a[i].computed, static_cast<int>(a[i].tokens.size()));
    }
  }
  const std::vector<int32_t> prompt = model->tokenizer().Encode("Lily saw a big red ball.", true);
  auto pc = e.Admit(prompt);
  auto pd = e.Admit(prompt);
  ASSERT_TRUE(pc.ok() && pd.ok());
  auto whole = e.Prefill(*pd);
  ASSERT_TRUE(whole.ok());
  std::vector<Sequence*> pa = {&a[0], &a[1]}, pb = {&b[0], &b[1]};
  const Engine::ChunkRef chunk[] = {{&*pc, static_cast<int>(prompt.size())}};
  auto m = e.StepWithChunks(pa, tok, chunk, std::span<const RowDraw>(draws).first(1));
  auto lg = e.StepBatch(pb, tok_b);
  ASSERT_TRUE(m.ok() && lg.ok()) << m.status();
  ASSERT_EQ(m->decode_drawn.size(), 1u);
  EXPECT_EQ(m->decode_drawn[0], DrawToken((*lg)[0], draws[0]));
  ASSERT_EQ(m->decode.size(), 1u);
  EXPECT_EQ(m->decode[0], (*lg)[1]);
  ASSERT_EQ(m->prefill.size(), 1u);
  EXPECT_LT(testing::MaxAbsDiff(m->prefill[0], *whole), 1e-4);
  for (auto* v : {&a, &b})
    for (Sequence& s : *v) e.Release(s);
  e.Release(*pc);
  e.Release(*pd);
}

// Several prompts' chunks in one pass (the scheduler's short prompts prefilled together), with
// and without decode rows: each prompt gets the next-token logits a lone Prefill gives it, the
// decoding sequences what StepBatch gives them.
TEST(Engine, ChunksOfSeveralSequencesInOnePassEqualSeparatePrefills) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  auto engine = EngineWithoutPrefixCache(*model);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  const char* texts[] = {"Once upon a time", "Tom had a dog named Max. One day"};
  const char* prompts[] = {"Lily went to the park with her mom and saw a big red ball.", "The sun",
                           "Tom and Sam built a tall tower of blocks, and then the cat came in "
                           "and knocked it down."};
  const size_t n = std::size(prompts);
  std::vector<std::vector<float>> ref(n);
  for (size_t i = 0; i < n; ++i) {
    auto s = e.Admit(model->tokenizer().Encode(prompts[i], true));
    ASSERT_TRUE(s.ok());
    auto lg = e.Prefill(*s);
    ASSERT_TRUE(lg.ok());
    ref[i] = std::move(*lg);
    e.Release(*s);
  }
  for (bool decode : {false, true}) {
    SCOPED_TRACE(decode ? "with decode rows" : "chunks only");
    std::vector<Sequence> a, b;  // decoding sequences: a in the chunks' passes, b separately
    std::vector<int32_t> tok;
    if (decode) tok = PrefillTwice(e, *model, texts, &a, &b);
    std::vector<Sequence> ps;
    for (const char* p : prompts) {
      auto s = e.Admit(model->tokenizer().Encode(p, true));
      ASSERT_TRUE(s.ok());
      ps.push_back(std::move(*s));
    }
    // Up to 6 tokens of every unfinished prompt per pass: the prompts end in different passes.
    std::vector<std::vector<float>> got(n);
    for (int pass = 0;; ++pass) {
      std::vector<size_t> which;
      const std::vector<Engine::ChunkRef> chunks = testing::NextChunks(ps, 6, &which);
      if (chunks.empty()) break;
      std::vector<Sequence*> ptrs;
      for (Sequence& s : a) ptrs.push_back(&s);
      auto m = e.StepWithChunks(ptrs, tok, chunks);
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_EQ(m->prefill.size(), chunks.size());
      for (size_t j = 0; j < chunks.size(); ++j) {
        Sequence& s = *chunks[j].seq;
        EXPECT_EQ(s.computed, chunks[j].end);
        EXPECT_EQ(m->prefill[j].empty(), s.computed < static_cast<int>(s.tokens.size()));
        if (!m->prefill[j].empty()) got[which[j]] = std::move(m->prefill[j]);
      }
      if (!decode) continue;
      std::vector<Sequence*> bp;
      for (Sequence& s : b) bp.push_back(&s);
      auto sep = e.StepBatch(bp, tok);
      ASSERT_TRUE(sep.ok());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_LT(testing::MaxAbsDiff(m->decode[i], (*sep)[i]), 1e-4)
            << "sequence " << i << " pass " << pass;
        tok[i] = Argmax(m->decode[i]);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      EXPECT_LT(testing::MaxAbsDiff(got[i], ref[i]), 1e-4) << prompts[i];
    }
    // Two chunks of one sequence, or a chunk of a decoding one: clear errors, nothing changed.
    auto q = e.Admit(model->tokenizer().Encode(prompts[0], true));
    ASSERT_TRUE(q.ok());
    const std::vector<Engine::ChunkRef> twice = {{&*q, 3}, {&*q, 5}};
    EXPECT_EQ(e.StepWithChunks({}, {}, twice).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(q->computed, 0);
    if (decode) {
      std::vector<Sequence*> ptrs = {&a[0]};
      std::vector<int32_t> t1 = {tok[0]};
      const size_t len = a[0].tokens.size();
      const std::vector<Engine::ChunkRef> mixed = {{&*q, 4}, {&a[0], static_cast<int>(len)}};
      EXPECT_EQ(e.StepWithChunks(ptrs, t1, mixed).status().code(),
                absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(a[0].tokens.size(), len);
      EXPECT_EQ(q->computed, 0);
    }
    e.Release(*q);
    for (auto* v : {&a, &b, &ps})
      for (Sequence& s : *v) e.Release(s);
  }
}

}  // namespace
}  // namespace sparsex

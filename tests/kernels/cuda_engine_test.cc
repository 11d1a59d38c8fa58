// End-to-end on the GPU: the real stories260K model loaded into the CUDA backend generates the
// same greedy tokens as the CPU reference, and its logits stay close. Skips without a device.
#include <cmath>
#include <memory>

#include "gpu_worker/engine/engine.h"
#include "gtest/gtest.h"

namespace sparsex {
namespace {

std::unique_ptr<Model> LoadStories() {
  auto m = LoadModel(ModelsDir() + "/stories260K/stories260K.gguf");
  EXPECT_TRUE(m.ok()) << "cannot load the test model (set $SPARSEX_MODELS, now resolving to "
                      << ModelsDir() << "): " << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

GenerateResult Greedy(Engine& e, const std::vector<int32_t>& prompt, int n) {
  GenerateRequest req;
  req.prompt = prompt;
  req.sampling.max_tokens = n;
  req.sampling.ignore_eos = true;
  auto r = e.Generate(req, [](const TokenEvent&) { return true; });
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

}  // namespace
}  // namespace sparsex

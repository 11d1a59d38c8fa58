// Quantized GGUF weights through the engine: stories260K converted to Q8_0 by the reference
// quantizer (QuantizeGgufFile) gives logits close to the fp32 model's and the same greedy
// tokens; Q4_0 runs and stays in the neighbourhood.
#include <cmath>

#include "gpu_worker/engine/engine.h"
#include "model/quant.h"
#include "tests/gpu_worker/reference_generate.h"
#include "tests/gpu_worker/test_util.h"

namespace sparsex {
namespace {

struct EngineRun {
  std::vector<float> logits;  // after the prompt
  std::vector<int32_t> tokens;
};

EngineRun PrefillAndGenerate(const Model& model, const std::string& prompt, int n) {
  EngineRun out;
  auto engine = Engine::Create(model, {});
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return out;
  const std::vector<int32_t> ids = model.tokenizer().Encode(prompt, /*add_bos=*/true);
  auto s = (*engine)->Admit(ids);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return out;
  auto lg = (*engine)->Prefill(*s);
  EXPECT_TRUE(lg.ok()) << lg.status();
  if (!lg.ok()) return out;
  out.logits = *lg;
  (*engine)->Release(*s);
  GenerateRequest req;
  req.prompt = ids;
  req.sampling.max_tokens = n;
  req.sampling.temperature = 0;
  auto r = sparsex::testing::Generate(**engine, req, [](const TokenEvent&) { return true; });
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) out.tokens = r->tokens;
  return out;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

TEST(QuantEngine, Q8_0LogitsCloseToFp32AndSameGreedyTokens) {
  const std::string q8 = ::testing::TempDir() + "/stories260K-q8_0-engine.gguf";
  ASSERT_TRUE(QuantizeGgufFile(testing::Stories260KPath(), q8, kGgmlQ8_0).ok());
  auto ref = testing::LoadStories260K();
  ASSERT_NE(ref, nullptr);
  auto q = LoadModel(q8);
  ASSERT_TRUE(q.ok()) << q.status();
  for (const char* prompt : {"Once upon a time", "Lily and Ben went to the park. They saw"}) {
    const EngineRun a = PrefillAndGenerate(*ref, prompt, 16);
    const EngineRun b = PrefillAndGenerate(**q, prompt, 16);
    ASSERT_EQ(a.logits.size(), b.logits.size());
    const float diff = testing::MaxAbsDiff(a.logits, b.logits);
    std::printf("Q8_0 \"%s\": max |logit diff| %.4f of max |logit| %.2f\n", prompt, diff,
                MaxAbs(a.logits));
    EXPECT_LT(diff, 0.02f * MaxAbs(a.logits)) << prompt;
    EXPECT_EQ(Argmax(a.logits), Argmax(b.logits)) << prompt;
    ASSERT_EQ(a.tokens.size(), 16u) << prompt;
    EXPECT_EQ(a.tokens, b.tokens) << prompt;
  }
}

TEST(QuantEngine, Q4_0RunsNearFp32) {
  const std::string q4 = ::testing::TempDir() + "/stories260K-q4_0-engine.gguf";
  ASSERT_TRUE(QuantizeGgufFile(testing::Stories260KPath(), q4, kGgmlQ4_0).ok());
  auto ref = testing::LoadStories260K();
  ASSERT_NE(ref, nullptr);
  auto q = LoadModel(q4);
  ASSERT_TRUE(q.ok()) << q.status();
  const EngineRun a = PrefillAndGenerate(*ref, "Once upon a time", 4);
  const EngineRun b = PrefillAndGenerate(**q, "Once upon a time", 4);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  const float diff = testing::MaxAbsDiff(a.logits, b.logits);
  std::printf("Q4_0: max |logit diff| %.4f of max |logit| %.2f\n", diff, MaxAbs(a.logits));
  for (float x : b.logits) ASSERT_TRUE(std::isfinite(x));
  // 4-bit weights on a 260K-parameter model move the logits, but not wholesale.
  EXPECT_LT(diff, 0.5f * MaxAbs(a.logits));
  EXPECT_EQ(b.tokens.size(), 4u);
}

}  // namespace
}  // namespace sparsex

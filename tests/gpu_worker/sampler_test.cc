// Sampler (gpu_worker/engine/sampler.h): greedy and seeded sampling, and non-finite logits
// (issue 16): NaN or +Inf is an INTERNAL "non-finite logits" error from TrySample, never a
// token; Sample (for callers without a Status) records it in status() and does not sort NaNs.
#include "gpu_worker/engine/sampler.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

namespace sparsex {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

SamplingParams Hot(int top_k = 0, float top_p = 1.0f) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = 7;
  return p;
}

TEST(SamplerTest, GreedyAndSeededSampling) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f};
  Sampler greedy(SamplingParams{});
  auto t = greedy.TrySample(logits);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, 1);
  EXPECT_EQ(greedy.Sample(logits), 1);
  EXPECT_TRUE(greedy.status().ok());
  // The same seed draws the same tokens; top_k 1 is greedy.
  Sampler a(Hot()), b(Hot()), k1(Hot(1));
  for (int i = 0; i < 20; ++i) {
    const int32_t x = a.Sample(logits);
    EXPECT_EQ(x, b.Sample(logits));
    EXPECT_GE(x, 0);
    EXPECT_LT(x, 4);
    EXPECT_EQ(k1.Sample(logits), 1);
  }
}

// logit_bias shifts logits before sampling (-100 bans, +100 forces); the penalties lower the
// logits of tokens already drawn: presence once, frequency per draw.
TEST(SamplerTest, LogitBiasAndPenalties) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f};
  SamplingParams ban;
  ban.logit_bias = {{1, -100.0f}};
  Sampler b(ban);
  EXPECT_EQ(*b.TrySample(logits), 3);  // 1 is banned: the next best
  SamplingParams force = Hot();
  force.logit_bias = {{2, 100.0f}};
  Sampler f(force);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(*f.TrySample(logits), 2);
  // Greedy with a presence penalty of 1: 1 (2.0), then 3 (1.5 > 2.0 - 1 = 1.0), then 1 again
  // (1.0 beats 3's 1.5 - 1 = 0.5): presence counts once, however often a token was drawn.
  SamplingParams pres;
  pres.presence_penalty = 1.0f;
  Sampler p(pres);
  EXPECT_EQ(*p.TrySample(logits), 1);
  EXPECT_EQ(*p.TrySample(logits), 3);
  EXPECT_EQ(*p.TrySample(logits), 1);  // 1: 2.0 - 1 = 1.0 beats 3: 1.5 - 1 = 0.5
  // A frequency penalty grows with each draw: 1 (2.0), 1 (1.6 > 1.5), then 3 (1.5 > 1.2).
  SamplingParams freq;
  freq.frequency_penalty = 0.4f;
  Sampler q(freq);
  EXPECT_EQ(*q.TrySample(logits), 1);
  EXPECT_EQ(*q.TrySample(logits), 1);
  EXPECT_EQ(*q.TrySample(logits), 3);
  // Out of range: refused.
  SamplingParams bad;
  bad.frequency_penalty = 2.5f;
  EXPECT_FALSE(ValidateSampling(bad).ok());
  bad = SamplingParams{};
  bad.logit_bias = {{0, 101.0f}};
  EXPECT_FALSE(ValidateSampling(bad).ok());
}

TEST(SamplerTest, NegativeInfinityMasksAToken) {
  const std::vector<float> logits = {-kInf, 0.0f, -kInf, 0.5f};
  for (const SamplingParams& p : {SamplingParams{}, Hot(), Hot(2), Hot(0, 0.5f)}) {
    Sampler s(p);
    for (int i = 0; i < 50; ++i) {
      auto t = s.TrySample(logits);
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_TRUE(*t == 1 || *t == 3) << *t;
    }
  }
}

TEST(SamplerTest, NonFiniteLogitsAreAnError) {
  const std::vector<std::vector<float>> bad = {
      {kNaN, kNaN, kNaN, kNaN},  // the issue: every logit NaN gave token 0 forever
      {0.5f, kNaN, 1.0f, 0.0f},
      {0.5f, 1.0f, kInf, 0.0f},
      {-kInf, -kInf, -kInf, -kInf},
      {}};
  for (const SamplingParams& p : {SamplingParams{}, Hot(), Hot(2), Hot(0, 0.9f)}) {
    for (const auto& logits : bad) {
      Sampler s(p);
      auto t = s.TrySample(logits);
      ASSERT_FALSE(t.ok()) << "temperature " << p.temperature << ", token " << *t;
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInternal);
      EXPECT_NE(t.status().message().find("non-finite logits"), std::string::npos) << t.status();
      // Sample: the error is recorded (the first one stays), no sort over NaNs.
      s.Sample(logits);
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInternal);
      EXPECT_NE(s.status().message().find("non-finite logits"), std::string::npos);
    }
  }
  auto s = CheckLogits(std::vector<float>{0.0f, 1.0f, kNaN});
  EXPECT_NE(s.message().find("logit 2 of 3 is nan"), std::string::npos) << s;
  EXPECT_TRUE(CheckLogits(std::vector<float>{0.0f, -kInf}).ok());
}

TEST(SamplerTest, NaNLogitsWithTemperatureDoNotBreakTheSort) {
  // A vocabulary-sized row with NaNs scattered through it: sorting with a NaN comparison is
  // undefined behaviour (std::sort may read out of bounds). Sample must stay well-defined.
  std::vector<float> logits(50000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = (i % 7 == 0) ? kNaN : float(i % 13);
  Sampler s(Hot());
  for (int i = 0; i < 5; ++i) {
    const int32_t t = s.Sample(logits);
    EXPECT_GE(t, 0);
    EXPECT_LT(t, static_cast<int32_t>(logits.size()));
  }
  EXPECT_FALSE(s.status().ok());
}

}  // namespace
}  // namespace sparsex

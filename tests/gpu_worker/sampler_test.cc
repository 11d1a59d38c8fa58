// Sampler (gpu_worker/engine/sampler.h): greedy and seeded sampling, and non-finite logits
// (docs/reliability.md): NaN or +Inf is an INTERNAL "non-finite logits" error from TrySample, never a
// token; Sample (for callers without a Status) records it in status() and does not sort NaNs.
// ComputeLogprobs: a normalized log-softmax of the raw logits, stable for large logits, top
// alternatives by value with ties broken by token id.
#include "gpu_worker/engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
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

// Argmax is the first index of the largest logit, NaN never larger (and a NaN first wins, as
// in a scan that keeps the strictly greater): checked against that scan on rows of every
// length around the lane width, with ties, infinities, signed zeros and NaNs.
TEST(SamplerTest, ArgmaxIsTheFirstLargest) {
  auto scan = [](const std::vector<float>& v) {
    int32_t best = 0;
    for (size_t i = 1; i < v.size(); ++i) {
      if (v[i] > v[best]) best = static_cast<int32_t>(i);
    }
    return best;
  };
  std::mt19937 rng(3);
  const float pool[] = {0.0f, -0.0f, 1.0f, 1.0f, 2.5f, -3.0f, kInf, -kInf, kNaN};
  for (int len = 1; len <= 70; ++len) {
    for (int trial = 0; trial < 30; ++trial) {
      std::vector<float> v(static_cast<size_t>(len));
      for (float& x : v) x = pool[rng() % (trial < 10 ? 6 : 9)];
      ASSERT_EQ(Argmax(v), scan(v)) << "length " << len << " trial " << trial;
    }
  }
  EXPECT_EQ(Argmax({}), 0);
  EXPECT_EQ(Argmax(std::vector<float>{-kInf, -kInf, -kInf}), 0);
  EXPECT_EQ(Argmax(std::vector<float>{kNaN, 5.0f}), 0);
  EXPECT_EQ(Argmax(std::vector<float>{1.0f, kNaN, 3.0f, 3.0f}), 2);
}

// Temperature, top-k and top-p draw from the distribution their definitions give (OpenAI's
// and vLLM's: softmax of logits / T over the k largest, then the shortest most-likely head
// with top_p of that mass, the lower id first among equal logits), whatever order Draw walks:
// every draw is in the reference's support, and frequencies match its probabilities.
TEST(SamplerTest, DrawsFollowTheTemperatureTopKAndTopPDistribution) {
  const std::vector<float> logits = {3.0f, 1.0f, 2.5f, -1.0f, 0.0f, 2.5f, -kInf, 1.2f, 0.4f};
  auto reference = [&](const SamplingParams& p) {
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    size_t keep = p.top_k > 0 ? std::min<size_t>(p.top_k, order.size()) : order.size();
    std::vector<double> w(logits.size(), 0.0);
    double sum = 0;
    for (size_t i = 0; i < keep; ++i) sum += std::exp((logits[order[i]] - 3.0) / p.temperature);
    double acc = 0;
    for (size_t i = 0; i < keep; ++i) {
      const double x = std::exp((logits[order[i]] - 3.0) / p.temperature);
      w[order[i]] = x;
      acc += x / sum;
      if (acc >= p.top_p) break;
    }
    double z = 0;
    for (double x : w) z += x;
    for (double& x : w) x /= z;
    return w;
  };
  struct Case {
    float t;
    int k;
    float p;
  };
  for (const Case c : {Case{0.7f, 0, 1.0f}, Case{0.7f, 0, 0.8f}, Case{1.3f, 0, 0.6f},
                       Case{0.7f, 3, 1.0f}, Case{1.0f, 4, 0.9f}, Case{2.0f, 0, 0.999f}}) {
    SamplingParams p;
    p.temperature = c.t;
    p.top_k = c.k;
    p.top_p = c.p;
    p.seed = 11;
    const std::vector<double> want = reference(p);
    Sampler s(p);
    std::vector<int> count(logits.size(), 0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) ++count[*s.TrySample(logits)];
    for (size_t t = 0; t < logits.size(); ++t) {
      const double got = static_cast<double>(count[t]) / draws;
      if (want[t] == 0) {
        EXPECT_EQ(count[t], 0) << "token " << t << " outside the support, T " << c.t << " k "
                               << c.k << " p " << c.p;
      } else {
        EXPECT_NEAR(got, want[t], 0.012) << "token " << t << ", T " << c.t << " k " << c.k
                                         << " p " << c.p;
      }
    }
  }
  // A large flat vocabulary (the nucleus is most of it): draws stay in the reference nucleus.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> big(5000);
  for (float& x : big) x = nd(rng);
  std::vector<int32_t> order(big.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return big[a] > big[b]; });
  const float mx = big[order[0]];
  double total = 0;
  for (float x : big) total += std::exp((x - mx) / 0.8);
  std::vector<char> in(big.size(), 0);
  double acc = 0;
  for (int32_t i : order) {
    in[i] = 1;
    acc += std::exp((big[i] - mx) / 0.8) / total;
    if (acc >= 0.9) break;
  }
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.9f;
  Sampler s(p);
  for (int i = 0; i < 3000; ++i) ASSERT_TRUE(in[*s.TrySample(big)]) << "draw " << i;
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

TEST(SamplerTest, LogprobsAreANormalizedLogSoftmax) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> logits(512);
  for (float& x : logits) x = normal(rng);
  const int32_t greedy = Argmax(logits);
  const TokenLogprobs all = ComputeLogprobs(logits, greedy, static_cast<int>(logits.size()));
  ASSERT_EQ(all.top.size(), logits.size());
  double sum = 0.0;
  for (const auto& [id, lp] : all.top) {
    EXPECT_LE(lp, 0.0f);
    sum += std::exp(static_cast<double>(lp));
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  // The greedy token's log-probability is the largest, and the first of the top list.
  EXPECT_EQ(all.token, greedy);
  EXPECT_EQ(all.top[0].first, greedy);
  EXPECT_FLOAT_EQ(all.logprob, all.top[0].second);
  for (size_t i = 0; i < logits.size(); ++i) {
    EXPECT_LE(ComputeLogprobs(logits, static_cast<int32_t>(i), 0).logprob, all.logprob);
  }
  // Top-k is sorted, most likely first; differences of log-probabilities are the logits'.
  const TokenLogprobs top5 = ComputeLogprobs(logits, 7, 5);
  ASSERT_EQ(top5.top.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(top5.top[i], all.top[i]);
    if (i > 0) EXPECT_GE(top5.top[i - 1].second, top5.top[i].second);
  }
  EXPECT_NEAR(top5.logprob - all.logprob, logits[7] - logits[greedy], 1e-4);
  // top_n 0: no alternatives; more than the vocabulary: all of it.
  EXPECT_TRUE(ComputeLogprobs(logits, 0, 0).top.empty());
  EXPECT_EQ(ComputeLogprobs(std::vector<float>{1, 2}, 0, 9).top.size(), 2u);
}

TEST(SamplerTest, LogprobsKnownValuesTiesAndStability) {
  // Uniform over 4: log(1/4) each, ties in token id order.
  const TokenLogprobs u = ComputeLogprobs(std::vector<float>{5, 5, 5, 5}, 2, 3);
  EXPECT_NEAR(u.logprob, std::log(0.25), 1e-6);
  ASSERT_EQ(u.top.size(), 3u);
  EXPECT_EQ(u.top[0].first, 0);
  EXPECT_EQ(u.top[1].first, 1);
  EXPECT_EQ(u.top[2].first, 2);
  // Ties below a larger value keep id order too.
  const TokenLogprobs t = ComputeLogprobs(std::vector<float>{1, 3, 1, 3, 2}, 0, 5);
  std::vector<int32_t> order;
  for (const auto& [id, lp] : t.top) order.push_back(id);
  EXPECT_EQ(order, (std::vector<int32_t>{1, 3, 4, 0, 2}));
  // Large logits do not overflow (a naive exp(1000) is inf), a -inf logit is -inf.
  const TokenLogprobs big = ComputeLogprobs(std::vector<float>{1000, 1000, -kInf}, 0, 3);
  EXPECT_NEAR(big.logprob, std::log(0.5), 1e-6);
  EXPECT_TRUE(std::isinf(big.top[2].second) && big.top[2].second < 0);
  EXPECT_EQ(big.top[2].first, 2);
  // Logits far apart: the small one's log-probability is exact, not log(0).
  const TokenLogprobs far = ComputeLogprobs(std::vector<float>{0, -200}, 1, 0);
  EXPECT_NEAR(far.logprob, -200.0, 1e-3);
}


// DrawToken (common/logits.h), the Gumbel-max rule a backend draws rows by: its shortcut
// (tokens whose scaled logit plus the largest noise is below the best score are skipped)
// gives exactly the token of scoring every logit, for peaked and flat rows, and -1 for rows
// no token can be drawn from.
TEST(SamplerTest, DrawTokenIsTheGumbelMaxOfEveryLogit) {
  auto every = [](const std::vector<float>& x, const RowDraw& d) {
    int32_t best_i = -1;
    float best = -kInf;
    for (size_t i = 0; i < x.size(); ++i) {
      const float v = x[i] * d.inv_temperature -
                      std::log(-std::log(DrawUniform(d.seed, d.counter, i)));
      if (best_i < 0 || v > best) {
        best = v;
        best_i = static_cast<int32_t>(i);
      }
    }
    return best_i;
  };
  std::mt19937 rng(3);
  for (const float spread : {0.5f, 4.0f, 30.0f}) {
    std::normal_distribution<float> nd(0.0f, spread);
    for (int row = 0; row < 40; ++row) {
      std::vector<float> x(3001);
      for (float& v : x) v = nd(rng);
      x[17] = -kInf;  // a masked token
      const RowDraw d{.inv_temperature = row % 2 ? 1.0f : 1.7f, .seed = 99, .counter = uint64_t(row)};
      EXPECT_EQ(DrawToken(x, d), every(x, d)) << "spread " << spread << " row " << row;
    }
  }
  const RowDraw hot{.inv_temperature = 1.0f, .seed = 1};
  EXPECT_EQ(DrawToken(std::vector<float>{0.0f, kNaN}, hot), -1);
  EXPECT_EQ(DrawToken(std::vector<float>{kInf, 0.0f}, hot), -1);
  EXPECT_EQ(DrawToken(std::vector<float>{-kInf, -kInf}, hot), -1);
  EXPECT_EQ(DrawToken(std::vector<float>{-kInf, 2.0f, -kInf}, hot), 1);
  EXPECT_EQ(DrawToken(std::vector<float>{1.0f, 3.0f, 3.0f}, RowDraw{}), 1);  // greedy
  // The variates are strictly inside (0, 1), the extreme bits included: no infinite noise
  // (with 24 bits the largest rounded up to 1).
  EXPECT_GT(UniformOfBits(0), 0.0f);
  EXPECT_LT(UniformOfBits((1u << kDrawBits) - 1), 1.0f);
  EXPECT_TRUE(std::isfinite(std::log(-std::log(UniformOfBits((1u << kDrawBits) - 1)))));
  EXPECT_TRUE(std::isfinite(std::log(-std::log(UniformOfBits(0)))));
  for (uint64_t i = 0; i < 100000; ++i) ASSERT_LT(DrawBits(5, 7, i), 1u << kDrawBits);
}

// A token far ahead (logit 30 above the rest of a 128K vocabulary: the others' total mass is
// ~1e-8) is drawn every time: the noise is bounded (~16.6), never infinite. With 24-bit
// variates the largest rounded up to u = 1, and ~0.8% of such draws chose a random token.
TEST(SamplerTest, GumbelNoiseIsBoundedSoAFarAheadTokenAlwaysWins) {
  std::vector<float> x(1 << 17, 0.0f);
  x[4321] = 30.0f;
  int other = 0;
  for (uint64_t c = 0; c < 3000; ++c) {
    other += DrawToken(x, RowDraw{.inv_temperature = 1.0f, .seed = 17, .counter = c}) != 4321;
  }
  EXPECT_EQ(other, 0);
}

// BackendDraw: which requests a backend may draw (greedy, plain temperature) with the
// sampler's seed and draw count; a token drawn there and reported with Drew() leaves the
// sampler where drawing it on the host would have: the same tokens either way, step by step.
TEST(SamplerTest, TokensDrawnOnTheBackendMatchTheHostDraws) {
  SamplingParams p;
  p.temperature = 0.9f;
  p.seed = 1234;
  Sampler host(p), mixed(p);
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int step = 0; step < 64; ++step) {
    std::vector<float> x(5000);
    for (float& v : x) v = nd(rng);
    const absl::StatusOr<int32_t> want = host.TrySample(x);
    ASSERT_TRUE(want.ok());
    if (step % 3 == 0) {  // this step's logits reached the host
      EXPECT_EQ(*mixed.TrySample(x), *want) << step;
      continue;
    }
    const std::optional<RowDraw> d = mixed.BackendDraw();
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->counter, static_cast<uint64_t>(step));
    EXPECT_FLOAT_EQ(d->inv_temperature, 1.0f / 0.9f);
    const int32_t t = DrawToken(x, *d);
    EXPECT_EQ(t, *want) << step;
    mixed.Drew(t);
  }
  // Greedy: inv_temperature 0; a temperature whose inverse is not a safe float is greedy too.
  SamplingParams g;
  EXPECT_EQ(Sampler(g).BackendDraw()->inv_temperature, 0.0f);
  g.temperature = 1e-30f;
  EXPECT_EQ(Sampler(g).BackendDraw()->inv_temperature, 0.0f);
  EXPECT_EQ(*Sampler(g).TrySample(std::vector<float>{0.0f, 1.0f, 1.0f - 1e-6f}), 1);
  // What only the host sampler does: top-k, top-p, logit bias, penalties.
  EXPECT_FALSE(Sampler(Hot(40)).BackendDraw().has_value());
  EXPECT_FALSE(Sampler(Hot(0, 0.95f)).BackendDraw().has_value());
  SamplingParams b = Hot();
  b.logit_bias = {{3, 1.0f}};
  EXPECT_FALSE(Sampler(b).BackendDraw().has_value());
  SamplingParams f;
  f.frequency_penalty = 0.5f;
  EXPECT_FALSE(Sampler(f).BackendDraw().has_value());
  EXPECT_TRUE(Sampler(Hot()).BackendDraw().has_value());
}

}  // namespace
}  // namespace sparsex

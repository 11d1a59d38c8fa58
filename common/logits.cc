#include "common/logits.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace sparsex {

int32_t Argmax(std::span<const float> logits) {
  const size_t n = logits.size();
  if (n == 0 || std::isnan(logits[0])) return 0;  // nothing compares greater than a NaN first
  // Two passes with no loop-carried index (a running "best index" scan is ~7x slower: each
  // step waits on a load at the index the previous one chose, 0.56 ms per 128K-logit row on
  // the CI machine, i.e. 18 ms per batch-32 decode step): the largest value NaN aside, in
  // independent lanes, then its first index. The same answer: the first of the largest.
  constexpr size_t kLanes = 16;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float* x = logits.data();
  float lane[kLanes];
  for (float& v : lane) v = kNegInf;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  float best = kNegInf;
  for (const float v : lane) best = v > best ? v : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  for (size_t k = 0; k < n; ++k) {
    if (x[k] == best) return static_cast<int32_t>(k);
  }
  return 0;
}

absl::Status CheckLogits(std::span<const float> logits) {
  if (logits.empty()) return absl::InternalError("non-finite logits: no logits");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // One branch-free pass (a vocabulary is ~10^5 logits per token); the culprit is looked up
  // only when there is one.
  bool bad = false, any = false;
  for (const float x : logits) {
    bad |= !(x < kInf);  // NaN or +Inf
    any |= x > -kInf;
  }
  if (bad) {
    for (size_t i = 0; i < logits.size(); ++i) {
      if (!(logits[i] < kInf)) {
        return absl::InternalError(absl::StrCat("non-finite logits: logit ", i, " of ",
                                                logits.size(), " is ", logits[i],
                                                " (broken weights or kernel)"));
      }
    }
  }
  if (!any) return absl::InternalError("non-finite logits: every logit is -inf");
  return absl::OkStatus();
}

namespace {
// The Gumbel noise of a draw's variate bits, in float as the kernel computes it.
inline float Gumbel(uint32_t bits) { return -std::log(-std::log(UniformOfBits(bits))); }

// An upper bound of the noise of every variate whose top 8 bits are b: the noise of the
// bucket's largest variate (the noise rises with the variate), plus a margin for log's
// rounding.
constexpr int kBucketShift = kDrawBits - 8;
struct NoiseBounds {
  float at[256];
  NoiseBounds() {
    for (uint32_t b = 0; b < 256; ++b) {
      at[b] = Gumbel((b << kBucketShift) | ((1u << kBucketShift) - 1)) + 1e-3f;
    }
  }
};
}  // namespace

int32_t DrawToken(std::span<const float> logits, const RowDraw& draw) {
  if (!CheckLogits(logits).ok()) return -1;
  if (draw.inv_temperature == 0.0f) return Argmax(logits);
  const float inv_t = draw.inv_temperature;
  // The noise's two logarithms are most of the cost (~5 ns a token), and most tokens cannot
  // win: a token whose scaled logit plus a bound of its noise (from its variate's top 8 bits)
  // is below the best score so far is skipped after a hash and a compare (float addition is
  // monotonic, so it could not win or tie). With N(0, 1) logits at temperature 1 that skips
  // ~95% of the logarithms. The best score starts at the most likely token's.
  static const NoiseBounds bound;
  const int32_t top = Argmax(logits);
  float best = logits[top] * inv_t + Gumbel(DrawBits(draw.seed, draw.counter, top));
  int32_t best_i = top;
  const float* x = logits.data();
  for (size_t i = 0; i < logits.size(); ++i) {
    const uint32_t bits = DrawBits(draw.seed, draw.counter, i);
    const float s = x[i] * inv_t;
    if (!(s + bound.at[bits >> kBucketShift] >= best) || static_cast<int32_t>(i) == top) continue;
    const float v = s + Gumbel(bits);
    if (v > best || (v == best && static_cast<int32_t>(i) < best_i)) {
      best = v;
      best_i = static_cast<int32_t>(i);
    }
  }
  return best_i;
}

}  // namespace sparsex

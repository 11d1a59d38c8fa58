#include "gpu_worker/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace sparsex {

absl::Status ValidateSampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return absl::InvalidArgumentError("temperature must be a finite number >= 0");
  }
  if (p.top_k < 0) return absl::InvalidArgumentError("top_k must be >= 0");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError("top_p must be in (0, 1]");
  }
  if (p.max_tokens < 0) return absl::InvalidArgumentError("max_tokens must be >= 0");
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) return absl::InvalidArgumentError("logit_bias: negative token id");
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return absl::InvalidArgumentError("logit_bias values must be in [-100, 100]");
    }
  }
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f) ||
      !(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return absl::InvalidArgumentError("presence_penalty and frequency_penalty must be in [-2, 2]");
  }
  return absl::OkStatus();
}

TokenLogprobs ComputeLogprobs(std::span<const float> logits, int32_t token, int top_n) {
  TokenLogprobs out;
  out.token = token;
  const int n = static_cast<int>(logits.size());
  if (n == 0) return out;
  // log_softmax(x)_i = x_i - (m + log(sum_j exp(x_j - m))), m = max_j x_j: every exponent is
  // <= 0, so nothing overflows, and the largest term is exp(0) = 1, so the sum is >= 1.
  double m = -std::numeric_limits<double>::infinity();
  for (const float x : logits) m = std::max(m, static_cast<double>(x));
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x) - m);
  const double lse = m + std::log(sum);
  const auto lp = [&](int32_t i) { return static_cast<float>(static_cast<double>(logits[i]) - lse); };
  if (token >= 0 && token < n) out.logprob = lp(token);
  top_n = std::clamp(top_n, 0, n);
  if (top_n > 0) {
    // One pass keeping the best top_n in a heap (its front the worst kept): no vocabulary-sized
    // index array per token.
    const auto better = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::vector<int32_t> heap;
    heap.reserve(top_n);
    for (int32_t i = 0; i < n; ++i) {
      if (static_cast<int>(heap.size()) < top_n) {
        heap.push_back(i);
        std::push_heap(heap.begin(), heap.end(), better);
      } else if (better(i, heap.front())) {
        std::pop_heap(heap.begin(), heap.end(), better);
        heap.back() = i;
        std::push_heap(heap.begin(), heap.end(), better);
      }
    }
    std::sort_heap(heap.begin(), heap.end(), better);  // best first
    out.top.reserve(top_n);
    for (const int32_t i : heap) out.top.emplace_back(i, lp(i));
  }
  return out;
}

int32_t Argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
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

int32_t Sampler::Sample(std::span<const float> logits) {
  absl::StatusOr<int32_t> t = TrySample(logits);
  if (t.ok()) return *t;
  if (status_.ok()) status_ = t.status();
  return logits.empty() ? 0 : Argmax(logits);
}

absl::StatusOr<int32_t> Sampler::TrySample(std::span<const float> raw) {
  RETURN_IF_ERROR(CheckLogits(raw));
  std::span<const float> logits = raw;
  const bool penalties = p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f;
  if (!p_.logit_bias.empty() || (penalties && !drawn_.empty())) {
    adjusted_.assign(raw.begin(), raw.end());
    const int64_t n = static_cast<int64_t>(adjusted_.size());
    for (const auto& [id, bias] : p_.logit_bias) {
      if (id < n) adjusted_[id] += bias;
    }
    for (const auto& [id, count] : drawn_) {
      if (id < n) adjusted_[id] -= p_.presence_penalty + p_.frequency_penalty * count;
    }
    logits = adjusted_;
  }
  ASSIGN_OR_RETURN(const int32_t t, Draw(logits));
  if (penalties) {
    auto it = std::find_if(drawn_.begin(), drawn_.end(), [t](const auto& e) { return e.first == t; });
    if (it == drawn_.end()) {
      drawn_.emplace_back(t, 1);
    } else {
      ++it->second;
    }
  }
  return t;
}

absl::StatusOr<int32_t> Sampler::Draw(std::span<const float> logits) {
  if (p_.temperature == 0.0f) return Argmax(logits);
  const int n = static_cast<int>(logits.size());
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  int keep = n;
  if (p_.top_k > 0 && p_.top_k < n) {
    std::partial_sort(idx.begin(), idx.begin() + p_.top_k, idx.end(),
                      [&](int a, int b) { return logits[a] > logits[b]; });
    keep = p_.top_k;
  } else {
    std::sort(idx.begin(), idx.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  }
  std::vector<double> prob(keep);
  const double mx = logits[idx[0]];
  double sum = 0;
  for (int i = 0; i < keep; ++i) {
    prob[i] = std::exp((logits[idx[i]] - mx) / p_.temperature);
    sum += prob[i];
  }
  if (p_.top_p < 1.0f) {
    double acc = 0;
    int cut = keep;
    for (int i = 0; i < keep; ++i) {
      acc += prob[i] / sum;
      if (acc >= p_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(prob.begin(), prob.begin() + keep, 0.0);
  }
  double r = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  for (int i = 0; i < keep; ++i) {
    r -= prob[i];
    if (r <= 0) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace sparsex

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
  return absl::OkStatus();
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

absl::StatusOr<int32_t> Sampler::TrySample(std::span<const float> logits) {
  RETURN_IF_ERROR(CheckLogits(logits));
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

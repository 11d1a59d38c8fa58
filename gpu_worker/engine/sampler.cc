#include "gpu_worker/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
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
  ++draws_;
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

float Sampler::InvTemperature() const {
  if (p_.temperature == 0.0f) return 0.0f;
  const float inv = 1.0f / p_.temperature;
  return std::isfinite(inv) && inv < 1e20f ? inv : 0.0f;
}

bool Sampler::Plain() const {
  return !(p_.top_k > 0) && p_.top_p >= 1.0f;
}

std::optional<RowDraw> Sampler::BackendDraw() const {
  if (!p_.logit_bias.empty() || p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f) {
    return std::nullopt;
  }
  const float inv_t = InvTemperature();
  if (inv_t != 0.0f && !Plain()) return std::nullopt;
  return NextDraw(inv_t);
}

RowDraw Sampler::NextDraw(float inv_temperature) const {
  RowDraw d;
  d.inv_temperature = inv_temperature;
  d.seed = p_.seed;
  d.counter = draws_;
  return d;
}

void Sampler::Drew(int32_t) { ++draws_; }

absl::StatusOr<int32_t> Sampler::Draw(std::span<const float> logits) {
  const float inv_temperature = InvTemperature();
  if (inv_temperature == 0.0f) return Argmax(logits);
  if (Plain()) {
    // Gumbel-max from (seed, draw count), as a backend draws the row on the device: the same
    // distribution as the softmax, and the same token wherever it is drawn.
    return DrawToken(logits, NextDraw(inv_temperature));
  }
  // Temperature sampling without sorting the vocabulary: a full sort of 128K logits took
  // ~11 ms per token per sequence on the CI machine (373 ms per batch-32 step; OpenAI's
  // default temperature is 1, so this was the common path). Now: the top k by selection;
  // otherwise the probabilities in vocabulary order, and for top_p only as much of the
  // descending order as the nucleus needs. Order among equal logits: the lower id first.
  const int n = static_cast<int>(logits.size());
  auto before = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const double mx = logits[Argmax(logits)];
  const double inv_t = 1.0 / p_.temperature;
  auto weight = [&](int32_t i) { return std::exp((logits[i] - mx) * inv_t); };
  std::vector<int32_t>& idx = idx_;
  std::vector<double>& prob = prob_;  // weights by token id (vocabulary order)
  std::vector<double>& kept = kept_;  // weights of idx[0, keep), in that order
  int keep = n;
  if (p_.top_k > 0 && p_.top_k < n) {
    // The k-th largest logit by selection over the values (no indirection), then the tokens
    // above it and, of those equal to it, the lower ids first.
    keep = p_.top_k;
    float kth;
    if (keep <= 1024) {  // a min-heap of the k largest: most logits fail one comparison
      vals_.assign(logits.begin(), logits.begin() + keep);
      std::make_heap(vals_.begin(), vals_.end(), std::greater<float>());
      for (int i = keep; i < n; ++i) {
        if (logits[i] > vals_.front()) {
          std::pop_heap(vals_.begin(), vals_.end(), std::greater<float>());
          vals_.back() = logits[i];
          std::push_heap(vals_.begin(), vals_.end(), std::greater<float>());
        }
      }
      kth = vals_.front();
    } else {
      vals_.assign(logits.begin(), logits.end());
      std::nth_element(vals_.begin(), vals_.begin() + (n - keep), vals_.end());
      kth = vals_[n - keep];
    }
    idx.clear();
    for (int i = 0; i < n; ++i) {
      if (logits[i] > kth) idx.push_back(i);
    }
    for (int i = 0; i < n && static_cast<int>(idx.size()) < keep; ++i) {
      if (logits[i] == kth) idx.push_back(i);
    }
    std::sort(idx.begin(), idx.end(), before);
  } else {
    // Nucleus: the shortest head of the descending order with top_p of the mass, found by a
    // selection on the mass (three-way partitions around a pivot logit, O(n) expected) rather
    // than a sort; the draw then needs no order within it.
    prob.resize(n);
    double total = 0;
    for (int i = 0; i < n; ++i) total += prob[i] = weight(i);
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    double need = p_.top_p * total;  // mass the nucleus still needs beyond idx[0, lo)
    // The end of the nucleus in ordered idx[from, to): just after the token whose weight
    // covers what is still needed, else `to`.
    auto cut_in = [&](size_t from, size_t to) {
      for (size_t i = from; i < to; ++i) {
        need -= prob[idx[i]];
        if (need <= 0) return static_cast<int>(i + 1);
      }
      return static_cast<int>(to);
    };
    size_t lo = 0, hi = static_cast<size_t>(n);
    keep = n;
    while (hi > lo) {
      if (hi - lo <= 64) {
        std::sort(idx.begin() + lo, idx.begin() + hi, before);
        keep = cut_in(lo, hi);
        break;
      }
      // Pivot: the median of three logits of the range.
      float a = logits[idx[lo]], b = logits[idx[lo + (hi - lo) / 2]], c = logits[idx[hi - 1]];
      const float pv = std::max(std::min(a, b), std::min(std::max(a, b), c));
      auto gt_end = std::partition(idx.begin() + lo, idx.begin() + hi,
                                   [&](int32_t i) { return logits[i] > pv; });
      auto eq_end = std::partition(gt_end, idx.begin() + hi,
                                   [&](int32_t i) { return logits[i] == pv; });
      double mass_gt = 0, mass_eq = 0;
      for (auto it = idx.begin() + lo; it != gt_end; ++it) mass_gt += prob[*it];
      for (auto it = gt_end; it != eq_end; ++it) mass_eq += prob[*it];
      const size_t g = static_cast<size_t>(gt_end - idx.begin());
      const size_t e = static_cast<size_t>(eq_end - idx.begin());
      if (mass_gt >= need && g > lo) {
        hi = g;  // within the larger logits
      } else if (mass_gt + mass_eq >= need) {
        // Within the pivot's equals: the lower ids first, as many as the mass needs.
        need -= mass_gt;
        std::sort(idx.begin() + g, idx.begin() + e);
        keep = cut_in(g, e);
        break;
      } else {
        need -= mass_gt + mass_eq;  // all of them, and more from the smaller logits
        lo = e;
        keep = n;
      }
    }
    idx.resize(keep);
  }
  kept.resize(keep);
  double sum = 0;
  for (int i = 0; i < keep; ++i) {
    // The nucleus has every token's weight already; the top k computes its own.
    sum += kept[i] = p_.top_k > 0 && p_.top_k < n ? weight(idx[i]) : prob[idx[i]];
  }
  if (p_.top_k > 0 && p_.top_k < n && p_.top_p < 1.0f) {  // top_p within the top k
    double acc = 0;
    int cut = keep;
    for (int i = 0; i < keep; ++i) {
      acc += kept[i] / sum;
      if (acc >= p_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(kept.begin(), kept.begin() + keep, 0.0);
  }
  double r = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  for (int i = 0; i < keep; ++i) {
    r -= kept[i];
    if (r <= 0) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace sparsex

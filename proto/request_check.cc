#include "proto/request_check.h"

#include <cmath>

namespace sparsex {

absl::Status CheckSamplingRequest(const v1::SamplingParams& p, int vocab_size) {
  const float t = p.has_temperature() ? p.temperature() : 0.0f;
  if (!std::isfinite(t) || t < 0 || t > 100) {
    return absl::InvalidArgumentError("sampling.temperature must be in [0, 100]");
  }
  if (p.top_k() < 0) return absl::InvalidArgumentError("sampling.top_k must be >= 0");
  const float top_p = p.has_top_p() ? p.top_p() : 1.0f;
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError("sampling.top_p must be in (0, 1]");
  }
  if (p.has_max_tokens() && p.max_tokens() < 1) {
    return absl::InvalidArgumentError("sampling.max_tokens must be >= 1");
  }
  if (p.logit_bias_size() > 1024) {
    return absl::InvalidArgumentError("sampling.logit_bias: at most 1024 entries");
  }
  for (const auto& [id, bias] : p.logit_bias()) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias: token id ", id,
                                                     " outside the vocabulary of ", vocab_size));
    }
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return absl::InvalidArgumentError("sampling.logit_bias values must be in [-100, 100]");
    }
  }
  for (const float v : {p.presence_penalty(), p.frequency_penalty()}) {
    if (!(v >= -2.0f && v <= 2.0f)) {
      return absl::InvalidArgumentError(
          "sampling.presence_penalty and frequency_penalty must be in [-2, 2]");
    }
  }
  for (int32_t id : p.stop_ids()) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.stop_ids: token id ", id,
                                                     " outside the vocabulary of ", vocab_size));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLogprobsRequest(bool logprobs, int top_logprobs) {
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "]"));
  }
  if (top_logprobs > 0 && !logprobs) {
    return absl::InvalidArgumentError("top_logprobs requires logprobs to be true");
  }
  return absl::OkStatus();
}

absl::Status CheckReuseRequest(const v1::ReuseOptions& p, int n_layers) {
  if (p.has_full_layers() &&
      (p.full_layers() < 0 || (n_layers > 0 && p.full_layers() > n_layers))) {
    return absl::InvalidArgumentError(
        absl::StrCat("reuse: full_layers must be in [0, ", n_layers, "]"));
  }
  if (p.has_recompute_ratio() && !(p.recompute_ratio() >= 0.0f && p.recompute_ratio() <= 1.0f)) {
    return absl::InvalidArgumentError("reuse.recompute_ratio must be in [0, 1]");
  }
  if (p.has_store_after_misses() &&
      (p.store_after_misses() < 1 || p.store_after_misses() > kMaxStoreAfterMisses)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reuse.store_after_misses must be in [1, ", kMaxStoreAfterMisses, "]"));
  }
  return absl::OkStatus();
}

}  // namespace sparsex

// Range checks of the public request messages (proto/sparsex.proto) that need no engine: the
// router applies them before routing and the worker once more at its own process boundary
// (gpu_worker/service/api_convert.h), from this one definition. Engine-level checks (selector
// names, segment encodings) belong to the worker alone.
#pragma once

#include "common/status.h"
#include "proto/sparsex.pb.h"

namespace sparsex {

// INVALID_ARGUMENT naming the field. vocab_size > 0 also checks stop_ids against the vocabulary.
absl::Status CheckSamplingRequest(const v1::SamplingParams& p, int vocab_size);
// GenerateRequest.logprobs / top_logprobs: top_logprobs in [0, kMaxTopLogprobs], and > 0 only
// with logprobs (as OpenAI refuses top_logprobs without logprobs).
inline constexpr int kMaxTopLogprobs = 20;
absl::Status CheckLogprobsRequest(bool logprobs, int top_logprobs);
// full_layers in [0, n_layers] (when n_layers > 0), recompute_ratio in [0, 1],
// store_after_misses in [1, kMaxStoreAfterMisses].
inline constexpr int kMaxStoreAfterMisses = 1000;
absl::Status CheckReuseRequest(const v1::ReuseOptions& p, int n_layers);

}  // namespace sparsex

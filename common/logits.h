// What a row of logits says before any sampling: whether a token can be drawn from it at all,
// and its most likely token. Shared by the sampler (gpu_worker/engine), the backends' argmax
// reduction (gpu_worker/backend: the host reference a GPU kernel is checked against) and the
// tensor-parallel group.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"

namespace sparsex {

// Logits a token can be drawn from: no NaN, no +Inf, not empty and not all -Inf (-Inf alone
// masks a token). Else INTERNAL "non-finite logits: ..." naming the first bad index: a broken
// model, weights or kernel, never a token.
absl::Status CheckLogits(std::span<const float> logits);

// Index of the largest logit (the first one on ties, as llama2.c does).
int32_t Argmax(std::span<const float> logits);

// The greedy token of a row: Argmax when CheckLogits passes, else -1 (what a backend's
// ArgmaxRows reports for such a row; the caller fails the request, never emits a token).
int32_t GreedyToken(std::span<const float> logits);

}  // namespace sparsex

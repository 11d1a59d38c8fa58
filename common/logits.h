// What a row of logits says before any sampling: whether a token can be drawn from it at all,
// its most likely token, and a token drawn at a temperature by the Gumbel-max rule. Shared by
// the sampler (gpu_worker/engine), the backends' row draws (gpu_worker/backend: the host
// reference a GPU kernel is checked against) and the tensor-parallel group.
#pragma once

#include <algorithm>
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

// How one row's token is drawn where the logits are (a backend's DrawRows): greedy when
// inv_temperature is 0, else the Gumbel-max rule at temperature 1 / inv_temperature with the
// noise of (seed, counter). Plain data: kernels::RowDraw has the same layout.
struct RowDraw {
  float inv_temperature = 0.0f;  // 0: the greedy token
  uint32_t reserved = 0;
  uint64_t seed = 0;     // the request's sampling seed
  uint64_t counter = 0;  // which of the request's draws (0 for its first token)
};

// The uniform variate of token `index` for a draw: a counter-based hash of (seed, counter,
// index) (SplitMix64's finalizer), its top 23 bits k as (k + 0.5) / 2^23. 23 bits, not 24:
// k + 0.5 must be exact in float, else the largest k rounds up to u = 1 and infinite noise
// (one token in 2^24, so ~1% of 128K-vocabulary draws, would win whatever its logit).
// kernels/ops.cu computes the same bits and variate.
constexpr int kDrawBits = 23;
inline uint32_t DrawBits(uint64_t seed, uint64_t counter, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter * 0xD1B54A32D192ED03ull + index +
               0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> (64 - kDrawBits));
}
// Strictly inside (0, 1) for every k < 2^23: 2^-24 up to 1 - 2^-24, exact in float.
inline float UniformOfBits(uint32_t k) { return (static_cast<float>(k) + 0.5f) * 0x1p-23f; }
inline float DrawUniform(uint64_t seed, uint64_t counter, uint64_t index) {
  return UniformOfBits(DrawBits(seed, counter, index));
}

// The token a RowDraw gives, -1 where CheckLogits fails (what a backend's DrawRows reports for
// such a row; the caller fails the request, never emits a token). Argmax when inv_temperature
// is 0; else the first index of the largest logit * inv_temperature + g, with
// g = -log(-log(DrawUniform(seed, counter, index))): exactly a draw from
// softmax(logits * inv_temperature) (Gumbel-max), reproducible from (seed, counter) alone, so a
// row drawn on a GPU and the same row drawn here agree up to the float rounding of log (a
// near-tie may fall the other way).
int32_t DrawToken(std::span<const float> logits, const RowDraw& draw);

// Rows of `vocab` logits per thread-pool task where rows are handled in parallel (a decode
// step's sampling, a backend's host draw, row copies): a thread woken for fewer than ~128K
// logits costs more than it saves, so small vocabularies stay on the caller's thread.
inline int64_t LogitRowsPerTask(int64_t vocab) {
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(vocab, 1));
}

}  // namespace sparsex

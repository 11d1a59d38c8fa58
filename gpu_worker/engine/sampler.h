// Token sampling: greedy (temperature 0), temperature, top-k, top-p, seeded; logit bias and
// presence/frequency penalties applied first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "common/logits.h"
#include "common/status.h"

namespace sparsex {

struct SamplingParams {
  float temperature = 0.0f;  // 0 selects greedy decoding. Default: 0
  int top_k = 0;             // keep the k most likely tokens; 0 disables. Default: 0
  float top_p = 1.0f;        // nucleus mass in (0, 1]; 1 disables. Default: 1
  uint64_t seed = 0;         // sampling is reproducible for a seed. Default: 0
  int max_tokens = 16;       // tokens to generate. Default: 16
  std::vector<int32_t> stop_ids;  // extra stop tokens besides the model's. Default: none
  bool ignore_eos = false;   // keep generating past the model's stop tokens. Default: false
  // (token id, bias) added to the logit before sampling, bias in [-100, 100]. Default: none
  std::vector<std::pair<int32_t, float>> logit_bias;
  // In [-2, 2]: the logit of a token this sampler already drew is lowered by presence_penalty
  // once and by frequency_penalty per draw (OpenAI's definition, over the generated tokens, as
  // vLLM applies it). Default: 0, 0
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;
};

absl::Status ValidateSampling(const SamplingParams& p);

// A generated token's log-probability and the most likely alternatives at its position, under
// the model's raw distribution: log-softmax of the logits as the model produced them, before
// logit bias, penalties, temperature, top-k and top-p (vLLM's default "raw_logprobs"; OpenAI
// reports the model's probabilities too). Values are <= 0; -inf for a masked (-inf) logit.
struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // (token, logprob), most likely first
};

// log p(token) and the top_n most likely tokens of log_softmax(logits), computed in double
// with a stable log-sum-exp (max subtracted). Ties in the top list: the lower token id first.
// Logits must pass CheckLogits; top_n is clamped to [0, logits.size()].
TokenLogprobs ComputeLogprobs(std::span<const float> logits, int32_t token, int top_n);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  // The next token, or CheckLogits' error.
  absl::StatusOr<int32_t> TrySample(std::span<const float> logits);
  // TrySample for callers that cannot take a Status yet (the engine's and the scheduler's
  // decode loops): on bad logits it records the first error in status() and returns
  // Argmax(logits) without sorting them (NaN breaks the ordering a sort needs). Such callers
  // should move to TrySample, or check status() after each call.
  int32_t Sample(std::span<const float> logits);
  // OK, or the first error Sample met.
  const absl::Status& status() const { return status_; }
  // How the next token can be drawn where the logits are (a backend's DrawRows, so the
  // logits never reach the host): the greedy token (temperature 0), or plain temperature
  // sampling (no top-k, no top-p, no logit bias, no penalties) by the Gumbel-max rule, which
  // TrySample also uses for such requests, so either place gives the same token for a seed
  // (up to float rounding of log on near-ties). nullopt when only TrySample can draw it.
  // After a token drawn elsewhere, Drew(token) keeps the sampler's count of draws.
  std::optional<RowDraw> BackendDraw() const;
  void Drew(int32_t token);

 private:
  // Greedy or temperature / top-k / top-p over already adjusted logits.
  absl::StatusOr<int32_t> Draw(std::span<const float> logits);
  // 1 / temperature for the Gumbel-max draw; 0 (greedy) where the temperature is 0 or so small
  // that its inverse is not a safe float (any logit gap then has probability 0).
  float InvTemperature() const;
  // Plain temperature sampling: no top-k, no top-p (the Gumbel-max draw).
  bool Plain() const;
  // The next draw's RowDraw: this sampler's seed and count of draws.
  RowDraw NextDraw(float inv_temperature) const;
  SamplingParams p_;
  std::mt19937_64 rng_;
  uint64_t draws_ = 0;  // tokens drawn so far: the Gumbel-max noise's counter
  std::vector<std::pair<int32_t, int>> drawn_;  // (token, times drawn), for the penalties
  std::vector<float> adjusted_;                 // logits after bias and penalties (reused)
  std::vector<int32_t> idx_;                    // Draw's candidate order (reused)
  std::vector<double> prob_;                    // Draw's weights by token id (reused)
  std::vector<double> kept_;                    // Draw's weights of the kept tokens (reused)
  std::vector<float> vals_;                     // Draw's top-k selection (reused)
  absl::Status status_;
};

}  // namespace sparsex

#include "gpu_worker/service/api_convert.h"

#include <algorithm>

#include "common/random.h"
#include "proto/request_check.h"

namespace sparsex::service {

uint64_t SeedFor(const v1::SamplingParams& p) {
  // A request without a seed draws a fresh one, as OpenAI and vLLM do: a fixed default would
  // give every unseeded request at a temperature the same text. An explicit seed (0 included)
  // stays reproducible.
  return p.has_seed() ? p.seed() : RandomU64();
}

absl::StatusOr<SamplingParams> SamplingFromProto(const v1::SamplingParams& p, int vocab_size) {
  RETURN_IF_ERROR(CheckSamplingRequest(p, vocab_size));
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  s.seed = SeedFor(p);
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop_ids.assign(p.stop_ids().begin(), p.stop_ids().end());
  s.ignore_eos = p.ignore_eos();
  for (const auto& [id, bias] : p.logit_bias()) s.logit_bias.emplace_back(id, bias);
  std::sort(s.logit_bias.begin(), s.logit_bias.end());  // a map's order is unspecified
  s.presence_penalty = p.presence_penalty();
  s.frequency_penalty = p.frequency_penalty();
  RETURN_IF_ERROR(ValidateSampling(s));
  return s;
}

absl::StatusOr<ReuseOptions> ReuseFromProto(const v1::ReuseOptions& p,
                                            const ReuseOptions& defaults, int n_layers) {
  RETURN_IF_ERROR(CheckReuseRequest(p, n_layers));
  ReuseOptions o = defaults;
  if (p.has_enable()) o.enable_reuse = p.enable();
  if (p.has_full_layers()) o.full_layers = p.full_layers();
  if (!p.selector().empty()) o.selector = p.selector();
  if (p.has_recompute_ratio()) {
    o.budget.mode = BudgetOptions::Mode::kFixed;
    o.budget.ratio = p.recompute_ratio();
  }
  if (p.has_store_new_segments()) o.store_new_segments = p.store_new_segments();
  if (p.has_register_prefix()) o.register_prefix = p.register_prefix();
  absl::Status s = ValidateReuseOptions(o, n_layers);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("reuse: ", s.message()));
  return o;
}

}  // namespace sparsex::service

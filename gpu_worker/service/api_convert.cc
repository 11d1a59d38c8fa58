#include "gpu_worker/service/api_convert.h"

#include <cmath>

namespace sparsex::service {

absl::StatusOr<SamplingParams> SamplingFromProto(const v1::SamplingParams& p) {
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  s.seed = p.seed();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop_ids.assign(p.stop_ids().begin(), p.stop_ids().end());
  s.ignore_eos = p.ignore_eos();
  if (!std::isfinite(s.temperature) || s.temperature < 0 || s.temperature > 100) {
    return absl::InvalidArgumentError("sampling.temperature must be in [0, 100]");
  }
  if (s.top_k < 0) return absl::InvalidArgumentError("sampling.top_k must be >= 0");
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) {
    return absl::InvalidArgumentError("sampling.top_p must be in (0, 1]");
  }
  if (s.max_tokens < 1) return absl::InvalidArgumentError("sampling.max_tokens must be >= 1");
  RETURN_IF_ERROR(ValidateSampling(s));
  return s;
}

absl::StatusOr<ReuseOptions> ReuseFromProto(const v1::ReuseOptions& p,
                                            const ReuseOptions& defaults, int n_layers) {
  ReuseOptions o = defaults;
  if (p.has_enable()) o.enable_reuse = p.enable();
  if (p.has_full_layers()) o.full_layers = p.full_layers();
  if (!p.selector().empty()) o.selector = p.selector();
  if (p.has_recompute_ratio()) {
    if (!(p.recompute_ratio() >= 0.0f && p.recompute_ratio() <= 1.0f)) {
      return absl::InvalidArgumentError("reuse.recompute_ratio must be in [0, 1]");
    }
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

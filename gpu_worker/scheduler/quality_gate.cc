#include "gpu_worker/scheduler/quality_gate.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace sparsex::service {

QualityGate::QualityGate(QualityGateOptions o) : o_(o) {
  o_.window = std::max(1, o_.window);
  o_.min_samples = std::clamp(o_.min_samples, 1, o_.window);
  o_.max_steps = std::max(0, o_.max_steps);
}

bool QualityGate::ShouldSample() {
  if (!o_.enabled || st_.reuse_disabled) return false;
  if (seen_++ < o_.warmup_requests) return true;
  if (o_.sample_rate <= 0) return false;
  sample_credit_ += std::min(1.0, o_.sample_rate);
  if (sample_credit_ < 1.0) return false;
  sample_credit_ -= 1.0;
  return true;
}

void QualityGate::Apply(ReuseOptions& o, int n_layers) const {
  if (!o.enable_reuse) return;
  if (st_.reuse_disabled) {
    o.enable_reuse = false;  // plain prefill; exact prefix caching still serves
    return;
  }
  if (st_.level == 0) return;
  o.full_layers = std::min(n_layers, o.full_layers + st_.level * o_.step_full_layers);
  switch (o.budget.mode) {
    case BudgetOptions::Mode::kFixed:
      o.budget.ratio = std::min(1.0f, o.budget.ratio + st_.level * o_.step_ratio);
      break;
    case BudgetOptions::Mode::kAdaptive:
      o.budget.max_ratio = std::min(1.0f, o.budget.max_ratio + st_.level * o_.step_ratio);
      o.budget.target_mass = 1.0f - (1.0f - o.budget.target_mass) / std::pow(4.0f, st_.level);
      break;
    case BudgetOptions::Mode::kQuality:
      o.budget.target_drop /= std::pow(4.0f, static_cast<float>(st_.level));
      break;
  }
}

std::string QualityGate::Record(double kl, bool top1_agree) {
  ++st_.replays;
  st_.kl_sum += kl;
  st_.top1_agree += top1_agree ? 1 : 0;
  if (st_.reuse_disabled) return "";  // a replay that was running when reuse went off
  window_.emplace_back(kl, top1_agree);
  while (static_cast<int>(window_.size()) > o_.window) window_.pop_front();
  double kl_sum = 0, agree = 0;
  for (const auto& [k, a] : window_) {
    kl_sum += k;
    agree += a ? 1 : 0;
  }
  st_.window_fill = static_cast<int>(window_.size());
  st_.rolling_kl = kl_sum / window_.size();
  st_.rolling_top1 = agree / window_.size();
  std::vector<double> kls;
  for (const auto& [k, a] : window_) kls.push_back(k);
  std::sort(kls.begin(), kls.end());
  const size_t m = kls.size();
  st_.rolling_median_kl = m % 2 ? kls[m / 2] : 0.5 * (kls[m / 2 - 1] + kls[m / 2]);
  if (st_.window_fill < o_.min_samples) return "";
  const bool bad = st_.rolling_top1 < o_.min_top1_agreement ||
                   st_.rolling_median_kl > o_.max_median_kl || st_.rolling_kl > o_.max_mean_kl;
  if (!bad) return "";
  ++st_.breaches;
  const std::string figures =
      absl::StrCat("rolling first-token agreement ", st_.rolling_top1, " (min ",
                   o_.min_top1_agreement, "), median KL ", st_.rolling_median_kl, " (max ",
                   o_.max_median_kl, "), mean KL ", st_.rolling_kl, " (max ", o_.max_mean_kl,
                   ") over ", st_.window_fill, " replays");
  // A fresh window for the new setting, judged from a new warm-up.
  window_.clear();
  st_.window_fill = 0;
  st_.rolling_top1 = 1.0;
  st_.rolling_kl = 0.0;
  st_.rolling_median_kl = 0.0;
  seen_ = 0;
  sample_credit_ = 0;
  if (st_.level < o_.max_steps) {
    ++st_.level;
    return absl::StrCat("quality gate: ", figures, "; reuse stepped up to level ", st_.level,
                        " of ", o_.max_steps, " (F +", st_.level * o_.step_full_layers,
                        ", ratio +", st_.level * o_.step_ratio, ")");
  }
  st_.reuse_disabled = true;
  return absl::StrCat("quality gate: ", figures, " after ", st_.level,
                      " step-ups; reuse DISABLED for this model (exact prefix caching still "
                      "serves) until the worker restarts");
}

double FirstTokenKl(std::span<const float> p, std::span<const float> q) {
  const size_t n = std::min(p.size(), q.size());
  if (n == 0) return 0;
  auto lse = [n](std::span<const float> x) {
    double mx = x[0], s = 0;
    for (size_t i = 0; i < n; ++i) mx = std::max<double>(mx, x[i]);
    for (size_t i = 0; i < n; ++i) s += std::exp(x[i] - mx);
    return mx + std::log(s);
  };
  const double lp = lse(p), lq = lse(q);
  double kl = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = p[i] - lp, b = q[i] - lq;
    kl += std::exp(a) * (a - b);
  }
  return std::max(0.0, kl);
}

}  // namespace sparsex::service

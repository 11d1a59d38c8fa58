#include "gpu_worker/scheduler/iteration_budget.h"

#include <algorithm>
#include <cmath>

namespace sparsex::service {

void IterationBudget::ObserveDecode(int rows, double seconds) {
  if (rows <= 0 || seconds < 0) return;
  Mix(&decode_ms_, seconds * 1e3);
}

void IterationBudget::ObservePlain(int tokens, int decode_rows, double seconds) {
  if (tokens <= 0 || seconds < 0) return;
  // The marginal cost of the tokens: the pass minus the decode step it carried (or, alone, the
  // weights every pass reads, which a decode step reads too).
  const double base = decode_ms_ > 0 ? decode_ms_ : 0.0;
  const double ms = std::max(seconds * 1e3 - base, 0.0) / tokens;
  if (decode_rows > 0 || ms > 0) Mix(&token_ms_, ms);
}

void IterationBudget::ObserveReuse(int64_t row_layers, double seconds) {
  if (row_layers <= 0 || seconds < 0) return;
  Mix(&row_layer_ms_, seconds * 1e3 / static_cast<double>(row_layers));
}

double IterationBudget::Room() const {
  return std::max(o_.target_ms - std::max(decode_ms_, 0.0), 0.0);
}

int IterationBudget::PlainTokens(int decode_rows, int max_tokens) const {
  if (!enabled() || decode_rows <= 0 || token_ms_ < 0) return max_tokens;
  const double fit = token_ms_ > 0 ? Room() / token_ms_ : static_cast<double>(max_tokens);
  const int lo = std::min(o_.min_tokens, max_tokens);
  return static_cast<int>(std::clamp(std::floor(fit), static_cast<double>(lo),
                                     static_cast<double>(max_tokens)));
}

int64_t IterationBudget::ReuseRowLayers(int decode_rows, int64_t max_row_layers) const {
  if (!enabled() || decode_rows <= 0 || row_layer_ms_ < 0) return max_row_layers;
  const double fit =
      row_layer_ms_ > 0 ? Room() / row_layer_ms_ : static_cast<double>(max_row_layers);
  return static_cast<int64_t>(
      std::clamp(std::floor(fit), 1.0, static_cast<double>(max_row_layers)));
}

}  // namespace sparsex::service

// Sparse-Q selection: which reused tokens are recomputed in the sparse layers [F, L).
// All selectors see the same input and return reused-token indices ranked by importance
// (most important first); the budget (fixed ratio or adaptive) then decides how many to keep.
//
//   auto sel = CreateSelector("sparsex");
//   std::vector<float> score = sel->Score(input);
//   std::vector<int32_t> kept = (*sel)->Rank(input, budget);  // what the executor recomputes
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace sparsex {

// Everything a selector may use, for the n reused (non-prefix) tokens of one request, measured
// during the full layers [0, F) (averaged over those layers and heads).
struct SelectionInput {
  std::vector<int32_t> segment;    // [n] segment index of each reused token
  std::vector<int32_t> offset;     // [n] position of the token inside its segment
  std::vector<float> cross_mass;   // [n] attention mass the token's query puts outside its segment
  std::vector<float> new_recv;     // [n] attention the new tokens pay to this token
  std::vector<float> kv_deviation; // [n] |fresh - cached| of K and V at the first sparse layer
  uint64_t seed = 0;               // for the random control
};

// Weights of the normalised signals in the "sparsex" score (docs/fidelity.md, "Selector
// score"): per token
//   base    = cross x C + recv x R + deviation x D   (C, R, D: the signals, each scaled to sum 1;
//                                                     D from the deviation itself)
//   product = R x (cross x C + deviation x D'), scaled to sum 1 (D' from the square root of the
//             squared deviation): what the new tokens read from the token times how stale it is
//   s       = base + product x product
// and then the successor prior: each token adds successor_weight x the mean s of the up to
// successor_window tokens before it in its segment, so the tokens right after important ones
// are recomputed with them (the new tokens' attention in the sparse layers reaches them).
// product = 0 and successor_window = 0 give the additive score of before ("sparsex-sum").
struct SparsexWeights {
  float cross = 1.0f;      // cross-segment mass of the token's own query. Default: 1
  float recv = 1.0f;       // attention paid by new tokens. Default: 1
  float deviation = 1.0f;  // KV deviation at the first sparse layer. Default: 1
  float product = 1.0f;    // weight of the query-attention x staleness term. Default: 1
  int successor_window = 2;       // preceding tokens whose mean score a token adds. Default: 2
  float successor_weight = 1.0f;  // weight of that mean. Default: 1
};

// Budget: how many of the ranked tokens to keep.
//   kFixed:    a fixed share of the reused tokens.
//   kAdaptive: the smallest set holding target_mass of the score mass, within max_ratio.
//   kQuality:  the smallest set whose predicted relative quality drop (docs/fidelity.md) is at
//              most target_drop, within max_ratio. The prediction is calibrated per model and
//              F by `sparsex fidelity --calibration-out` (QualityCalibration):
//              predicted drop = drop_per_uncovered x the share of the request's score mass
//              left unrecomputed, so a request whose importance is concentrated on a few
//              tokens recomputes few, one with a flat score distribution many.
struct BudgetOptions {
  enum class Mode { kFixed, kAdaptive, kQuality } mode = Mode::kFixed;  // Default: fixed
  float ratio = 0.15f;         // fixed: share of reused tokens recomputed. Default: 0.15
  float target_mass = 0.5f;    // adaptive: smallest set holding this share of the score mass.
                               // Default: 0.5
  float max_ratio = 0.3f;      // adaptive: cap. Default: 0.3. Quality: the reuse prefill
                               // sets it to where recompute would cost more than full prefill
  float target_drop = 0.01f;   // quality: predicted relative quality drop. Default: 0.01 (1%)
  // quality: predicted relative drop per unit of uncovered score share (the calibration's
  // slope for this request's F; the reuse prefill sets it from ReuseOptions::calibration).
  // Default: 0.060 (stories260K, F = 2: docs/quality_calibration.stories260K.json)
  float drop_per_uncovered = 0.060f;
};

// Per-model calibration of the quality budget: for each F, the relative quality drop per unit
// of score share left unrecomputed (a quantile of per-prompt drop / uncovered share over the
// harness's prompts and ratios, so most requests stay under the target). Written by
// `sparsex fidelity --calibration-out FILE`, read by the worker (--quality_calibration).
struct QualityCalibration {
  std::string selector = "sparsex";  // the selector the scores come from. Default: sparsex
  // The calibrated model's fingerprint (Hash128::Hex); a worker refuses a calibration of
  // another model. Empty: not recorded (files written before it was). Default: ""
  std::string model_fingerprint;
  std::vector<float> drop_per_uncovered;  // [F]; entries < 0: not measured
  // The slope for F: its own, else the nearest measured F's, else `fallback`.
  float SlopeFor(int F, float fallback) const;
};
absl::StatusOr<QualityCalibration> ParseQualityCalibration(const std::string& json);
absl::StatusOr<QualityCalibration> LoadQualityCalibration(const std::string& path);

// Share of the (non-negative) score mass outside `kept` (1 with no mass).
double UncoveredShare(const std::vector<float>& score, const std::vector<int32_t>& kept);

// Indices (into the reused tokens) of the selected set, sorted by importance.
std::vector<int32_t> ApplyBudget(const std::vector<float>& score, const BudgetOptions& b);

class Selector {
 public:
  virtual ~Selector() = default;
  virtual std::string name() const = 0;
  // Non-negative importance per reused token; higher is recomputed first.
  virtual std::vector<float> Score(const SelectionInput& in) const = 0;
  // The kept tokens (indices into the reused tokens), most important first: by default the
  // budget applied to Score. Selectors whose unit is not the single token (whole KV blocks) or
  // that split the budget per segment (prophetkv) override it.
  virtual std::vector<int32_t> Rank(const SelectionInput& in, const BudgetOptions& b) const {
    return ApplyBudget(Score(in), b);
  }
  // What the executor must measure for this selector.
  virtual bool needs_attention_stats() const { return false; }
  virtual bool needs_kv_deviation() const { return false; }
};

// "sparsex" (cross-segment mass + new-token attention + KV deviation, with the product term and
// the successor prior of SparsexWeights), "sparsex-sum" (the same signals added only, the
// default before: product 0, no successor prior), "cacheblend" (KV
// deviation), "epic" (first tokens of each segment), "random" (control), and the query-aware
// baselines of docs/fidelity.md: "prophetkv" (the new tokens' attention splits the budget
// over segments in proportion to each segment's share of it, then ranks tokens inside each
// segment) and "a3" (the new tokens' attention ranks all reused tokens together).
// "<name>:block" selects whole 16-token blocks of each segment (aligned to the segment start,
// the unit the segment store keeps) ranked by the mean score of their tokens, as many as fit
// in the same token budget; "<name>:smooth" stays token-granular but adds to each token's
// score the mean score of its block (a contiguity prior).
absl::StatusOr<std::unique_ptr<Selector>> CreateSelector(const std::string& name,
                                                          const SparsexWeights& w = {});

}  // namespace sparsex

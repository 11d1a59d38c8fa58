// The online correctness gate (docs/reliability.md): the worker replays a sample of its reuse
// requests with full prefill, off the critical path (BatchScheduler runs a replay only in
// iterations with no user request queued, admitted or being fetched, after deferred stores and
// spills, and abandons it as soon as one arrives), and compares the first-token distribution of
// the reuse pass with full prefill's: first-token (argmax) agreement and KL(full || reuse).
// When the rolling quality falls below its thresholds the gate steps reuse up (more full layers
// F, a larger recompute ratio r or a lower quality target), up to max_steps times; if the last
// step does not restore it, reuse is disabled for the model (exact prefix caching still
// serves) until the worker restarts.
//
//   QualityGate gate(opts.gate);
//   if (gate.ShouldSample()) { ... replay ...; gate.Record(kl, agree); }
//   gate.Apply(request.reuse, n_layers);  // at admission: the current step or reuse off
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "gpu_worker/reuse/reuse_prefill.h"

namespace sparsex::service {

struct QualityGateOptions {
  // Replay reuse requests at all. Default: false in the library (SchedulerOptions); the worker
  // turns it on (--gate 1)
  bool enabled = false;
  // Share of reuse requests replayed after the warm-up (every 1/sample_rate-th). Default: 0.01
  double sample_rate = 0.01;
  // Reuse requests replayed without sampling: the first ones served, and again after every
  // step up (the new setting is judged at once). Default: 32
  int warmup_requests = 32;
  // Rolling window of the judged figures, in replays. Default: 32
  int window = 32;
  // Replays in the window before it is judged. Default: 16
  int min_samples = 16;
  // The window fails when any of these is crossed (stories260K figures, docs/fidelity.md, 300
  // prompts: first-token agreement 0.97, mean KL 0.0032, median 0.00017 at the default
  // setting; naive reuse 0.94, 0.0097, 0.0013; naive reuse of segments encoded after BOS
  // 0.94, 0.023, 0.0047). KL is heavy-tailed (one prompt can carry half a mean), so the median
  // is the sensitive test and the mean a guard against rare catastrophes.
  // Rolling first-token agreement below this fails. Default: 0.9
  double min_top1_agreement = 0.9;
  // Rolling median first-token KL(full || reuse) above this fails. Default: 0.001
  double max_median_kl = 0.001;
  // Rolling mean first-token KL above this fails. Default: 0.02
  double max_mean_kl = 0.02;
  // Step-ups before reuse is disabled; each adds step_full_layers to F (at most L) and
  // step_ratio to a fixed ratio (at most 1), or divides a quality budget's target by 4.
  // Defaults: 2, 1, 0.15
  int max_steps = 2;
  int step_full_layers = 1;
  float step_ratio = 0.15f;
  // Replays waiting for an idle iteration; a sample beyond is dropped (counted). Default: 8
  int max_pending = 8;
};

// First-token KL histogram bucket upper bounds (the metric's buckets; +Inf is implied).
inline constexpr std::array<double, 10> kGateKlBuckets = {1e-4, 3e-4, 1e-3, 3e-3, 0.01,
                                                          0.03, 0.1,  0.3,  1.0,  3.0};

// What the gate publishes (SchedulerLoad::gate).
struct QualityGateState {
  int level = 0;                 // step-ups applied (0 = the configured setting)
  bool reuse_disabled = false;   // reuse off for the model
  int64_t replays = 0;           // replays compared
  int64_t dropped = 0;           // samples dropped (max_pending full, or no KV for the replay)
  int64_t preempted = 0;         // replays abandoned for a user request (retried later)
  int64_t breaches = 0;          // windows judged below the thresholds
  int64_t top1_agree = 0;        // replays whose first-token argmax agreed
  double kl_sum = 0;             // sum of the replays' KL
  int window_fill = 0;           // replays in the current window
  // Over the current window (1 / 0 / 0 when empty).
  double rolling_top1 = 1.0, rolling_kl = 0.0, rolling_median_kl = 0.0;
};

class QualityGate {
 public:
  explicit QualityGate(QualityGateOptions o);
  const QualityGateOptions& options() const { return o_; }
  const QualityGateState& state() const { return st_; }
  // A reuse request (with reused tokens) finished its prefill: replay it?
  bool ShouldSample();
  // The request's reuse options under the gate: the current step, or reuse off.
  void Apply(ReuseOptions& o, int n_layers) const;
  // One replay's figures. Returns a log line when the gate stepped up or disabled reuse.
  std::string Record(double kl, bool top1_agree);
  void CountDropped() { ++st_.dropped; }
  void CountPreempted() { ++st_.preempted; }

 private:
  QualityGateOptions o_;
  QualityGateState st_;
  std::deque<std::pair<double, bool>> window_;
  int64_t seen_ = 0;            // reuse requests offered since the last step
  double sample_credit_ = 0;    // sampling after the warm-up: every 1/sample_rate-th
};

// KL(p || q) of two logit vectors' softmax distributions (p: full prefill, q: reuse).
double FirstTokenKl(std::span<const float> p_logits, std::span<const float> q_logits);

}  // namespace sparsex::service

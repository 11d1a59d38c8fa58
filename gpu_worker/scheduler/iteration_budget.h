// Sizes an iteration's prefill work so that the sequences decoding beside it see about a target
// time per output token (the stall-free batching of Sarathi-Serve, with its token budget taken
// from a TPOT target instead of a fixed chunk). From what the engine thread measures, as moving
// averages: the time of a decode step, the marginal time of a plain prefill token (a mixed pass
// minus its decode step) and the time of a reuse prefill row-layer, it answers how much prefill
// work fits in target - decode step. Iterations without decoding sequences are not limited
// (their prefill only delays the first tokens of the requests it serves).
//
//   IterationBudget b({.target_ms = 12});
//   int tokens = b.PlainTokens(/*decode_rows=*/n, opts.prefill_chunk);
//   ... run the pass ... b.ObservePlain(tokens, n, seconds);
#pragma once

#include <cstdint>

namespace sparsex::service {

struct IterationBudgetOptions {
  // Target time of an iteration that decodes (about the TPOT its sequences see); 0: off (the
  // fixed prefill_chunk / reuse slice). Default: 0
  double target_ms = 0;
  // Least plain prefill tokens an iteration runs (prompts keep advancing under any target; on
  // a GPU fewer rows than this cost about the same pass). Default: 64
  int min_tokens = 64;
  // Weight of a new measurement in the moving averages. Default: 0.2
  double alpha = 0.2;
};

class IterationBudget {
 public:
  explicit IterationBudget(IterationBudgetOptions o = {}) : o_(o) {}
  bool enabled() const { return o_.target_ms > 0; }

  // A decode step of `rows` sequences alone.
  void ObserveDecode(int rows, double seconds);
  // Plain prefill chunks of `tokens` tokens with a decode step of `decode_rows` sequences in
  // the same pass (decode_rows 0: the chunks alone).
  void ObservePlain(int tokens, int decode_rows, double seconds);
  // A slice of a reuse prefill that ran `row_layers` rows through layers.
  void ObserveReuse(int64_t row_layers, double seconds);

  // Plain prefill tokens for an iteration with `decode_rows` decoding sequences: max_tokens
  // when off, when none decode or before anything was measured; else what fits in the target
  // beside the decode step, at least min_tokens (and at most max_tokens).
  int PlainTokens(int decode_rows, int max_tokens) const;
  // Row-layers of a reuse prefill slice for such an iteration (its decode step runs after the
  // slice): max_row_layers as above, else what fits, at least 1 (a slice always runs a row
  // chunk of a full layer or a whole sparse layer).
  int64_t ReuseRowLayers(int decode_rows, int64_t max_row_layers) const;

  // The estimates (ms; negative: not measured yet), for metrics and tests.
  double decode_ms() const { return decode_ms_; }
  double token_ms() const { return token_ms_; }
  double row_layer_ms() const { return row_layer_ms_; }

 private:
  void Mix(double* avg, double v) const { *avg = *avg < 0 ? v : *avg + o_.alpha * (v - *avg); }
  // Time left for prefill work beside a decode step (ms, >= 0).
  double Room() const;
  IterationBudgetOptions o_;
  double decode_ms_ = -1, token_ms_ = -1, row_layer_ms_ = -1;
};

}  // namespace sparsex::service

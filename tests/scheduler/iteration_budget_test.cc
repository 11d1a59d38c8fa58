// The TPOT-targeted iteration budget: how much prefill work fits beside a decode step, from
// measured costs (pure arithmetic; the scheduler test covers it in the engine loop).
#include "gpu_worker/scheduler/iteration_budget.h"

#include "gtest/gtest.h"

namespace sparsex::service {
namespace {

TEST(IterationBudget, OffOrUnmeasuredOrNothingDecodingGivesTheWholeBudget) {
  IterationBudget off;
  off.ObserveDecode(4, 0.004);
  off.ObservePlain(100, 4, 0.014);
  EXPECT_EQ(off.PlainTokens(4, 2048), 2048);
  EXPECT_EQ(off.ReuseRowLayers(4, 100000), 100000);
  IterationBudget b({.target_ms = 12});
  EXPECT_EQ(b.PlainTokens(4, 2048), 2048);  // nothing measured yet
  EXPECT_EQ(b.ReuseRowLayers(4, 100000), 100000);
  b.ObserveDecode(4, 0.004);
  b.ObservePlain(100, 4, 0.014);
  b.ObserveReuse(1000, 0.010);
  EXPECT_EQ(b.PlainTokens(0, 2048), 2048);  // no decoding sequence: TTFT only
  EXPECT_EQ(b.ReuseRowLayers(0, 100000), 100000);
}

TEST(IterationBudget, PrefillFitsTheTargetBesideTheDecodeStep) {
  IterationBudget b({.target_ms = 12});
  b.ObserveDecode(4, 0.004);         // 4 ms a decode step
  b.ObservePlain(100, 4, 0.014);     // 10 ms for 100 tokens beside it: 0.1 ms a token
  EXPECT_DOUBLE_EQ(b.decode_ms(), 4);
  EXPECT_NEAR(b.token_ms(), 0.1, 1e-12);
  EXPECT_EQ(b.PlainTokens(4, 2048), 80);  // (12 - 4) / 0.1
  EXPECT_EQ(b.PlainTokens(4, 50), 50);    // never above the chunk
  b.ObserveReuse(1000, 0.010);            // 0.01 ms a row-layer
  EXPECT_EQ(b.ReuseRowLayers(4, 100000), 800);
  EXPECT_EQ(b.ReuseRowLayers(4, 500), 500);
}

TEST(IterationBudget, ATightTargetStillAdvancesPrefill) {
  IterationBudget b({.target_ms = 3, .min_tokens = 64});
  b.ObserveDecode(1, 0.004);  // the decode step alone exceeds the target
  b.ObservePlain(100, 1, 0.014);
  b.ObserveReuse(1000, 0.010);
  EXPECT_EQ(b.PlainTokens(1, 2048), 64);
  EXPECT_EQ(b.PlainTokens(1, 16), 16);  // a smaller chunk setting wins
  EXPECT_EQ(b.ReuseRowLayers(1, 100000), 1);  // one layer: the slice's least
}

TEST(IterationBudget, EstimatesAreMovingAverages) {
  IterationBudget b({.target_ms = 12, .min_tokens = 64, .alpha = 0.5});
  b.ObserveDecode(1, 0.004);
  b.ObserveDecode(1, 0.008);
  EXPECT_DOUBLE_EQ(b.decode_ms(), 6);
  b.ObserveReuse(0, 1.0);  // nothing ran: ignored
  EXPECT_LT(b.row_layer_ms(), 0);
}

}  // namespace
}  // namespace sparsex::service

#include "gpu_worker/backend/rope.h"

#include <cmath>

#include "gtest/gtest.h"

namespace sparsex {
namespace {

TEST(Rope, Llama3ScalingBands) {
  RopeParams p;
  p.head_dim = 128;
  p.theta = 500000.0f;
  std::vector<float> base = RopeInvFreq(p);
  p.scaling.type = RopeScaling::Type::kLlama3;
  p.scaling.factor = 8.0f;
  p.scaling.low_freq_factor = 1.0f;
  p.scaling.high_freq_factor = 4.0f;
  p.scaling.original_max_position = 8192;
  std::vector<float> s = RopeInvFreq(p);
  ASSERT_EQ(s.size(), 64u);
  int same = 0, divided = 0, between = 0;
  for (int j = 0; j < 64; ++j) {
    const double wavelen = 2 * M_PI / base[j];
    if (wavelen < 8192.0 / 4) {
      EXPECT_FLOAT_EQ(s[j], base[j]);
      ++same;
    } else if (wavelen > 8192.0) {
      EXPECT_FLOAT_EQ(s[j], base[j] / 8);
      ++divided;
    } else {
      EXPECT_LT(s[j], base[j]);
      EXPECT_GT(s[j], base[j] / 8);
      ++between;
    }
  }
  EXPECT_GT(same, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(between, 0);
  // llama2.c's formula for the unscaled table.
  EXPECT_FLOAT_EQ(base[1], 1.0f / powf(500000.0f, 2.0f / 128.0f));
}

}  // namespace
}  // namespace sparsex

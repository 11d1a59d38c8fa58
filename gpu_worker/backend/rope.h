// RoPE frequency table shared by every backend, so all of them rotate by identical angles.
#pragma once

#include <cmath>
#include <vector>

#include "gpu_worker/backend/backend.h"

namespace sparsex {

// inv_freq[j] for pair j in [0, head_dim/2). Computed in float like llama2.c (powf), so the CPU
// reference reproduces its greedy output bit-for-bit where accumulation order allows; llama3
// rope_scaling follows Meta's reference (wavelength bands, smooth interpolation between them).
inline std::vector<float> RopeInvFreq(const RopeParams& p) {
  const int half = p.head_dim / 2;
  std::vector<float> f(half);
  for (int j = 0; j < half; ++j) {
    f[j] = 1.0f / powf(p.theta, static_cast<float>(2 * j) / static_cast<float>(p.head_dim));
  }
  if (p.scaling.type == RopeScaling::Type::kLlama3) {
    const double old_ctx = p.scaling.original_max_position;
    const double low_wavelen = old_ctx / p.scaling.low_freq_factor;
    const double high_wavelen = old_ctx / p.scaling.high_freq_factor;
    for (float& v : f) {
      const double wavelen = 2.0 * M_PI / v;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        v = static_cast<float>(v / p.scaling.factor);
      } else {
        const double smooth = (old_ctx / wavelen - p.scaling.low_freq_factor) /
                              (p.scaling.high_freq_factor - p.scaling.low_freq_factor);
        v = static_cast<float>((1.0 - smooth) * v / p.scaling.factor + smooth * v);
      }
    }
  }
  return f;
}

}  // namespace sparsex

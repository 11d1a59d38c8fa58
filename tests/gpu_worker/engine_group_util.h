// Greedy decoding through an EngineGroup, shared by the tensor-parallel tests (CPU ranks in
// tests/gpu_worker, NCCL ranks in tests/kernels).
#pragma once

#include <algorithm>
#include <vector>

#include "gpu_worker/engine/engine_group.h"
#include "gtest/gtest.h"

namespace sparsex::testing {

// n greedy tokens through the group's Admit / Prefill / Step / RegisterPrefix / Release.
inline std::vector<int32_t> Greedy(EngineGroup& g, const std::vector<int32_t>& prompt, int n) {
  auto seq = g.Admit(prompt);
  EXPECT_TRUE(seq.ok()) << seq.status();
  if (!seq.ok()) return {};
  auto lg = g.Prefill(*seq);
  std::vector<int32_t> out;
  while (lg.ok() && static_cast<int>(out.size()) < n) {
    const int32_t t = static_cast<int32_t>(std::max_element(lg->begin(), lg->end()) - lg->begin());
    out.push_back(t);
    lg = g.Step(*seq, t);
  }
  EXPECT_TRUE(lg.ok()) << lg.status();
  g.RegisterPrefix(*seq);
  g.Release(*seq);
  return out;
}

}  // namespace sparsex::testing

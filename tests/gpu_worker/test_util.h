// Shared helpers for engine tests: the models folder and loading the real test model.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "testing/models_dir.h"
#include "model/model.h"
#include "gtest/gtest.h"

namespace sparsex::testing {

inline std::string Stories260KPath() { return ModelsDir() + "/stories260K/stories260K.gguf"; }
inline std::string TinyStoriesPath() {
  return ModelsDir() + "/tinystories-text/tinystories_sample.txt";
}

// Fails the calling test loudly (never skips) when the model is absent.
inline std::unique_ptr<Model> LoadStories260K() {
  auto m = LoadModel(Stories260KPath());
  EXPECT_TRUE(m.ok()) << "cannot load the test model (set $SPARSEX_MODELS, now resolving to "
                      << ModelsDir() << "): " << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Largest absolute difference of two logit vectors (a size mismatch fails the test).
inline float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace sparsex::testing

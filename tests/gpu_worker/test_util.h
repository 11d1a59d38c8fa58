// Shared helpers for engine tests: the models folder and loading the real test model.
#pragma once

#include <memory>
#include <string>

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

}  // namespace sparsex::testing

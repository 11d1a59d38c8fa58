// Test and benchmark support (never linked into a production binary): where the small real
// models live.
#pragma once

#include <string>

namespace sparsex::testing {

// Root of the test models: $SPARSEX_MODELS, else ../shared/models relative to the source tree.
std::string ModelsDir();

}  // namespace sparsex::testing

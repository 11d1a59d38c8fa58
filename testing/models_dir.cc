#include "testing/models_dir.h"

#include <cstdlib>

namespace sparsex::testing {

std::string ModelsDir() {
  const char* env = std::getenv("SPARSEX_MODELS");
  if (env != nullptr && env[0] != '\0') return env;
  return std::string(SPARSEX_SOURCE_DIR) + "/../shared/models";
}

}  // namespace sparsex::testing

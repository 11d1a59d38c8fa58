#include "gpu_worker/cli/commands.h"

namespace sparsex::cli {
absl::Status Fidelity(const Args&) { return absl::UnimplementedError("fidelity: pending"); }
}  // namespace sparsex::cli

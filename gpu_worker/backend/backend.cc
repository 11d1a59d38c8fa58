#include "gpu_worker/backend/backend.h"

namespace sparsex {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& opts) {
  if (opts.kind == "cpu") return CreateCpuBackend();
  if (opts.kind == "cuda") {
#if SPARSEX_WITH_CUDA
    if (!CudaAvailable()) return absl::UnavailableError("no usable CUDA device in this process");
    return CreateCudaBackend(opts.device);
#else
    return absl::UnavailableError("this build has no CUDA backend (SPARSEX_WITH_CUDA=0)");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", opts.kind,
                                                 "' (expected cpu or cuda)"));
}

#if !SPARSEX_WITH_CUDA
bool CudaAvailable() { return false; }
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int) {
  return absl::UnavailableError("this build has no CUDA backend (SPARSEX_WITH_CUDA=0)");
}
#endif

}  // namespace sparsex

#include "gpu_worker/backend/backend.h"

namespace sparsex {

absl::Status Backend::RowSqDist(const Tensor& a, int64_t a_col, const Tensor& b, int64_t b_col,
                                int64_t n_cols, std::span<float> out) {
  if (a.rows != b.rows || static_cast<int64_t>(out.size()) != a.rows ||
      a_col + n_cols > a.cols || b_col + n_cols > b.cols) {
    return absl::InvalidArgumentError("RowSqDist: shapes do not match");
  }
  std::vector<float> ha(static_cast<size_t>(a.rows * a.cols)), hb(static_cast<size_t>(b.rows * b.cols));
  RETURN_IF_ERROR(Download(a, ha));
  RETURN_IF_ERROR(Download(b, hb));
  for (int64_t i = 0; i < a.rows; ++i) {
    double d = 0;
    for (int64_t j = 0; j < n_cols; ++j) {
      const double x = ha[i * a.cols + a_col + j] - hb[i * b.cols + b_col + j];
      d += x * x;
    }
    out[i] += static_cast<float>(d);
  }
  return absl::OkStatus();
}

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

// cudaError_t as absl::Status for the CUDA backend's files (internal to
// gpu_worker/backend/cuda).
//
//   CUDA_RETURN(cudaStreamSynchronize(stream), "Synchronize");  // returns InternalError
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"

namespace sparsex::cuda_internal {

inline absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

}  // namespace sparsex::cuda_internal

#define CUDA_RETURN(expr, what)                                                  \
  do {                                                                           \
    cudaError_t spx_cuda_err_ = (expr);                                          \
    if (spx_cuda_err_ != cudaSuccess) {                                          \
      return ::sparsex::cuda_internal::CudaError(spx_cuda_err_, what);           \
    }                                                                            \
  } while (0)

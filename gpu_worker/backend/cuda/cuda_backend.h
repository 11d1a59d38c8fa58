// CUDA backend internals that callers outside the Backend interface may need: the stream every
// operation is enqueued on (for CUDA-event timing and graph capture in benchmarks and the
// engine). Only compiled when SPARSEX_WITH_CUDA.
//
//   ASSIGN_OR_RETURN(auto be, CreateCudaBackend(0));
//   cudaStream_t s = CudaBackendStream(*be);  // nullptr for a non-CUDA backend
//   cudaEventRecord(start, s); ... ; cudaEventRecord(stop, s);
#pragma once

#include <cuda_runtime.h>

#include "gpu_worker/backend/backend.h"

namespace sparsex {

// The stream of a backend made by CreateCudaBackend; nullptr for any other backend.
cudaStream_t CudaBackendStream(Backend& backend);

}  // namespace sparsex

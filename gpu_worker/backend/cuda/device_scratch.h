// A device allocation that grows on demand, for the CUDA backend's per-operation scratch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "common/status.h"

namespace sparsex {

class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (ptr_) cudaFree(ptr_);
  }
  // At least `bytes`; growing synchronises the stream first, so no queued kernel still reads
  // the old allocation.
  absl::StatusOr<void*> Get(size_t bytes, cudaStream_t stream) {
    if (bytes <= size_) return ptr_;
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return Error(e, "sync");
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    const size_t want = std::max<size_t>({bytes, 2 * size_, size_t{1} << 20});
    if (cudaError_t e = cudaMalloc(&ptr_, want); e != cudaSuccess) {
      ptr_ = nullptr;
      return Error(e, "alloc");
    }
    size_ = want;
    return ptr_;
  }

 private:
  static absl::Status Error(cudaError_t e, const char* what) {
    return absl::InternalError(absl::StrCat("scratch ", what, ": ", cudaGetErrorName(e), " (",
                                            cudaGetErrorString(e), ")"));
  }
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace sparsex

// Dense causal attention through cuDNN's fused flash-attention engine (the cuDNN 9 backend
// graph API), for the CUDA backend's dense prefill. cuDNN is loaded at run time with dlopen, so
// SparseX builds without it and runs without it (the backend then uses its own kernels); no
// cuDNN header is needed either: the few ABI constants used are declared in the .cc.
//
// Why: on the H200, cuDNN's SDPA runs a 32K causal layer in 14.8 ms against 26.4 ms for our
// wgmma kernel (docs/perf-notes.md). It cannot express the sparse-recompute rows (each with its
// own position over a paged slot table), so our kernel keeps those, decode and statistics.
//
//   ASSIGN_OR_RETURN(auto dnn, CudnnAttention::Create(stream));
//   RETURN_IF_ERROR(dnn->Run(shape, q, k, v, o));   // enqueued on `stream`
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "common/status.h"
#include "gpu_worker/backend/cuda/device_scratch.h"

namespace sparsex {

// One attention problem, batch 1. Query row i sits at position n_kv - n_q + i and attends over
// keys [0, n_kv - n_q + i] (causal, aligned to the last key). Q, K, V and O are bf16 row-major
// matrices whose rows hold the heads side by side (head h at columns [h*head_dim, ...)).
struct CudnnAttentionShape {
  int64_t n_q = 0, n_kv = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;  // heads a multiple of kv_heads
  int64_t q_stride = 0, kv_stride = 0, o_stride = 0;  // row strides in elements
  float scale = 0.0f;
  // Run also writes the softmax statistics (the caller's selection statistics need them): a
  // plan with the statistics as a real output. Default: false
  bool stats_out = false;
  auto Key() const {
    return std::make_tuple(n_q, n_kv, heads, kv_heads, head_dim, q_stride, kv_stride, o_stride,
                           scale, stats_out);
  }
};

class CudnnAttention {
 public:
  // Loads `library` when given and loadable (CudaBackendOptions::cudnn_library), else
  // libcudnn.so.9, and makes a handle bound to `stream`; Unavailable with the reason when that
  // fails.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(cudaStream_t stream,
                                                                const std::string& library = "");
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Enqueues O = softmax(scale * Q K^T, causal) V on the stream. The first call for a shape
  // builds its execution plan (heuristics, then the first engine configuration that finalizes;
  // cuDNN may compile a kernel then); later calls reuse it. Unimplemented when no engine takes
  // the shape (remembered, so the caller's fallback costs nothing the next time). With
  // shape.stats_out, lse (device, [heads, n_q] fp32) receives each row's natural-log
  // log-sum-exp of the scaled scores (element head * n_q + row).
  absl::Status Run(const CudnnAttentionShape& shape, const void* q, const void* k, const void* v,
                   void* o, float* lse = nullptr);

  std::string version() const;  // e.g. "9.19.0"
  int64_t plans_built() const { return plans_built_; }
  double plan_build_ms() const { return plan_build_ms_; }  // total over all plans built

 private:
  struct Api;
  struct Plan;
  CudnnAttention() = default;
  absl::StatusOr<Plan*> GetPlan(const CudnnAttentionShape& shape);
  absl::StatusOr<std::unique_ptr<Plan>> Build(const CudnnAttentionShape& shape, bool stats_out);

  std::unique_ptr<Api> api_;
  void* handle_ = nullptr;  // cudnnHandle_t
  cudaStream_t stream_ = nullptr;
  std::map<decltype(CudnnAttentionShape{}.Key()), std::unique_ptr<Plan>> plans_;
  DeviceScratch workspace_;
  DeviceScratch stats_;  // softmax statistics, for engines that want them as an output
  int64_t plans_built_ = 0;
  double plan_build_ms_ = 0;
};

}  // namespace sparsex

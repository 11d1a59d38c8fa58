// bf16 GEMM through cuBLASLt: out = x @ w^T (+ beta * out), fp32 accumulation, bf16 output.
// Row-major operands as the model stores them (a projection w is [out_features, in_features]).
// Algorithms are chosen once per shape by cuBLASLt's heuristic and cached with their
// descriptors; one workspace serves every call (calls on one object must share a stream or be
// serialised by the caller).
//
//   kernels::LtGemm gemm;
//   gemm.Init(32 << 20);
//   gemm.Run(x, x_stride, w, w_stride, out, out_stride, n, m, k, 0.0f, stream);
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace sparsex::kernels {

class LtGemm {
 public:
  LtGemm() = default;
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Creates the handle and a device workspace of workspace_bytes. Default in callers: 32 MiB.
  cublasStatus_t Init(size_t workspace_bytes);

  // x: [n, k] (row stride x_stride), w: [m, k] (row stride w_stride), out: [n, m] (row stride
  // out_stride). out = x @ w^T + beta * out. n == 0 is a no-op.
  cublasStatus_t Run(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                     int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                     int64_t m, int64_t k, float beta, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool has_algo = false;
  };
  // (n, m, k, x_stride, w_stride, out_stride, alignment of x | w | out in bytes)
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>;
  cublasStatus_t MakePlan(const Key& key, Plan& plan);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
};

const char* CublasStatusName(cublasStatus_t s);

// Weight-streaming GEMM for few rows (decode): out[n, m] = x[n, k] @ w[m, k]^T + beta * out.
// Each warp owns two output features and streams their weight rows once with 16-byte loads;
// x rows come through L1. fp32 accumulation. Supported when SmallNGemmSupported(...).
constexpr int kSmallNGemmMaxRows = 8;
bool SmallNGemmSupported(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                         int64_t w_stride, int64_t n, int64_t k);
cudaError_t SmallNGemm(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                       int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                       int64_t m, int64_t k, float beta, cudaStream_t stream);

}  // namespace sparsex::kernels

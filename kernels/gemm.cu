#include "kernels/gemm.h"

namespace sparsex::kernels {

#define SPX_LT_CHECK(expr)                               \
  do {                                                   \
    cublasStatus_t spx_st_ = (expr);                     \
    if (spx_st_ != CUBLAS_STATUS_SUCCESS) return spx_st_; \
  } while (0)

LtGemm::~LtGemm() {
  for (auto& [key, p] : plans_) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

cublasStatus_t LtGemm::Init(size_t workspace_bytes) {
  if (handle_) return CUBLAS_STATUS_SUCCESS;
  SPX_LT_CHECK(cublasLtCreate(&handle_));
  if (workspace_bytes > 0) {
    if (cudaMalloc(&workspace_, workspace_bytes) != cudaSuccess) return CUBLAS_STATUS_ALLOC_FAILED;
    workspace_bytes_ = workspace_bytes;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Row-major out[n, m] = x[n, k] @ w[m, k]^T is, in cuBLAS's column-major terms,
// out^T (m x n, ld out_stride) = op_T(W) (W: k x m, ld w_stride) * X (k x n, ld x_stride).
cublasStatus_t LtGemm::MakePlan(const Key& key, Plan& plan) {
  const auto [n, m, k, xs, ws, os, align] = key;
  SPX_LT_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  SPX_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                              sizeof(ta)));
  SPX_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                              sizeof(tb)));
  SPX_LT_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, k, m, ws));
  SPX_LT_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, k, n, xs));
  SPX_LT_CHECK(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_16BF, m, n, os));
  cublasLtMatmulPreference_t pref = nullptr;
  SPX_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t wsb = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                       sizeof(wsb));
  // The heuristic assumes 256-byte aligned buffers unless told otherwise.
  const uint32_t al = static_cast<uint32_t>(align);
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.c,
                                                     plan.c, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (returned == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  plan.algo = result.algo;
  plan.has_algo = true;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LtGemm::Run(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                           int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                           int64_t m, int64_t k, float beta, cudaStream_t stream) {
  if (n == 0 || m == 0) return CUBLAS_STATUS_SUCCESS;
  if (!handle_) return CUBLAS_STATUS_NOT_INITIALIZED;
  uintptr_t bits = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) |
                   reinterpret_cast<uintptr_t>(out) | 256;
  const int align = static_cast<int>(bits & (~bits + 1));  // lowest set bit, at most 256
  const Key key{n, m, k, x_stride, w_stride, out_stride, align};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    Plan plan;
    cublasStatus_t st = MakePlan(key, plan);
    if (st != CUBLAS_STATUS_SUCCESS) {
      if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
      if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
      if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
      if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
      return st;
    }
    it = plans_.emplace(key, plan).first;
  }
  const Plan& p = it->second;
  const float alpha = 1.0f;
  return cublasLtMatmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, out, p.c, out, p.c,
                        &p.algo, workspace_, workspace_bytes_, stream);
}

const char* CublasStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

}  // namespace sparsex::kernels

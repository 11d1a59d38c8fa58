#include "kernels/gemm.h"

#include "kernels/common.cuh"

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

// ---------------------------------------------------------------------------------------------
// Small-n GEMM (decode).
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int kGemvWarps = 4;
constexpr int kGemvRowsPerWarp = 2;

template <int N>
__global__ void __launch_bounds__(kGemvWarps * 32)
    SmallNGemmKernel(const __nv_bfloat16* __restrict__ x, int64_t xs,
                     const __nv_bfloat16* __restrict__ w, int64_t ws, __nv_bfloat16* out,
                     int64_t os, int64_t m, int64_t k, float beta) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = blockIdx.x * int64_t(kGemvWarps) + (threadIdx.x >> 5);
  const int64_t row0 = warp * kGemvRowsPerWarp;
  if (row0 >= m) return;
  const bool has1 = row0 + 1 < m;
  const __nv_bfloat16* w0 = w + row0 * ws;
  const __nv_bfloat16* w1 = has1 ? w0 + ws : w0;
  // The weights never depend on the previous kernel: under programmatic dependent launch this
  // warp asks for its rows (128-byte lines into L2) while that kernel is still running, then
  // waits for it before reading x.
  for (int64_t c = lane * 64; c < k; c += 32 * 64) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w0 + c));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + c));
  }
  sparsex::kernels::detail::PdlWait();
  sparsex::kernels::detail::PdlLaunchDependents();
  float acc[kGemvRowsPerWarp][N];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[r][j] = 0.0f;
#pragma unroll(N <= 2 ? 4 : 2)
  for (int64_t c = lane * 8; c < k; c += 256) {
    const uint4 a = __ldcs(reinterpret_cast<const uint4*>(w0 + c));  // streamed once
    const uint4 b = __ldcs(reinterpret_cast<const uint4*>(w1 + c));
    const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + j * xs + c));
      const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 xf = __bfloat1622float2(xh[e]);
        const float2 af = __bfloat1622float2(ah[e]);
        const float2 bf = __bfloat1622float2(bh[e]);
        acc[0][j] = fmaf(af.x, xf.x, fmaf(af.y, xf.y, acc[0][j]));
        acc[1][j] = fmaf(bf.x, xf.x, fmaf(bf.y, xf.y, acc[1][j]));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float v = acc[r][j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[r][j] = v;
    }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r) {
      if (r == 1 && !has1) break;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        __nv_bfloat16* o = out + j * os + row0 + r;
        float v = acc[r][j];
        if (beta != 0.0f) v += beta * __bfloat162float(*o);
        *o = __float2bfloat16_rn(v);
      }
    }
  }
}

template <int N>
cudaError_t LaunchSmallN(const __nv_bfloat16* x, int64_t xs, const __nv_bfloat16* w, int64_t ws,
                         __nv_bfloat16* out, int64_t os, int64_t m, int64_t k, float beta,
                         cudaStream_t stream) {
  const int64_t rows_per_block = kGemvWarps * kGemvRowsPerWarp;
  const int64_t blocks = (m + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return sparsex::kernels::detail::LaunchPdl(SmallNGemmKernel<N>, static_cast<unsigned>(blocks),
                                             kGemvWarps * 32, 0, stream, x, xs, w, ws, out, os,
                                             m, k, beta);
}

}  // namespace

bool SmallNGemmSupported(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                         int64_t w_stride, int64_t n, int64_t k) {
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return n >= 1 && n <= kSmallNGemmMaxRows && k % 8 == 0 && x_stride % 8 == 0 &&
         w_stride % 8 == 0 && al(x) && al(w);
}

cudaError_t SmallNGemm(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                       int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                       int64_t m, int64_t k, float beta, cudaStream_t stream) {
  if (n == 0 || m == 0) return cudaSuccess;
  if (!SmallNGemmSupported(x, x_stride, w, w_stride, n, k)) return cudaErrorInvalidValue;
  switch (n) {
    case 1: return LaunchSmallN<1>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    case 2: return LaunchSmallN<2>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    case 3: return LaunchSmallN<3>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    case 4: return LaunchSmallN<4>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    case 5: return LaunchSmallN<5>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    case 6: return LaunchSmallN<6>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    case 7: return LaunchSmallN<7>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
    default: return LaunchSmallN<8>(x, x_stride, w, w_stride, out, out_stride, m, k, beta, stream);
  }
}

}  // namespace sparsex::kernels

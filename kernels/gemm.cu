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

// Variants 1-4 and every fused gate_up + SwiGLU kernel (v8). A block is G groups of W warps;
// a group owns F weight rows, which are F consecutive output features or, with SWIGLU, the gate
// rows of F/2 features and their up rows `half` rows further. Warp g of a group streams the
// 256-element segments g, g + W, g + 2W, ... of each row (512 contiguous bytes per warp load),
// U segments of every row at a time: all U * F 16-byte loads of a lane are issued before the
// first is used. Each lane adds its segments in increasing order, the warp then sums its lanes
// with the butterfly of v2, and W > 1 adds the warps' partials in warp order through shared
// memory: a feature's sum depends only on (W, k), never on which rows share its group, which
// is what makes the fused kernel equal SmallNGemm then SwiGlu. With W = 1, F = 2, U = 4 the
// order is v2's own (lane l adds columns l*8 + 256 t for t = 0, 1, ...), so the fused kernel of
// variant 0 matches the v2 kernel.
//
// MinBlocks1: blocks per SM the one-row kernel is compiled for (its register budget; the kernels
// for more rows take the registers they need, unspilled).
template <int F, int W, int G, int U, int MinBlocks1>
struct GemvConfig {
  static_assert(F % 2 == 0 && F <= 4, "F: 2 or 4 rows (F * N partials fit one warp's lanes)");
  static_assert(W == 1 || G == 1, "a block either splits k or holds independent warps");
  static constexpr int kF = F, kW = W, kG = G, kU = U, kMinBlocks1 = MinBlocks1;
};

template <int N, class C, bool SWIGLU>
__global__ void __launch_bounds__(C::kG * C::kW * 32, N == 1 ? C::kMinBlocks1 : 1)
    SmallNGemmVariantKernel(const __nv_bfloat16* __restrict__ x, int64_t xs,
                            const __nv_bfloat16* __restrict__ w, int64_t ws, __nv_bfloat16* out,
                            int64_t os, int64_t m_out, int64_t half, int64_t k, float beta) {
  constexpr int F = C::kF, W = C::kW, U = C::kU;
  constexpr int P = SWIGLU ? F / 2 : F;  // output features per group
  constexpr int64_t kSeg = 256;          // elements per warp load (32 lanes x 8)
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wig = warp % W;  // warp in group: which k segments
  const int64_t j0 = (blockIdx.x * int64_t(C::kG) + warp / W) * P;
  // W > 1 means one group per block, so a block leaves as a whole (before its barrier).
  if (j0 >= m_out) return;
  const __nv_bfloat16* rows[F];
#pragma unroll
  for (int f = 0; f < F; ++f) {
    const int p = f % P;
    const int64_t j = j0 + p < m_out ? j0 + p : m_out - 1;  // past the end: a duplicate read
    rows[f] = w + ((SWIGLU && f >= P ? half : 0) + j) * ws;
  }
  // As in v2: the weights never depend on the previous kernel, so this warp asks for its
  // 128-byte lines (lane l: line l & 3 of segment (l >> 2) + 8 i) before waiting for it.
#pragma unroll
  for (int f = 0; f < F; ++f) {
    for (int64_t c = ((lane >> 2) * W + wig) * kSeg + (lane & 3) * 64; c < k;
         c += 8 * W * kSeg) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(rows[f] + c));
    }
  }
  sparsex::kernels::detail::PdlWait();
  sparsex::kernels::detail::PdlLaunchDependents();
  float acc[F][N];
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[f][j] = 0.0f;
  const int64_t lane_off = wig * kSeg + lane * 8;
#pragma unroll 1
  for (int64_t base = 0; base < k; base += int64_t(U) * W * kSeg) {
    uint4 wv[U][F];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * W * kSeg + lane_off;
#pragma unroll
      for (int f = 0; f < F; ++f) {
        wv[u][f] = c < k ? __ldcs(reinterpret_cast<const uint4*>(rows[f] + c))  // streamed once
                         : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * W * kSeg + lane_off;
      if (c >= k) continue;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + j * xs + c));
        const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
        for (int f = 0; f < F; ++f) {
          const __nv_bfloat162* wh = reinterpret_cast<const __nv_bfloat162*>(&wv[u][f]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 xf = __bfloat1622float2(xh[e]);
            const float2 wf = __bfloat1622float2(wh[e]);
            acc[f][j] = fmaf(wf.x, xf.x, fmaf(wf.y, xf.y, acc[f][j]));
          }
        }
      }
    }
  }
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[f][j] = sparsex::kernels::detail::WarpSum(acc[f][j]);
  // Lane t < P * N finishes output feature j0 + t / N of row t % N: v0 its (gate) sum, v1 the
  // up sum.
  float v0 = 0.0f, v1 = 0.0f;
  if constexpr (W == 1) {
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (lane == p * N + j) {
          v0 = acc[p][j];
          if constexpr (SWIGLU) v1 = acc[p + P][j];
        }
      }
  } else {
    __shared__ float partial[W][F * N];
    // Every lane holds every sum after the butterfly: lane t stores sum t.
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (lane == f * N + j) partial[wig][lane] = acc[f][j];
      }
    __syncthreads();
    if (warp != 0) return;
    if (lane < P * N) {
      v0 = partial[0][lane];
      if constexpr (SWIGLU) v1 = partial[0][lane + P * N];
#pragma unroll
      for (int g = 1; g < W; ++g) {
        v0 += partial[g][lane];
        if constexpr (SWIGLU) v1 += partial[g][lane + P * N];
      }
    }
  }
  const int64_t j = j0 + lane / N;
  if (lane >= P * N || j >= m_out) return;
  __nv_bfloat16* o = out + (lane % N) * os + j;
  if constexpr (SWIGLU) {
    // Rounded as the separate path stores gate and up, then exactly SwiGlu's arithmetic.
    const float g = __bfloat162float(__float2bfloat16_rn(v0));
    const float u = __bfloat162float(__float2bfloat16_rn(v1));
    *o = __float2bfloat16_rn(sparsex::kernels::detail::Silu(g) * u);
  } else {
    if (beta != 0.0f) v0 += beta * __bfloat162float(*o);
    *o = __float2bfloat16_rn(v0);
  }
}

template <int N, class C, bool SWIGLU>
cudaError_t LaunchVariant(const __nv_bfloat16* x, int64_t xs, const __nv_bfloat16* w,
                          int64_t ws, __nv_bfloat16* out, int64_t os, int64_t m_out,
                          int64_t half, int64_t k, float beta, cudaStream_t stream) {
  constexpr int64_t per_block = int64_t(C::kG) * (SWIGLU ? C::kF / 2 : C::kF);
  const int64_t blocks = (m_out + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return sparsex::kernels::detail::LaunchPdl(SmallNGemmVariantKernel<N, C, SWIGLU>,
                                             static_cast<unsigned>(blocks),
                                             C::kG * C::kW * 32, 0, stream, x, xs, w, ws, out,
                                             os, m_out, half, k, beta);
}

template <class C, bool SWIGLU>
cudaError_t LaunchVariantRows(const __nv_bfloat16* x, int64_t xs, const __nv_bfloat16* w,
                              int64_t ws, __nv_bfloat16* out, int64_t os, int64_t n,
                              int64_t m_out, int64_t half, int64_t k, float beta,
                              cudaStream_t stream) {
#define SPX_VARIANT_CASE(R) \
  case R: return LaunchVariant<R, C, SWIGLU>(x, xs, w, ws, out, os, m_out, half, k, beta, stream)
  switch (n) {
    SPX_VARIANT_CASE(1);
    SPX_VARIANT_CASE(2);
    SPX_VARIANT_CASE(3);
    SPX_VARIANT_CASE(4);
    SPX_VARIANT_CASE(5);
    SPX_VARIANT_CASE(6);
    SPX_VARIANT_CASE(7);
    default: return LaunchVariant<8, C, SWIGLU>(x, xs, w, ws, out, os, m_out, half, k, beta,
                                                stream);
  }
#undef SPX_VARIANT_CASE
}

// The configuration of each variant (F rows per group, W warps per group, G groups per block,
// U segments in flight per row, blocks per SM at one row); variant 0's is the v2 kernel's
// order, used for its fused form. At one row every variant keeps 16-32 warps per SM with
// 4-8 KB of weights in flight each (~128 KB per SM).
using ConfigWarp2 = GemvConfig<2, 1, 4, 4, 8>;
using ConfigWarp2Deep = GemvConfig<2, 1, 4, 8, 4>;
using ConfigWarp4 = GemvConfig<4, 1, 4, 4, 4>;
using ConfigSplitK4 = GemvConfig<4, 4, 1, 2, 8>;
using ConfigSplitK8 = GemvConfig<4, 8, 1, 2, 4>;

template <bool SWIGLU>
cudaError_t LaunchByVariant(SmallNGemmVariant v, const __nv_bfloat16* x, int64_t xs,
                            const __nv_bfloat16* w, int64_t ws, __nv_bfloat16* out, int64_t os,
                            int64_t n, int64_t m_out, int64_t half, int64_t k, float beta,
                            cudaStream_t stream) {
  switch (v) {
    case SmallNGemmVariant::kWarp2:
      return LaunchVariantRows<ConfigWarp2, SWIGLU>(x, xs, w, ws, out, os, n, m_out, half, k,
                                                    beta, stream);
    case SmallNGemmVariant::kWarp2Deep:
      return LaunchVariantRows<ConfigWarp2Deep, SWIGLU>(x, xs, w, ws, out, os, n, m_out, half,
                                                        k, beta, stream);
    case SmallNGemmVariant::kWarp4:
      return LaunchVariantRows<ConfigWarp4, SWIGLU>(x, xs, w, ws, out, os, n, m_out, half, k,
                                                    beta, stream);
    case SmallNGemmVariant::kSplitK4:
      return LaunchVariantRows<ConfigSplitK4, SWIGLU>(x, xs, w, ws, out, os, n, m_out, half, k,
                                                      beta, stream);
    case SmallNGemmVariant::kSplitK8:
      return LaunchVariantRows<ConfigSplitK8, SWIGLU>(x, xs, w, ws, out, os, n, m_out, half, k,
                                                      beta, stream);
    default: return cudaErrorInvalidValue;
  }
}

SmallNGemmVariant Resolve(SmallNGemmVariant v, int64_t n, int64_t m, int64_t k) {
  return v == SmallNGemmVariant::kAuto ? SmallNGemmAutoVariant(n, m, k) : v;
}

}  // namespace

const char* SmallNGemmVariantName(SmallNGemmVariant v) {
  switch (v) {
    case SmallNGemmVariant::kAuto: return "auto";
    case SmallNGemmVariant::kWarp2: return "warp2";
    case SmallNGemmVariant::kWarp2Deep: return "warp2-deep";
    case SmallNGemmVariant::kWarp4: return "warp4";
    case SmallNGemmVariant::kSplitK4: return "splitk4";
    case SmallNGemmVariant::kSplitK8: return "splitk8";
  }
  return "unknown";
}

// H200, gpu_prefill_bench --small-n (perf-notes v8), us per call at 1 row, best small-n vs
// cuBLASLt: qkv 6144x4096 16.2 (splitk8) vs 17.6; o 4096x4096 11.3 (splitk4) vs 13.4; gate_up
// 28672x4096 61.4 (splitk8) vs 60.1 + a separate SwiGLU; down 4096x14336 34.6 vs 32.8;
// lm_head 128256x4096 263 vs 248. At 2 rows only o is level (13.2 vs 13.3); from 4 rows
// cuBLASLt wins every shape, by up to 2.6x at 8 rows (down 33 vs 85 us).
constexpr int64_t kSmallNSquare = int64_t{4096} * 4096;

SmallNGemmVariant SmallNGemmAutoVariant(int64_t n, int64_t m, int64_t k) {
  (void)n;
  return m * k <= kSmallNSquare ? SmallNGemmVariant::kSplitK4 : SmallNGemmVariant::kSplitK8;
}

bool SmallNGemmSupported(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                         int64_t w_stride, int64_t n, int64_t k) {
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return n >= 1 && n <= kSmallNGemmMaxRows && k % 8 == 0 && x_stride % 8 == 0 &&
         w_stride % 8 == 0 && al(x) && al(w);
}

cudaError_t SmallNGemm(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                       int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                       int64_t m, int64_t k, float beta, cudaStream_t stream,
                       SmallNGemmVariant variant) {
  if (n == 0 || m == 0) return cudaSuccess;
  if (!SmallNGemmSupported(x, x_stride, w, w_stride, n, k)) return cudaErrorInvalidValue;
  variant = Resolve(variant, n, m, k);
  if (variant != SmallNGemmVariant::kWarp2) {
    return LaunchByVariant<false>(variant, x, x_stride, w, w_stride, out, out_stride, n, m, 0, k,
                                  beta, stream);
  }
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

cudaError_t SmallNGemmSwiGlu(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                             int64_t w_stride, __nv_bfloat16* out, int64_t out_stride,
                             int64_t n, int64_t half, int64_t k, cudaStream_t stream,
                             SmallNGemmVariant variant) {
  if (n == 0 || half == 0) return cudaSuccess;
  if (!SmallNGemmSupported(x, x_stride, w, w_stride, n, k)) return cudaErrorInvalidValue;
  return LaunchByVariant<true>(Resolve(variant, n, 2 * half, k), x, x_stride, w, w_stride, out,
                               out_stride, n, half, half, k, 0.0f, stream);
}

}  // namespace sparsex::kernels

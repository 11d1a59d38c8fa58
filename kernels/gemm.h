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
// Weight rows are streamed once with 16-byte loads (evict-first); x rows come through L1; fp32
// accumulation. Supported when SmallNGemmSupported(...).
constexpr int kSmallNGemmMaxRows = 8;

// How the warps cover the weight rows (docs/perf-notes.md v2, v8). The matrices of a decode
// step are small enough (qkv, o: 50 and 34 MB) that the bytes each SM has in flight, not the
// bandwidth, bound the v2 kernel; the later variants put more 16-byte loads in flight per warp
// or split k over the warps of a block.
enum class SmallNGemmVariant : int {
  kAuto = -1,      // SmallNGemmAutoVariant(n, m, k)
  kWarp2 = 0,      // v2: a warp per 2 output features, 4 warps per block, compiler-unrolled
  kWarp2Deep = 1,  // a warp per 2 features, 8 loads per row issued before the first is used
  kWarp4 = 2,      // a warp per 4 features, 4 loads per row in flight (x read once per 4)
  kSplitK4 = 3,    // 4 warps share 4 features, each a quarter of k; sums meet in shared memory
  kSplitK8 = 4,    // 8 warps share 4 features, each an eighth of k
};
constexpr int kSmallNGemmVariants = 5;
// "warp2", "warp2-deep", "warp4", "splitk4", "splitk8" ("auto" for kAuto).
const char* SmallNGemmVariantName(SmallNGemmVariant v);
// The variant kAuto runs for a shape (m output features of k inputs, n rows), from the H200
// measurement of every variant per Llama-3-8B decode shape (docs/perf-notes.md v8):
// splitk4 up to 4096 x 4096 weights, splitk8 above.
SmallNGemmVariant SmallNGemmAutoVariant(int64_t n, int64_t m, int64_t k);

bool SmallNGemmSupported(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                         int64_t w_stride, int64_t n, int64_t k);
cudaError_t SmallNGemm(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                       int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                       int64_t m, int64_t k, float beta, cudaStream_t stream,
                       SmallNGemmVariant variant = SmallNGemmVariant::kAuto);

// The MLP's gate_up projection with SwiGLU in its epilogue, for decode rows:
//   out[r, j] = silu(x[r] . w[j]) * (x[r] . w[half + j])      j < half, r < n
// w: [2*half, k] (the gate rows, then the up rows), out: [n, half]. The [n, 2*half]
// intermediate is never written. Gate and up are rounded to bf16 before the product, as
// SmallNGemm then SwiGlu (ops.h) round them, and each variant sums a feature in the same order
// as SmallNGemm of that variant: the result is bit-identical to those two calls. Supported
// when SmallNGemmSupported(x, x_stride, w, w_stride, n, k).
cudaError_t SmallNGemmSwiGlu(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                             int64_t w_stride, __nv_bfloat16* out, int64_t out_stride,
                             int64_t n, int64_t half, int64_t k, cudaStream_t stream,
                             SmallNGemmVariant variant = SmallNGemmVariant::kAuto);

// The same gate_up + SwiGLU for prefill-sized row counts on Hopper (kernels/gemm_sm90.cu:
// wgmma with bulk tensor copies, sm_90a builds on compute capability 9.0 only). cuBLASLt then
// SwiGlu write and read back the [n, 2*half] gate_up product; here it stays in registers.
// Gate and up are rounded to bf16 before the product as there, but summed in the kernel's own
// order: nothing guarantees the same bits as LtGemm then SwiGlu, though every comparison on an
// H100 found them.
// Supported from 128 rows, 128 outputs and 64 inputs, with 16-byte aligned x and w rows.
bool Sm90GemmSwiGluSupported(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                             int64_t w_stride, const __nv_bfloat16* out, int64_t out_stride,
                             int64_t n, int64_t half, int64_t k);
// The kernel's shapes (docs/perf-notes.md has their figures): 3 stages of 64
// inputs with the SwiGLU computed by three otherwise idle warps from a staging buffer while the
// MMA warpgroups go on to the next tile, or 4 stages with the SwiGLU computed by the MMA
// warpgroups after each tile.
enum class Sm90GemmSwiGluVariant : int {
  kStages3Staged = 0,
  kStages4 = 1,
};
constexpr int kSm90GemmSwiGluVariants = 2;
// "stages-3-staged", "stages-4".
const char* Sm90GemmSwiGluVariantName(Sm90GemmSwiGluVariant v);
cudaError_t Sm90GemmSwiGlu(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                           int64_t w_stride, __nv_bfloat16* out, int64_t out_stride, int64_t n,
                           int64_t half, int64_t k, cudaStream_t stream,
                           Sm90GemmSwiGluVariant variant = Sm90GemmSwiGluVariant::kStages3Staged);

}  // namespace sparsex::kernels

// Device helpers shared by the kernels (CUDA translation units only): bf16 conversion, 16-byte
// vector access, warp reductions, cp.async and the mma.sync / ldmatrix wrappers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

namespace sparsex::kernels::detail {

using bf16 = __nv_bfloat16;

#define SPX_RETURN_LAUNCH_ERROR() \
  do {                            \
    return cudaGetLastError();    \
  } while (0)

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Threads of a one-block-per-row launch over cols columns, per_thread each: whole warps, at
// most 1024 (the norms and DrawRows).
inline int RowThreads(int64_t cols, int per_thread) {
  const int64_t t = CeilDiv(CeilDiv(cols, per_thread), 32) * 32;
  return static_cast<int>(t > 1024 ? 1024 : t);
}

// Programmatic dependent launch (Hopper): a kernel started by LaunchPdl may begin while the
// previous kernel on the stream is still running (its blocks fill the idle SMs, a matmul
// streams its weights), so every such kernel calls PdlWait() before it touches memory the
// previous kernel reads or writes, and PdlLaunchDependents() to let the next one start early.
// Both are no-ops on older GPUs and in kernels launched without the attribute.
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void PdlLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches may carry the programmatic-dependency attribute: the current device is
// compute capability 9.0 or newer and SPX_PDL is not "0" (read once per process).
bool PdlEnabled();

// Launches kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream
// serialization when PdlEnabled() and the grid is at most kPdlMaxBlocks blocks (decode-sized
// work, the largest being the lm_head matmul's 16032): a long prefill's element-wise grids gain
// nothing from an early start, and their blocks waiting in PdlWait would hold SM slots the
// kernel they wait for still needs. Only for kernels that call PdlWait() first.
constexpr uint64_t kPdlMaxBlocks = 16384;
template <typename... P, typename... A>
cudaError_t LaunchPdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, A&&... args) {
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  if (blocks > kPdlMaxBlocks || !PdlEnabled()) {
    kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

// SiLU as the SwiGLU kernels compute it (ops.cu and the fused gate_up epilogue in gemm.cu share
// it so their results are bit-identical).
__device__ __forceinline__ float Silu(float g) { return g / (1.0f + __expf(-g)); }

// One RoPE pair (x0, x1) rotated by pos * inv_freq, rounded to bf16. Every rounding is
// explicit (nothing left to the compiler's contraction), so the kernels that rotate (rope.cu:
// Rope, RopeWriteKv, AssembleKv) give the same bits whatever each one's compiled code fuses.
__device__ __forceinline__ void RotatePair(float x0, float x1, float pos, float inv_freq,
                                           __nv_bfloat16* y0, __nv_bfloat16* y1) {
  float sn, cs;
  sincosf(__fmul_rn(pos, inv_freq), &sn, &cs);
  *y0 = __float2bfloat16_rn(__fmaf_rn(x0, cs, -__fmul_rn(x1, sn)));
  *y1 = __float2bfloat16_rn(__fmaf_rn(x0, sn, __fmul_rn(x1, cs)));
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). All threads get the result.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpSum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    float s = lane < nw ? partial[lane] : 0.0f;
    s = WarpSum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// 8 bf16 in one 16-byte vector.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};
__device__ __forceinline__ void Unpack8(const Bf16x8& v, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ Bf16x8 Pack8(const float* f) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- cp.async (sm_80+) ----
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Copies 16 bytes global -> shared; when !valid the destination is zero-filled (src not read).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)),
               "l"(gmem), "r"(src_size));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- tensor-core fragments (mma.sync m16n8k16, bf16 in, fp32 accumulate) ----
__device__ __forceinline__ void LdMatrixX4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                           const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(SmemAddr(smem)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                uint32_t& r3, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(SmemAddr(smem)));
}
// Element offset of 16-byte chunk `chunk` of row `row` in a shared tile of HD-wide bf16 rows,
// XOR-swizzled by chunk (chunk ^ (row & 7)) so that ldmatrix reads are bank-conflict free.
template <int HD>
__device__ __forceinline__ int Swz(int row, int chunk) {
  return row * HD + ((chunk ^ (row & 7)) << 3);
}
// d = a * b + d; a: 4 regs (16x16 row-major), b: 2 regs (16x8 col-major), d: 4 fp32 (16x8).
__device__ __forceinline__ void MmaBf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- online softmax of the flash kernels (mma.sync and wgmma share the accumulator layout) ----
// ex2.approx: one MUFU op (2^-inf = +0); the scores are already in the log2 domain.
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One tile of the online softmax. A thread holds raw scores (masked keys -inf) of two rows
// (g, g + 8) for NB groups of 8 keys: element [nb][c] belongs to row c >> 1, and a row is spread
// over the 4 lanes of a quad. scale_log2 > 0 takes them to the log2 domain: the row maxima of
// the raw scores (a positive scale keeps their order) are scaled once and p = 2^(s scale - m)
// is one FFMA and one ex2 a score. Replaces the scores by those exponentials, advances row_m
// (log2 domain) and row_l (this thread's partial row sums), and returns in corr the factor by
// which the caller rescales whatever else it accumulated (O, cross mass). kRowSum false leaves
// row_l's additions to the caller (a kernel that sums the rows on the tensor cores).
template <int NB, bool kRowSum = true>
__device__ __forceinline__ void OnlineSoftmaxStep(float (&s)[NB][4], float scale_log2,
                                                  float (&row_m)[2], float (&row_l)[2],
                                                  float (&corr)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    mx[0] = fmaxf(mx[0], fmaxf(s[nb][0], s[nb][1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[nb][2], s[nb][3]));
  }
  float neg_ref[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    const float m_new = fmaxf(row_m[i], mx[i] * scale_log2);
    const float ref = m_new == -INFINITY ? 0.0f : m_new;
    corr[i] = Ex2(row_m[i] - ref);
    row_m[i] = m_new;
    row_l[i] *= corr[i];
    neg_ref[i] = -ref;
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    s[nb][0] = Ex2(fmaf(s[nb][0], scale_log2, neg_ref[0]));
    s[nb][1] = Ex2(fmaf(s[nb][1], scale_log2, neg_ref[0]));
    s[nb][2] = Ex2(fmaf(s[nb][2], scale_log2, neg_ref[1]));
    s[nb][3] = Ex2(fmaf(s[nb][3], scale_log2, neg_ref[1]));
    if constexpr (kRowSum) {
      row_l[0] += s[nb][0] + s[nb][1];
      row_l[1] += s[nb][2] + s[nb][3];
    }
  }
}
// The same for scores already in the log2 domain: with a scale of 1 the maximum is unchanged and
// fmaf(s, 1, -m) rounds exactly as s - m does.
template <int NB>
__device__ __forceinline__ void OnlineSoftmaxStep(float (&s)[NB][4], float (&row_m)[2],
                                                  float (&row_l)[2], float (&corr)[2]) {
  OnlineSoftmaxStep(s, 1.0f, row_m, row_l, corr);
}

// ---- selection statistics by complement: the key tiles a block reads ----
// The first key tile in [t, t_end) whose segment range (tile_groups: lo, hi per tile) meets the
// block's [qg_lo, qg_hi] or holds shared keys ((INT32_MIN, INT32_MAX)); t_end when none.
// Warp-wide (every lane must call it with the same arguments): 32 tiles a ballot, since a
// block's own segment can lie hundreds of tiles past the first.
__device__ __forceinline__ int NextGroupTile(const int32_t* tile_groups, int t, int t_end,
                                             int qg_lo, int qg_hi, int lane) {
  for (; t < t_end; t += 32) {
    const int c = t + lane;
    bool hit = false;
    if (c < t_end) hit = tile_groups[2 * c + 1] >= qg_lo && tile_groups[2 * c] <= qg_hi;
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (m != 0) return t + __ffs(m) - 1;
  }
  return t_end;
}

// ---- fused cross-segment mass (selection statistic) for the flash kernels ----
// A thread holds probabilities (unnormalised, after the online-softmax exponent) of two rows
// (g, g + 8) for NB groups of 8 keys in the mma/wgmma accumulator layout: element [nb][c] is
// key key0 + 8 nb + (c & 1) of row c >> 1. Adds those on keys of another segment (key_group
// >= 0 and != the row's segment) to xacc, which the caller rescales like the row sum.
template <int NB>
__device__ __forceinline__ void AccumulateCross(const float (&pr)[NB][4], int key0,
                                                const int32_t* key_group, int ctx_len,
                                                const int (&qg)[2], float (&xacc)[2]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = key0 + nb * 8 + e;
      const int kg = key < ctx_len ? key_group[key] : -1;
      if (kg >= 0) {
        if (kg != qg[0]) xacc[0] += pr[nb][e];
        if (kg != qg[1]) xacc[1] += pr[nb][2 + e];
      }
    }
  }
}
// Adds a row's cross mass (its quad's partial sums over its normaliser) / n_heads to out[qrow].
__device__ __forceinline__ void FlushCross(float xacc, float row_l, bool write, float* out,
                                           int n_heads) {
  xacc += __shfl_xor_sync(0xffffffffu, xacc, 1);
  xacc += __shfl_xor_sync(0xffffffffu, xacc, 2);
  if (write && row_l > 0.0f && xacc != 0.0f) atomicAdd(out, xacc / row_l / n_heads);
}

}  // namespace sparsex::kernels::detail

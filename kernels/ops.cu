#include "kernels/ops.h"

#include "kernels/common.cuh"

#include <cstdlib>
#include <string>

namespace sparsex::kernels {
namespace {

using detail::Bf16x8;
using detail::CeilDiv;

constexpr int kThreads = 256;

int GridFor(int64_t work, int threads = kThreads) {
  const int64_t b = CeilDiv(work, threads);
  return static_cast<int>(b < 1 ? 1 : (b > 65535LL * 16 ? 65535LL * 16 : b));
}

// True when every pointer is 16-byte aligned and every stride/width is a multiple of 8 elements,
// so rows can be moved as 16-byte vectors.
bool Vec8(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> dims) {
  for (const void* p : ptrs)
    if (!detail::Aligned16(p)) return false;
  for (int64_t d : dims)
    if (d % 8 != 0) return false;
  return true;
}

__global__ void F32ToBf16Kernel(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}
__global__ void Bf16ToF32Kernel(const bf16* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}
__global__ void F16ToBf16Kernel(const __half* src, bf16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(__half2float(src[i]));
}

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__global__ void FillUniformKernel(bf16* dst, int64_t n, float a, uint64_t seed) {
  const uint64_t s = SplitMix64(seed);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = SplitMix64(s ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * a);
  }
}
__global__ void FillKernel(bf16* dst, int64_t n, float v) {
  const bf16 b = __float2bfloat16_rn(v);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = b;
}

}  // namespace

namespace detail {
bool PdlEnabled() {
  static int cached[64];  // per device: 0 unknown, 1 off, 2 on
  static const bool env_on = [] {
    const char* e = std::getenv("SPX_PDL");
    return e == nullptr || std::string(e) != "0";
  }();
  int dev = 0;
  if (!env_on || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cached[dev] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cached[dev] = major >= 9 ? 2 : 1;
  }
  return cached[dev] == 2;
}
}  // namespace detail

namespace {

// One block per row. VEC = 8 moves 16-byte vectors, VEC = 1 single elements.
template <int VEC, bool kAdd>
__global__ void RmsNormKernel(bf16* res, int64_t res_stride, const bf16* x, int64_t x_stride,
                              const bf16* w, bf16* out, int64_t out_stride, int dim, float eps) {
  // The norm weights never depend on the previous kernel: this thread's first chunk is
  // requested before the wait, off the step's critical path (decode: one block a row).
  const int c0 = threadIdx.x * VEC;
  float g0[VEC] = {};
  if (c0 < dim) {
    if constexpr (VEC == 8) {
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(w + c0), g0);
    } else {
      g0[0] = __bfloat162float(w[c0]);
    }
  }
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int64_t row = blockIdx.x;
  const bf16* xr = x + row * x_stride;
  bf16* rr = kAdd ? res + row * res_stride : nullptr;
  float ss = 0.0f;
  for (int c = threadIdx.x * VEC; c < dim; c += blockDim.x * VEC) {
    float v[VEC];
    if constexpr (VEC == 8) {
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(xr + c), v);
    } else {
      v[0] = __bfloat162float(xr[c]);
    }
    if constexpr (kAdd) {
      float r[VEC];
      if constexpr (VEC == 8) {
        detail::Unpack8(*reinterpret_cast<const Bf16x8*>(rr + c), r);
      } else {
        r[0] = __bfloat162float(rr[c]);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(r[i] + v[i]));
      if constexpr (VEC == 8) {
        *reinterpret_cast<Bf16x8*>(rr + c) = detail::Pack8(v);
      } else {
        rr[c] = __float2bfloat16_rn(v[0]);
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) ss += v[i] * v[i];
  }
  const float inv = rsqrtf(detail::BlockSum(ss) / static_cast<float>(dim) + eps);
  const bf16* src = kAdd ? rr : xr;  // each thread re-reads only what it wrote itself
  bf16* orow = out + row * out_stride;
  for (int c = c0; c < dim; c += blockDim.x * VEC) {
    float v[VEC], g[VEC];
    if constexpr (VEC == 8) {
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(src + c), v);
      if (c == c0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) g[i] = g0[i];
      } else {
        detail::Unpack8(*reinterpret_cast<const Bf16x8*>(w + c), g);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = v[i] * inv * g[i];
      *reinterpret_cast<Bf16x8*>(orow + c) = detail::Pack8(v);
    } else {
      const float gc = c == c0 ? g0[0] : __bfloat162float(w[c]);
      orow[c] = __float2bfloat16_rn(__bfloat162float(src[c]) * inv * gc);
    }
  }
}

template <int VEC>
__global__ void AddKernel(bf16* a, int64_t a_stride, const bf16* b, int64_t b_stride,
                          int64_t rows, int64_t cols) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int64_t per_row = cols / VEC;
  const int64_t total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * VEC;
    bf16* pa = a + r * a_stride + c;
    const bf16* pb = b + r * b_stride + c;
    if constexpr (VEC == 8) {
      float x[8], y[8];
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(pa), x);
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(pb), y);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] += y[k];
      *reinterpret_cast<Bf16x8*>(pa) = detail::Pack8(x);
    } else {
      *pa = __float2bfloat16_rn(__bfloat162float(*pa) + __bfloat162float(*pb));
    }
  }
}

using detail::Silu;

template <int VEC>
__global__ void SwiGluKernel(const bf16* x, int64_t x_stride, bf16* out, int64_t out_stride,
                             int64_t rows, int64_t half) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int64_t per_row = half / VEC;
  const int64_t total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * VEC;
    const bf16* g = x + r * x_stride + c;
    const bf16* u = g + half;
    bf16* o = out + r * out_stride + c;
    if constexpr (VEC == 8) {
      float gv[8], uv[8];
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(g), gv);
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(u), uv);
#pragma unroll
      for (int k = 0; k < 8; ++k) gv[k] = Silu(gv[k]) * uv[k];
      *reinterpret_cast<Bf16x8*>(o) = detail::Pack8(gv);
    } else {
      *o = __float2bfloat16_rn(Silu(__bfloat162float(*g)) * __bfloat162float(*u));
    }
  }
}

template <int VEC>
__global__ void GatherKernel(const bf16* src, int64_t src_stride, int64_t src_rows,
                             const int32_t* idx, bf16* dst, int64_t dst_stride, int64_t n,
                             int64_t cols) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int64_t per_row = cols / VEC;
  const int64_t total = n * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * VEC;
    const int64_t s = idx[r];
    bf16* d = dst + r * dst_stride + c;
    if constexpr (VEC == 8) {
      Bf16x8 v;
      if (s >= 0 && s < src_rows) {
        v = *reinterpret_cast<const Bf16x8*>(src + s * src_stride + c);
      } else {
        float z[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        v = detail::Pack8(z);
      }
      *reinterpret_cast<Bf16x8*>(d) = v;
    } else {
      *d = (s >= 0 && s < src_rows) ? src[s * src_stride + c] : __float2bfloat16_rn(0.0f);
    }
  }
}

template <int VEC>
__global__ void ScatterKernel(const bf16* src, int64_t src_stride, const int32_t* idx, bf16* dst,
                              int64_t dst_stride, int64_t dst_rows, int64_t n, int64_t cols) {
  const int64_t per_row = cols / VEC;
  const int64_t total = n * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * VEC;
    const int64_t d = idx[r];
    if (d < 0 || d >= dst_rows) continue;
    if constexpr (VEC == 8) {
      *reinterpret_cast<Bf16x8*>(dst + d * dst_stride + c) =
          *reinterpret_cast<const Bf16x8*>(src + r * src_stride + c);
    } else {
      dst[d * dst_stride + c] = src[r * src_stride + c];
    }
  }
}

// One warp per row; lanes stride over the columns, then a shuffle reduction.
__global__ void RowSqDistKernel(const bf16* a, int64_t as, const bf16* b, int64_t bs,
                                int64_t rows, int64_t cols, float* out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; r < rows; r += warps) {
    const bf16* pa = a + r * as;
    const bf16* pb = b + r * bs;
    float acc = 0.0f;
    for (int64_t j = lane; j < cols; j += 32) {
      const float d = __bfloat162float(pa[j]) - __bfloat162float(pb[j]);
      acc += d * d;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[r] = acc;
  }
}

__global__ void CopyPinnedKernel(const uint4* src, uint4* dst, int64_t n) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

cudaError_t CopyFromPinned(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (bytes % 16 || !detail::Aligned16(src) || !detail::Aligned16(dst)) return cudaErrorInvalidValue;
  const int64_t n = static_cast<int64_t>(bytes / 16);
  return detail::LaunchPdl(CopyPinnedKernel, GridFor(n), kThreads, 0, stream,
                           static_cast<const uint4*>(src), static_cast<uint4*>(dst), n);
}

cudaError_t RowSqDist(const bf16* a, int64_t a_stride, const bf16* b, int64_t b_stride,
                      int64_t rows, int64_t cols, float* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  RowSqDistKernel<<<GridFor(rows * 32), kThreads, 0, stream>>>(a, a_stride, b, b_stride, rows,
                                                               cols, out);
  return cudaGetLastError();
}

cudaError_t F32ToBf16(const float* src, bf16* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  F32ToBf16Kernel<<<GridFor(n), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}
cudaError_t Bf16ToF32(const bf16* src, float* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  Bf16ToF32Kernel<<<GridFor(n), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}
cudaError_t F16ToBf16(const void* src, bf16* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  F16ToBf16Kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<const __half*>(src), dst, n);
  return cudaGetLastError();
}
cudaError_t FillUniform(bf16* dst, int64_t n, float a, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillUniformKernel<<<GridFor(n), kThreads, 0, stream>>>(dst, n, a, seed);
  return cudaGetLastError();
}
cudaError_t Fill(bf16* dst, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillKernel<<<GridFor(n), kThreads, 0, stream>>>(dst, n, value);
  return cudaGetLastError();
}

namespace {
// The 23 variate bits of (seed, counter, index): common/logits.h DrawBits, bit for bit (23 so
// that k + 0.5 is exact in float and u < 1).
__device__ __forceinline__ uint32_t DrawBits(uint64_t seed, uint64_t counter, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter * 0xD1B54A32D192ED03ull + index +
               0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 41);
}

// One block per row: each thread keeps the largest score it saw (the value, or with a
// temperature the scaled value plus its Gumbel noise) and its first index (its indices rise,
// so a later equal score never replaces an earlier one), then the block reduces (score, index)
// pairs, the larger score or on a tie the lower index. A NaN never compares greater, so it is
// caught by the flag instead.
template <int VEC>
__global__ void DrawRowsKernel(const bf16* x, int64_t x_stride, int64_t cols,
                               const RowDraw* draws, int32_t* out) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const bf16* row = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  const float kInf = __int_as_float(0x7f800000);
  const RowDraw d = draws != nullptr ? draws[blockIdx.x] : RowDraw{0.0f, 0, 0, 0};
  float best = -kInf;
  int64_t best_i = -1;
  bool bad = false, any = false;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    float v[VEC];
    if constexpr (VEC == 8) {
      detail::Unpack8(*reinterpret_cast<const Bf16x8*>(row + c), v);
    } else {
      v[0] = __bfloat162float(row[c]);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      bad |= !(v[i] < kInf);
      any |= v[i] > -kInf;
      float score = v[i];
      if (d.inv_temperature != 0.0f && v[i] > -kInf) {
        const float u = (static_cast<float>(DrawBits(d.seed, d.counter, c + i)) + 0.5f) *
                        1.1920928955078125e-07f;  // 2^-23
        score = v[i] * d.inv_temperature - logf(-logf(u));
      }
      if (score > best || (best_i < 0 && score == score)) {  // the first non-NaN seeds it
        best = score;
        best_i = c + i;
      }
    }
  }
  // Warp, then block: the larger score, on a tie the lower index (-1: saw only NaN).
  auto better = [](float a, int64_t ai, float b, int64_t bi) {
    if (bi < 0) return true;
    if (ai < 0) return false;
    return a > b || (a == b && ai < bi);
  };
  for (int off = 16; off > 0; off >>= 1) {
    const float ob = __shfl_down_sync(0xffffffffu, best, off);
    const int64_t oi = __shfl_down_sync(0xffffffffu, best_i, off);
    if (!better(best, best_i, ob, oi)) {
      best = ob;
      best_i = oi;
    }
  }
  __shared__ float s_best[32];
  __shared__ int64_t s_idx[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_best[warp] = best;
    s_idx[warp] = best_i;
  }
  const bool row_bad = __syncthreads_or(bad);
  const bool row_any = __syncthreads_or(any);
  if (threadIdx.x == 0) {
    const int warps = (blockDim.x + 31) / 32;
    for (int w = 1; w < warps; ++w) {
      if (!better(best, best_i, s_best[w], s_idx[w])) {
        best = s_best[w];
        best_i = s_idx[w];
      }
    }
    out[blockIdx.x] = row_bad || !row_any || best_i < 0 ? -1 : static_cast<int32_t>(best_i);
  }
}

}  // namespace

cudaError_t DrawRows(const bf16* x, int64_t x_stride, int64_t rows, int64_t cols,
                     const RowDraw* draws, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff || cols <= 0 || cols > 0x7fffffff) return cudaErrorInvalidValue;
  const bool v8 = Vec8({x}, {x_stride, cols});
  const int per_thread = v8 ? 8 : 1;
  const int threads = detail::RowThreads(cols, per_thread);
  return detail::LaunchPdl(v8 ? DrawRowsKernel<8> : DrawRowsKernel<1>,
                           static_cast<unsigned>(rows), threads, 0, stream, x, x_stride, cols,
                           draws, out);
}

cudaError_t RmsNorm(const bf16* x, int64_t x_stride, const bf16* w, bf16* out,
                    int64_t out_stride, int64_t rows, int dim, float eps, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  const bool v8 = Vec8({x, w, out}, {x_stride, out_stride, dim});
  const int per_thread = v8 ? 8 : 1;
  const int threads = detail::RowThreads(dim, per_thread);
  return detail::LaunchPdl(v8 ? RmsNormKernel<8, false> : RmsNormKernel<1, false>,
                           static_cast<unsigned>(rows), threads, 0, stream, nullptr, 0, x, x_stride,
                           w, out, out_stride, dim, eps);
}

cudaError_t AddRmsNorm(bf16* residual, int64_t res_stride, const bf16* x, int64_t x_stride,
                       const bf16* w, bf16* out, int64_t out_stride, int64_t rows, int dim,
                       float eps, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  const bool v8 = Vec8({residual, x, w, out}, {res_stride, x_stride, out_stride, dim});
  const int per_thread = v8 ? 8 : 1;
  const int threads = detail::RowThreads(dim, per_thread);
  return detail::LaunchPdl(v8 ? RmsNormKernel<8, true> : RmsNormKernel<1, true>,
                           static_cast<unsigned>(rows), threads, 0, stream, residual, res_stride, x,
                           x_stride, w, out, out_stride, dim, eps);
}

cudaError_t Add(bf16* a, int64_t a_stride, const bf16* b, int64_t b_stride, int64_t rows,
                int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (Vec8({a, b}, {a_stride, b_stride, cols})) {
    return detail::LaunchPdl(AddKernel<8>, GridFor(rows * cols / 8), kThreads, 0, stream, a,
                             a_stride, b, b_stride, rows, cols);
  }
  return detail::LaunchPdl(AddKernel<1>, GridFor(rows * cols), kThreads, 0, stream, a, a_stride, b,
                           b_stride, rows, cols);
}

cudaError_t SwiGlu(const bf16* x, int64_t x_stride, bf16* out, int64_t out_stride, int64_t rows,
                   int64_t half, cudaStream_t stream) {
  if (rows <= 0 || half <= 0) return cudaSuccess;
  if (Vec8({x, out}, {x_stride, out_stride, half})) {
    return detail::LaunchPdl(SwiGluKernel<8>, GridFor(rows * half / 8), kThreads, 0, stream, x,
                             x_stride, out, out_stride, rows, half);
  }
  return detail::LaunchPdl(SwiGluKernel<1>, GridFor(rows * half), kThreads, 0, stream, x, x_stride,
                           out, out_stride, rows, half);
}

cudaError_t GatherRows(const bf16* src, int64_t src_stride, int64_t src_rows,
                       const int32_t* idx, bf16* dst, int64_t dst_stride, int64_t n,
                       int64_t cols, cudaStream_t stream) {
  if (n <= 0 || cols <= 0) return cudaSuccess;
  if (Vec8({src, dst}, {src_stride, dst_stride, cols})) {
    return detail::LaunchPdl(GatherKernel<8>, GridFor(n * cols / 8), kThreads, 0, stream, src,
                             src_stride, src_rows, idx, dst, dst_stride, n, cols);
  }
  return detail::LaunchPdl(GatherKernel<1>, GridFor(n * cols), kThreads, 0, stream, src, src_stride,
                           src_rows, idx, dst, dst_stride, n, cols);
}

cudaError_t ScatterRows(const bf16* src, int64_t src_stride, const int32_t* idx, bf16* dst,
                        int64_t dst_stride, int64_t dst_rows, int64_t n, int64_t cols,
                        cudaStream_t stream) {
  if (n <= 0 || cols <= 0) return cudaSuccess;
  if (Vec8({src, dst}, {src_stride, dst_stride, cols})) {
    ScatterKernel<8><<<GridFor(n * cols / 8), kThreads, 0, stream>>>(
        src, src_stride, idx, dst, dst_stride, dst_rows, n, cols);
  } else {
    ScatterKernel<1><<<GridFor(n * cols), kThreads, 0, stream>>>(src, src_stride, idx, dst,
                                                                dst_stride, dst_rows, n, cols);
  }
  return cudaGetLastError();
}

}  // namespace sparsex::kernels

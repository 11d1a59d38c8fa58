// Memory-bound kernels on bf16 row-major matrices (fp32 arithmetic inside): conversions, seeded
// random fill, RMSNorm (optionally fused with the residual add), residual add, SwiGLU, and row
// movement (embedding gather, gather/scatter by index). Raw device pointers plus a stream; each
// returns the launch's cudaError_t. Every matrix is described by its row stride in elements so a
// column window of a wider matrix can be addressed in place.
//
//   kernels::RmsNorm(x, x_stride, w, out, out_stride, rows, dim, 1e-5f, stream);
//
// The CPU reference for each is the CPU backend (gpu_worker/backend/cpu_backend.cc); the
// consistency test (tests/kernels/backend_consistency_test.cc) checks one against the other.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sparsex::kernels {

using bf16 = __nv_bfloat16;

// dst[i] = bf16(src[i]), n elements.
cudaError_t F32ToBf16(const float* src, bf16* dst, int64_t n, cudaStream_t stream);
// dst[i] = float(src[i]), n elements.
cudaError_t Bf16ToF32(const bf16* src, float* dst, int64_t n, cudaStream_t stream);
// dst[i] = bf16(float(src[i])) for IEEE half input, n elements.
cudaError_t F16ToBf16(const void* src, bf16* dst, int64_t n, cudaStream_t stream);

// dst[i] = U(-a, a) from a counter-based hash of (seed, i): identical for a seed on any GPU.
cudaError_t FillUniform(bf16* dst, int64_t n, float a, uint64_t seed, cudaStream_t stream);
// dst[i] = value.
cudaError_t Fill(bf16* dst, int64_t n, float value, cudaStream_t stream);

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w      x, out: [rows, dim]; w: [dim]
cudaError_t RmsNorm(const bf16* x, int64_t x_stride, const bf16* w, bf16* out,
                    int64_t out_stride, int64_t rows, int dim, float eps, cudaStream_t stream);
// residual[r, :] += x[r, :]; out[r, :] = rmsnorm(residual[r, :]) * w (the sum is rounded to bf16
// first, exactly as a separate Add then RmsNorm would).
cudaError_t AddRmsNorm(bf16* residual, int64_t res_stride, const bf16* x, int64_t x_stride,
                       const bf16* w, bf16* out, int64_t out_stride, int64_t rows, int dim,
                       float eps, cudaStream_t stream);

// a[r, c] += b[r, c]     a, b: [rows, cols]
cudaError_t Add(bf16* a, int64_t a_stride, const bf16* b, int64_t b_stride, int64_t rows,
                int64_t cols, cudaStream_t stream);

// out[r, j] = silu(x[r, j]) * x[r, j + half]      x: [rows, 2*half] (gate | up); out: [rows, half]
cudaError_t SwiGlu(const bf16* x, int64_t x_stride, bf16* out, int64_t out_stride, int64_t rows,
                   int64_t half, cudaStream_t stream);

// How row r's token is drawn (common/logits.h RowDraw has the same layout): the largest value
// when inv_temperature is 0, else the largest x * inv_temperature + g with the Gumbel noise
// g = -log(-log(u)) of u from the 23-bit counter-based hash of (seed, counter, column).
struct RowDraw {
  float inv_temperature;
  uint32_t reserved;
  uint64_t seed;
  uint64_t counter;
};

// out[r] = the token drawn from row r of x (the first index on ties), or -1 when the row holds
// a NaN or +Inf or is all -Inf: no token can be drawn from it (common/logits.h DrawToken is
// the host reference).   x: [rows, cols] with stride x_stride; draws: [rows] device, or null
// (every row greedy); out: [rows] device
cudaError_t DrawRows(const bf16* x, int64_t x_stride, int64_t rows, int64_t cols,
                     const RowDraw* draws, int32_t* out, cudaStream_t stream);

// dst[i, :] = src[idx[i], :]   (embedding lookup and row gather)
//   src: [*, cols] with stride src_stride; idx: [n] device; dst: [n, cols]
// Indices outside [0, src_rows) produce zero rows (callers validate on the host).
cudaError_t GatherRows(const bf16* src, int64_t src_stride, int64_t src_rows,
                       const int32_t* idx, bf16* dst, int64_t dst_stride, int64_t n,
                       int64_t cols, cudaStream_t stream);
// dst[idx[i], :] = src[i, :]   idx: [n] device; indices outside [0, dst_rows) are skipped.
cudaError_t ScatterRows(const bf16* src, int64_t src_stride, const int32_t* idx, bf16* dst,
                        int64_t dst_stride, int64_t dst_rows, int64_t n, int64_t cols,
                        cudaStream_t stream);

// dst[0, bytes) = src[0, bytes) where src is pinned host memory the device can read (UVA) and
// both are 16-byte aligned, bytes a multiple of 16: small host-to-device transfers done by SMs
// rather than a copy engine, so they never queue behind bulk copies on another stream.
cudaError_t CopyFromPinned(const void* src, void* dst, size_t bytes, cudaStream_t stream);

// out[r] = sum_j (a[r, j] - b[r, j])^2 for j < cols, in fp32 (the selector's KV deviation:
// only one float per row leaves the device).   a, b: [rows, cols] with their row strides.
cudaError_t RowSqDist(const bf16* a, int64_t a_stride, const bf16* b, int64_t b_stride,
                      int64_t rows, int64_t cols, float* out, cudaStream_t stream);

}  // namespace sparsex::kernels

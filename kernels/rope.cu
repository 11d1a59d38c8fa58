#include "kernels/ops.h"
#include "kernels/rope.h"

#include "kernels/common.cuh"

namespace sparsex::kernels {
namespace {

using detail::CeilDiv;
constexpr int kThreads = 256;

// RopeWriteKv takes 16-byte items (RopeWriteKvVecKernel) from this many rows: prefill sizes
// gain (H100: full prefill 32K 1136-1138 ms against 1145-1148), while a decode
// row's launch is latency-bound and one pair a thread is shorter (batch 1 at 8K: 6.26 ms a step
// with items against 6.17; batch 32 level).
constexpr int64_t kRopeItemMinRows = 64;

int GridFor(int64_t work) {
  const int64_t b = CeilDiv(work, kThreads);
  return static_cast<int>(b < 1 ? 1 : (b > 65535LL * 16 ? 65535LL * 16 : b));
}

// One thread per (row, head, pair). Reads src row i, writes dst row (slots ? slots[i] : i).
// In-place use passes src == dst and no slots.
__global__ void RopeKernel(const bf16* src, int64_t src_stride, bf16* dst, int64_t dst_stride,
                           int64_t dst_rows, const int32_t* slots, int64_t rows, int n_heads,
                           const int32_t* pos, const float* inv_freq, int head_dim,
                           bool halves) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int half = head_dim / 2;
  const int64_t per_row = static_cast<int64_t>(n_heads) * half;
  const int64_t total = rows * per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row;
    const int rem = static_cast<int>(t % per_row);
    const int h = rem / half, j = rem % half;
    const int64_t dr = slots ? slots[r] : r;
    if (dr < 0 || dr >= dst_rows) continue;
    const int i0 = h * head_dim + (halves ? j : 2 * j);
    const int i1 = i0 + (halves ? half : 1);
    const bf16* s = src + r * src_stride;
    bf16* d = dst + dr * dst_stride;
    detail::RotatePair(__bfloat162float(s[i0]), __bfloat162float(s[i1]),
                       static_cast<float>(pos[r]), inv_freq[j], d + i0, d + i1);
  }
}

// K and V rows to their pool slots in one launch, 16 bytes per thread step.
__global__ void WriteKvKernel(bf16* pk, bf16* pv, int64_t num_slots, int kv_dim, const bf16* ks,
                              int64_t k_stride, const bf16* vs, int64_t v_stride,
                              const int32_t* slots, int64_t n) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int64_t per_row = kv_dim / 8, half = n * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < 2 * half;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool is_v = i >= half;
    const int64_t j = is_v ? i - half : i;
    const int64_t r = j / per_row, c = (j % per_row) * 8;
    const int64_t d = slots[r];
    if (d < 0 || d >= num_slots) continue;
    const bf16* src = is_v ? vs + r * v_stride : ks + r * k_stride;
    bf16* dst = (is_v ? pv : pk) + d * kv_dim;
    *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
  }
}

// One thread per (row, rotated pair) of the Q and K heads, then per 16-byte chunk of V. A pair
// of a K head is stored both in place and in the pool, with the same rounded values.
__global__ void RopeWriteKvKernel(bf16* qkv, int64_t stride, int64_t rows, int n_heads,
                                  int n_kv_heads, const int32_t* pos, const int32_t* slots,
                                  bf16* pk, bf16* pv, int64_t num_slots, const float* inv_freq,
                                  int head_dim, bool halves, bool trigger_first) {
  if (trigger_first) detail::PdlLaunchDependents();
  detail::PdlWait();
  if (!trigger_first) detail::PdlLaunchDependents();
  const int half = head_dim / 2;
  const int kv_dim = n_kv_heads * head_dim;
  const int64_t n_pairs = static_cast<int64_t>(n_heads + n_kv_heads) * half;
  const int64_t per_row = n_pairs + kv_dim / 8;
  const int64_t total = rows * per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row;
    const int64_t rem = t % per_row;
    bf16* row = qkv + r * stride;
    const int64_t slot = slots[r];
    const bool store = slot >= 0 && slot < num_slots;
    if (rem < n_pairs) {
      const int h = static_cast<int>(rem / half), j = static_cast<int>(rem % half);
      const int i0 = h * head_dim + (halves ? j : 2 * j);
      const int i1 = i0 + (halves ? half : 1);
      bf16 y0, y1;
      detail::RotatePair(__bfloat162float(row[i0]), __bfloat162float(row[i1]),
                         static_cast<float>(pos[r]), inv_freq[j], &y0, &y1);
      row[i0] = y0;
      row[i1] = y1;
      if (h >= n_heads && store) {
        bf16* d = pk + slot * kv_dim - static_cast<int64_t>(n_heads) * head_dim;
        d[i0] = y0;
        d[i1] = y1;
      }
    } else if (store) {
      const int64_t c = (rem - n_pairs) * 8;
      *reinterpret_cast<uint4*>(pv + slot * kv_dim + c) = *reinterpret_cast<const uint4*>(
          row + static_cast<int64_t>(n_heads + n_kv_heads) * head_dim + c);
    }
  }
}

// One 16-byte item of a head: two 8-element chunks a and b holding 8 RoPE pairs, rotated in
// place by p * f[e] (f: the item's 8 frequencies). Halves layout: pair e is (a[e], b[e]), a from
// the head's first half, b the same columns of its second. Adjacent pairs: a's four pairs, then
// b's. The chunks' columns in a head for item q: halves 8 q and 8 q + head_dim / 2, adjacent
// 16 q and 16 q + 8 (ItemColumns adds the head's offset).
__device__ __forceinline__ void RotateItem(uint4& a, uint4& b, float p, const float* f,
                                           bool halves) {
  bf16* ea = reinterpret_cast<bf16*>(&a);
  bf16* eb = reinterpret_cast<bf16*>(&b);
  if (halves) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      detail::RotatePair(__bfloat162float(ea[e]), __bfloat162float(eb[e]), p, f[e], ea + e,
                         eb + e);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      bf16* x = e < 4 ? ea + 2 * e : eb + 2 * (e - 4);
      detail::RotatePair(__bfloat162float(x[0]), __bfloat162float(x[1]), p, f[e], x, x + 1);
    }
  }
}

// The two chunks' columns in a row for item q of head h (RotateItem's layouts).
__device__ __forceinline__ void ItemColumns(int h, int q, int head_dim, bool halves, int* c0,
                                            int* c1) {
  *c0 = h * head_dim + (halves ? 8 * q : 16 * q);
  *c1 = *c0 + (halves ? head_dim / 2 : 8);
}

// RopeWriteKvKernel on 16-byte items (head_dim a multiple of 16, at least kRopeItemMinRows
// rows): per row, (n_heads + n_kv_heads) * head_dim / 16 rotation items (RotateItem), then
// kv_dim / 8 V chunks. A K head's item is stored in place and to the pool with the same bits.
// Eight pairs a thread step instead of one, and 32-bit index arithmetic within a row: the
// per-pair kernel's 64-bit divisions and per-pair loads make it instruction-bound at prefill
// sizes (~1.2 ms a 32K layer in an H100 trace against ~0.3 at the copy rate).
__global__ void RopeWriteKvVecKernel(bf16* qkv, int64_t stride, int64_t rows, int n_heads,
                                     int n_kv_heads, const int32_t* pos, const int32_t* slots,
                                     bf16* pk, bf16* pv, int64_t num_slots,
                                     const float* inv_freq, int head_dim, bool halves,
                                     bool trigger_first) {
  if (trigger_first) detail::PdlLaunchDependents();
  detail::PdlWait();
  if (!trigger_first) detail::PdlLaunchDependents();
  const int kv_dim = n_kv_heads * head_dim;
  const int items_per_head = head_dim / 16;
  const int rot_items = (n_heads + n_kv_heads) * items_per_head;
  const int per_row = rot_items + kv_dim / 8;
  const int64_t total = rows * per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row;
    const int it = static_cast<int>(t - r * per_row);
    bf16* row = qkv + r * stride;
    const int64_t slot = slots[r];
    const bool store = slot >= 0 && slot < num_slots;
    if (it >= rot_items) {
      if (!store) continue;
      const int c = (it - rot_items) * 8;
      *reinterpret_cast<uint4*>(pv + slot * kv_dim + c) =
          *reinterpret_cast<const uint4*>(row + (n_heads + n_kv_heads) * head_dim + c);
      continue;
    }
    const int h = it / items_per_head, q = it - h * items_per_head;
    int c0, c1;
    ItemColumns(h, q, head_dim, halves, &c0, &c1);
    uint4 a = *reinterpret_cast<const uint4*>(row + c0);
    uint4 b = *reinterpret_cast<const uint4*>(row + c1);
    RotateItem(a, b, static_cast<float>(pos[r]), inv_freq + 8 * q, halves);
    *reinterpret_cast<uint4*>(row + c0) = a;
    *reinterpret_cast<uint4*>(row + c1) = b;
    if (h >= n_heads && store) {
      bf16* d = pk + slot * kv_dim - n_heads * head_dim;
      *reinterpret_cast<uint4*>(d + c0) = a;
      *reinterpret_cast<uint4*>(d + c1) = b;
    }
  }
}

// Reused KV assembly, 16 bytes per access: per row, kv_dim / 16 K items (a halves item: 8
// elements of a head's first half with their 8 partners in the second; an adjacent-pairs item:
// 16 consecutive elements, 8 pairs) rotated to pos[r], then kv_dim / 8 V chunks copied. The
// scalar RopeKernel + ScatterRows pair it replaces moved 2 bytes per access in two launches
// (H100: 18 + 14 us per 4064-row segment and layer at kv_dim 1024).
__global__ void AssembleKvKernel(const bf16* ks, int64_t k_stride, const bf16* vs,
                                 int64_t v_stride, const int32_t* pos, const int32_t* slots,
                                 int64_t n, bf16* pk, bf16* pv, int64_t num_slots, int kv_dim,
                                 const float* inv_freq, int head_dim, bool halves) {
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int k_items = kv_dim / 16, v_items = kv_dim / 8, per_row = k_items + v_items;
  const int items_per_head = head_dim / 16;
  const int64_t total = n * per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row;
    const int it = static_cast<int>(t % per_row);
    const int64_t slot = slots[r];
    if (slot < 0 || slot >= num_slots) continue;
    if (it >= k_items) {
      const int c = (it - k_items) * 8;
      *reinterpret_cast<uint4*>(pv + slot * kv_dim + c) =
          *reinterpret_cast<const uint4*>(vs + r * v_stride + c);
      continue;
    }
    const int h = it / items_per_head, q = it % items_per_head;
    int c0, c1;
    ItemColumns(h, q, head_dim, halves, &c0, &c1);
    const bf16* src = ks + r * k_stride;
    uint4 a = *reinterpret_cast<const uint4*>(src + c0);
    uint4 b = *reinterpret_cast<const uint4*>(src + c1);
    RotateItem(a, b, static_cast<float>(pos[r]), inv_freq + 8 * q, halves);
    bf16* dst = pk + slot * kv_dim;
    *reinterpret_cast<uint4*>(dst + c0) = a;
    *reinterpret_cast<uint4*>(dst + c1) = b;
  }
}

}  // namespace

cudaError_t RopeWriteKv(const KvPoolView& pool, bf16* qkv, int64_t qkv_stride, int64_t rows,
                        int n_heads, const int32_t* pos, const int32_t* slots,
                        const RopeArgs& rope, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rope.head_dim <= 0 || rope.head_dim % 2 != 0 || rope.inv_freq == nullptr ||
      pool.kv_dim % rope.head_dim != 0 || n_heads < 0)
    return cudaErrorInvalidValue;
  const int n_kv_heads = pool.kv_dim / rope.head_dim;
  const int64_t k_col = static_cast<int64_t>(n_heads) * rope.head_dim;
  const int64_t v_col = k_col + pool.kv_dim;
  if (pool.kv_dim % 8 != 0 || qkv_stride % 8 != 0 || !detail::Aligned16(qkv) ||
      !detail::Aligned16(pool.k) || !detail::Aligned16(pool.v)) {
    cudaError_t e = Rope(qkv, qkv_stride, rows, n_heads + n_kv_heads, pos, rope, stream);
    if (e != cudaSuccess) return e;
    return WriteKv(pool, qkv + k_col, qkv_stride, qkv + v_col, qkv_stride, slots, rows, stream);
  }
  if (rope.head_dim % 16 == 0 && rows >= kRopeItemMinRows) {
    const int64_t total =
        rows * (static_cast<int64_t>(n_heads + n_kv_heads) * (rope.head_dim / 16) +
                pool.kv_dim / 8);
    return detail::LaunchPdl(RopeWriteKvVecKernel, GridFor(total), kThreads, 0, stream, qkv,
                             qkv_stride, rows, n_heads, n_kv_heads, pos, slots, pool.k, pool.v,
                             pool.num_slots, rope.inv_freq, rope.head_dim, rope.halves,
                             rope.trigger_first);
  }
  const int64_t total =
      rows * (static_cast<int64_t>(n_heads + n_kv_heads) * (rope.head_dim / 2) + pool.kv_dim / 8);
  return detail::LaunchPdl(RopeWriteKvKernel, GridFor(total), kThreads, 0, stream, qkv,
                           qkv_stride, rows, n_heads, n_kv_heads, pos, slots, pool.k, pool.v,
                           pool.num_slots, rope.inv_freq, rope.head_dim, rope.halves,
                           rope.trigger_first);
}

cudaError_t Rope(bf16* x, int64_t x_stride, int64_t rows, int n_heads, const int32_t* pos,
                 const RopeArgs& rope, cudaStream_t stream) {
  if (rows <= 0 || n_heads <= 0) return cudaSuccess;
  if (rope.head_dim <= 0 || rope.head_dim % 2 != 0 || rope.inv_freq == nullptr)
    return cudaErrorInvalidValue;
  const int64_t total = rows * n_heads * (rope.head_dim / 2);
  return detail::LaunchPdl(RopeKernel, GridFor(total), kThreads, 0, stream, x, x_stride, x,
                           x_stride, rows, nullptr, rows, n_heads, pos, rope.inv_freq,
                           rope.head_dim, rope.halves);
}

cudaError_t WriteKv(const KvPoolView& pool, const bf16* k_src, int64_t k_stride,
                    const bf16* v_src, int64_t v_stride, const int32_t* slots, int64_t n,
                    cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (pool.kv_dim % 8 == 0 && k_stride % 8 == 0 && v_stride % 8 == 0 &&
      detail::Aligned16(k_src) && detail::Aligned16(v_src) && detail::Aligned16(pool.k) &&
      detail::Aligned16(pool.v)) {
    return detail::LaunchPdl(WriteKvKernel, GridFor(2 * n * (pool.kv_dim / 8)), kThreads, 0,
                             stream, pool.k, pool.v, pool.num_slots, pool.kv_dim, k_src, k_stride,
                             v_src, v_stride, slots, n);
  }
  cudaError_t e = ScatterRows(k_src, k_stride, slots, pool.k, pool.kv_dim, pool.num_slots, n,
                              pool.kv_dim, stream);
  if (e != cudaSuccess) return e;
  return ScatterRows(v_src, v_stride, slots, pool.v, pool.kv_dim, pool.num_slots, n, pool.kv_dim,
                     stream);
}

cudaError_t AssembleKv(const KvPoolView& pool, const bf16* k_pre, int64_t k_stride,
                       const bf16* v_pre, int64_t v_stride, const int32_t* pos,
                       const int32_t* slots, int64_t n, int n_kv_heads, const RopeArgs& rope,
                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (rope.head_dim <= 0 || rope.head_dim % 2 != 0 || rope.inv_freq == nullptr ||
      n_kv_heads * rope.head_dim != pool.kv_dim)
    return cudaErrorInvalidValue;
  if (rope.head_dim % 16 == 0 && k_stride % 8 == 0 && v_stride % 8 == 0 &&
      detail::Aligned16(k_pre) && detail::Aligned16(v_pre) && detail::Aligned16(pool.k) &&
      detail::Aligned16(pool.v)) {
    const int64_t total = n * (pool.kv_dim / 16 + pool.kv_dim / 8);
    return detail::LaunchPdl(AssembleKvKernel, GridFor(total), kThreads, 0, stream, k_pre,
                             k_stride, v_pre, v_stride, pos, slots, n, pool.k, pool.v,
                             pool.num_slots, pool.kv_dim, rope.inv_freq, rope.head_dim,
                             rope.halves);
  }
  const int64_t total = n * n_kv_heads * (rope.head_dim / 2);
  cudaError_t e = detail::LaunchPdl(RopeKernel, GridFor(total), kThreads, 0, stream, k_pre,
                                    k_stride, pool.k, pool.kv_dim, pool.num_slots, slots, n,
                                    n_kv_heads, pos, rope.inv_freq, rope.head_dim, rope.halves);
  if (e != cudaSuccess) return e;
  return ScatterRows(v_pre, v_stride, slots, pool.v, pool.kv_dim, pool.num_slots, n, pool.kv_dim,
                     stream);
}

}  // namespace sparsex::kernels

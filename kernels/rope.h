// Rotary position embedding and paged-KV writes.
//
// RoPE rotates pairs of a head's columns by angle pos * inv_freq[j]; inv_freq ([head_dim / 2],
// device, fp32) is precomputed on the host (gpu_worker/backend/rope.h, llama3 scaling included)
// so every backend rotates by identical angles. Pair layouts:
//   adjacent (GGUF, llama2.c): (x[2j], x[2j + 1]);   halves (HF Llama): (x[j], x[j + d/2]).
//
//   kernels::RopeArgs r{inv_freq_dev, 128, /*halves=*/true};
//   kernels::Rope(qkv, qkv_stride, n, 32, pos_dev, r, stream);              // Q heads in place
//   kernels::WriteKv(kv, k_src, k_stride, v_src, v_stride, slots_dev, n, stream);
//   kernels::RopeWriteKv(kv, qkv, qkv_stride, n, 32, pos_dev, slots_dev, r, stream);  // both
//   kernels::AssembleKv(kv, k_pre, v_pre, stride, pos_dev, slots_dev, n, 8, r, stream);
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sparsex::kernels {

using bf16 = __nv_bfloat16;

struct RopeArgs {
  const float* inv_freq = nullptr;  // [head_dim / 2] device
  int head_dim = 0;                 // even
  bool halves = false;              // false: adjacent pairs; true: halves
  // RopeWriteKv only: the kernel lets the next launch start before its own launch wait
  // (kernels/common.cuh), so a decode attention with PagedAttentionParams::decode_early_kv
  // requests its older keys while the qkv projection still runs. Only for a next kernel that
  // reads nothing before its own wait that the kernel before this one writes.
  bool trigger_first = false;
};

// Rotates n_heads heads of head_dim columns starting at x (a column window of a wider matrix
// with row stride x_stride) in place; row i at position pos[i] (device, [rows]).
cudaError_t Rope(bf16* x, int64_t x_stride, int64_t rows, int n_heads, const int32_t* pos,
                 const RopeArgs& rope, cudaStream_t stream);

// One layer's paged K and V pools.
struct KvPoolView {
  bf16* k = nullptr;      // [num_slots, kv_dim]
  bf16* v = nullptr;      // [num_slots, kv_dim]
  int64_t num_slots = 0;  // num_blocks * block_size
  int kv_dim = 0;         // n_kv_heads * head_dim (row stride of both pools)
};

// pool.k[slots[i]] = k_src[i, 0:kv_dim]; pool.v[slots[i]] = v_src[i, 0:kv_dim].
// k_src / v_src point at the first K / V column (e.g. inside a fused QKV matrix); slots: [n]
// device. Slots outside [0, num_slots) are skipped.
cudaError_t WriteKv(const KvPoolView& pool, const bf16* k_src, int64_t k_stride,
                    const bf16* v_src, int64_t v_stride, const int32_t* slots, int64_t n,
                    cudaStream_t stream);

// A layer's RoPE and KV write in one launch (decode runs ~10 kernels per layer, so each launch
// saved is ~3 us per layer): qkv [rows, (n_heads + 2 * kv_dim / head_dim) * head_dim] holds the
// Q heads, the K heads and V; the Q and K heads are rotated in place (row i at pos[i]) and the
// rotated K and V rows written to the pool at slots[i] (slots outside the pool skipped).
// Bit-identical to Rope over the Q and K heads then WriteKv. Needs 16-byte aligned rows
// (qkv_stride, kv_dim multiples of 8); otherwise it runs those two kernels. Prefill sizes (64
// rows or more, head_dim a multiple of 16) move 16 bytes a thread step; decode rows one pair.
cudaError_t RopeWriteKv(const KvPoolView& pool, bf16* qkv, int64_t qkv_stride, int64_t rows,
                        int n_heads, const int32_t* pos, const int32_t* slots,
                        const RopeArgs& rope, cudaStream_t stream);

// KV assembly for reused segments: K rows stored before RoPE are rotated to their new positions
// and written to the pool in one pass, V rows copied alongside.
//   k_pre, v_pre: [n, kv_dim] (row strides k_stride, v_stride); pos, slots: [n] device.
cudaError_t AssembleKv(const KvPoolView& pool, const bf16* k_pre, int64_t k_stride,
                       const bf16* v_pre, int64_t v_stride, const int32_t* pos,
                       const int32_t* slots, int64_t n, int n_kv_heads, const RopeArgs& rope,
                       cudaStream_t stream);

}  // namespace sparsex::kernels

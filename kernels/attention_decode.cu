#include "kernels/attention_decode.h"

#include <climits>
#include <cmath>

#include "kernels/common.cuh"

namespace sparsex::kernels {
namespace {

using detail::CeilDiv;
using detail::CpAsync16;
using detail::Ex2;
using detail::LdMatrixX4;
using detail::LdMatrixX4Trans;
using detail::MmaBf16;
using detail::PackBf16x2;
using detail::Swz;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -INFINITY;
constexpr int kRows = 16;  // one m16n8k16 tile of (query row, head) pairs per block

// Q tile + every warp's ST stages of BN keys (K and V). The merge after the loop reuses the
// stage area for the warps' fp32 partial outputs ([NW][kRows][HD]).
template <int HD, int NW, int BN, int ST>
constexpr int DecodeSmemBytes() {
  static_assert(NW * ST * 2 * BN * HD * 2 >= NW * kRows * HD * 4, "merge area");
  return (kRows * HD + NW * ST * 2 * BN * HD) * 2;
}

// Block (sequence x, KV head y, split z). M row m of the tile is query row m / G of the
// sequence, head kvh * G + m % G. Warp w takes key tiles t_begin + w, t_begin + w + NW, ...
template <int HD, int NW, int BN, int ST>
__global__ void __launch_bounds__(32 * NW)
    DecodeKernel(const PagedAttentionParams p, float* ws_o, float* ws_lse) {
  constexpr int CH = HD / 8;  // 16-byte chunks per row
  constexpr int kStage = 2 * BN * HD;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sKV = sQ + kRows * HD;
  __shared__ float s_m[NW][kRows], s_l[NW][kRows];
  // early_kv: the tiles of keys below every row's position are requested before the wait
  // (attention.h says why that is safe); everything else after it.
  const bool early = p.decode_early_kv != 0;
  if (!early) {
    detail::PdlWait();
    detail::PdlLaunchDependents();
  }

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = p.n_heads, G = p.n_heads / p.n_kv_heads;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int q0 = p.seq_rows[blockIdx.x];
  const int R = min(p.seq_rows[blockIdx.x + 1] - q0, kRows / G);
  const int ctx_len = p.seq_ctx_len[blockIdx.x];
  const int32_t* ctx_slots = p.ctx_slots + p.seq_ctx_start[blockIdx.x];

  // Keys [0, kv_end) are needed by some row; tiles past min_lim need the causal mask.
  int kv_end = 0, min_lim = INT_MAX;
  for (int r = 0; r < R; ++r) {
    const int lim = max(min(p.q_pos[q0 + r], ctx_len - 1), -1);
    kv_end = max(kv_end, lim + 1);
    min_lim = min(min_lim, lim);
  }
  const int g = lane >> 2, tq = lane & 3;  // this thread's M rows: g and g + 8
  int lim[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = g + 8 * i;
    lim[i] = m / G < R ? max(min(p.q_pos[q0 + m / G], ctx_len - 1), -1) : -1;
  }

  const int n_tiles = static_cast<int>(CeilDiv(kv_end, BN));
  int t_begin = 0, t_end = n_tiles;
  if (ws_o != nullptr) {  // this block's own key range divided over the splits
    const int per = static_cast<int>(CeilDiv(n_tiles, static_cast<int>(gridDim.z)));
    t_begin = split * per;
    t_end = min(n_tiles, t_begin + per);
  }
  const int first = t_begin + warp;
  const int my_n = first < t_end ? static_cast<int>(CeilDiv(t_end - first, NW)) : 0;
  bf16* wKV = sKV + warp * ST * kStage;
  // Lane l holds the pool slot of key row l % BN of a tile: one load per lane, shuffled to the
  // lanes that copy the row. The slots of a tile are loaded one loop step before its copies are
  // issued, so a copy never waits on its own slot load (a dependent global load per row).
  static_assert(BN <= 32, "one slot per lane");
  auto slot_of = [&](int tile) -> int {
    const int j = tile * BN + (lane % BN);
    return j < kv_end ? __ldg(ctx_slots + j) : 0;
  };
  auto load = [&](int stage, int tile, int sl) {
    bf16* dk = wKV + stage * kStage;
    bf16* dv = dk + BN * HD;
#pragma unroll
    for (int idx = lane; idx < BN * CH; idx += 32) {
      const int r = idx / CH, c = idx % CH;
      const int slot = __shfl_sync(0xffffffffu, sl, r);
      const bool valid = tile * BN + r < kv_end;
      const int64_t off = valid ? (int64_t)slot * p.kv_stride + kvh * HD + c * 8 : 0;
      CpAsync16(dk + Swz<HD>(r, c), p.k_pool + off, valid);
      CpAsync16(dv + Swz<HD>(r, c), p.v_pool + off, valid);
    }
  };
  int pre[ST];  // the slots of this warp's first ST tiles, requested before anything waits
#pragma unroll
  for (int s = 0; s < ST; ++s) pre[s] = s < my_n ? slot_of(first + s * NW) : 0;
  auto load_q = [&]() {
    for (int idx = tid; idx < kRows * CH; idx += 32 * NW) {
      const int m = idx / CH, c = idx % CH;
      const bool valid = m / G < R;
      const int64_t off =
          valid ? (int64_t)(q0 + m / G) * p.q_stride + (kvh * G + m % G) * HD + c * 8 : 0;
      CpAsync16(sQ + Swz<HD>(m, c), p.q + off, valid);
    }
  };
  if (early) {
    // Groups: the first ST - 1 tiles that hold only keys below min_lim (one group each, empty
    // for the others), then after the wait Q with the rest of them; all land before the loop,
    // whose group count then matches the path below.
    const auto safe = [&](int s) { return s < my_n && (first + s * NW + 1) * BN <= min_lim; };
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      if (safe(s)) load(s, first + s * NW, pre[s]);
      detail::CpAsyncCommit();
    }
    detail::PdlWait();
    detail::PdlLaunchDependents();
    load_q();
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      if (s < my_n && !safe(s)) load(s, first + s * NW, pre[s]);
    }
    detail::CpAsyncCommit();
    detail::CpAsyncWait<0>();
  } else {
    // Q and the first key tiles are requested together: the tiles do not wait for Q to land.
    load_q();
    detail::CpAsyncCommit();
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      if (s < my_n) load(s, first + s * NW, pre[s]);
      detail::CpAsyncCommit();  // empty groups keep the count the wait below relies on
    }
    detail::CpAsyncWait<ST - 1>();  // Q's group (the oldest) has landed
  }
  int next_slot = pre[ST - 1];  // the slots of the tile the loop's first step loads
  __syncthreads();
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks)
    LdMatrixX4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3],
               sQ + Swz<HD>(lane & 15, ks * 2 + (lane >> 4)));

  const float scale_log2 = p.scale * kLog2e;
  float o[HD / 8][4];
#pragma unroll
  for (int nd = 0; nd < HD / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  float row_m[2] = {kNegInf, kNegInf}, row_l[2] = {0.0f, 0.0f};

  for (int i = 0; i < my_n; ++i) {
    if (i + ST - 1 < my_n) load((i + ST - 1) % ST, first + (i + ST - 1) * NW, next_slot);
    detail::CpAsyncCommit();
    // The next step's slots, landing while this step computes.
    if (i + ST < my_n) next_slot = slot_of(first + (i + ST) * NW);
    detail::CpAsyncWait<ST - 1>();  // tile i has landed (this lane's copies) ...
    __syncwarp();                   // ... and every lane's
    const int t = first + i * NW;
    const bf16* tK = wKV + (i % ST) * kStage;
    const bf16* tV = tK + BN * HD;
    float s[BN / 8][4];
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
      for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
        uint32_t b0, b1, b2, b3;
        LdMatrixX4(b0, b1, b2, b3,
                   tK + Swz<HD>(nb2 * 16 + ((lane >> 4) << 3) + (lane & 7),
                                ks * 2 + ((lane >> 3) & 1)));
        MmaBf16(s[2 * nb2], qf[ks], b0, b1);
        MmaBf16(s[2 * nb2 + 1], qf[ks], b2, b3);
      }
    }
    const int key0 = t * BN + 2 * tq;
    const bool need_mask = t * BN + BN - 1 > min_lim;
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = s[nb][c] * scale_log2;
        if (need_mask && key0 + nb * 8 + (c & 1) > lim[c >> 1]) v = kNegInf;
        s[nb][c] = v;
      }
    }
    float corr[2];
    detail::OnlineSoftmaxStep(s, row_m, row_l, corr);
#pragma unroll
    for (int nd = 0; nd < HD / 8; ++nd) {
      o[nd][0] *= corr[0];
      o[nd][1] *= corr[0];
      o[nd][2] *= corr[1];
      o[nd][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = PackBf16x2(s[2 * kk][0], s[2 * kk][1]);
      a[1] = PackBf16x2(s[2 * kk][2], s[2 * kk][3]);
      a[2] = PackBf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = PackBf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int nd2 = 0; nd2 < HD / 16; ++nd2) {
        uint32_t b0, b1, b2, b3;
        LdMatrixX4Trans(b0, b1, b2, b3,
                        tV + Swz<HD>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                     nd2 * 2 + (lane >> 4)));
        MmaBf16(o[2 * nd2], a, b0, b1);
        MmaBf16(o[2 * nd2 + 1], a, b2, b3);
      }
    }
    __syncwarp();  // the stage is refilled by the next iteration's load
  }
  detail::CpAsyncWait<0>();

  // Merge the warps' partial states: max, rescaled sums and outputs through shared memory.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_l[i] += __shfl_xor_sync(0xffffffffu, row_l[i], 1);
    row_l[i] += __shfl_xor_sync(0xffffffffu, row_l[i], 2);
  }
  __syncthreads();  // every warp is done with its stages: the area becomes sO
  float* sO = reinterpret_cast<float*>(sKV);
  if (tq == 0) {
    s_m[warp][g] = row_m[0];
    s_l[warp][g] = row_l[0];
    s_m[warp][g + 8] = row_m[1];
    s_l[warp][g + 8] = row_l[1];
  }
#pragma unroll
  for (int nd = 0; nd < HD / 8; ++nd) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int m = g + 8 * (c >> 1);
      sO[(warp * kRows + m) * HD + nd * 8 + 2 * tq + (c & 1)] = o[nd][c];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kRows * HD; idx += 32 * NW) {
    const int m = idx / HD, d = idx % HD;
    if (m / G >= R) continue;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, s_m[w][m]);
    float l = 0.0f, acc = 0.0f;
    if (mx != kNegInf) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        if (s_m[w][m] == kNegInf) continue;
        const float f = Ex2(s_m[w][m] - mx);
        l += f * s_l[w][m];
        acc += f * sO[(w * kRows + m) * HD + d];
      }
    }
    const float v = l > 0.0f ? acc / l : 0.0f;
    const float lse = l > 0.0f ? mx + log2f(l) : kNegInf;
    const int qrow = q0 + m / G, head = kvh * G + m % G;
    const int64_t rh = (int64_t)qrow * H + head;
    if (ws_o != nullptr) {
      const int64_t base = (int64_t)split * p.num_q * H + rh;
      ws_o[base * HD + d] = v;
      if (d == 0) ws_lse[base] = lse;
    } else {
      p.out[(int64_t)qrow * p.out_stride + head * HD + d] = __float2bfloat16_rn(v);
      if (d == 0 && p.lse) p.lse[rh] = lse;
    }
  }
}

template <int HD, int NW, int BN, int ST>
cudaError_t Launch(const PagedAttentionParams& p, float* ws_o, float* ws_lse, int splits,
                   cudaStream_t stream) {
  constexpr int smem = DecodeSmemBytes<HD, NW, BN, ST>();
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(
        DecodeKernel<HD, NW, BN, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.n_kv_heads),
                  static_cast<unsigned>(splits));
  return detail::LaunchPdl(DecodeKernel<HD, NW, BN, ST>, grid, 32 * NW, smem, stream, p, ws_o,
                           ws_lse);
}

}  // namespace

bool DecodeAttentionSupports(const PagedAttentionParams& p) {
  if (p.num_seqs <= 0 || p.max_seq_rows <= 0 || p.decode_kernel == 1) return false;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  if (p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads) return false;
  return p.max_seq_rows * (p.n_heads / p.n_kv_heads) <= kRows;
}

// 16-key tiles, 3 stages, 4 warps: ~100 KB of shared memory at head_dim 128, so two blocks
// share an SM and each SM keeps up to 16 tiles (128 KB) of K/V in flight.
cudaError_t DecodeAttention(const PagedAttentionParams& p, float* ws_o, float* ws_lse,
                            int splits, cudaStream_t stream) {
  if (!DecodeAttentionSupports(p)) return cudaErrorInvalidValue;
  if (p.decode_kernel == 2) {
    return p.head_dim == 128 ? Launch<128, 4, 32, 3>(p, ws_o, ws_lse, splits, stream)
                             : Launch<64, 4, 32, 3>(p, ws_o, ws_lse, splits, stream);
  }
  return p.head_dim == 128 ? Launch<128, 4, 16, 3>(p, ws_o, ws_lse, splits, stream)
                           : Launch<64, 4, 16, 3>(p, ws_o, ws_lse, splits, stream);
}

}  // namespace sparsex::kernels

#include "kernels/attention.h"

#include "kernels/attention_decode.h"
#include "kernels/attention_sm90.h"

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

// ---------------------------------------------------------------------------------------------
// Tensor-core path (head_dim 64 / 128).
//
// A block owns one KV head and a tile of QT = 64 / G query rows, where G = n_heads / n_kv_heads:
// its 64 "M rows" are the (head-in-group, query row) pairs m -> (m / QT, m % QT), so the G query
// heads of a group share each K/V tile. 4 warps, each 16 M rows; key tiles of 64 double-buffered
// with cp.async; shared tiles are XOR-swizzled by 16-byte chunk (chunk ^ (row & 7)) so ldmatrix
// reads are bank-conflict free.
// ---------------------------------------------------------------------------------------------
// Auto choice (impl 0) on sm_90a: whether to use the wgmma kernel, and which variant
// (docs/perf-notes.md has the measurements behind it).
constexpr bool kDefaultSm90 = true;
// The warp-specialised variant: 21.1 against 25.0 ms for a 32K causal layer, 3.39 against 4.02
// for 15% sparse rows (H100); on 128-key tiles 18.6 against 20.1 ms and 3.07 against 3.41
// (H100).
constexpr bool kDefaultWarpSpecialized = true;
constexpr int kBN = 64;       // keys per step
static_assert(kBN == kStatsTileKeys, "AttentionStatsParams::tile_groups counts key steps");
constexpr int kMaxGroup = 64;  // G must divide 16 * warps for every block size
// Split-K partials per row at most; the combine keeps their weights in shared memory, one per
// thread (head_dim >= 64 threads).
constexpr int kMaxSplits = 64;


// K/V stages of FlashKernel: two for attention; four K tiles for the statistics pass, which has
// no V to load. Four were tried for its complement form's ~98 TFLOP/s of Q K^T and measured no
// faster (9.58 against 9.71 ms, H100): it is bound by instruction latency at 2 warps
// per scheduler, not by its loads (docs/perf-notes.md); kept, as the smem was unused.
template <bool STATS>
constexpr int FlashStages() {
  return STATS ? 4 : 2;
}
template <int HD, bool STATS, int NW>
constexpr int FlashSmemBytes() {
  // Q tile (16 * NW rows) + the K stages (+ as many V stages).
  return (16 * NW * HD + FlashStages<STATS>() * kBN * HD * (STATS ? 1 : 2)) * 2;
}

struct FlashExtra {
  int group = 1;            // G: query heads per KV head
  int qt = 64;              // query rows per block (16 * warps / G)
  float* ws_o = nullptr;    // [splits, num_q, n_heads, HD] fp32, split mode only
  float* ws_lse = nullptr;  // [splits, num_q, n_heads]
  // Statistics by complement with AttentionStatsParams::recv_rows_*: x-blocks [0, recv_blocks)
  // take the received attention of the query tiles from row recv_q0 on, recv_parts blocks per
  // tile, each over its part of the keys; the other x-blocks take the cross mass only.
  int recv_blocks = 0;
  int recv_parts = 1;
  int recv_q0 = 0;
};

// The statistics pass is bound by instruction latency with one 8-warp block per SM (141
// registers, 2 warps per scheduler, per Nsight Compute): it is held to 128 registers so that two
// blocks share an SM (2 x 98 KB of shared memory fit).
template <int HD, bool STATS, int NW>
__global__ void __launch_bounds__(32 * NW, NW == 4 || STATS ? 2 : 1)
    FlashKernel(const PagedAttentionParams p, const AttentionStatsParams st, const FlashExtra ex) {
  constexpr int kBM = 16 * NW;       // M rows (query row x head-in-group) per block
  constexpr int kThreads = 32 * NW;
  constexpr int CH = HD / 8;  // 16-byte chunks per row
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  constexpr int NS = FlashStages<STATS>();
  bf16* sK = sQ + kBM * HD;                // [NS][kBN * HD]
  bf16* sV = sK + NS * kBN * HD;           // [NS][kBN * HD] (none in STATS)
  __shared__ int s_lim[kBM];
  __shared__ int s_max_lim, s_min_lim;
  __shared__ int s_qg_lo, s_qg_hi;  // complement statistics: the segments of the block's rows
  detail::PdlWait();
  detail::PdlLaunchDependents();

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = ex.group, QT = ex.qt;
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  // Rows [q0, q_end) of this block and their keys: one query tile of the sequence, or (batched
  // sequences) block x is sequence x with its own context.
  int q0, q_end = p.num_q, ctx_len = p.ctx_len;
  const int32_t* ctx_slots = p.ctx_slots;
  const int recv_part = static_cast<int>(blockIdx.x) < ex.recv_blocks
                            ? static_cast<int>(blockIdx.x) % ex.recv_parts
                            : -1;  // >= 0: a received-attention block (statistics only)
  if (recv_part >= 0) {
    q0 = ex.recv_q0 + static_cast<int>(blockIdx.x) / ex.recv_parts * QT;
  } else if (p.num_seqs > 0) {
    const int sq = blockIdx.x;
    q0 = p.seq_rows[sq];
    q_end = min(p.seq_rows[sq + 1], q0 + QT);
    ctx_len = p.seq_ctx_len[sq];
    ctx_slots = p.ctx_slots + p.seq_ctx_start[sq];
  } else {
    q0 = (gridDim.x - 1 - blockIdx.x) * QT;  // heavy (late) tiles first
  }
  const int H = p.n_heads;

  if (tid == 0) {
    s_max_lim = -1;
    s_min_lim = 0x7fffffff;
    s_qg_lo = 0x7fffffff;
    s_qg_hi = -1;
  }
  __syncthreads();
  bool has_weight = false;
  // With split received attention (ex.recv_blocks), the other blocks take the cross mass only.
  const bool take_recv = ex.recv_blocks == 0 || recv_part >= 0;
  const bool take_cross = recv_part < 0;
  for (int m = tid; m < kBM; m += kThreads) {
    const int qrow = q0 + m % QT;
    int lim = -1;
    if (qrow < q_end) {
      lim = min(p.q_pos[qrow], ctx_len - 1);
      if (lim < 0) lim = -1;
      if constexpr (STATS) {
        if (take_recv && st.recv_weight && st.out_recv && st.recv_weight[qrow] > 0.0f)
          has_weight = true;
        if (st.cross_complement && lim >= 0) {
          const int gq = st.q_group[qrow];
          if (gq >= 0) {
            atomicMin(&s_qg_lo, gq);
            atomicMax(&s_qg_hi, gq);
          }
        }
      }
    }
    s_lim[m] = lim;
    // The minimum includes rows without keys (-1) so that tiles are masked for them.
    atomicMin(&s_min_lim, lim);
    if (lim >= 0) atomicMax(&s_max_lim, lim);
  }
  if constexpr (STATS) {
    has_weight = __syncthreads_or(has_weight);
    // Only received attention asked for (the cross mass was fused into the attention pass):
    // blocks without weighted rows have nothing to add.
    if (!has_weight && !(take_cross && st.out_cross && st.key_group && st.q_group)) return;
  } else {
    __syncthreads();
  }
  const int kv_end = s_max_lim + 1;  // keys [0, kv_end) are needed by some row
  const int min_lim = s_min_lim;
  const int n_tiles = static_cast<int>(CeilDiv(kv_end, kBN));
  // The block's own key range (not the launch's planned maximum) is divided over the split-K
  // splits (ws_o) or a received-attention block's parts: balanced for sequences of any length
  // in one launch, and a launch planned for a bucket of lengths (a replayed decode graph) loses
  // nothing to empty splits.
  const int parts = ex.ws_o != nullptr ? static_cast<int>(gridDim.z)
                    : recv_part >= 0   ? ex.recv_parts
                                       : 1;
  const int part = ex.ws_o != nullptr ? split : recv_part >= 0 ? recv_part : 0;
  const int per = static_cast<int>(CeilDiv(n_tiles, parts));
  const int t_begin = part * per, t_end = min(n_tiles, t_begin + per);

  // Complement statistics of a block without recv weight: only the key tiles that hold keys of
  // its rows' own segments or shared keys (tile_groups: each tile's segment range; shared keys
  // make it (INT32_MIN, INT32_MAX)). Rows of no segment (q_group < 0) need the shared tiles only.
  bool skip_tiles = false;
  if constexpr (STATS) skip_tiles = st.cross_complement && st.tile_groups != nullptr && !has_weight;
  const int qg_lo = s_qg_lo, qg_hi = s_qg_hi;
  // Block-uniform: every warp walks the same tiles.
  auto next_tile = [&](int t) {
    return skip_tiles ? detail::NextGroupTile(st.tile_groups, t + 1, t_end, qg_lo, qg_hi, lane)
                      : t + 1;
  };
  const int t_first = next_tile(t_begin - 1);

  // Rows owned by this thread inside its warp's 16: g and g + 8.
  const int g = lane >> 2, tq = lane & 3;
  const int mr[2] = {warp * 16 + g, warp * 16 + g + 8};
  const int lim[2] = {s_lim[mr[0]], s_lim[mr[1]]};
  int qrow[2], head[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    qrow[i] = q0 + mr[i] % QT;
    head[i] = kvh * G + mr[i] / QT;
  }
  const float scale_log2 = p.scale * kLog2e;
  const bool warp_active = __any_sync(0xffffffffu, lim[0] >= 0 || lim[1] >= 0);

  auto load_kv = [&](int buf, int tile) {
    bf16* dk = sK + buf * kBN * HD;
    bf16* dv = sV + buf * kBN * HD;
    for (int idx = tid; idx < kBN * CH; idx += kThreads) {
      const int r = idx / CH, c = idx % CH;
      const int j = tile * kBN + r;
      const bool valid = j < kv_end;
      const int64_t slot = valid ? ctx_slots[j] : 0;
      const int64_t off = slot * p.kv_stride + kvh * HD + c * 8;
      CpAsync16(dk + Swz<HD>(r, c), p.k_pool + (valid ? off : 0), valid);
      if constexpr (!STATS) CpAsync16(dv + Swz<HD>(r, c), p.v_pool + (valid ? off : 0), valid);
    }
  };

  // Q tile (group 0 together with the first K/V tile).
  for (int idx = tid; idx < kBM * CH; idx += kThreads) {
    const int m = idx / CH, c = idx % CH;
    const int qr = q0 + m % QT;
    const int hh = kvh * G + m / QT;
    const bool valid = qr < q_end;
    const int64_t off = valid ? (int64_t)qr * p.q_stride + hh * HD + c * 8 : 0;
    CpAsync16(sQ + Swz<HD>(m, c), p.q + off, valid);
  }
  detail::CpAsyncCommit();
  uint32_t qf[HD / 16][4];  // this warp's 16 Q rows as mma A fragments, loaded once

  float o[STATS ? 1 : HD / 8][4];
  float row_m[2] = {kNegInf, kNegInf}, row_l[2] = {0.0f, 0.0f};
  if constexpr (!STATS) {
#pragma unroll
    for (int nd = 0; nd < HD / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  }
  // STATS state; cross[] and qg[] also serve the fused cross mass (p.out_cross).
  float lse_row[2] = {0.0f, 0.0f}, w_row[2] = {0.0f, 0.0f}, cross[2] = {0.0f, 0.0f};
  int qg[2] = {0, 0};
  const bool fused_cross = !STATS && p.out_cross != nullptr;
  if (fused_cross) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (lim[i] >= 0) qg[i] = p.q_group[qrow[i]];
  }
  if constexpr (STATS) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (lim[i] >= 0) {
        lse_row[i] = st.lse_by_head != nullptr
                         ? st.lse_by_head[(int64_t)head[i] * p.num_q + qrow[i]] * kLog2e
                         : p.lse[(int64_t)qrow[i] * H + head[i]];
        if (st.q_group) qg[i] = st.q_group[qrow[i]];
        if (st.recv_weight) w_row[i] = fmaxf(st.recv_weight[qrow[i]], 0.0f);
      }
    }
  }

  // NS - 1 tiles in flight ahead of the one computed; t_load walks the same tile sequence
  // (tiles may be skipped) ahead of t.
  int t_load = t_first;
#pragma unroll
  for (int b = 0; b < NS - 1; ++b) {
    if (t_load < t_end) {
      load_kv(b, t_load);
      t_load = next_tile(t_load);
    }
    detail::CpAsyncCommit();
  }

  int it = 0;  // iterations so far: the stage of this tile is it % NS
  for (int t = t_first; t < t_end; t = next_tile(t), ++it) {
    const int buf = it % NS;
    // Into the stage the previous iteration computed on (free after its closing barrier).
    if (t_load < t_end) {
      load_kv((it + NS - 1) % NS, t_load);
      t_load = next_tile(t_load);
    }
    detail::CpAsyncCommit();
    detail::CpAsyncWait<NS - 1>();  // this tile's group has landed
    __syncthreads();
    // A warp whose 16 rows are all empty (short query tiles; decode, where a sequence has one
    // row per head) only helps load.
    if (!warp_active) {
      __syncthreads();
      continue;
    }

    if (it == 0) {
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks)
        LdMatrixX4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3],
                   sQ + Swz<HD>(warp * 16 + (lane & 15), ks * 2 + (lane >> 4)));
    }
    // STATS: a tile of one segment (tile_groups lo == hi: most tiles of a segmented prompt)
    // needs no per-key segment load; read before the MMAs so its latency hides behind them.
    int tile_kg = -1;
    bool tile_uniform = false;
    if constexpr (STATS) {
      if (st.tile_groups != nullptr && st.key_group != nullptr) {
        const int lo = st.tile_groups[2 * t], hi = st.tile_groups[2 * t + 1];
        tile_uniform = lo == hi;
        tile_kg = lo;
      }
    }
    const bf16* tK = sK + buf * kBN * HD;
    float s[kBN / 8][4];
#pragma unroll
    for (int nb = 0; nb < kBN / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
      for (int nb2 = 0; nb2 < kBN / 16; ++nb2) {
        uint32_t b0, b1, b2, b3;
        LdMatrixX4(b0, b1, b2, b3,
                   tK + Swz<HD>(nb2 * 16 + ((lane >> 4) << 3) + (lane & 7),
                                ks * 2 + ((lane >> 3) & 1)));
        MmaBf16(s[2 * nb2], qf[ks], b0, b1);
        MmaBf16(s[2 * nb2 + 1], qf[ks], b2, b3);
      }
    }

    // Causal mask by each row's own limit, as a block-uniform branch taken only by tiles past
    // some row's limit (a per-score predicate cost three instructions a score on every tile);
    // the scale (log2 domain) rides in the exponent's FFMA (STATS) or is applied below.
    const int key0 = t * kBN + 2 * tq;
    if ((t * kBN + kBN - 1) > min_lim) {
#pragma unroll
      for (int nb = 0; nb < kBN / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (key0 + nb * 8 + (c & 1) > lim[c >> 1]) s[nb][c] = kNegInf;
        }
      }
    }

    if constexpr (STATS) {
      float colsum[kBN / 8][2];
#pragma unroll
      for (int nb = 0; nb < kBN / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + nb * 8 + e;
          // Keys past ctx_len in a uniform tile are masked (p = 0): their group adds nothing.
          const int kg = tile_uniform                    ? tile_kg
                         : (key < ctx_len && st.key_group) ? st.key_group[key]
                                                           : -1;
          const float p0 = Ex2(fmaf(s[nb][e], scale_log2, -lse_row[0]));
          const float p1 = Ex2(fmaf(s[nb][2 + e], scale_log2, -lse_row[1]));
          if (st.cross_complement) {  // own segment and shared keys; the cross mass is the rest
            if (kg < 0 || kg == qg[0]) cross[0] += p0;
            if (kg < 0 || kg == qg[1]) cross[1] += p1;
          } else if (kg >= 0) {
            if (kg != qg[0]) cross[0] += p0;
            if (kg != qg[1]) cross[1] += p1;
          }
          colsum[nb][e] = w_row[0] * p0 + w_row[1] * p1;
        }
      }
      if (has_weight) {
#pragma unroll
        for (int nb = 0; nb < kBN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = colsum[nb][e];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            const int key = key0 + nb * 8 + e;
            if (g == 0 && v != 0.0f && key < ctx_len)
              atomicAdd(st.out_recv + key, v / static_cast<float>(H));
          }
        }
      }
    } else {
#pragma unroll
      for (int nb = 0; nb < kBN / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nb][c] *= scale_log2;
      }
      float corr[2];
      detail::OnlineSoftmaxStep(s, row_m, row_l, corr);
      cross[0] *= corr[0];
      cross[1] *= corr[1];
      if (fused_cross) detail::AccumulateCross(s, key0, p.key_group, ctx_len, qg, cross);
#pragma unroll
      for (int nd = 0; nd < HD / 8; ++nd) {
        o[nd][0] *= corr[0];
        o[nd][1] *= corr[0];
        o[nd][2] *= corr[1];
        o[nd][3] *= corr[1];
      }
      const bf16* tV = sV + buf * kBN * HD;
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
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
    }
    __syncthreads();
  }
  detail::CpAsyncWait<0>();

  if constexpr (STATS) {
    if (take_cross && st.out_cross && st.key_group && st.q_group) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float v = cross[i];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (st.cross_complement) v = fminf(fmaxf(1.0f - v, 0.0f), 1.0f);
        if (tq == 0 && lim[i] >= 0 && v != 0.0f)
          atomicAdd(st.out_cross + qrow[i], v / static_cast<float>(H));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_l[i] += __shfl_xor_sync(0xffffffffu, row_l[i], 1);
      row_l[i] += __shfl_xor_sync(0xffffffffu, row_l[i], 2);
    }
    if (fused_cross) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
        detail::FlushCross(cross[i], row_l[i], tq == 0 && lim[i] >= 0,
                           p.out_cross + (lim[i] >= 0 ? qrow[i] : 0), H);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (qrow[i] >= q_end) continue;
      const float inv = row_l[i] > 0.0f ? 1.0f / row_l[i] : 0.0f;
      const float lse = row_l[i] > 0.0f ? row_m[i] + log2f(row_l[i]) : kNegInf;
      const int64_t rh = (int64_t)qrow[i] * H + head[i];
      if (ex.ws_o != nullptr) {
        const int64_t base = (int64_t)split * p.num_q * H + rh;
        float* wo = ex.ws_o + base * HD;
#pragma unroll
        for (int nd = 0; nd < HD / 8; ++nd) {
          *reinterpret_cast<float2*>(wo + nd * 8 + 2 * tq) =
              make_float2(o[nd][2 * i] * inv, o[nd][2 * i + 1] * inv);
        }
        if (tq == 0) ex.ws_lse[base] = lse;
      } else {
        bf16* orow = p.out + (int64_t)qrow[i] * p.out_stride + head[i] * HD;
#pragma unroll
        for (int nd = 0; nd < HD / 8; ++nd) {
          *reinterpret_cast<uint32_t*>(orow + nd * 8 + 2 * tq) =
              PackBf16x2(o[nd][2 * i] * inv, o[nd][2 * i + 1] * inv);
        }
        if (tq == 0 && p.lse) p.lse[rh] = lse;
      }
    }
  }
}

// Merges split-K partials: one block of head_dim threads per (query row, head). Every split's
// output of this thread's column is requested at once, before the weights are known (one load
// round trip instead of one per 8 splits), and the splits' maximum is a shuffle reduction: at
// decode batch 1 this kernel sits between the attention and the o projection on every layer.
// The sum runs over the splits in order with the arithmetic of the first version (a split's
// weight exp2f(lse - max), 0 for an empty split): bit-identical results.
__global__ void CombineKernel(const PagedAttentionParams p, const float* ws_o,
                              const float* ws_lse, int splits) {
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_m[32];
  detail::PdlWait();
  detail::PdlLaunchDependents();
  const int64_t rh = blockIdx.x;  // qrow * H + head
  const int qrow = static_cast<int>(rh / p.n_heads), head = static_cast<int>(rh % p.n_heads);
  const int d = threadIdx.x, lane = d & 31, warp = d >> 5;
  const int64_t stride = (int64_t)p.num_q * p.n_heads;
  float ov[kMaxSplits];
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    ov[s] = s < splits ? ws_o[(s * stride + rh) * p.head_dim + d] : 0.0f;
  }
  float m = kNegInf;
  for (int s = d; s < splits; s += blockDim.x) {
    const float l = ws_lse[s * stride + rh];
    s_w[s] = l;
    m = fmaxf(m, l);
  }
  float mx = kNegInf;
  if (blockDim.x % 32 == 0) {  // whole warps (head_dim 64, 128): a shuffle reduction
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) s_m[warp] = m;
    __syncthreads();
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) mx = fmaxf(mx, s_m[w]);
  } else {  // a partial warp (small head_dim): over the splits one by one
    __syncthreads();
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, s_w[s]);
  }
  __syncthreads();  // every thread has read the log-sum-exps before they become weights
  // Thread s turns split s's log-sum-exp into its weight (0: empty split, never read).
  for (int s = d; s < splits; s += blockDim.x) {
    const float l = s_w[s];
    s_w[s] = (mx == kNegInf || l == kNegInf) ? 0.0f : exp2f(l - mx);
  }
  __syncthreads();
  float acc = 0.0f, wsum = 0.0f;
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s >= splits) break;
    const float w = s_w[s];
    if (w != 0.0f) {
      wsum += w;
      acc += w * ov[s];
    }
  }
  const float v = wsum > 0.0f ? acc / wsum : 0.0f;
  p.out[(int64_t)qrow * p.out_stride + head * p.head_dim + d] = __float2bfloat16_rn(v);
  if (d == 0 && p.lse) p.lse[rh] = wsum > 0.0f ? mx + log2f(wsum) : kNegInf;
}

// ---------------------------------------------------------------------------------------------
// Generic path (head_dim <= 64): one warp per (query row, head), lanes split the keys, fp32.
// ---------------------------------------------------------------------------------------------
template <int MAXD>
__global__ void GenericAttentionKernel(const PagedAttentionParams p) {
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= (int64_t)p.num_q * p.n_heads) return;
  const int qrow = static_cast<int>(w / p.n_heads), head = static_cast<int>(w % p.n_heads);
  const int kvh = head / (p.n_heads / p.n_kv_heads);
  const int hd = p.head_dim;
  const int lim = min(p.q_pos[qrow], p.ctx_len - 1);
  const float scale_log2 = p.scale * kLog2e;
  float q[MAXD], o[MAXD];
  const bf16* qp = p.q + (int64_t)qrow * p.q_stride + head * hd;
#pragma unroll
  for (int d = 0; d < MAXD; ++d) {
    q[d] = d < hd ? __bfloat162float(qp[d]) * scale_log2 : 0.0f;
    o[d] = 0.0f;
  }
  float m = kNegInf, l = 0.0f, x = 0.0f;  // x: fused cross mass (p.out_cross)
  const int qg = p.out_cross ? p.q_group[qrow] : 0;
  for (int j = lane; j <= lim; j += 32) {
    const int64_t off = (int64_t)p.ctx_slots[j] * p.kv_stride + kvh * hd;
    const bf16* kp = p.k_pool + off;
    const bf16* vp = p.v_pool + off;
    float sc = 0.0f;
#pragma unroll
    for (int d = 0; d < MAXD; ++d)
      if (d < hd) sc += q[d] * __bfloat162float(kp[d]);
    const float m_new = fmaxf(m, sc);
    const float corr = exp2f(m - m_new);
    const float pr = exp2f(sc - m_new);
    l = l * corr + pr;
    if (p.out_cross) {
      const int kg = p.key_group[j];
      x = x * corr + (kg >= 0 && kg != qg ? pr : 0.0f);
    }
#pragma unroll
    for (int d = 0; d < MAXD; ++d)
      if (d < hd) o[d] = o[d] * corr + pr * __bfloat162float(vp[d]);
    m = m_new;
  }
  const float M = detail::WarpMax(m);
  const float f = (m == kNegInf) ? 0.0f : exp2f(m - M);
  l = detail::WarpSum(l * f);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  if (p.out_cross) {
    x = detail::WarpSum(x * f);
    if (lane == 0 && x != 0.0f) atomicAdd(p.out_cross + qrow, x * inv / p.n_heads);
  }
  bf16* op = p.out + (int64_t)qrow * p.out_stride + head * hd;
#pragma unroll
  for (int d = 0; d < MAXD; ++d) {
    const float v = detail::WarpSum(o[d] * f);
    if (d < hd && (d & 31) == lane) op[d] = __float2bfloat16_rn(v * inv);
  }
  if (lane == 0 && p.lse) p.lse[w] = l > 0.0f ? M + log2f(l) : kNegInf;
}

template <int MAXD>
__global__ void GenericStatsKernel(const PagedAttentionParams p, const AttentionStatsParams st) {
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= (int64_t)p.num_q * p.n_heads) return;
  const int qrow = static_cast<int>(w / p.n_heads), head = static_cast<int>(w % p.n_heads);
  const int kvh = head / (p.n_heads / p.n_kv_heads);
  const int hd = p.head_dim;
  const int lim = min(p.q_pos[qrow], p.ctx_len - 1);
  if (lim < 0) return;
  const float scale_log2 = p.scale * kLog2e;
  const float lse = p.lse[w];
  const bool do_cross = st.out_cross && st.key_group && st.q_group;
  const int qg = st.q_group ? st.q_group[qrow] : 0;
  const float wr = (st.recv_weight && st.out_recv) ? st.recv_weight[qrow] : 0.0f;
  if (!do_cross && !(wr > 0.0f)) return;
  float q[MAXD];
  const bf16* qp = p.q + (int64_t)qrow * p.q_stride + head * hd;
#pragma unroll
  for (int d = 0; d < MAXD; ++d) q[d] = d < hd ? __bfloat162float(qp[d]) * scale_log2 : 0.0f;
  const float inv_h = 1.0f / static_cast<float>(p.n_heads);
  float cross = 0.0f;
  for (int j = lane; j <= lim; j += 32) {
    const bf16* kp = p.k_pool + (int64_t)p.ctx_slots[j] * p.kv_stride + kvh * hd;
    float sc = 0.0f;
#pragma unroll
    for (int d = 0; d < MAXD; ++d)
      if (d < hd) sc += q[d] * __bfloat162float(kp[d]);
    const float pr = exp2f(sc - lse);
    if (do_cross) {
      const int kg = st.key_group[j];
      if (kg >= 0 && kg != qg) cross += pr;
    }
    if (wr > 0.0f) atomicAdd(st.out_recv + j, wr * pr * inv_h);
  }
  if (do_cross) {
    cross = detail::WarpSum(cross);
    if (lane == 0 && cross != 0.0f) atomicAdd(st.out_cross + qrow, cross * inv_h);
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch.
// ---------------------------------------------------------------------------------------------
int Warps(const PagedAttentionParams& p) { return p.warps == 4 ? 4 : 8; }

bool TensorCorePath(const PagedAttentionParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  const int G = p.n_heads / p.n_kv_heads;
  if (kMaxGroup % G != 0) return false;
  if (p.q_stride % 8 || p.kv_stride % 8 || !detail::Aligned16(p.q) ||
      !detail::Aligned16(p.k_pool) || !detail::Aligned16(p.v_pool))
    return false;
  return true;
}

int NumSms() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
  return sms > 0 ? sms : 132;
}

struct SplitPlan {
  int splits = 1;
  int tiles_per_split = 0;
};

SplitPlan PlanSplits(const PagedAttentionParams& p) {
  SplitPlan plan;
  if (!TensorCorePath(p) || p.out_cross != nullptr) return plan;
  const int G = p.n_heads / p.n_kv_heads;
  const int64_t blocks =
      (p.num_seqs > 0 ? p.num_seqs : CeilDiv(p.num_q, 16 * Warps(p) / G)) * p.n_kv_heads;
  const int tiles = static_cast<int>(CeilDiv(p.num_seqs > 0 ? p.max_seq_ctx : p.ctx_len, kBN));
  const int sms = NumSms();
  if (blocks >= sms || tiles < 4) return plan;
  // About two blocks per SM for the smallest launches (decode batch 1-2: 8-16 KV-head blocks),
  // one from 32 blocks: on the H200 at 8K context, batch 4 took 6.45 vs 6.73 ms per step and
  // batch 8 7.88 vs 8.46 with one wave, batch 2 5.55 vs 5.81 with two (docs/perf-notes.md v9).
  const int waves = p.split_waves > 0 ? p.split_waves : blocks <= 16 ? 2 : 1;
  int want = static_cast<int>(CeilDiv(static_cast<int64_t>(waves) * sms, blocks));
  want = want > kMaxSplits ? kMaxSplits : want;
  want = want > tiles / 2 ? tiles / 2 : want;
  if (want <= 1) return plan;
  plan.tiles_per_split = static_cast<int>(CeilDiv(tiles, want));
  plan.splits = static_cast<int>(CeilDiv(tiles, plan.tiles_per_split));
  return plan;
}

template <int HD, bool STATS, int NW>
cudaError_t LaunchFlashNW(const PagedAttentionParams& p, const AttentionStatsParams& st,
                          FlashExtra ex, int splits, cudaStream_t stream) {
  constexpr int smem = FlashSmemBytes<HD, STATS, NW>();
  static bool configured = false;
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(FlashKernel<HD, STATS, NW>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const int G = p.n_heads / p.n_kv_heads;
  ex.group = G;
  ex.qt = 16 * NW / G;
  const unsigned tiles_x = static_cast<unsigned>(
      (p.num_seqs > 0 ? p.num_seqs : CeilDiv(p.num_q, ex.qt)) + ex.recv_blocks);
  const dim3 grid(tiles_x, p.n_kv_heads, splits);
  return detail::LaunchPdl(FlashKernel<HD, STATS, NW>, grid, 32 * NW, smem, stream, p, st, ex);
}

template <int HD, bool STATS>
cudaError_t LaunchFlash(const PagedAttentionParams& p, const AttentionStatsParams& st,
                        FlashExtra ex, int splits, cudaStream_t stream) {
  return Warps(p) == 4 ? LaunchFlashNW<HD, STATS, 4>(p, st, ex, splits, stream)
                       : LaunchFlashNW<HD, STATS, 8>(p, st, ex, splits, stream);
}

bool ValidCommon(const PagedAttentionParams& p) {
  if (p.num_q < 0 || p.ctx_len < 0 || p.n_heads <= 0 || p.n_kv_heads <= 0 || p.head_dim <= 0)
    return false;
  if (p.n_heads % p.n_kv_heads != 0) return false;
  if (p.num_q > 0 && (!p.q || !p.q_pos || !p.out)) return false;
  if (p.ctx_len > 0 && (!p.k_pool || !p.v_pool || !p.ctx_slots)) return false;
  if (p.out_cross && (!p.q_group || (p.ctx_len > 0 && !p.key_group))) return false;
  if (p.num_seqs > 0 && (!p.seq_rows || !p.seq_ctx_start || !p.seq_ctx_len || p.out_cross ||
                         p.max_seq_ctx < 0 || !p.ctx_slots))
    return false;
  return true;
}

}  // namespace

int PagedAttentionMaxRowsPerSeq(const PagedAttentionParams& p) {
  if (!TensorCorePath(p)) return 0;
  return 16 * Warps(p) / (p.n_heads / p.n_kv_heads);
}

bool PagedAttentionSupported(int head_dim, int n_heads, int n_kv_heads) {
  if (head_dim <= 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads) return false;
  if (head_dim <= 64) return true;
  return head_dim == 128 && kMaxGroup % (n_heads / n_kv_heads) == 0;
}

size_t PagedAttentionWorkspaceBytes(const PagedAttentionParams& p) {
  if (!ValidCommon(p) || p.num_q == 0) return 0;
  const SplitPlan plan = PlanSplits(p);
  if (plan.splits <= 1) return 0;
  return static_cast<size_t>(plan.splits) * p.num_q * p.n_heads * (p.head_dim + 1) *
         sizeof(float);
}

cudaError_t PagedAttention(const PagedAttentionParams& p, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  if (!ValidCommon(p)) return cudaErrorInvalidValue;
  if (p.num_q == 0) return cudaSuccess;
  if (TensorCorePath(p)) {
    const SplitPlan plan = PlanSplits(p);
    FlashExtra ex;
    AttentionStatsParams none;
    if (plan.splits <= 1 && p.head_dim == 128 && p.impl != 1 && p.num_seqs == 0 &&
        (p.impl != 0 || kDefaultSm90) && Sm90AttentionAvailable() && Sm90AttentionSupports(p)) {
      // Calls with the fused cross mass too (AttentionConsistency.WarpSpecializedWgmma's
      // statistics case checks them).
      const bool ws_auto = p.impl == 0 && kDefaultWarpSpecialized;
      const Sm90Variant v = p.impl == 8                ? Sm90Variant::kWs128RowSum
                            : p.impl == 7 || ws_auto ? Sm90Variant::kWs128
                            : p.impl == 6            ? Sm90Variant::kWsPipelined
                            : p.impl == 5            ? Sm90Variant::kWsPingPong
                            : p.impl == 4            ? Sm90Variant::kWarpSpecialized
                            : p.impl == 3            ? Sm90Variant::kPipelined
                                                     : Sm90Variant::kPlain;
      return Sm90PagedAttention(p, v, stream);
    }
    if (plan.splits > 1) {
      if (workspace_bytes < PagedAttentionWorkspaceBytes(p) || workspace == nullptr)
        return cudaErrorInvalidValue;
      ex.ws_o = static_cast<float*>(workspace);
      ex.ws_lse = ex.ws_o + static_cast<size_t>(plan.splits) * p.num_q * p.n_heads * p.head_dim;
    }
    cudaError_t e =
        DecodeAttentionSupports(p)
            ? DecodeAttention(p, ex.ws_o, ex.ws_lse, plan.splits, stream)
        : p.head_dim == 128 ? LaunchFlash<128, false>(p, none, ex, plan.splits, stream)
                            : LaunchFlash<64, false>(p, none, ex, plan.splits, stream);
    if (e != cudaSuccess || plan.splits <= 1) return e;
    return detail::LaunchPdl(CombineKernel, static_cast<unsigned>((int64_t)p.num_q * p.n_heads),
                             p.head_dim, 0, stream, p, ex.ws_o, ex.ws_lse, plan.splits);
  }
  if (p.head_dim > 64 || p.num_seqs > 0) return cudaErrorInvalidValue;
  const int64_t warps = (int64_t)p.num_q * p.n_heads;
  const unsigned blocks = static_cast<unsigned>(CeilDiv(warps * 32, 128));
  if (p.head_dim <= 16) {
    GenericAttentionKernel<16><<<blocks, 128, 0, stream>>>(p);
  } else {
    GenericAttentionKernel<64><<<blocks, 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t AttentionStats(const PagedAttentionParams& p, const AttentionStatsParams& s,
                           cudaStream_t stream) {
  if (!ValidCommon(p) || (p.lse == nullptr && s.lse_by_head == nullptr) || p.num_seqs > 0)
    return cudaErrorInvalidValue;
  // The complement and cuDNN's normaliser are read by the mma.sync kernel and the wgmma
  // cross-mass kernel only.
  const bool complement_path = s.cross_complement || s.lse_by_head != nullptr;
  if (s.cross_complement &&
      (!s.out_cross || !s.q_group || !s.tile_groups || (p.ctx_len > 0 && !s.key_group)))
    return cudaErrorInvalidValue;
  if (complement_path && !TensorCorePath(p)) return cudaErrorInvalidValue;
  if (p.num_q == 0 || p.ctx_len == 0) return cudaSuccess;
  if (!s.out_cross && !s.out_recv) return cudaSuccess;
  // The wgmma statistics pass measured slower than mma.sync (36.4 vs 27.5 ms at 32K,
  // docs/perf-notes.md): only taken when a wgmma kernel is asked for explicitly.
  if (!complement_path && p.head_dim == 128 && (p.impl == 2 || p.impl == 3) &&
      Sm90AttentionAvailable() && Sm90AttentionSupports(p))
    return Sm90AttentionStats(p, s, stream);
  const bool recv_split = s.cross_complement && s.out_recv && s.recv_weight &&
                          s.recv_rows_begin >= 0 && s.recv_rows_begin < s.recv_rows_end &&
                          s.recv_rows_end <= p.num_q;
  // The cross mass by complement, and the weighted rows' received attention, on wgmma
  // (attention_stats_sm90.cu).
  if (s.cross_complement && s.impl == 0 && p.head_dim == 128 && Sm90AttentionAvailable() &&
      Sm90AttentionSupports(p) && (!s.out_recv || recv_split))
    return Sm90CrossComplement(p, s, stream);
  if (TensorCorePath(p)) {
    FlashExtra ex;
    if (recv_split) {
      // Blocks of about kRecvTiles key tiles each: ~64 at 32K, against the cross-mass blocks'
      // ~34 (their own 4K segment), so the launch ends evenly.
      constexpr int kRecvTiles = 64;
      const int qt = 16 * Warps(p) / (p.n_heads / p.n_kv_heads);
      ex.recv_q0 = s.recv_rows_begin / qt * qt;
      const int tiles = static_cast<int>(CeilDiv(p.ctx_len, kBN));
      const int parts = static_cast<int>(CeilDiv(tiles, kRecvTiles));
      ex.recv_parts = parts > 1 ? parts : 1;
      ex.recv_blocks =
          static_cast<int>(CeilDiv(s.recv_rows_end - ex.recv_q0, qt)) * ex.recv_parts;
    }
    return p.head_dim == 128 ? LaunchFlash<128, true>(p, s, ex, 1, stream)
                             : LaunchFlash<64, true>(p, s, ex, 1, stream);
  }
  if (p.head_dim > 64) return cudaErrorInvalidValue;
  const int64_t warps = (int64_t)p.num_q * p.n_heads;
  const unsigned blocks = static_cast<unsigned>(CeilDiv(warps * 32, 128));
  if (p.head_dim <= 16) {
    GenericStatsKernel<16><<<blocks, 128, 0, stream>>>(p, s);
  } else {
    GenericStatsKernel<64><<<blocks, 128, 0, stream>>>(p, s);
  }
  return cudaGetLastError();
}

}  // namespace sparsex::kernels

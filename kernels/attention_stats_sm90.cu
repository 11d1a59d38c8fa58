// The cross mass by complement (AttentionStatsParams::cross_complement) on Hopper warpgroup MMAs:
// per row and head, the probability on the keys of the row's own segment and the shared keys,
// p = 2^(s scale log2 e - lse) with the normaliser of an attention pass that ran elsewhere
// (cuDNN's, lse_by_head, or PagedAttention's p.lse); out_cross gets 1 minus its head mean. Only
// the key tiles holding such keys for some row of the block are read (tile_groups), so a row of
// a 4K segment in a 32K prompt reads about its own segment.
//
// Why a kernel of its own: the mma.sync statistics pass, bound by instruction latency, took
// 3.5 ms a layer for this at 32K (4.2 with the new rows' received attention); this one takes
// 1.6 (1.9) (H100, docs/perf-notes.md). Each score is one MMA share, an FFMA, an
// ex2 and an add, the Q K^T of one warpgroup running on the tensor cores while another
// exponentiates. Block: one producer warp (bulk tensor copies of whole
// 16-slot pool blocks, cp.async gathers for other tiles) and two consumer warpgroups of 64
// "M rows" (query row x head-in-group, as in attention_sm90.cu) over 64-key tiles in a 4-stage
// ring of K only; two blocks per SM. The received attention of the weighted rows (the new
// tokens) runs in the same launch, in blocks of its own over 128 keys each (see the kernel).
#include "kernels/attention_sm90.h"

#include <cmath>

#include "kernels/common.cuh"
#include "kernels/wgmma.cuh"

namespace sparsex::kernels {
namespace {

using detail::CeilDiv;
using detail::CpAsync16;
using detail::Ex2;
using namespace sm90;  // NOLINT: the shared wgmma building blocks (kernels/wgmma.cuh)

constexpr int kHd = 128, kBm = 128;
constexpr int kBn = kStatsTileKeys;  // keys per tile: tile_groups' unit
constexpr int kStages = 4;
constexpr int kConsumers = 256;             // two warpgroups
constexpr int kThreads = kConsumers + 32;   // and the producer warp
constexpr int kQBytes = kBm * kHd * 2;      // 32 KiB
constexpr int kTileBytes = kBn * kHd * 2;   // 16 KiB of K
constexpr int kSmemBytes = 1024 + kQBytes + kStages * kTileBytes;  // 97 KiB: two blocks an SM
static_assert(kBn % 32 == 0, "the pool-block check and the gathers take 32 keys a step");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -INFINITY;
#endif

// The received attention's rows for the blocks that take it (x-blocks [0, blocks), 128 keys of
// one KV head each): list[0, count) (AttentionStatsParams::recv_rows), or begin + [0, count)
// (recv_rows_begin/end) where list is null.
struct RecvRows {
  int blocks = 0;
  int begin = 0, count = 0;
  const int32_t* list = nullptr;
};

// Two roles, by x-block. Cross mass: the stationary operand is the block's 128 M rows of Q (as in
// attention_sm90.cu), the ring carries the K tiles of its own segments and the shared keys, each
// row sums its probabilities. Received attention (the first rr.blocks x-blocks): the same
// schedule with the operands' roles swapped: the stationary operand is 128 keys, the ring
// carries 64-row tiles of the weighted rows' Q (one query head of the group a tile), and each
// key sums w_i p(i, key) over the tile's rows, w_i folded into the exponent's bias
// (lse - log2 w_i, which the producer puts beside each tile).
__global__ void __launch_bounds__(kThreads, 2)
    CrossComplementKernel(const PagedAttentionParams p, const AttentionStatsParams st, int group,
                          int qt, const RecvRows rr, const __grid_constant__ KvMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ int s_lim[kBm];
  __shared__ int s_max_lim, s_min_lim, s_qg_lo, s_qg_hi;
  // Per stage: "full" (the producer's tile landed), "empty" (the eight consumer warps read it).
  __shared__ __align__(8) uint64_t s_full[kStages], s_empty[kStages];
  // Received attention: each ring tile's column biases and causal limits, and their minimum.
  __shared__ float s_bias[kStages][kBn];
  __shared__ int s_clim[kStages][kBn];
  __shared__ int s_tmin[kStages];
  const uint32_t raw = detail::SmemAddr(smem_raw);
  const uint32_t sbase = raw + ((1024u - (raw & 1023u)) & 1023u);  // swizzle atoms: 1024-aligned
  const uint32_t k_base = sbase + kQBytes;  // the ring
  unsigned char* const s_a = smem_raw + (sbase - raw);  // the stationary operand

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = group, QT = qt;
  const int kvh = blockIdx.y;
  const bool recv = static_cast<int>(blockIdx.x) < rr.blocks;
  const int key_base = static_cast<int>(blockIdx.x) * kBm;    // recv: the block's keys
  const int q0 = (gridDim.x - 1 - blockIdx.x) * QT;            // cross: late (heavier) tiles first
  const int recv_tiles = G * static_cast<int>(CeilDiv(rr.count, kBn));
  const float scale_log2 = p.scale * kLog2e;
  // The normaliser of row r, head h, in the log2 domain.
  auto lse_of = [&](int r, int h) {
    return st.lse_by_head != nullptr ? st.lse_by_head[static_cast<int64_t>(h) * p.num_q + r] * kLog2e
                                     : p.lse[static_cast<int64_t>(r) * p.n_heads + h];
  };
  if (tid == 0) {
    s_max_lim = -1;
    s_min_lim = 0x7fffffff;
    s_qg_lo = 0x7fffffff;
    s_qg_hi = -1;
    for (int i = 0; i < kStages; ++i) {
      // Each producer lane arrives once (cross), or twice (received attention: its copies, then
      // its stores of the tile's biases).
      MbarInit(detail::SmemAddr(&s_full[i]), recv ? 64 : 32);
      MbarInit(detail::SmemAddr(&s_empty[i]), kConsumers / 32);  // one per consumer warp
    }
  }
  __syncthreads();
  if (!recv) {
    for (int m = tid; m < kBm; m += kThreads) {
      const int qrow = q0 + m % QT;
      int lim = -1;
      if (qrow < p.num_q) {
        lim = min(p.q_pos[qrow], p.ctx_len - 1);
        if (lim < 0) lim = -1;
        if (lim >= 0) {
          const int gq = st.q_group[qrow];
          if (gq >= 0) {
            atomicMin(&s_qg_lo, gq);
            atomicMax(&s_qg_hi, gq);
          }
        }
      }
      s_lim[m] = lim;
      atomicMin(&s_min_lim, lim);  // rows without keys (-1) mask every tile for them
      if (lim >= 0) atomicMax(&s_max_lim, lim);
    }
    __syncthreads();
  }
  const int kv_end = s_max_lim + 1;
  const int min_lim = s_min_lim;
  const int n_tiles = recv ? recv_tiles : static_cast<int>(CeilDiv(kv_end, kBn));
  const int qg_lo = s_qg_lo, qg_hi = s_qg_hi;
  // Cross: the tiles holding keys of the block's segments or shared keys, in order; the
  // producer warp and every consumer warp walk the same sequence (a warp-wide ballot over 32
  // tiles a step). Received attention: every tile of the weighted rows.
  auto next_tile = [&](int t) {
    return recv ? t + 1
                : detail::NextGroupTile(st.tile_groups, t + 1, n_tiles, qg_lo, qg_hi, lane);
  };

  if (warp == kConsumers / 32) {
    // The producer warp: tile t into the stage of its iteration once the consumers released
    // what was there.
    int it = 0;
    for (int t = next_tile(-1); t < n_tiles; t = next_tile(t), ++it) {
      const int stage = it % kStages;
      if (it >= kStages) MbarWait(detail::SmemAddr(&s_empty[stage]), ((it / kStages) - 1) & 1);
      const uint32_t full = detail::SmemAddr(&s_full[stage]);
      const uint32_t dk = k_base + stage * kTileBytes;
      unsigned char* dst = smem_raw + (dk - raw);
      constexpr int kIters = kBn * 16 / 32;
      if (recv) {
        // 64 weighted rows of query head kvh * G + t % G (zero past the last), their biases
        // and limits; the copies arrive when they land, the stores with a release arrival.
        const int h = kvh * G + t % G, c0 = t / G * kBn;
        int tmin = 0x7fffffff;
        int rows[2];  // the rows of columns lane and lane + 32 (-1: none)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int c = lane + 32 * k, ci = c0 + c;
          const int r = ci >= rr.count ? -1 : rr.list != nullptr ? rr.list[ci] : rr.begin + ci;
          rows[k] = r;
          int lim = -1;
          float bias = INFINITY;  // p = 0
          if (r >= 0) {
            lim = min(p.q_pos[r], p.ctx_len - 1);
            const float w = st.recv_weight[r];
            if (lim >= 0 && w > 0.0f) bias = lse_of(r, h) - log2f(w);
            if (lim < 0) lim = -1;
          }
          s_bias[stage][c] = bias;
          s_clim[stage][c] = lim;
          tmin = min(tmin, lim);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) tmin = min(tmin, __shfl_xor_sync(0xffffffffu, tmin, o));
        if (lane == 0) s_tmin[stage] = tmin;
#pragma unroll
        for (int k = 0; k < kIters; ++k) {
          // Column idx >> 4 (< 32 for the first 16 copies, lane + 32's after) from its lane.
          const int idx = lane + 32 * k;
          const int r = __shfl_sync(0xffffffffu, rows[k < kIters / 2 ? 0 : 1], (idx >> 4) & 31);
          const bool valid = r >= 0;
          CpAsync16(dst + SwOff(idx >> 4, idx & 15, kBn),
                    p.q + (valid ? static_cast<int64_t>(r) * p.q_stride + h * kHd + (idx & 15) * 8
                                 : 0),
                    valid);
        }
        MbarArriveCpAsync(full);
        MbarArrive(full);
        continue;
      }
      // Cross: a whole tile whose 16-key groups each sit in consecutive pool rows goes as 8
      // bulk tensor copies from lane 0; other tiles (the last, partial one; 8-slot blocks) as
      // 32 cp.async a lane, zero-filled past kv_end.
      int32_t first[kBn / kBulkKeys];
      if (maps.ok != 0 && t * kBn + kBn <= kv_end &&
          WholePoolBlocks<kBn / 32>(p.ctx_slots, t * kBn, lane, first)) {
        if (lane == 0) {
          MbarArriveExpectTx(full, kTileBytes);
          TmaPoolBlocks(dk, &maps.k, kvh * kHd, first, full);
        } else {
          MbarArrive(full);
        }
        continue;
      }
      int64_t off[kIters];
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int idx = lane + 32 * k;
        const int j = t * kBn + (idx >> 4);
        off[k] = j < kv_end ? static_cast<int64_t>(p.ctx_slots[j]) * p.kv_stride + kvh * kHd +
                                  (idx & 15) * 8
                            : -1;
      }
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int idx = lane + 32 * k;
        CpAsync16(dst + SwOff(idx >> 4, idx & 15, kBn), p.k_pool + (off[k] >= 0 ? off[k] : 0),
                  off[k] >= 0);
      }
      MbarArriveCpAsync(full);
    }
    detail::CpAsyncWait<0>();  // nothing may outlive the block's shared memory
    return;
  }

  // Consumers: the stationary operand once: Q of the block's 128 M rows (cross), or K of its
  // 128 keys (received attention, zero past ctx_len).
  for (int idx = tid; idx < kBm * 16; idx += kConsumers) {
    const int m = idx >> 4, c = idx & 15;
    int64_t off = -1;
    if (recv) {
      const int key = key_base + m;
      if (key < p.ctx_len)
        off = static_cast<int64_t>(p.ctx_slots[key]) * p.kv_stride + kvh * kHd + c * 8;
    } else {
      const int qr = q0 + m % QT;
      if (qr < p.num_q) off = static_cast<int64_t>(qr) * p.q_stride + (kvh * G + m / QT) * kHd + c * 8;
    }
    CpAsync16(s_a + SwOff(m, c, kBm), (recv ? p.k_pool : p.q) + (off >= 0 ? off : 0), off >= 0);
  }
  detail::CpAsyncCommit();

  const int wg = warp >> 2, g = lane >> 2, tq = lane & 3;
  const int mr[2] = {warp * 16 + g, warp * 16 + g + 8};
  int lim[2] = {-1, -1}, qrow[2] = {0, 0}, qg[2] = {-1, -1};
  float lse[2] = {0.0f, 0.0f};
  if (!recv) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      lim[i] = s_lim[mr[i]];
      qrow[i] = q0 + mr[i] % QT;
      if (lim[i] >= 0) {
        lse[i] = lse_of(qrow[i], kvh * G + mr[i] / QT);
        qg[i] = st.q_group[qrow[i]];
      }
    }
  }
  detail::CpAsyncWait<0>();
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory");  // both warpgroups' rows
  FenceProxyAsync();
  const uint32_t a_desc = sbase + wg * 64 * 128;  // this warpgroup's 64 rows

  // Per row of this thread: the own-segment + shared mass (cross), or the received attention.
  float sum_row[2] = {0.0f, 0.0f};
  int it = 0;
  for (int t = next_tile(-1); t < n_tiles; t = next_tile(t), ++it) {
    const int stage = it % kStages;
    // Cross: the tile's segment range, read before the wait so that its latency hides there.
    int lo = 0, hi = 0;
    if (!recv) {
      lo = st.tile_groups[2 * t];
      hi = st.tile_groups[2 * t + 1];
    }
    MbarWait(detail::SmemAddr(&s_full[stage]), (it / kStages) & 1);
    FenceProxyAsync();  // cp.async-written tiles, before the MMAs' reads
    const uint32_t k_s = k_base + stage * kTileBytes;
    float acc[kBn / 8][4];
    WgFence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t koff = (ks & 3) * 32;
      WgmmaQK(&acc[0][0], Desc(a_desc + (ks >> 2) * (kBm * 128) + koff, 16, 1024),
              Desc(k_s + (ks >> 2) * (kBn * 128) + koff, 16, 1024), ks > 0);
    }
    WgCommit();
    WgWait0();
    if (recv) {
      // Column j of this thread: nb * 8 + 2 * tq + e. Its bias and limit, read before the
      // stage goes back to the producer.
      float bias[kBn / 8][2];
      int clim[kBn / 8][2];
#pragma unroll
      for (int nb = 0; nb < kBn / 8; ++nb) {
        const float2 b = *reinterpret_cast<const float2*>(&s_bias[stage][nb * 8 + 2 * tq]);
        const int2 l = *reinterpret_cast<const int2*>(&s_clim[stage][nb * 8 + 2 * tq]);
        bias[nb][0] = b.x;
        bias[nb][1] = b.y;
        clim[nb][0] = l.x;
        clim[nb][1] = l.y;
      }
      const bool need_mask = key_base + kBm - 1 > s_tmin[stage];
      __syncwarp();
      if (lane == 0) MbarArrive(detail::SmemAddr(&s_empty[stage]));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int key = key_base + mr[i];
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < kBn / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float v = fmaf(acc[nb][2 * i + e], scale_log2, -bias[nb][e]);
            sum += Ex2(need_mask && key > clim[nb][e] ? kNegInf : v);
          }
        }
        sum_row[i] += sum;
      }
      continue;
    }
    __syncwarp();
    if (lane == 0) MbarArrive(detail::SmemAddr(&s_empty[stage]));  // S is in registers

    const int key0 = t * kBn + 2 * tq;
    if (t * kBn + kBn - 1 > min_lim) {  // block-uniform: only tiles past some row's limit
#pragma unroll
      for (int nb = 0; nb < kBn / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (key0 + nb * 8 + (c & 1) > lim[c >> 1]) acc[nb][c] = kNegInf;
      }
    }
    if (lo == hi) {
      // One segment's keys (most tiles): a row takes the whole tile or none of it.
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (lo != qg[i]) continue;
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < kBn / 8; ++nb) {
          sum += Ex2(fmaf(acc[nb][2 * i], scale_log2, -lse[i]));
          sum += Ex2(fmaf(acc[nb][2 * i + 1], scale_log2, -lse[i]));
        }
        sum_row[i] += sum;
      }
    } else {
      // Shared keys or a segment boundary: each key's group decides (keys past ctx_len are
      // masked above, p = 0).
#pragma unroll
      for (int nb = 0; nb < kBn / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + nb * 8 + e;
          const int kg = key < p.ctx_len ? st.key_group[key] : -1;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if (kg < 0 || kg == qg[i])
              sum_row[i] += Ex2(fmaf(acc[nb][2 * i + e], scale_log2, -lse[i]));
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float v = sum_row[i];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (recv) {
      const int key = key_base + mr[i];
      if (tq == 0 && key < p.ctx_len && v != 0.0f)
        atomicAdd(st.out_recv + key, v / static_cast<float>(p.n_heads));
      continue;
    }
    v = fminf(fmaxf(1.0f - v, 0.0f), 1.0f);
    if (tq == 0 && lim[i] >= 0 && v != 0.0f)
      atomicAdd(st.out_cross + qrow[i], v / static_cast<float>(p.n_heads));
  }
#else
  (void)p;
  (void)st;
  (void)group;
  (void)qt;
  (void)rr;
  (void)maps;
  __trap();  // never launched: Sm90AttentionAvailable() is false without sm_90a code
#endif
}

}  // namespace

cudaError_t Sm90CrossComplement(const PagedAttentionParams& p, const AttentionStatsParams& s,
                                cudaStream_t stream) {
  if (!Sm90AttentionAvailable() || !Sm90AttentionSupports(p) || !s.cross_complement ||
      !s.out_cross || !s.q_group || !s.tile_groups || (p.lse == nullptr && !s.lse_by_head) ||
      (p.ctx_len > 0 && !s.key_group))
    return cudaErrorInvalidValue;
  // Received attention needs its rows: a list, or a range (every weighted row inside it).
  if (s.out_recv != nullptr &&
      (!s.recv_weight || (s.recv_rows != nullptr ? s.num_recv_rows < 0
                                                 : s.recv_rows_begin < 0 ||
                                                       s.recv_rows_begin >= s.recv_rows_end ||
                                                       s.recv_rows_end > p.num_q)))
    return cudaErrorInvalidValue;
  if (p.num_q == 0 || p.ctx_len == 0) return cudaSuccess;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(
        CrossComplementKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const int G = p.n_heads / p.n_kv_heads;
  const int qt = kBm / G;
  RecvRows rr;
  if (s.out_recv != nullptr) {
    rr.list = s.recv_rows;
    rr.begin = s.recv_rows_begin;
    rr.count = s.recv_rows != nullptr ? s.num_recv_rows : s.recv_rows_end - s.recv_rows_begin;
    rr.blocks = rr.count > 0 ? static_cast<int>(CeilDiv(p.ctx_len, kBm)) : 0;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.num_q, qt) + rr.blocks), p.n_kv_heads, 1);
  const KvMaps maps = EncodeKvMaps(p);
  CrossComplementKernel<<<grid, kThreads, kSmemBytes, stream>>>(p, s, G, qt, rr, maps);
  return cudaGetLastError();
}

}  // namespace sparsex::kernels

// Hopper (sm_90a) paged attention: the FlashAttention-2 algorithm of attention.cu on warpgroup
// MMA (wgmma) instead of mma.sync. Same contract (PagedAttentionParams: per-row positions,
// K/V gathered through the slot table, GQA heads of one KV head in one block); used for head_dim
// 128 when the key axis is not split (prefill, sparse recompute), see PagedAttention.
//
// Block: 2 warpgroups (8 warps), 128 "M rows" (query row x head-in-group), 64 keys per step,
// 3-stage cp.async pipeline for the K/V tiles. Shared tiles use the 128-byte swizzle of the
// wgmma descriptors: a row of 64 bf16 (128 B) per swizzle row, 16-byte chunk c of row r at
// chunk c ^ (r & 7), a 128-wide head split into two 64-column blocks. S = Q K^T reads Q and K
// from shared memory (K-major); O += P V takes P from registers (the S accumulator layout is the
// A-fragment layout) and V as stored (MN-major, transposed by the instruction). Variants
// (docs/perf-notes.md has their timings; the automatic choice is ws, see PagedAttention): S of
// the next tile issued before this tile's softmax ("pipelined"), warp-specialised ("ws": a
// producer warpgroup gathers the K/V stages into 5 stages and the two consumer warpgroups take
// them through mbarriers, with no block-wide barrier in the loop), ws with the consumers taking
// turns at the tensor cores ("ws ping-pong"), ws with each consumer's softmax overlapping its
// own previous P V ("ws pipelined"), ws on 128-key tiles ("ws 128", not yet run on a GPU), and
// the statistics pass of AttentionStats. Built only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL);
// elsewhere Sm90AttentionAvailable() is false.
#include "kernels/attention_sm90.h"

#include <cmath>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/wgmma.cuh"

namespace sparsex::kernels {
namespace {

using detail::CeilDiv;
using detail::CpAsync16;
using detail::Ex2;
using detail::PackBf16x2;
using namespace sm90;  // NOLINT: the shared wgmma building blocks (kernels/wgmma.cuh)

constexpr int kHd = 128, kBm = 128, kThreads = 256;
// Shared layout (bytes from the 1024-aligned base): Q, then K and V of each stage.
constexpr int kQBytes = kBm * kHd * 2;         // 32 KiB
constexpr int kStages = 3;  // cp.async stages of the variants without a producer
// The warp-specialised variant keeps more tiles in flight: its producer runs ahead of both
// warpgroups, and 5 stages of 64 keys (193 KiB with Q) still fit one block per SM (6, 225 KiB,
// measured no faster).
constexpr int kWsStages = 5;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -INFINITY;

// Ping-pong turns: barrier 2 + w is warpgroup w's; it waits there (bar.sync, 128 threads) for
// the other warpgroup's arrival (bar.arrive, 128 threads).
__device__ __forceinline__ void TurnWait(int bar) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(bar), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void TurnGive(int bar) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(bar), "n"(kThreads) : "memory");
}
// Barrier 1 over the two consumer warpgroups only (the producer warpgroup does not take part).
__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
}

// D[64x128] += A[64x16] (registers: P) * B[16x128] in shared memory, B MN-major (the V tile as stored, hd contiguous; transposed by the instruction).
__device__ __forceinline__ void WgmmaPVMn(float* d, const uint32_t* a, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// kWsPingPong: the warp-specialised layout with the consumer warpgroups taking turns at the
// tensor cores (FlashAttention-3's ping-pong): a warpgroup issues this tile's Q K^T and the
// previous tile's P V together, then hands the tensor cores to the other one and runs its
// softmax while they work.
// kWsPipelined: the ping-pong schedule without the turns: each consumer warpgroup issues tile
// t's Q K^T with tile t - 1's P V and runs tile t's softmax while that P V runs
// (FlashAttention-3's overlap inside a warpgroup), the warpgroups free-running.
// Neither uses setmaxnreg: every variant measured with it (H100; producer 40, consumers 232
// registers) ran at ~257-266 TFLOP/s against ws's ~420, and both at ~390 without it
// (perf-notes.md, also for Q in registers and a two-warp producer, both slower).
enum Mode {
  kPlain = 0,
  kPipelined = 1,
  kStats = 2,
  kWarpSpecialized = 3,
  kWsPingPong = 4,
  kWsPipelined = 5,
  kWs128 = 6,
  kWs128RowSum = 7
};
// kWs128RowSum: kWs128 with the softmax's row sums on the tensor cores: each tile's P times a
// 16 x 8 block of ones (one m64n8k16 a k-step beside P V) instead of an FADD a score, in an
// issue-bound softmax (~300 instructions a thread and tile); the sums then use P as rounded to
// bf16, as P V does. On an H100 no faster than kWs128 in the 32K reuse prefill, so kWs128
// stays the automatic choice.
template <int MODE>
constexpr bool IsWs128() {
  return MODE == kWs128 || MODE == kWs128RowSum;
}
template <int MODE>
constexpr bool IsWs() {
  return MODE == kWarpSpecialized || MODE == kWsPingPong || MODE == kWsPipelined ||
         IsWs128<MODE>();
}
// The warp-specialised variant adds a producer warpgroup to the two consumer warpgroups: one
// producer warp alone measured 2x slower than the plain variant (H100: its 64 dependent
// slot-load + copy pairs per lane and tile could not keep up with the MMAs), two warps ~20%
// slower.
constexpr int kProducerThreads = 128;
constexpr int kWsThreads = kThreads + kProducerThreads;
template <int MODE>
constexpr int BlockThreads() {
  return IsWs<MODE>() ? kWsThreads : kThreads;
}
// Keys per step: 64; kWs128 (the ws schedule on 128-key tiles) halves the per-tile overheads
// (stage waits and releases, row maxima, MMA fences and waits) and fits 3 stages (225 KiB).
template <int MODE>
constexpr int TileKeys() {
  return IsWs128<MODE>() ? 128 : 64;
}
template <int MODE>
constexpr int Stages() {
  return IsWs128<MODE>() ? 3 : IsWs<MODE>() ? kWsStages : kStages;
}
// Shared bytes: 1024 of alignment slack, Q, then K and V of each stage.
template <int MODE>
constexpr int SmemBytes() {
  return 1024 + kQBytes + Stages<MODE>() * 2 * TileKeys<MODE>() * kHd * 2;
}

// MODE kStats: the selection statistics pass (AttentionStats): S again, p = 2^(s - lse) with the
// log-sum-exp of the attention pass, cross-segment mass per row and received attention per key.
template <int MODE>
__global__ void __launch_bounds__(BlockThreads<MODE>(), 1)
    WgmmaFlashKernel(const PagedAttentionParams p, const AttentionStatsParams st, int group,
                     int qt, const __grid_constant__ KvMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kStatsMode = MODE == kStats;
  constexpr int kBn = TileKeys<MODE>();          // keys per step
  constexpr int kTileBytes = kBn * kHd * 2;      // 16 or 32 KiB
  constexpr int kStageBytes = 2 * kTileBytes;    // K + V
  constexpr int kNs = Stages<MODE>();            // stages (the ws variants' ring)
  extern __shared__ unsigned char smem_raw[];
  __shared__ int s_lim[kBm];
  __shared__ int s_max_lim, s_min_lim;
  // Warp-specialised variant: per stage, "full" (the producer's K/V landed) and "empty" (the
  // eight consumer warps are done reading it).
  __shared__ __align__(8) uint64_t s_full[kNs], s_empty[kNs];
  // Swizzle atoms must start on 1024-byte boundaries of the shared window.
  const uint32_t raw = detail::SmemAddr(smem_raw);
  const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  unsigned char* base = smem_raw + pad;
  const uint32_t sbase = raw + pad;
  unsigned char* sQ = base;
  unsigned char* sKV = base + kQBytes;  // [stage][K | V]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int G = group, QT = qt;
  const int qtile = gridDim.x - 1 - blockIdx.x;  // heavy (late) tiles first
  const int kvh = blockIdx.y;
  const int q0 = qtile * QT;

  if (tid == 0) {
    s_max_lim = -1;
    s_min_lim = 0x7fffffff;
    if constexpr (IsWs<MODE>()) {
      for (int st_i = 0; st_i < kNs; ++st_i) {
        // One cp.async arrival per producer thread.
        MbarInit(detail::SmemAddr(&s_full[st_i]), kProducerThreads);
        MbarInit(detail::SmemAddr(&s_empty[st_i]), kThreads / 32);  // one per consumer warp
      }
    }
  }
  __syncthreads();
  bool has_weight = false;  // some row of the block adds to out_recv (statistics)
  for (int m = tid; m < kBm; m += kThreads) {
    const int qrow = q0 + m % QT;
    int lim = -1;
    if (qrow < p.num_q) {
      lim = min(p.q_pos[qrow], p.ctx_len - 1);
      if (lim < 0) lim = -1;
      if (kStatsMode && st.recv_weight && st.out_recv && st.recv_weight[qrow] > 0.0f)
        has_weight = true;
    }
    s_lim[m] = lim;
    atomicMin(&s_min_lim, lim);
    if (lim >= 0) atomicMax(&s_max_lim, lim);
  }
  has_weight = __syncthreads_or(has_weight);
  const int kv_end = s_max_lim + 1;
  const int min_lim = s_min_lim;
  const int n_tiles = static_cast<int>(CeilDiv(kv_end, kBn));

  // K (and V) of key tile `tile` into `stage`, the 16-byte chunks split over the `count`
  // threads from `first` (every thread of the block, or the warp-specialised variant's producer
  // warpgroup). The slot loads go first, all of them: each copy is an asm statement with a
  // memory clobber, which would otherwise keep every slot load behind the copy before it.
  auto load_kv_by = [&](int stage, int tile, int first, auto count_c) {
    constexpr int kCount = decltype(count_c)::value;
    constexpr int kIters = kBn * 16 / kCount;
    static_assert(kBn * 16 % kCount == 0, "every thread issues the same number of copies");
    unsigned char* dk = sKV + stage * kStageBytes;
    [[maybe_unused]] unsigned char* dv = dk + kTileBytes;
    int64_t off[kIters];
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int idx = first + k * kCount;
      const int j = tile * kBn + (idx >> 4);
      off[k] = j < kv_end ? static_cast<int64_t>(p.ctx_slots[j]) * p.kv_stride +
                                kvh * kHd + (idx & 15) * 8
                          : -1;
    }
#pragma unroll
    for (int k = 0; k < kIters; ++k) {
      const int idx = first + k * kCount;
      const uint32_t o = SwOff(idx >> 4, idx & 15, kBn);
      const bool valid = off[k] >= 0;
      CpAsync16(dk + o, p.k_pool + (valid ? off[k] : 0), valid);
      if constexpr (!kStatsMode) CpAsync16(dv + o, p.v_pool + (valid ? off[k] : 0), valid);
    }
  };

  if constexpr (IsWs<MODE>()) {
    if (tid >= kThreads) {
      // The producer warpgroup: K/V tile t into stage t % kNs once the consumers released
      // the tile that was there; each thread's arrival fires when its copies have landed.
      const int ptid = tid - kThreads;
      for (int t = 0; t < n_tiles; ++t) {
        const int stage = t % kNs;
        if (t >= kNs)
          MbarWait(detail::SmemAddr(&s_empty[stage]), ((t / kNs) - 1) & 1);
        const uint32_t full = detail::SmemAddr(&s_full[stage]);
        if constexpr (IsWs128<MODE>()) {
          // A whole tile whose 16-key groups each sit in consecutive pool rows goes as 32 bulk
          // tensor copies issued by one thread (K and V, 8 groups, two 64-column halves)
          // instead of 4096 cp.async from the producer's 128 threads, whose issue slots the
          // consumers' schedulers share. Every producer warp reads the same slots, so all
          // agree on the path; each thread still arrives once, as the barrier counts.
          static_assert(kBn % 32 == 0, "the pool-block check takes 32 keys a step");
          int32_t first[kBn / kBulkKeys];
          if (maps.ok != 0 && t * kBn + kBn <= kv_end &&
              WholePoolBlocks<kBn / 32>(p.ctx_slots, t * kBn, lane, first)) {
            if (ptid == 0) {
              MbarArriveExpectTx(full, kStageBytes);
              const uint32_t dk = sbase + kQBytes + stage * kStageBytes;
              TmaPoolBlocks(dk, &maps.k, kvh * kHd, first, full);
              TmaPoolBlocks(dk + kTileBytes, &maps.v, kvh * kHd, first, full);
            } else {
              MbarArrive(full);
            }
            continue;
          }
        }
        load_kv_by(stage, t, ptid, std::integral_constant<int, kProducerThreads>());
        MbarArriveCpAsync(full);
      }
      // Nothing may outlive the block's shared memory: wait for the last copies to land.
      detail::CpAsyncWait<0>();
      return;
    }
  }

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

  auto load_kv = [&](int stage, int tile) {
    load_kv_by(stage, tile, tid, std::integral_constant<int, kThreads>());
  };

  // Q tile with the first K/V tile, the second K/V tile in its own group (the warp-specialised
  // variant: Q alone; its producer warpgroup loads the K/V tiles).
  for (int idx = tid; idx < kBm * 16; idx += kThreads) {
    const int m = idx >> 4, c = idx & 15;
    const int qr = q0 + m % QT;
    const int hh = kvh * G + m / QT;
    const bool valid = qr < p.num_q;
    const int64_t off = valid ? (int64_t)qr * p.q_stride + hh * kHd + c * 8 : 0;
    CpAsync16(sQ + SwOff(m, c, kBm), p.q + off, valid);
  }
  if constexpr (!IsWs<MODE>()) {
    if (n_tiles > 0) load_kv(0, 0);
    detail::CpAsyncCommit();
    if (n_tiles > 1) load_kv(1, 1);
  }
  detail::CpAsyncCommit();

  float o[16][4];
#pragma unroll
  for (int nd = 0; nd < 16; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  float row_m[2] = {kNegInf, kNegInf}, row_l[2] = {0.0f, 0.0f};
  // kWs128RowSum: the row sums as an m64n8 accumulator (every column the sum of its row) and the
  // block of ones its MMAs read (static shared memory, written before the consumers' barrier).
  constexpr bool kMmaRowSum = MODE == kWs128RowSum;
  float lsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  __shared__ __align__(128) bf16 s_ones[kMmaRowSum ? 256 : 1];
  if constexpr (kMmaRowSum) {
    for (int i = tid; i < 256; i += kThreads) s_ones[i] = __float2bfloat16(1.0f);
    FenceProxyAsync();  // generic stores, read by the MMAs (async proxy) after ConsumerSync
  }
  // Fused cross-segment mass (p.out_cross), rescaled with the row sums.
  const bool fused_cross = !kStatsMode && p.out_cross != nullptr;
  float xacc[2] = {0.0f, 0.0f};
  int xqg[2] = {0, 0};
  if (fused_cross) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (lim[i] >= 0) xqg[i] = p.q_group[qrow[i]];
  }
  const uint32_t q_desc_base = sbase + wg * 64 * 128;  // this warpgroup's 64 rows

  // S = Q K^T of the tile in `stage` into acc (8 k-steps over the head dimension).
  auto issue_s = [&](int stage, float (&acc)[kBn / 8][4]) {
    const uint32_t k_s = sbase + kQBytes + stage * kStageBytes;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t koff = (ks & 3) * 32;
      const uint64_t da = Desc(q_desc_base + (ks >> 2) * (kBm * 128) + koff, 16, 1024);
      const uint64_t db = Desc(k_s + (ks >> 2) * (kBn * 128) + koff, 16, 1024);
      // A 128-key tile in one MMA (its 128 rows are consecutive 8-row swizzle atoms).
      if constexpr (kBn == 128) {
        WgmmaQK128(&acc[0][0], da, db, ks > 0);
      } else {
        WgmmaQK(&acc[0][0], da, db, ks > 0);
      }
    }
  };
  // Scale, causal mask, online softmax of tile t in acc (P in fp32, the row statistics and the
  // cross mass updated, corr the factor O must be rescaled by), touching neither O nor pa: in
  // the ping-pong variant the previous tile's P V still reads and writes them meanwhile.
  uint32_t pa[kBn / 16][4];  // P as the A fragments of the k-steps (16 keys each)
  // Instruction counts matter here (Nsight Compute on an H100: the ws kernel issues an
  // instruction every 1.8 cycles per scheduler with ~1 eligible warp): the mask is a
  // block-uniform branch taken only by tiles that reach past some row's causal limit (a per-score
  // predicate cost three instructions a score on every tile), and the scale rides in the
  // exponent's FFMA.
  auto softmax_scores = [&](float (&acc)[kBn / 8][4], int t, float (&corr)[2]) {
    const int key0 = t * kBn + 2 * tq;
    if ((t * kBn + kBn - 1) > min_lim) {
#pragma unroll
      for (int nb = 0; nb < kBn / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (key0 + nb * 8 + (c & 1) > lim[c >> 1]) acc[nb][c] = kNegInf;
        }
      }
    }
    detail::OnlineSoftmaxStep<kBn / 8, !kMmaRowSum>(acc, scale_log2, row_m, row_l, corr);
    xacc[0] *= corr[0];
    xacc[1] *= corr[1];
    if (fused_cross) detail::AccumulateCross(acc, key0, p.key_group, p.ctx_len, xqg, xacc);
  };
  // P into pa, O rescaled unless no row of the warp changed its maximum (corr exactly 1: the
  // usual case once the first tiles set the maxima), which skips 64 multiplies a thread.
  auto softmax_finish = [&](const float (&acc)[kBn / 8][4], const float (&corr)[2]) {
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      pa[kk][0] = PackBf16x2(acc[2 * kk][0], acc[2 * kk][1]);
      pa[kk][1] = PackBf16x2(acc[2 * kk][2], acc[2 * kk][3]);
      pa[kk][2] = PackBf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
      pa[kk][3] = PackBf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int nd = 0; nd < 16; ++nd) {
        o[nd][0] *= corr[0];
        o[nd][1] *= corr[0];
        o[nd][2] *= corr[1];
        o[nd][3] *= corr[1];
      }
      lsum[0] *= corr[0];
      lsum[1] *= corr[0];
      lsum[2] *= corr[1];
      lsum[3] *= corr[1];
    }
  };
  auto softmax = [&](float (&acc)[kBn / 8][4], int t) {
    float corr[2];
    softmax_scores(acc, t, corr);
    softmax_finish(acc, corr);
  };
  // O += P V of the tile in `stage`: V as stored (16 key rows per k-step, the 128 head columns
  // in two 64-column blocks 8 KiB apart), transposed by the instruction.
  auto issue_pv = [&](int stage) {
    const uint32_t v_s = sbase + kQBytes + stage * kStageBytes + kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk) {
      WgmmaPVMn(&o[0][0], pa[kk], Desc(v_s + kk * 2048, kBn * 128, 1024));
      // Every byte the descriptor can reach (two core matrices 128 bytes apart) holds a one.
      if constexpr (kMmaRowSum)
        WgmmaRowSum(lsum, pa[kk], DescNoSwizzle(detail::SmemAddr(s_ones), 128, 256));
    }
  };

  float s_cur[kBn / 8][4];
  // Tile t's scores into s_cur, one tile after the other: wait for its K/V, start loading the
  // tile kStages - 1 ahead into the stage tile t - 1 used, S = Q K^T.
  auto tile_scores = [&](int t) {
    detail::CpAsyncWait<kStages - 2>();  // tile t has landed
    FenceProxyAsync();
    __syncthreads();  // ... for every thread; the stage of tile t - 1 is free
    if (t + kStages - 1 < n_tiles) load_kv((t + kStages - 1) % kStages, t + kStages - 1);
    detail::CpAsyncCommit();
    WgFence();
    issue_s(t % kStages, s_cur);
    WgCommit();
    WgWait0();
  };
  // Warp-specialised variants: wait until tile t's K/V has landed (the producer's copies,
  // generic proxy, before the MMAs' reads, async proxy); give tile t's stage back once this
  // warp's MMAs on it are done (one arrival per consumer warp).
  [[maybe_unused]] auto wait_tile = [&](int t) {
    MbarWait(detail::SmemAddr(&s_full[t % kNs]), (t / kNs) & 1);
    FenceProxyAsync();
  };
  [[maybe_unused]] auto release_tile = [&](int t) {
    __syncwarp();
    if (lane == 0) MbarArrive(detail::SmemAddr(&s_empty[t % kNs]));
  };
  if constexpr (kStatsMode) {
    float lse_row[2] = {0.0f, 0.0f}, w_row[2] = {0.0f, 0.0f}, cross[2] = {0.0f, 0.0f};
    int qg[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (lim[i] >= 0) {
        lse_row[i] = p.lse[(int64_t)qrow[i] * p.n_heads + head[i]];
        if (st.q_group) qg[i] = st.q_group[qrow[i]];
        if (st.recv_weight) w_row[i] = fmaxf(st.recv_weight[qrow[i]], 0.0f);
      }
    }
    for (int t = 0; t < n_tiles; ++t) {
      tile_scores(t);
      const int key0 = t * kBn + 2 * tq;
      const bool need_mask = (t * kBn + kBn - 1) > min_lim;
      float colsum[kBn / 8][2];
#pragma unroll
      for (int nb = 0; nb < kBn / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + nb * 8 + e;
          const int kg = (key < p.ctx_len && st.key_group) ? st.key_group[key] : -1;
          float s0 = s_cur[nb][e] * scale_log2, s1 = s_cur[nb][2 + e] * scale_log2;
          if (need_mask && key > lim[0]) s0 = kNegInf;
          if (need_mask && key > lim[1]) s1 = kNegInf;
          const float p0 = Ex2(s0 - lse_row[0]), p1 = Ex2(s1 - lse_row[1]);
          if (kg >= 0) {
            if (kg != qg[0]) cross[0] += p0;
            if (kg != qg[1]) cross[1] += p1;
          }
          colsum[nb][e] = w_row[0] * p0 + w_row[1] * p1;
        }
      }
      if (has_weight) {
#pragma unroll
        for (int nb = 0; nb < kBn / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = colsum[nb][e];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            const int key = key0 + nb * 8 + e;
            if (g == 0 && v != 0.0f && key < p.ctx_len)
              atomicAdd(st.out_recv + key, v / static_cast<float>(p.n_heads));
          }
        }
      }
    }
    detail::CpAsyncWait<0>();
    if (st.out_cross && st.key_group && st.q_group) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float v = cross[i];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (tq == 0 && lim[i] >= 0 && v != 0.0f)
          atomicAdd(st.out_cross + qrow[i], v / static_cast<float>(p.n_heads));
      }
    }
    return;
  } else if constexpr (MODE == kWarpSpecialized || IsWs128<MODE>()) {
    // Q landed for both warpgroups before the first S; then each warpgroup runs at its own pace,
    // waiting only for the stage it reads.
    detail::CpAsyncWait<0>();
    ConsumerSync();
    FenceProxyAsync();
    for (int t = 0; t < n_tiles; ++t) {
      const int stage = t % kNs;
      wait_tile(t);
      WgFence();
      issue_s(stage, s_cur);
      WgCommit();
      WgWait0();
      softmax(s_cur, t);
      WgFence();
      issue_pv(stage);
      WgCommit();
      WgWait0();
      release_tile(t);
    }
  } else if constexpr (MODE == kWsPingPong || MODE == kWsPipelined) {
    // A step issues this warpgroup's MMAs (in its turn, ping-pong: then hands the tensor cores
    // to the other warpgroup), then runs the tile's softmax while they may still run; O and pa
    // change only once the previous P V is done, which also frees its stage. kWsPipelined is
    // the same schedule without the turns: each warpgroup's softmax of tile t overlaps its own
    // P V of tile t - 1 (FlashAttention-3's intra-warpgroup overlap); every step ends with no
    // MMA pending (a version with a P V pending across the loop's back edge drew ptxas's
    // C7514: its MMAs serialised).
    constexpr bool kTurns = MODE == kWsPingPong;
    detail::CpAsyncWait<0>();
    ConsumerSync();
    FenceProxyAsync();
    [[maybe_unused]] const int my_turn = 2 + wg, their_turn = 3 - wg;
    // Steps: Q K^T of tile 0; then Q K^T of tile t with P V of tile t - 1; then P V of the last
    // tile; the branches are block-uniform, and peeled so that no MMA sits in a divergent path
    // (ptxas serialises those). Each wait for a warpgroup's turn matches one arrival of the
    // other's: warpgroup 1's first arrival comes before the first step, so its last step has
    // nobody left to hand over to.
    float corr[2];
    if (n_tiles > 0) {
      if (kTurns && wg == 1) TurnGive(2);  // warpgroup 0 goes first
      wait_tile(0);
      if constexpr (kTurns) TurnWait(my_turn);
      WgFence();
      issue_s(0, s_cur);
      WgCommit();
      if constexpr (kTurns) TurnGive(their_turn);
      WgWait0();
      softmax(s_cur, 0);
    }
    for (int t = 1; t < n_tiles; ++t) {
      wait_tile(t);
      if constexpr (kTurns) TurnWait(my_turn);
      WgFence();
      issue_s(t % kNs, s_cur);
      WgCommit();
      issue_pv((t - 1) % kNs);
      WgCommit();
      if constexpr (kTurns) TurnGive(their_turn);
      WgWait1();  // Q K^T done (groups retire in order); the P V may still run
      softmax_scores(s_cur, t, corr);
      WgWait0();  // P V done: O and pa may change, its stage is free
      release_tile(t - 1);
      softmax_finish(s_cur, corr);
    }
    if (n_tiles > 0) {
      if constexpr (kTurns) TurnWait(my_turn);
      WgFence();
      issue_pv((n_tiles - 1) % kNs);
      WgCommit();
      if (kTurns && wg == 0) TurnGive(their_turn);
      WgWait0();
      release_tile(n_tiles - 1);
    }
  } else if constexpr (MODE == kPipelined) {
    // S of tile t + 1 runs on the tensor cores while tile t's softmax runs on the ALUs.
    float s_nxt[kBn / 8][4];
    if (n_tiles > 0) {
      detail::CpAsyncWait<1>();
      FenceProxyAsync();
      __syncthreads();
      WgFence();
      issue_s(0, s_cur);
      WgCommit();
      WgWait0();
    }
    for (int t = 0; t < n_tiles; ++t) {
      detail::CpAsyncWait<0>();  // tile t + 1 has landed
      FenceProxyAsync();
      __syncthreads();  // ... for every thread; stage (t + 2) % 3 is free
      if (t + 2 < n_tiles) load_kv((t + 2) % kStages, t + 2);
      detail::CpAsyncCommit();
      const bool next = t + 1 < n_tiles;
      if (next) {
        WgFence();
        issue_s((t + 1) % kStages, s_nxt);
        WgCommit();
      }
      softmax(s_cur, t);
      WgFence();
      issue_pv(t % kStages);
      WgCommit();
      WgWait0();
      if (next) {
#pragma unroll
        for (int nb = 0; nb < kBn / 8; ++nb)
#pragma unroll
          for (int c = 0; c < 4; ++c) s_cur[nb][c] = s_nxt[nb][c];
      }
    }
  } else {
    for (int t = 0; t < n_tiles; ++t) {
      tile_scores(t);
      softmax(s_cur, t);
      WgFence();
      issue_pv(t % kStages);
      WgCommit();
      WgWait0();
    }
  }
  detail::CpAsyncWait<0>();

  if constexpr (kMmaRowSum) {
    row_l[0] = lsum[0];  // whole rows already: the MMAs summed over every key
    row_l[1] = lsum[2];
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_l[i] += __shfl_xor_sync(0xffffffffu, row_l[i], 1);
      row_l[i] += __shfl_xor_sync(0xffffffffu, row_l[i], 2);
    }
  }
  if (fused_cross) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      detail::FlushCross(xacc[i], row_l[i], tq == 0 && lim[i] >= 0,
                         p.out_cross + (lim[i] >= 0 ? qrow[i] : 0), p.n_heads);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (qrow[i] >= p.num_q) continue;
    const float inv = row_l[i] > 0.0f ? 1.0f / row_l[i] : 0.0f;
    const float lse = row_l[i] > 0.0f ? row_m[i] + log2f(row_l[i]) : kNegInf;
    bf16* orow = p.out + (int64_t)qrow[i] * p.out_stride + head[i] * kHd;
#pragma unroll
    for (int nd = 0; nd < 16; ++nd) {
      *reinterpret_cast<uint32_t*>(orow + nd * 8 + 2 * tq) =
          PackBf16x2(o[nd][2 * i] * inv, o[nd][2 * i + 1] * inv);
    }
    if (tq == 0 && p.lse) p.lse[(int64_t)qrow[i] * p.n_heads + head[i]] = lse;
  }
#else
  (void)p;
  (void)st;
  (void)group;
  (void)qt;
  (void)maps;
  __trap();  // never launched: Sm90AttentionAvailable() is false without sm_90a code
#endif
}

template <int MODE>
cudaError_t Launch(const PagedAttentionParams& p, const AttentionStatsParams& st,
                   cudaStream_t stream) {
  constexpr int smem = SmemBytes<MODE>();
  static bool configured = false;
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(WgmmaFlashKernel<MODE>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const int G = p.n_heads / p.n_kv_heads;
  const int qt = kBm / G;
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.num_q, qt)), p.n_kv_heads, 1);
  const KvMaps maps = IsWs128<MODE>() ? EncodeKvMaps(p) : KvMaps{};
  WgmmaFlashKernel<MODE><<<grid, BlockThreads<MODE>(), smem, stream>>>(p, st, G, qt, maps);
  return cudaGetLastError();
}

}  // namespace

bool Sm90AttentionAvailable() { return sm90::Sm90aDevice(); }

bool Sm90AttentionSupports(const PagedAttentionParams& p) {
  if (p.head_dim != kHd || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads) return false;
  const int G = p.n_heads / p.n_kv_heads;
  if (kBm % G != 0) return false;
  return p.q_stride % 8 == 0 && p.kv_stride % 8 == 0 && p.out_stride % 2 == 0 &&
         detail::Aligned16(p.q) && detail::Aligned16(p.k_pool) && detail::Aligned16(p.v_pool);
}

cudaError_t Sm90PagedAttention(const PagedAttentionParams& p, Sm90Variant variant,
                               cudaStream_t stream) {
  if (!Sm90AttentionAvailable() || !Sm90AttentionSupports(p)) return cudaErrorInvalidValue;
  if (p.num_q == 0) return cudaSuccess;
  const AttentionStatsParams none;
  switch (variant) {
    case Sm90Variant::kPipelined:
      return Launch<kPipelined>(p, none, stream);
    case Sm90Variant::kWarpSpecialized:
      return Launch<kWarpSpecialized>(p, none, stream);
    case Sm90Variant::kWsPingPong:
      return Launch<kWsPingPong>(p, none, stream);
    case Sm90Variant::kWsPipelined:
      return Launch<kWsPipelined>(p, none, stream);
    case Sm90Variant::kWs128:
      return Launch<kWs128>(p, none, stream);
    case Sm90Variant::kWs128RowSum:
      return Launch<kWs128RowSum>(p, none, stream);
    case Sm90Variant::kPlain:
      break;
  }
  return Launch<kPlain>(p, none, stream);
}

cudaError_t Sm90AttentionStats(const PagedAttentionParams& p, const AttentionStatsParams& s,
                               cudaStream_t stream) {
  if (!Sm90AttentionAvailable() || !Sm90AttentionSupports(p) || p.lse == nullptr)
    return cudaErrorInvalidValue;
  if (p.num_q == 0 || p.ctx_len == 0) return cudaSuccess;
  return Launch<kStats>(p, s, stream);
}

}  // namespace sparsex::kernels

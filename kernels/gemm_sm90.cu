// Hopper (sm_90a) gate_up projection with SwiGLU in its epilogue, for prefill-sized row counts
// (kernels/gemm.h, Sm90GemmSwiGlu). cuBLASLt writes the [n, 2 * half] gate_up product (at 32K
// rows 1.9 GB a layer) that a separate SwiGLU pass reads back; here each tile's gate and up
// columns meet in the same thread's registers, so only the [n, half] activation is written.
//
// Block: a producer warpgroup and two consumer warpgroups (64 rows each) over a 128-row x
// (128 gate + 128 up)-column tile, 64 inputs a stage (one 128-byte swizzle row: A 16 KiB, the
// gate and up boxes 16 KiB each) through full/empty mbarriers; the producer warpgroup's first
// thread issues the bulk tensor copies. Each consumer issues one m64n256k16 MMA a k-step (gate
// and up rows together) into 128 fp32 accumulators. Persistent: one block per SM walks the
// tiles grouped by 16 row tiles, so a wave's blocks share the A rows and the weight columns
// they read through L2. Two shapes (Sm90GemmSwiGluVariant): 4 stages with the SwiGLU computed
// by the consumers after each tile, or 3 stages with the consumers leaving gate and up (bf16)
// in a staging buffer and going on to the next tile while the producer warpgroup's three idle
// warps compute silu(gate) * up and store it.
// Measured on an H100 (docs/perf-notes.md): both level with or up to 7% behind
// cuBLASLt then SwiGLU, call to call. A third shape, clusters of two blocks sharing the weight
// boxes by multicast, ran ~40% behind (a pair of SMs at one SM's rate, with all 66 clusters
// resident) and was removed. No setmaxnreg: the attention kernels measured slower with it.
#include <cuda.h>

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/gemm.h"
#include "kernels/wgmma.cuh"

namespace sparsex::kernels {
namespace {

using detail::Bf16x8;
using detail::CeilDiv;
using namespace sm90;  // NOLINT: the shared wgmma building blocks (kernels/wgmma.cuh)

constexpr int kBm = 128;            // rows of a tile
constexpr int kBn = 128;            // output columns of a tile (gate and up columns each)
constexpr int kBk = 64;             // inputs a stage: one 128-byte swizzle row
constexpr int kMaxStages = 4;
constexpr int kGroupRows = 16;      // row tiles walked together (L2 reuse of weights)
constexpr int kConsumers = 256;     // two consumer warpgroups
constexpr int kThreads = kConsumers + 128;
constexpr int kEpilogueWarps = 3;   // the producer warpgroup's warps 1-3
constexpr int kABytes = kBm * kBk * 2;              // 16 KiB
constexpr int kBBytes = 2 * kBn * kBk * 2;          // gate + up boxes, 32 KiB
constexpr int kStageBytes = kABytes + kBBytes;      // 48 KiB
// Staging: gate and up of a tile as bf16 rows padded to 272 bytes, so that the consumers'
// 4-byte stores (8 rows x 4 column pairs a warp) fall on 32 different banks.
constexpr int kStageRow = kBn * 2 + 16;
constexpr int kStagingBytes = kBm * kStageRow;      // one of gate, up: 34 KiB

// The kernel's shapes (Sm90GemmSwiGluVariant): the stage count, and the SwiGLU on the
// consumers or on the epilogue warps from a staging buffer.
template <int kNs, bool kEpiWarps>
struct Cfg {
  static constexpr bool epi_warps = kEpiWarps;
  static constexpr int stages = kNs;
  static constexpr int smem = 1024 + kNs * kStageBytes + (kEpiWarps ? 2 * kStagingBytes : 0);
  static_assert(kNs <= kMaxStages && smem <= 227 * 1024, "one block an SM");
};

struct GemmMaps {
  CUtensorMap x, w;
};

__device__ __forceinline__ void TileOf(int t, int m_tiles, int n_tiles, int& mt, int& nt) {
  const int per_group = kGroupRows * n_tiles;
  const int first_m = (t / per_group) * kGroupRows;
  const int rows_here = min(kGroupRows, m_tiles - first_m);
  const int local = t % per_group;
  mt = first_m + local % rows_here;
  nt = local / rows_here;
}

template <class C>
__global__ void __launch_bounds__(kThreads, 1)
    GemmSwiGluKernel(const __grid_constant__ GemmMaps maps, bf16* out, int64_t out_stride,
                     int n, int half, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // Per stage: full (the copies landed), empty (the 8 consumer warps are done with it). The
  // staging buffer: written (by the 8 consumer warps), read (by the epilogue warps).
  constexpr int kStages = C::stages;
  __shared__ __align__(8) uint64_t s_full[kStages], s_empty[kStages], s_written, s_read;
  // Swizzle atoms must start on 1024-byte boundaries of the shared window.
  const uint32_t raw = detail::SmemAddr(smem_raw);
  const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  const uint32_t sbase = raw + pad;
  unsigned char* staging = smem_raw + pad + kStages * kStageBytes;  // gate, then up
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m_tiles = static_cast<int>(CeilDiv(n, kBm));
  const int n_tiles = static_cast<int>(CeilDiv(half, kBn));
  const int tiles = m_tiles * n_tiles, k_blocks = static_cast<int>(CeilDiv(k, kBk));
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(detail::SmemAddr(&s_full[s]), 1);  // the producer's expect_tx
      MbarInit(detail::SmemAddr(&s_empty[s]), kConsumers / 32);  // one per consumer warp
    }
    MbarInit(detail::SmemAddr(&s_written), kConsumers / 32);
    MbarInit(detail::SmemAddr(&s_read), kEpilogueWarps);
  }
  __syncthreads();

  if (tid == kConsumers) {
    // Producer: stage it % kStages gets k-block kb of the tile once the consumers released
    // what was there; the copies complete the full barrier's bytes.
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int mt, nt;
      TileOf(t, m_tiles, n_tiles, mt, nt);
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        if (it >= kStages) MbarWait(detail::SmemAddr(&s_empty[s]), ((it / kStages) - 1) & 1);
        const uint32_t full = detail::SmemAddr(&s_full[s]);
        const uint32_t a_s = sbase + s * kStageBytes, b_s = a_s + kABytes;
        MbarArriveExpectTx(full, kStageBytes);
        TmaLoad2d(a_s, &maps.x, kb * kBk, mt * kBm, full);
        TmaLoad2d(b_s, &maps.w, kb * kBk, nt * kBn, full);                       // gate rows
        TmaLoad2d(b_s + kBBytes / 2, &maps.w, kb * kBk, half + nt * kBn, full);  // up rows
      }
    }
  } else if (C::epi_warps && warp > kConsumers / 32) {
    // Epilogue warps: each tile's staged gate and up, 8 columns a thread at a time (16-byte
    // loads and stores, a row's 256 output bytes by 16 consecutive threads).
    const int et = tid - kConsumers - 32, threads = 32 * kEpilogueWarps;
    int i = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++i) {
      int mt, nt;
      TileOf(t, m_tiles, n_tiles, mt, nt);
      MbarWait(detail::SmemAddr(&s_written), i & 1);
      for (int idx = et; idx < kBm * (kBn / 8); idx += threads) {
        const int r = idx / (kBn / 8), c = (idx % (kBn / 8)) * 8;
        const int row = mt * kBm + r, col = nt * kBn + c;
        if (row >= n || col >= half) continue;  // half % 8 == 0: a chunk is whole or out
        float g[8], u[8];
        detail::Unpack8(*reinterpret_cast<const Bf16x8*>(staging + r * kStageRow + c * 2), g);
        detail::Unpack8(
            *reinterpret_cast<const Bf16x8*>(staging + kStagingBytes + r * kStageRow + c * 2),
            u);
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = detail::Silu(g[e]) * u[e];
        *reinterpret_cast<Bf16x8*>(out + static_cast<int64_t>(row) * out_stride + col) =
            detail::Pack8(g);
      }
      __syncwarp();
      if (lane == 0) MbarArrive(detail::SmemAddr(&s_read));
    }
  } else if (tid < kConsumers) {
    const int wg = warp >> 2;
    float acc[128];  // [4j + 2h + c]: row g + 8h of the warp's 16, column 8j + 2tq + c (j < 16:
                     // gate columns, j >= 16: the up columns 8(j - 16) + 2tq + c)
    auto release = [&](int stage) {  // one arrival a consumer warp
      __syncwarp();
      if (lane == 0) MbarArrive(detail::SmemAddr(&s_empty[stage]));
    };
    int it = 0, i = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++i) {
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        MbarWait(detail::SmemAddr(&s_full[s]), (it / kStages) & 1);
        const uint32_t a_s = sbase + s * kStageBytes + wg * 64 * 128;
        const uint32_t b_s = sbase + s * kStageBytes + kABytes;
        WgFence();
#pragma unroll
        for (int ks = 0; ks < kBk / 16; ++ks) {
          WgmmaN256(acc, Desc(a_s + ks * 32, 16, 1024), Desc(b_s + ks * 32, 16, 1024),
                    kb > 0 || ks > 0);
        }
        WgCommit();
        // The previous k-block's MMAs are done: its stage can be refilled.
        WgWait1();
        if (kb > 0) release((it - 1) % kStages);
      }
      WgWait0();
      release((it - 1) % kStages);
      if constexpr (C::epi_warps) {
        // Gate and up rounded to bf16 (as the separate GEMM and SwiGLU kernels round them)
        // into the staging buffer once the epilogue warps have read the previous tile's.
        if (i > 0) MbarWait(detail::SmemAddr(&s_read), (i - 1) & 1);
        const int r0 = wg * 64 + (warp & 3) * 16 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < kBn / 8; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int off = (r0 + 8 * h) * kStageRow + (j * 8 + (lane & 3) * 2) * 2;
            *reinterpret_cast<uint32_t*>(staging + off) =
                detail::PackBf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            *reinterpret_cast<uint32_t*>(staging + kStagingBytes + off) =
                detail::PackBf16x2(acc[64 + 4 * j + 2 * h], acc[64 + 4 * j + 2 * h + 1]);
          }
        }
        __syncwarp();
        if (lane == 0) MbarArrive(detail::SmemAddr(&s_written));
      } else {
        // The consumers' own epilogue: gate and up rounded to bf16 first, column pairs stored.
        int mt, nt;
        TileOf(t, m_tiles, n_tiles, mt, nt);
        const int row0 = mt * kBm + wg * 64 + (warp & 3) * 16 + (lane >> 2);
        const int col0 = nt * kBn + (lane & 3) * 2;
#pragma unroll
        for (int j = 0; j < kBn / 8; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h, col = col0 + 8 * j;
            if (row >= n || col >= half) continue;
            float v[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float g = __bfloat162float(__float2bfloat16_rn(acc[4 * j + 2 * h + c]));
              const float u = __bfloat162float(__float2bfloat16_rn(acc[64 + 4 * j + 2 * h + c]));
              v[c] = detail::Silu(g) * u;
            }
            *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(row) * out_stride + col) =
                detail::PackBf16x2(v[0], v[1]);
          }
        }
      }
    }
  }
#else
  (void)maps;
  (void)out;
  (void)out_stride;
  (void)n;
  (void)half;
  (void)k;
  __trap();  // never launched: Sm90GemmSwiGluSupported() is false without sm_90a code
#endif
}

}  // namespace

bool Sm90GemmSwiGluSupported(const bf16* x, int64_t x_stride, const bf16* w, int64_t w_stride,
                             const bf16* out, int64_t out_stride, int64_t n, int64_t half,
                             int64_t k) {
  // Bulk copies need 16-byte aligned bases and row strides, and each matrix at least one box
  // (smaller calls are cheap on cuBLASLt); the epilogue stores 8 columns at a time.
  const auto aligned = [](const void* p, unsigned a) {
    return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0;
  };
  return sm90::Sm90aDevice() && n >= kBm && half >= kBn && k >= kBk && half % 8 == 0 &&
         k % 8 == 0 && x_stride % 8 == 0 && w_stride % 8 == 0 && out_stride % 8 == 0 &&
         x_stride >= k &&
         w_stride >= k && out_stride >= half && aligned(x, 16) && aligned(w, 16) &&
         aligned(out, 16) && n <= INT32_MAX && 2 * half <= INT32_MAX && k <= INT32_MAX;
}

namespace {

template <class C>
cudaError_t Launch(const GemmMaps& maps, bf16* out, int64_t out_stride, int64_t n, int64_t half,
                   int64_t k, cudaStream_t stream) {
  static const cudaError_t configured = cudaFuncSetAttribute(
      GemmSwiGluKernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem);
  if (configured != cudaSuccess) return configured;
  static const int sms = [] {
    int dev = 0, count = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
    return std::max(count, 1);
  }();
  // Persistent: a block an SM, never more than there are tiles.
  const int64_t tiles = CeilDiv(n, static_cast<int64_t>(kBm)) *
                        CeilDiv(half, static_cast<int64_t>(kBn));
  const int grid = static_cast<int>(std::min<int64_t>(tiles, sms));
  GemmSwiGluKernel<C><<<grid, kThreads, C::smem, stream>>>(maps, out, out_stride,
                                                           static_cast<int>(n),
                                                           static_cast<int>(half),
                                                           static_cast<int>(k));
  return cudaGetLastError();
}

}  // namespace

const char* Sm90GemmSwiGluVariantName(Sm90GemmSwiGluVariant v) {
  switch (v) {
    case Sm90GemmSwiGluVariant::kStages3Staged:
      return "stages-3-staged";
    case Sm90GemmSwiGluVariant::kStages4:
      return "stages-4";
  }
  return "?";
}

cudaError_t Sm90GemmSwiGlu(const bf16* x, int64_t x_stride, const bf16* w, int64_t w_stride,
                           bf16* out, int64_t out_stride, int64_t n, int64_t half, int64_t k,
                           cudaStream_t stream, Sm90GemmSwiGluVariant variant) {
  if (!Sm90GemmSwiGluSupported(x, x_stride, w, w_stride, out, out_stride, n, half, k))
    return cudaErrorInvalidValue;
  GemmMaps maps{};
  if (!sm90::EncodeBf16Map(&maps.x, x, k, n, x_stride, kBk, kBm) ||
      !sm90::EncodeBf16Map(&maps.w, w, k, 2 * half, w_stride, kBk, kBn))
    return cudaErrorInvalidValue;
  switch (variant) {
    case Sm90GemmSwiGluVariant::kStages3Staged:
      return Launch<Cfg<3, true>>(maps, out, out_stride, n, half, k, stream);
    case Sm90GemmSwiGluVariant::kStages4:
      return Launch<Cfg<4, false>>(maps, out, out_stride, n, half, k, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sparsex::kernels

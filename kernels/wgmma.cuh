// Hopper (sm_90a) building blocks shared by the wgmma kernels (attention_sm90.cu,
// attention_stats_sm90.cu, gemm_sm90.cu; CUDA translation units only): the 128-byte-swizzled
// tile layout and its wgmma descriptors, the warpgroup MMAs, mbarriers, and bulk tensor copies
// (TMA) with the tensor maps that describe the K/V pools and plain row-major matrices. Device
// code exists only in sm_90a compilations (__CUDA_ARCH_FEAT_SM90_ALL); the tensor maps are
// encoded on the host.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention.h"
#include "kernels/common.cuh"

namespace sparsex::kernels::sm90 {

constexpr int kBulkKeys = 16;  // rows of a bulk copy's box: a pool block of 16 consecutive slots
constexpr int kBulkCols = 64;  // head dims of a box: one 128-byte swizzle row

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of 16-byte chunk `chunk` (0..15 over a 128-wide row) of row `row` in a tile of
// `rows` rows stored as two 64-column blocks with the 128-byte swizzle.
__device__ __forceinline__ uint32_t SwOff(int row, int chunk, int rows) {
  return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// wgmma shared-memory descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t Desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void WgFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgWait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// mbarriers of the warp-specialised variant (shared-memory addresses).
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives on bar once every cp.async this thread issued before has landed; .noinc: the
// barrier's count includes these arrivals.
__device__ __forceinline__ void MbarArriveCpAsync(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Arrives on bar and adds `bytes` to the transaction count its phase waits for (the bulk tensor
// copies below complete it).
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
                   bar),
               "r"(bytes)
               : "memory");
}
// A box of the 2-D tensor map `map` at element coordinates (c0, c1) into shared memory at dst,
// completing `bar`'s transaction bytes when it lands.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void WgWait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// D[64x64] (+)= A[64x16] * B[16x64], A and B in shared memory (K-major descriptors);
// accumulate = 0 overwrites D.
__device__ __forceinline__ void WgmmaQK(float* d, uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate));
}
// D[64x128] (+)= A[64x16] * B[16x128], both in shared memory (K-major): one instruction for a
// 128-key tile's Q K^T. Two 64-key halves read A twice for the same work: with both operands
// in shared memory an m64n64k16 needs 32 FLOP a byte read, what the tensor cores' peak draws
// from the 128 bytes a clock shared memory serves with nothing to spare; m64n128k16 needs 43.
__device__ __forceinline__ void WgmmaQK128(float* d, uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate));
}
// D[64x256] (+)= A[64x16] * B[16x256], both in shared memory (K-major): the gate_up kernel's
// k-step (kernels/gemm_sm90.cu), one instruction over a tile's 128 gate and 128 up rows. A is
// read once for 256 columns where two m64n128k16 read it twice: 52 FLOP a shared byte against
// 43.
__device__ __forceinline__ void WgmmaN256(float* d, uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(accumulate));
}
// D[64x8] += A[64x16] (registers: P) * B[16x8] in shared memory, B K-major without swizzle
// (db from DescNoSwizzle): with B all ones, every column of D is the row sum of P.
__device__ __forceinline__ void WgmmaRowSum(float* d, const uint32_t* a, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// wgmma shared-memory descriptor without swizzle: core matrices of 8 rows x 16 bytes, lbo
// bytes apart along K, sbo along M/N.
__device__ __forceinline__ uint64_t DescNoSwizzle(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);
}
// Whether each 16-key group of the 32 * N keys from key0 sits in consecutive pool rows (one
// pool block), so that the tile can go as bulk copies; warp-wide (every lane must call it and
// gets the same answer, one slot load per lane and 32 keys). When it does, first[g] is the
// first pool row of group g.
template <int N>
__device__ __forceinline__ bool WholePoolBlocks(const int32_t* ctx_slots, int key0, int lane,
                                                int32_t (&first)[2 * N]) {
  int32_t slot[N];
  bool ok = true;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    slot[k] = ctx_slots[key0 + 32 * k + lane];
    const int32_t group_first = __shfl_sync(0xffffffffu, slot[k], lane & kBulkKeys);
    ok = ok && slot[k] == group_first + (lane & (kBulkKeys - 1));
  }
  if (!__all_sync(0xffffffffu, ok)) return false;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    first[2 * k] = __shfl_sync(0xffffffffu, slot[k], 0);
    first[2 * k + 1] = __shfl_sync(0xffffffffu, slot[k], kBulkKeys);
  }
  return true;
}
// One thread's bulk copies of a 128-dim head (columns c0 on of map's rows) for the pool blocks
// first[] into a tile of 16 * G rows at dst, in SwOff's layout (two 64-column halves of 128-byte
// rows), completing bar's transaction bytes.
template <int G>
__device__ __forceinline__ void TmaPoolBlocks(uint32_t dst, const CUtensorMap* map, int c0,
                                              const int32_t (&first)[G], uint32_t bar) {
#pragma unroll
  for (int gi = 0; gi < G; ++gi) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      TmaLoad2d(dst + h * G * kBulkKeys * 128 + gi * kBulkKeys * 128, map, c0 + h * kBulkCols,
                first[gi], bar);
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Tensor maps of the K and V pools for bulk loads of whole pool blocks: 2-D, [num_slots rows,
// kv_stride bf16], boxes of {64 head dims, 16 rows} with the 128-byte swizzle the MMAs read, so
// one box is a 16-key pool block's half of one 128-dim KV head, landing as 16 rows of a tile's
// 64-column block (SwOff's layout).
struct KvMaps {
  CUtensorMap k, v;
  int ok = 0;  // 0: no maps (cp.async only)
};

// cuTensorMapEncodeTiled from the driver (through the runtime's entry point query, so the
// kernels link no libcuda); null where the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// True when this build carries sm_90a code (SPX_HAVE_SM90A) and the current device is compute
// capability 9.0: the wgmma kernels' precondition.
inline bool Sm90aDevice() {
#if defined(SPX_HAVE_SM90A)
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// A 2-D tensor map of a row-major bf16 matrix of `rows` x `cols` elements (row stride `stride`
// elements) for bulk loads of {box_cols, box_rows} boxes with the 128-byte swizzle the MMAs read
// (box_cols = 64: one 128-byte swizzle row); elements outside the matrix load as zeros. False
// where the driver cannot encode it (base 16-byte aligned and stride * 2 a multiple of 16
// required).
inline bool EncodeBf16Map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows,
                          int64_t stride, int box_cols, int box_rows) {
  const auto encode = TensorMapEncoder();
  if (encode == nullptr || cols <= 0 || rows <= 0) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
                strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The K and V pools' tensor maps of p (head_dim 128); ok = 0 when p.num_slots is 0 or the
// driver cannot encode them (the kernels then gather with cp.async).
inline KvMaps EncodeKvMaps(const PagedAttentionParams& p) {
  KvMaps m{};
  if (p.num_slots <= 0 || p.head_dim != 2 * kBulkCols || p.kv_stride < p.head_dim) return m;
  for (int i = 0; i < 2; ++i) {
    if (!EncodeBf16Map(i == 0 ? &m.k : &m.v, i == 0 ? p.k_pool : p.v_pool, p.kv_stride,
                       p.num_slots, p.kv_stride, kBulkCols, kBulkKeys))
      return KvMaps{};
  }
  m.ok = 1;
  return m;
}

}  // namespace sparsex::kernels::sm90

// Paged attention with a per-query position array, and the SparseX selection statistics.
//
// Each query row i (absolute position q_pos[i]) attends over keys at positions
// [0, min(q_pos[i], ctx_len - 1)], key position j living in pool row ctx_slots[j]. One kernel
// therefore serves dense causal prefill, chunked prefill, decode and sparse recompute (selected
// rows, each with its own causal limit). Grouped-query heads of one KV head are processed by one
// thread block so they share every K/V tile load.
//
// Paths (chosen by PagedAttention, "unsupported head_dim" otherwise):
//   head_dim 64 or 128, 16-byte aligned rows: FlashAttention-2 style tiles on mma.sync bf16
//     tensor cores (64 or 128 query-head rows x 64 keys per step, online softmax in fp32,
//     exponentials on ex2.approx); when there
//     are too few query tiles to fill the GPU (decode, short chunks) the key axis is split over
//     blocks and a combine kernel merges the partial results (split-K / flash-decoding).
//   head_dim 128 on Hopper (sm_90a build, unsplit): the same algorithm on warpgroup MMA
//     (wgmma), kernels/attention_sm90.cu.
//   batched decode (num_seqs > 0, each sequence's rows x G <= 16), head_dim 64 or 128: the
//     packed decode kernel, kernels/attention_decode.cu.
//   head_dim <= 64 (any): one warp per (query row, head), fp32 throughout.
//
//   kernels::PagedAttentionParams p;  // fill every field
//   size_t ws = kernels::PagedAttentionWorkspaceBytes(p);
//   kernels::PagedAttention(p, workspace, ws, stream);
//   kernels::AttentionStats(p, stats, stream);  // needs p.lse from the call above
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace sparsex::kernels {

using bf16 = __nv_bfloat16;

struct PagedAttentionParams {
  const bf16* q = nullptr;        // [num_q, q_stride]; head h at columns [h*hd, (h+1)*hd)
  int64_t q_stride = 0;
  bf16* out = nullptr;            // [num_q, out_stride]; same column layout as q
  int64_t out_stride = 0;
  const int32_t* q_pos = nullptr; // [num_q] absolute position of each query row
  int num_q = 0;
  const bf16* k_pool = nullptr;   // [num_slots, kv_stride]; KV head h at columns [h*hd, ...)
  const bf16* v_pool = nullptr;   // [num_slots, kv_stride]
  int64_t kv_stride = 0;
  // Rows of k_pool and v_pool. With it the ws kernel on 128-key tiles (impl 7, the automatic
  // choice on sm_90a) and the wgmma statistics kernel (AttentionStatsParams::impl 0) load a
  // key tile whose 16-key groups each sit in 16 consecutive pool rows (a pool block) as bulk
  // tensor copies (TMA) instead of per-thread cp.async; other tiles, and every tile when 0,
  // take the cp.async gathers. Default: 0
  int64_t num_slots = 0;
  const int32_t* ctx_slots = nullptr;  // [ctx_len] pool row of each key position
  int ctx_len = 0;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;             // softmax scale (1/sqrt(head_dim) typically)
  // Optional out: [num_q, n_heads] log2-domain log-sum-exp of the scaled scores
  // (log2(sum_j 2^(s_ij * scale * log2 e))); -inf for a row with no keys.
  float* lse = nullptr;
  // Tensor-core path block size: 4 warps (64 query-head rows, 2 blocks per SM) or 8 warps
  // (128 rows, 1 block per SM, half the K/V traffic per FLOP). 0: the default (8).
  int warps = 0;
  // Kernel choice for unsplit head_dim-128 attention: 0 auto (the warp-specialised wgmma kernel
  // of attention_sm90.cu when this build and the device are sm_90a, else mma.sync), 1 mma.sync,
  // 2 wgmma, 3 wgmma with the next tile's Q K^T overlapping this tile's softmax, 4 wgmma
  // warp-specialised (a producer warpgroup loads the K/V stages, the warpgroups wait on mbarriers),
  // 5 the same with the consumer warpgroups taking turns at the tensor cores (ping-pong), 6 the
  // ws kernel with each warpgroup's next Q K^T overlapping its softmax (ws pipelined), 7 the ws
  // kernel on 128-key tiles, 8 the same with the softmax's row sums on the tensor cores.
  // Split-K (decode) always uses mma.sync; the statistics pass uses wgmma only with 2 or 3.
  // Default: 0
  int impl = 0;
  // Optional fused selection statistic (the cross mass of AttentionStatsParams computed in the
  // online softmax, no second pass): out_cross[i] += (1/n_heads) sum_h of the probability row i
  // puts on keys whose key_group is >= 0 and differs from q_group[i]. Device arrays; the launch
  // is not split over the key axis when set.
  const int32_t* key_group = nullptr;  // [ctx_len]
  const int32_t* q_group = nullptr;    // [num_q]
  float* out_cross = nullptr;          // [num_q]
  // Optional batch of sequences (batched decode), tensor-core path only: rows
  // [seq_rows[s], seq_rows[s + 1]) belong to sequence s, whose key positions 0..seq_ctx_len[s]-1
  // live at ctx_slots[seq_ctx_start[s] + j] (ctx_len unused). Each sequence may hold at most
  // PagedAttentionMaxRowsPerSeq(p) rows; no statistics, no fused cross mass.
  int num_seqs = 0;
  const int32_t* seq_rows = nullptr;       // [num_seqs + 1] device
  const int32_t* seq_ctx_start = nullptr;  // [num_seqs] device
  const int32_t* seq_ctx_len = nullptr;    // [num_seqs] device
  int max_seq_ctx = 0;                     // the largest seq_ctx_len (plans the key split)
  // The most rows any sequence holds (host-known). When it times G fits one 16-row MMA tile
  // (decode: one row per sequence), the packed decode kernel of attention_decode.cu takes the
  // call: a sequence's G query heads share one tile and the block's warps split the keys, each
  // with its own cp.async pipeline. 0: unknown (the general tile kernel).
  int max_seq_rows = 0;
  // Batched-call kernel: 0 auto (packed decode kernel when it fits), 1 the general tile kernel,
  // 2 the packed kernel with 32-key tiles (comparisons). Default: 0
  int decode_kernel = 0;
  // Split-K of short launches (decode): the key axis is divided so the launch fills about
  // split_waves blocks per SM (capped at 64 splits and two 64-key tiles per split). 0: two for
  // launches of at most 16 blocks, else one (measured, docs/perf-notes.md v9).
  int split_waves = 0;
  // The packed decode kernel requests the key tiles below every row's position before its
  // programmatic-launch wait (kernels/common.cuh), overlapping the kernels before it (the
  // step's RoPE + K/V write, which may let it start during the qkv projection:
  // RopeArgs::trigger_first). Only where nothing those two kernels write is read early: they
  // write keys at the rows' own positions only (every key below them is older), and the
  // position and slot tables were staged before them (the backend sets this only when its
  // tables were staged by an earlier call; a fresh stage is a copy kernel right before this
  // one). The qkv projection waits before it lets the RoPE start, and a kernel that has
  // finished had passed its own wait, so when this one starts every kernel before the qkv
  // projection has finished. Default: 0
  int decode_early_kv = 0;
};

// Selection statistics, computed from p.lse (the softmax normaliser of PagedAttention) in a
// second pass over the keys; no N x N matrix is formed. Results are accumulated (+=) into
// device fp32 arrays.
struct AttentionStatsParams {
  const int32_t* key_group = nullptr;  // [ctx_len] segment of each key; negative: shared (ignored)
  const int32_t* q_group = nullptr;    // [num_q] segment of each query row
  const float* recv_weight = nullptr;  // [num_q] weight of each row's attention onto keys
  // out_cross[i] += (1/n_heads) sum_h sum_{j: key_group[j] >= 0, != q_group[i]} p_h(i, j)
  float* out_cross = nullptr;          // [num_q] or null
  // out_recv[j] += sum_{i: recv_weight[i] > 0} recv_weight[i] * (1/n_heads) sum_h p_h(i, j)
  float* out_recv = nullptr;           // [ctx_len] or null
  // The cross mass by its complement, for an attention pass that ran elsewhere (cuDNN) and left
  // only its normaliser: out_cross[i] += (1/n_heads) sum_h clamp(1 - sum_{j <= lim_i:
  // key_group[j] < 0 or == q_group[i]} p_h(i, j), 0, 1). A block whose rows carry no recv weight
  // reads only the key tiles holding such keys for one of its rows (tile_groups), so a row of a
  // 4K segment in a 32K prompt reads about its own segment instead of every earlier key.
  // Tensor-core path (head_dim 64 / 128, mma.sync) only; needs out_cross, key_group, q_group.
  bool cross_complement = false;
  // [2 * ceil(ctx_len / kStatsTileKeys)]: per key tile its smallest and largest key_group >= 0,
  // or (INT32_MIN, INT32_MAX) when it holds a key with key_group < 0. Device array.
  const int32_t* tile_groups = nullptr;
  // The normaliser in cuDNN's layout, used instead of p.lse when set: [n_heads, num_q], the
  // natural-log log-sum-exp of the scaled scores (element head * num_q + row).
  const float* lse_by_head = nullptr;
  // Complement pass with received attention: host-known rows [recv_rows_begin, recv_rows_end)
  // hold every row with recv_weight > 0 (the new tokens). When set (end > begin), their
  // received attention runs in blocks of their own, each over a part of the keys, ahead of the
  // cross-mass blocks, which then read only their own segments: the few weighted rows' reads of
  // every key no longer trail the launch (6.40 ms a layer at 32K on an H100, of which 2.4 were
  // that tail). A weighted row outside the range would lose its received attention. 0, 0: off.
  int recv_rows_begin = 0;
  int recv_rows_end = 0;
  // For the wgmma kernel (impl below): the rows with recv_weight > 0 among those, ascending
  // (device array), so that its received-attention blocks read only those rows' Q; a range's
  // rows without weight cost a full pass there (a reuse prefill weights every row outside the
  // reused segments, such as an early token in no segment, which stretched the range over the
  // prompt: 40 ms a layer). Null: every row of the range.
  const int32_t* recv_rows = nullptr;
  int num_recv_rows = 0;
  // Kernel of the statistics by complement: 0 auto (on sm_90a with head_dim 128, the wgmma
  // kernel of attention_stats_sm90.cu, the received attention, when asked for, in blocks of
  // its own in the same launch: that needs recv_rows_begin/end, else all on mma.sync),
  // 1 mma.sync (comparisons). Default: 0
  int impl = 0;
};

// Keys per tile of AttentionStatsParams::tile_groups (the tensor-core kernels' key step).
constexpr int kStatsTileKeys = 64;


// Device workspace PagedAttention needs for p (split-K partials); 0 when it splits nothing.
size_t PagedAttentionWorkspaceBytes(const PagedAttentionParams& p);

// Returns cudaErrorInvalidValue for unsupported shapes (head_dim not 64/128 and above 64,
// n_heads not a multiple of n_kv_heads, misaligned rows for the tensor-core path) and when
// workspace_bytes < PagedAttentionWorkspaceBytes(p).
cudaError_t PagedAttention(const PagedAttentionParams& p, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

// Second pass computing the statistics of s from p (p.lse must hold PagedAttention's output,
// or s.lse_by_head cuDNN's).
cudaError_t AttentionStats(const PagedAttentionParams& p, const AttentionStatsParams& s,
                           cudaStream_t stream);

// Rows one sequence of a batched call (num_seqs > 0) may hold; 0 when p's shapes have no
// batched path (head_dim other than 64/128, misaligned rows).
int PagedAttentionMaxRowsPerSeq(const PagedAttentionParams& p);

// Whether PagedAttention supports these sizes (used by adapters to report a clear error).
bool PagedAttentionSupported(int head_dim, int n_heads, int n_kv_heads);

}  // namespace sparsex::kernels

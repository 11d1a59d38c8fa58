// Hopper wgmma path of PagedAttention (kernels/attention_sm90.cu); PagedAttention dispatches to
// it, callers normally do not use it directly.
#pragma once

#include "kernels/attention.h"

namespace sparsex::kernels {

// True when this build carries sm_90a code and the current device is compute capability 9.0.
bool Sm90AttentionAvailable();
// Whether the shapes and alignment of p suit the wgmma kernel (head_dim 128, 128 % G == 0,
// 16-byte aligned rows).
bool Sm90AttentionSupports(const PagedAttentionParams& p);
// The wgmma kernel's variants: one step after the other (plain); the next tile's Q K^T
// overlapping this tile's softmax (pipelined); a producer warpgroup loading the K/V stages for the
// two consumer warpgroups through mbarriers (warp-specialised); the same with the consumer
// warpgroups taking turns at the tensor cores (ws ping-pong); the same with each
// warpgroup's next Q K^T overlapping its softmax (ws pipelined); ws on 128-key tiles (ws 128);
// ws 128 with the softmax's row sums on the tensor cores (P times a block of ones).
enum class Sm90Variant {
  kPlain,
  kPipelined,
  kWarpSpecialized,
  kWsPingPong,
  kWsPipelined,
  kWs128,
  kWs128RowSum
};
// Unsplit attention for p (out and, when set, lse).
cudaError_t Sm90PagedAttention(const PagedAttentionParams& p, Sm90Variant variant,
                               cudaStream_t stream);
// The statistics pass of AttentionStats on wgmma (p.lse from the attention pass).
cudaError_t Sm90AttentionStats(const PagedAttentionParams& p, const AttentionStatsParams& s,
                               cudaStream_t stream);
// The cross mass by complement of s (s.cross_complement, out_cross, q_group, key_group,
// tile_groups; the normaliser from s.lse_by_head or p.lse) and, when s.out_recv is set, the
// received attention of rows [s.recv_rows_begin, s.recv_rows_end), on wgmma
// (kernels/attention_stats_sm90.cu).
cudaError_t Sm90CrossComplement(const PagedAttentionParams& p, const AttentionStatsParams& s,
                                cudaStream_t stream);

}  // namespace sparsex::kernels

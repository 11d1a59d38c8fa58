// Packed decode path of PagedAttention (kernels/attention_decode.cu); PagedAttention dispatches
// to it, callers normally do not use it directly.
//
// The general tile kernel gives a batched decode call one block per (sequence, KV head) whose
// 64-128 MMA rows are (head-in-group, query row) pairs: with one query row per sequence, G of
// them are live, each in a different warp, and the block moves its keys through one
// double-buffered pipeline behind block-wide barriers. Here a sequence's (query row, head) pairs
// are packed into one 16-row tile that every warp holds; the warps take interleaved key tiles,
// each with its own multi-stage cp.async pipeline (no block barrier in the loop), and merge
// their partial softmax states in shared memory at the end.
#pragma once

#include "kernels/attention.h"

namespace sparsex::kernels {

// Whether the packed kernel takes p: a batched call (num_seqs > 0) whose max_seq_rows x G fits
// 16 rows, head_dim 64 or 128, decode_kernel not 1. The caller has checked the tensor-core
// path's alignment.
bool DecodeAttentionSupports(const PagedAttentionParams& p);
// Runs p. ws_o / ws_lse null: writes p.out (and p.lse); else each split's partial output and
// log2 sum-exp in the layout the split-K combine kernel reads ([splits, num_q, n_heads, hd] and
// [splits, num_q, n_heads]).
cudaError_t DecodeAttention(const PagedAttentionParams& p, float* ws_o, float* ws_lse,
                            int splits, cudaStream_t stream);

}  // namespace sparsex::kernels

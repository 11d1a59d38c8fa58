// Host side of the selection statistics taken by complement (the CUDA backend's
// CudaBackendOptions::cudnn_statistics): the attention pass of a full layer runs on cuDNN,
// which leaves only each row's softmax normaliser, and a second pass reads just the keys of
// each row's own segment and the shared keys, whose probability mass is 1 minus the
// cross-segment mass (kernels::AttentionStatsParams::cross_complement). Plain C++, so the
// planning is tested without a GPU.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace sparsex {

// Per tile of tile_keys keys: {smallest, largest} key_group >= 0 in the tile, or {INT32_MIN,
// INT32_MAX} when the tile holds a shared key (key_group < 0), which every row reads
// (kernels::AttentionStatsParams::tile_groups). 2 * ceil(key_group.size() / tile_keys) ints.
std::vector<int32_t> StatsTileGroups(std::span<const int32_t> key_group, int tile_keys);

// The share of the key tiles a plain attention pass reads that the complement pass reads, for
// rows in blocks of rows_per_block consecutive rows (the kernel's query tile), each block up to
// its latest row's causal limit: a block whose rows carry a recv weight reads every tile; any
// other only the shared tiles and those whose segment range meets its rows' segments. 0 for no
// rows. tile_groups from StatsTileGroups over the same keys. The CUDA backend takes the
// complement where this is at most CudaBackendOptions::cudnn_statistics_max_share.
double ComplementReadShare(std::span<const int32_t> q_pos, std::span<const int32_t> q_group,
                           std::span<const float> recv_weight,
                           std::span<const int32_t> tile_groups, int tile_keys,
                           int64_t ctx_len, int rows_per_block);

}  // namespace sparsex

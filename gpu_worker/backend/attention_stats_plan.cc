#include "gpu_worker/backend/attention_stats_plan.h"

#include <algorithm>
#include <limits>

namespace sparsex {

std::vector<int32_t> StatsTileGroups(std::span<const int32_t> key_group, int tile_keys) {
  const int64_t n = static_cast<int64_t>(key_group.size());
  const int64_t tiles = tile_keys > 0 ? (n + tile_keys - 1) / tile_keys : 0;
  std::vector<int32_t> out(2 * tiles);
  for (int64_t t = 0; t < tiles; ++t) {
    int32_t lo = std::numeric_limits<int32_t>::max(), hi = -1;
    bool shared = false;
    for (int64_t j = t * tile_keys; j < std::min(n, (t + 1) * tile_keys); ++j) {
      const int32_t g = key_group[j];
      if (g < 0) {
        shared = true;
        break;
      }
      lo = std::min(lo, g);
      hi = std::max(hi, g);
    }
    out[2 * t] = shared ? std::numeric_limits<int32_t>::min() : lo;
    out[2 * t + 1] = shared ? std::numeric_limits<int32_t>::max() : hi;
  }
  return out;
}

double ComplementReadShare(std::span<const int32_t> q_pos, std::span<const int32_t> q_group,
                           std::span<const float> recv_weight,
                           std::span<const int32_t> tile_groups, int tile_keys,
                           int64_t ctx_len, int rows_per_block) {
  const int64_t n = static_cast<int64_t>(q_pos.size());
  const int64_t tiles = static_cast<int64_t>(tile_groups.size()) / 2;
  if (n == 0 || ctx_len <= 0 || tile_keys <= 0 || rows_per_block <= 0) return 0.0;
  int64_t plain = 0, complement = 0;
  for (int64_t b = 0; b < n; b += rows_per_block) {
    int64_t lim = -1;
    int32_t lo = std::numeric_limits<int32_t>::max(), hi = -1;
    bool weighted = false;
    for (int64_t i = b; i < std::min(n, b + rows_per_block); ++i) {
      const int64_t l = std::min<int64_t>(q_pos[i], ctx_len - 1);
      if (l < 0) continue;
      lim = std::max(lim, l);
      if (i < static_cast<int64_t>(recv_weight.size()) && recv_weight[i] > 0) weighted = true;
      const int32_t g = i < static_cast<int64_t>(q_group.size()) ? q_group[i] : -1;
      if (g >= 0) {
        lo = std::min(lo, g);
        hi = std::max(hi, g);
      }
    }
    if (lim < 0) continue;
    const int64_t end = std::min(tiles, lim / tile_keys + 1);
    plain += end;
    if (weighted) {
      complement += end;
      continue;
    }
    for (int64_t t = 0; t < end; ++t) {
      if (tile_groups[2 * t + 1] >= lo && tile_groups[2 * t] <= hi) ++complement;
    }
  }
  return plain > 0 ? static_cast<double>(complement) / static_cast<double>(plain) : 0.0;
}

}  // namespace sparsex

#include "model/chunking.h"

#include <algorithm>

#include "common/hash.h"

namespace sparsex {

std::vector<std::pair<int, int>> ChunkTokens(std::span<const int32_t> ids,
                                             const ChunkingOptions& o) {
  std::vector<std::pair<int, int>> out;
  const int n = static_cast<int>(ids.size());
  const int min_len = std::max(1, o.min_tokens);
  const int max_len = std::max(min_len, o.max_tokens);
  uint64_t mask = 1;
  while (mask * 2 <= static_cast<uint64_t>(std::max(1, o.avg_tokens - min_len))) mask *= 2;
  mask -= 1;
  const int w = std::max(1, o.window);
  int start = 0;
  for (int i = 0; i < n; ++i) {
    const int len = i - start + 1;
    bool cut = len >= max_len;
    if (!cut && len >= min_len && i + 1 >= w) {
      // Hash of the window ending at i: identical content gives identical cuts anywhere.
      const uint64_t h = Hash64(ids.data() + i + 1 - w, sizeof(int32_t) * w, 0x5ea5e0c5);
      cut = (h & mask) == 0;
    }
    if (cut) {
      out.emplace_back(start, i + 1);
      start = i + 1;
    }
  }
  if (start < n) out.emplace_back(start, n);
  return out;
}

}  // namespace sparsex

// Content-defined chunking over token ids: splits a plain prompt into segments whose boundaries
// depend only on nearby content, so a span repeated anywhere (at any offset) tends to be cut
// into the same segments and found in the segment store without any separator.
//
//   auto segs = ChunkTokens(ids, {.min_tokens = 32, .avg_tokens = 64, .max_tokens = 128});
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace sparsex {

struct ChunkingOptions {
  int min_tokens = 32;   // no boundary before this many tokens. Default: 32
  int avg_tokens = 64;   // expected chunk length (rounded to a power of two). Default: 64
  int max_tokens = 256;  // forced boundary. Default: 256
  int window = 8;        // tokens in the rolling window that decides a boundary. Default: 8
};

// Returns [begin, end) token ranges covering ids in order. Deterministic across processes:
// the boundary test is a fixed hash of the last `window` token ids.
std::vector<std::pair<int, int>> ChunkTokens(std::span<const int32_t> ids,
                                             const ChunkingOptions& opts);

}  // namespace sparsex

// Deterministic synthetic KV blocks, for the cli, the benchmark and the tests: the same
// (seed, segment, layer) gives the same bytes in every process, so a reader can check a
// block fetched from another process byte for byte.
//
//   SyntheticShape s{.num_tokens = 16, .kv_dim = 64};
//   BlockKey k = SyntheticKey(seed, seg, layer);
//   std::string block = SyntheticBlock(model_fp, seed, seg, layer, s);
#pragma once

#include <cstdint>
#include <string>

#include "cache_client/block_key.h"
#include "common/kv_block.h"

namespace sparsex::cache {

struct SyntheticShape {
  uint32_t num_tokens = 16;
  uint32_t kv_dim = 64;
  KvDtype dtype = KvDtype::kBF16;
};

Hash128 SyntheticModel(uint64_t seed);
Hash128 SyntheticSegment(uint64_t seed, uint64_t segment);
// One layer of a synthetic segment: layers [layer, layer + 1).
BlockKey SyntheticKey(uint64_t seed, uint64_t segment, uint32_t layer);
std::string SyntheticBlock(const Hash128& model_fp, uint64_t seed, uint64_t segment,
                           uint32_t layer, const SyntheticShape& shape);
// Same, into `out` (exactly the encoded size), without allocating.
absl::Status SyntheticBlockInto(const Hash128& model_fp, uint64_t seed, uint64_t segment,
                                uint32_t layer, const SyntheticShape& shape,
                                std::span<uint8_t> out);
uint64_t SyntheticBlockBytes(const SyntheticShape& shape);

}  // namespace sparsex::cache

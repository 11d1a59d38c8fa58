#include "cache_server/synthetic.h"

#include <cstring>

namespace sparsex::cache {

Hash128 SyntheticModel(uint64_t seed) {
  Hasher h;
  h.Str("sparsex.synthetic.model").U64(seed);
  return h.Finish();
}

Hash128 SyntheticSegment(uint64_t seed, uint64_t segment) {
  Hasher h;
  h.Str("sparsex.synthetic.segment").U64(seed).U64(segment);
  return h.Finish();
}

BlockKey SyntheticKey(uint64_t seed, uint64_t segment, uint32_t layer) {
  return BlockKey{SyntheticSegment(seed, segment), layer, layer + 1};
}

static KvBlockHeader Header(const Hash128& model, uint64_t seed, uint64_t segment,
                            uint32_t layer, const SyntheticShape& s) {
  KvBlockHeader h;
  h.model_fp = model;
  h.segment_fp = SyntheticSegment(seed, segment);
  h.layer_begin = layer;
  h.layer_end = layer + 1;
  h.num_tokens = s.num_tokens;
  h.kv_dim = s.kv_dim;
  h.dtype = s.dtype;
  return h;
}

uint64_t SyntheticBlockBytes(const SyntheticShape& shape) {
  auto n = KvBlockEncodedBytes(Header({}, 0, 0, 0, shape));
  return n.ok() ? *n : 0;
}

absl::Status SyntheticBlockInto(const Hash128& model, uint64_t seed, uint64_t segment,
                                uint32_t layer, const SyntheticShape& shape,
                                std::span<uint8_t> out) {
  KvBlockHeader h = Header(model, seed, segment, layer, shape);
  ASSIGN_OR_RETURN(uint64_t pb, KvPayloadBytes(h));
  if (out.size() != pb + kKvBlockHeaderBytes) {
    return absl::InvalidArgumentError("synthetic block: wrong output size");
  }
  uint8_t* p = out.data() + kKvBlockHeaderBytes;
  uint64_t x = Hash64(&segment, sizeof segment, seed) ^ (uint64_t{layer} * 0x9e3779b97f4a7c15ull);
  x |= 1;
  size_t i = 0;
  for (; i + 8 <= pb; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < pb; ++i) p[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
  return EncodeKvBlockInto(h, {p, pb}, out);
}

std::string SyntheticBlock(const Hash128& model, uint64_t seed, uint64_t segment,
                           uint32_t layer, const SyntheticShape& shape) {
  std::string s(SyntheticBlockBytes(shape), '\0');
  (void)SyntheticBlockInto(model, seed, segment, layer, shape,
                           {reinterpret_cast<uint8_t*>(s.data()), s.size()});
  return s;
}

}  // namespace sparsex::cache

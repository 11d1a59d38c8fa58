#include "common/fingerprint.h"

namespace sparsex {

Hash128 SegmentFingerprint(const Hash128& model_fp, std::span<const int32_t> tokens,
                           std::string_view encoding) {
  Hasher h;
  h.Str("sparsex.segment").U64(kKvLayoutVersion).U64(model_fp.hi).U64(model_fp.lo);
  h.Str(encoding).I32s(tokens);
  return h.Finish();
}

Hash128 PrefixBlockHash(const Hash128& model_fp, const Hash128& parent,
                        std::span<const int32_t> block_tokens) {
  Hasher h;
  h.Str("sparsex.prefix").U64(kKvLayoutVersion).U64(model_fp.hi).U64(model_fp.lo);
  h.U64(parent.hi).U64(parent.lo).I32s(block_tokens);
  return h.Finish();
}

}  // namespace sparsex

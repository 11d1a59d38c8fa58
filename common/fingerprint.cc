#include "common/fingerprint.h"

namespace sparsex {

Hash128 SegmentFingerprint(const Hash128& model_fp, std::span<const int32_t> tokens,
                           std::string_view encoding) {
  Hasher h;
  h.Str("sparsex.segment").U64(kKvLayoutVersion).U64(model_fp.hi).U64(model_fp.lo);
  h.Str(encoding).I32s(tokens);
  return h.Finish();
}

Hash128 ScopedModelFingerprint(const Hash128& model_fp, const Hash128& scope) {
  if (scope == Hash128{}) return model_fp;
  Hasher h;
  h.Str("sparsex.scope").U64(model_fp.hi).U64(model_fp.lo).U64(scope.hi).U64(scope.lo);
  return h.Finish();
}

Hash128 PrefixBlockHash(const Hash128& model_fp, const Hash128& parent,
                        std::span<const int32_t> block_tokens) {
  Hasher h;
  h.Str("sparsex.prefix").U64(kKvLayoutVersion).U64(model_fp.hi).U64(model_fp.lo);
  h.U64(parent.hi).U64(parent.lo).I32s(block_tokens);
  return h.Finish();
}

std::string FingerprintToBytes(const Hash128& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

absl::StatusOr<Hash128> FingerprintFromBytes(std::string_view s) {
  if (s.size() != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad_fingerprint: fingerprint must be 16 bytes, got ", s.size()));
  }
  Hash128 h;
  for (int i = 0; i < 8; ++i) {
    h.hi = (h.hi << 8) | static_cast<unsigned char>(s[i]);
    h.lo = (h.lo << 8) | static_cast<unsigned char>(s[8 + i]);
  }
  return h;
}

}  // namespace sparsex

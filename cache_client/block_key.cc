#include "cache_client/block_key.h"

#include "common/fingerprint.h"

namespace sparsex::cache {
namespace {

void PutBE64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (56 - 8 * i));
}
void PutBE32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (24 - 8 * i));
}
uint64_t GetBE64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
uint32_t GetBE32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

std::string BlockKey::ToString() const {
  return absl::StrCat(segment.Hex(), "[", layer_begin, ",", layer_end, ")");
}

absl::Status ValidateBlockKey(const BlockKey& k) {
  if (k.layer_end <= k.layer_begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad_key: empty layer range in ", k.ToString()));
  }
  return absl::OkStatus();
}

std::string EncodeStoreKey(const BlockKey& k) {
  std::string s(kStoreKeyBytes, '\0');
  PutBE64(s.data(), k.segment.hi);
  PutBE64(s.data() + 8, k.segment.lo);
  PutBE32(s.data() + 16, k.layer_begin);
  PutBE32(s.data() + 20, k.layer_end);
  return s;
}

absl::StatusOr<BlockKey> DecodeStoreKey(std::string_view s) {
  if (s.size() != kStoreKeyBytes) {
    return absl::DataLossError(absl::StrCat("store key of ", s.size(), " bytes"));
  }
  BlockKey k;
  k.segment = {GetBE64(s.data()), GetBE64(s.data() + 8)};
  k.layer_begin = GetBE32(s.data() + 16);
  k.layer_end = GetBE32(s.data() + 20);
  return k;
}

std::string EncodeFingerprint(const Hash128& h) { return FingerprintToBytes(h); }

absl::StatusOr<Hash128> DecodeFingerprint(std::string_view s) { return FingerprintFromBytes(s); }

}  // namespace sparsex::cache

// Identity of one cached block: layers [layer_begin, layer_end) of a segment's KV. All layers of
// a segment live on the same cache server (placement hashes the segment fingerprint only), so a
// worker leases a whole segment, layer by layer, in one request.
//
//   BlockKey k{seg_fp, 0, 1};                // layer 0 of the segment
//   std::string db_key = EncodeStoreKey(k);  // 24 bytes, sorts by segment then layer
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/hash.h"
#include "common/status.h"

namespace sparsex::cache {

struct BlockKey {
  Hash128 segment;
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;

  bool operator==(const BlockKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockKey& k) {
    return H::combine(std::move(h), k.segment, k.layer_begin, k.layer_end);
  }
  // "<32 hex>[b,e)"
  std::string ToString() const;
};

// INVALID_ARGUMENT for an empty layer range.
absl::Status ValidateBlockKey(const BlockKey& k);

// 24-byte big-endian key: segment hi, segment lo, layer_begin, layer_end.
inline constexpr size_t kStoreKeyBytes = 24;
std::string EncodeStoreKey(const BlockKey& k);
absl::StatusOr<BlockKey> DecodeStoreKey(std::string_view s);

// 16-byte big-endian Hash128 (the proto's fingerprint encoding).
std::string EncodeFingerprint(const Hash128& h);
absl::StatusOr<Hash128> DecodeFingerprint(std::string_view s);

}  // namespace sparsex::cache

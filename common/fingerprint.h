// Fingerprints of KV content. Deterministic across processes and machines (XXH3, fixed
// serialisation, no seeds); every key includes the model fingerprint and the KV layout version,
// so KV of another model or of an older layout can never be found.
//
//   Hash128 seg = SegmentFingerprint(model_fp, tokens, "none");
//   Hash128 b0 = PrefixBlockHash(model_fp, Hash128{}, block0_tokens);
//   Hash128 b1 = PrefixBlockHash(model_fp, b0, block1_tokens);   // chained
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/hash.h"
#include "common/status.h"

namespace sparsex {

// Bumped whenever the stored bytes of a segment change meaning (pre-RoPE K layout, dtype rules).
inline constexpr uint32_t kKvLayoutVersion = 1;

// Position-independent fingerprint of a segment's KV: the model, the layout version, the
// encoding context ("none", "bos", or "prefix:<hex>") and the token ids.
Hash128 SegmentFingerprint(const Hash128& model_fp, std::span<const int32_t> tokens,
                           std::string_view encoding);

// The model fingerprint a KV scope's segment keys derive from (router/auth.h: tenants and shared
// scopes): model_fp itself for the unscoped namespace (scope all zero), else a hash of both, so
// that the same tokens of two scopes never share a key in any tier.
Hash128 ScopedModelFingerprint(const Hash128& model_fp, const Hash128& scope);

// Chained hash of one full prefix block (vLLM-style): identical only when every token before it
// and in it is identical, for the same model. The first block's parent is the request's scope
// (all zero when unscoped), which keeps exact-prefix blocks of different scopes apart.
Hash128 PrefixBlockHash(const Hash128& model_fp, const Hash128& parent,
                        std::span<const int32_t> block_tokens);

// The wire encoding of a fingerprint in every proto: 16 bytes, big-endian, hi then lo.
std::string FingerprintToBytes(const Hash128& h);
// INVALID_ARGUMENT ("bad_fingerprint: ...") unless s is 16 bytes.
absl::StatusOr<Hash128> FingerprintFromBytes(std::string_view s);

}  // namespace sparsex

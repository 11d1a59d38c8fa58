#include "model/prompt.h"

#include <algorithm>

#include "common/fingerprint.h"

namespace sparsex {

std::vector<PromptSegment> ChunkPrompt(std::span<const int32_t> ids, const ChunkingOptions& o) {
  std::vector<PromptSegment> out;
  for (auto [b, e] : ChunkTokens(ids, o)) {
    PromptSegment s;
    s.tokens.assign(ids.begin() + b, ids.begin() + e);
    out.push_back(std::move(s));
  }
  return out;
}

Hash128 KvIdentity(const KvIdentityFields& f) {
  Hasher h;
  h.Str("sparsex.kv-identity.v1").U64(f.model_fp.hi).U64(f.model_fp.lo);
  h.U64(f.tokenizer_fp.hi).U64(f.tokenizer_fp.lo);
  h.Str(f.chat_template).Str(f.kv_dtype).Str(f.adapter);
  return h.Finish();
}

RequestFingerprints FingerprintRequest(const Hash128& model_fp,
                                       std::span<const PromptSegment> segments, int32_t bos_id,
                                       const FingerprintOptions& options) {
  RequestFingerprints f;
  std::vector<int32_t> all;
  if (bos_id >= 0) all.push_back(bos_id);
  for (const PromptSegment& s : segments) all.insert(all.end(), s.tokens.begin(), s.tokens.end());
  const size_t bs = static_cast<size_t>(std::max(1, options.block_size));
  Hash128 parent = options.prefix_scope;
  for (size_t i = 0; i + bs < all.size(); i += bs) {
    parent = PrefixBlockHash(model_fp, parent, std::span<const int32_t>(all.data() + i, bs));
    f.prefix_blocks.push_back(parent);
  }
  f.segments.reserve(segments.size());
  for (const PromptSegment& s : segments) {
    if (options.segments && s.cacheable && !s.tokens.empty()) {
      f.segments.push_back(SegmentFingerprint(ScopedModelFingerprint(model_fp, s.scope),
                                              s.tokens, options.encoding));
    } else {
      f.segments.push_back(std::nullopt);
    }
  }
  return f;
}

}  // namespace sparsex

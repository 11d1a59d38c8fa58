// A prompt as the engine and the router see it: a sequence of segments, with the one definition
// of the fingerprints a request's KV is found by. The router computes them to route; the worker
// computes the same ones to look its KV up (common/fingerprint.h holds the hash functions).
//
//   std::vector<PromptSegment> segs = ChunkPrompt(ids, ChunkingOptions{});
//   RequestFingerprints f = FingerprintRequest(model_fp, segs, bos_id, {.block_size = 16});
//   f.segments[i];       // the segment's fingerprint (absent for uncacheable or empty ones)
//   f.prefix_blocks;     // chained exact-prefix block hashes, as the block manager computes them
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/hash.h"
#include "model/chunking.h"

namespace sparsex {

struct PromptSegment {
  std::vector<int32_t> tokens;
  bool cacheable = true;  // look up and store this segment. Default: true
  // KV scope the segment is fingerprinted in (ScopedModelFingerprint); all zero: unscoped.
  // Default: unscoped
  Hash128 scope;
};

// Splits a plain prompt into segments by content-defined chunking.
std::vector<PromptSegment> ChunkPrompt(std::span<const int32_t> ids, const ChunkingOptions& o);

struct FingerprintOptions {
  int block_size = 16;              // KV block size of the exact-prefix cache. Default: 16
  std::string encoding = "none";    // segment encoding context. Default: "none"
  bool segments = true;             // fingerprint segments (false: reuse off). Default: true
  Hash128 prefix_scope;             // root of the exact-prefix block chain. Default: unscoped
};

struct RequestFingerprints {
  // Chained hashes of every full block before the block holding the last token (the last token
  // is always computed, so its block is never an exact hit).
  std::vector<Hash128> prefix_blocks;
  // One entry per segment; nullopt for an uncacheable or empty segment, or with segments off.
  std::vector<std::optional<Hash128>> segments;
};

// The identity every KV key of a worker derives from (in place of the bare model fingerprint):
// each field that changes what KV a token sequence has, or which token sequence a text becomes.
// model_fp covers the weights and the configuration (RoPE included); the layout version is in
// every key already (common/fingerprint.h); the tenant's scope joins per key. Two workers whose
// identities differ never share a key in any tier.
struct KvIdentityFields {
  Hash128 model_fp;
  Hash128 tokenizer_fp;        // TokenizerFingerprint (model/model.h)
  std::string chat_template;   // as shipped; "" for none
  std::string kv_dtype;        // element type the backend computes and keeps KV in: f32 | bf16
  std::string adapter;         // LoRA or other adapter id; "" for none (none are served yet)
};
Hash128 KvIdentity(const KvIdentityFields& f);

// bos_id < 0: no BOS is prepended.
RequestFingerprints FingerprintRequest(const Hash128& model_fp,
                                       std::span<const PromptSegment> segments, int32_t bos_id,
                                       const FingerprintOptions& options);

}  // namespace sparsex

#include "router/prepare.h"

#include "common/fingerprint.h"
#include "common/random.h"
#include "common/utf8.h"
#include "model/prompt.h"
#include "proto/request_check.h"

namespace sparsex::router {
namespace {

namespace wpb = sparsex::worker::v1;

}  // namespace

absl::StatusOr<Prepared> PrepareRequest(const v1::GenerateRequest& req, const ModelInfo& model,
                                        const ChunkingOptions& chunking,
                                        const ServedIdentity& ident,
                                        const CallerScopes& scopes) {
  Prepared p;
  const Tokenizer& tok = *model.tokenizer;
  const ModelConfig& cfg = model.config;
  // The worker API is proto3: an invalid UTF-8 request_id would fail there with an empty
  // INTERNAL error, so it is refused here, naming the field.
  if (!IsValidUtf8(req.request_id())) {
    return absl::InvalidArgumentError("request_id: invalid UTF-8");
  }
  const bool has_prompt = !req.prompt().empty() || req.prompt_ids_size() > 0;
  if (req.segments_size() > 0 && has_prompt) {
    return absl::InvalidArgumentError("set either segments or prompt/prompt_ids, not both");
  }
  if (!req.prompt().empty() && req.prompt_ids_size() > 0) {
    return absl::InvalidArgumentError("set either prompt or prompt_ids, not both");
  }
  std::vector<PromptSegment> segs;
  if (req.segments_size() > 0) {
    for (int i = 0; i < req.segments_size(); ++i) {
      const v1::Segment& s = req.segments(i);
      PromptSegment ps;
      ps.cacheable = s.has_cacheable() ? s.cacheable() : true;
      if (s.has_ids()) {
        ps.tokens.assign(s.ids().ids().begin(), s.ids().ids().end());
      } else {
        if (!IsValidUtf8(s.text())) {
          return absl::InvalidArgumentError(absl::StrCat("segment ", i, ": invalid UTF-8"));
        }
        ps.tokens = tok.Encode(s.text(), /*add_bos=*/false);
      }
      segs.push_back(std::move(ps));
    }
  } else if (has_prompt) {
    std::vector<int32_t> ids;
    if (!req.prompt().empty()) {
      if (!IsValidUtf8(req.prompt())) return absl::InvalidArgumentError("prompt: invalid UTF-8");
      ids = tok.Encode(req.prompt(), /*add_bos=*/false);
    } else {
      ids.assign(req.prompt_ids().begin(), req.prompt_ids().end());
    }
    segs = ChunkPrompt(ids, chunking);
  } else {
    return absl::InvalidArgumentError("empty request: set segments, prompt or prompt_ids");
  }
  const bool add_bos = req.has_add_bos() ? req.add_bos() : true;
  int n = (add_bos && tok.bos_id() >= 0) ? 1 : 0;
  for (const auto& s : segs) {
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= cfg.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " outside the vocabulary of ", cfg.vocab_size));
      }
    }
    n += static_cast<int>(s.tokens.size());
  }
  if (n == 0) return absl::InvalidArgumentError("empty prompt");
  if (n > cfg.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", n, " tokens exceeds the context length of ", cfg.max_seq_len));
  }
  RETURN_IF_ERROR(CheckSamplingRequest(req.sampling(), cfg.vocab_size));
  RETURN_IF_ERROR(CheckReuseRequest(req.reuse(), cfg.n_layers));
  RETURN_IF_ERROR(CheckLogprobsRequest(req.logprobs(), req.top_logprobs()));
  p.prompt_tokens = n;
  p.wreq.set_request_id(req.request_id().empty() ? "req-" + RandomHex(16) : req.request_id());
  p.wreq.set_add_bos(add_bos);
  *p.wreq.mutable_sampling() = req.sampling();
  *p.wreq.mutable_reuse() = req.reuse();
  p.wreq.set_return_token_ids(req.return_token_ids());
  p.wreq.set_logprobs(req.logprobs());
  p.wreq.set_top_logprobs(req.top_logprobs());
  const bool reuse_on = !req.reuse().has_enable() || req.reuse().enable();
  for (auto& s : segs) {
    s.scope = scopes.store;
    // A shared scope is used only where it holds the segment already: what a tenant computes
    // itself is stored in its own scope, so its private text never enters a shared one.
    if (ident.known && reuse_on && s.cacheable && !s.tokens.empty() && scopes.held) {
      for (const Hash128& r : scopes.read) {
        if (scopes.held(SegmentFingerprint(ScopedModelFingerprint(ident.fingerprint, r),
                                           s.tokens, ident.encoding))) {
          s.scope = r;
          break;
        }
      }
    }
  }
  for (const auto& s : segs) {
    wpb::TokenSegment* ts = p.wreq.add_segments();
    ts->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
    ts->set_cacheable(s.cacheable);
    if (!(s.scope == Hash128{})) ts->set_scope(FingerprintToBytes(s.scope));
  }
  if (!(scopes.store == Hash128{})) p.wreq.set_prefix_scope(FingerprintToBytes(scopes.store));
  // Routing hints: exact-prefix blocks (their tokens add to a worker's score on top of any
  // segment hit covering them: an exact hit needs no recompute) and segment fingerprints,
  // hashed as the workers hash them. Unknown until a worker has reported its identity.
  if (ident.known) {
    const RequestFingerprints f = FingerprintRequest(
        ident.fingerprint, segs, add_bos ? tok.bos_id() : -1,
        {.block_size = ident.block_size,
         .encoding = ident.encoding,
         .segments = reuse_on,
         .prefix_scope = scopes.store});
    for (const Hash128& h : f.prefix_blocks) {
      p.fps.push_back({h, ident.block_size, /*block=*/true});
    }
    for (size_t i = 0; i < segs.size(); ++i) {
      if (f.segments[i].has_value()) {
        p.fps.push_back({*f.segments[i], static_cast<int>(segs[i].tokens.size())});
      }
    }
  }
  return p;
}

}  // namespace sparsex::router

// The reference decode loop of the engine tests: one request alone on an Engine, prefill then
// one token at a time. Production generation (the worker and the CLI) runs through the
// scheduler (gpu_worker/scheduler/); this unbatched loop is what its batched, sliced and mixed
// passes are compared with.
//
//   GenerateRequest req{.prompt = ids, .sampling = {.max_tokens = 32}};
//   auto r = sparsex::testing::Generate(*engine, req, [](const TokenEvent& e) { return true; });
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "gpu_worker/engine/engine.h"
#include "gpu_worker/engine/sampler.h"

namespace sparsex {

// The reference loop's request, streamed token and result (test-only types).
struct TokenEvent {
  int32_t token;
  std::string text;  // newly completed UTF-8 text (may be empty mid-character)
};
using TokenCallback = std::function<bool(const TokenEvent&)>;  // false cancels

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

struct GenerateResult {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;  // "stop", "length" or "cancelled"
  int prompt_tokens = 0;
  int cached_tokens = 0;  // prompt tokens served from the prefix cache
};

namespace testing {

// Admits, prefills and decodes req until a stop token (the request's, the tokenizer's unless
// ignore_eos, or a generated BOS), max_tokens, the context length or cancellation; registers
// the sequence's blocks for prefix reuse and releases it.
inline absl::StatusOr<GenerateResult> Generate(Engine& engine, const GenerateRequest& req,
                                               const TokenCallback& cb) {
  RETURN_IF_ERROR(ValidateSampling(req.sampling));
  ASSIGN_OR_RETURN(Sequence seq, engine.Admit(req.prompt));
  GenerateResult res;
  res.prompt_tokens = static_cast<int>(req.prompt.size());
  res.cached_tokens = seq.cached_prefix;
  const Tokenizer& tok = engine.model().tokenizer();
  std::vector<int32_t> stops = req.sampling.stop_ids;
  if (!req.sampling.ignore_eos) {
    for (int32_t s : tok.StopIds()) stops.push_back(s);
    if (tok.bos_id() >= 0) stops.push_back(tok.bos_id());
  }
  Sampler sampler(req.sampling);
  StreamDecoder dec(tok);
  res.finish_reason = "length";
  absl::StatusOr<std::vector<float>> logits = engine.Prefill(seq);
  while (logits.ok() && static_cast<int>(res.tokens.size()) < req.sampling.max_tokens) {
    absl::StatusOr<int32_t> next = sampler.TrySample(*logits);
    if (!next.ok()) {
      logits = next.status();
      break;
    }
    if (std::find(stops.begin(), stops.end(), *next) != stops.end()) {
      res.finish_reason = "stop";
      break;
    }
    res.tokens.push_back(*next);
    TokenEvent ev{*next, dec.Push(*next)};
    res.text += ev.text;
    if (cb && !cb(ev)) {
      res.finish_reason = "cancelled";
      break;
    }
    if (static_cast<int>(res.tokens.size()) == req.sampling.max_tokens) break;
    if (static_cast<int>(seq.tokens.size()) >= engine.model().config().max_seq_len) break;
    logits = engine.Step(seq, *next);
  }
  if (logits.ok()) engine.RegisterPrefix(seq);
  engine.Release(seq);
  RETURN_IF_ERROR(logits.status());
  res.text += dec.Flush();
  return res;
}

// The next pass's chunks when several prompts prefill together (Engine::StepWithChunks): up
// to `per_pass` more tokens of every unfinished prompt in `ps`; `which` gets each chunk's
// index into ps. Empty when every prompt is computed.
inline std::vector<Engine::ChunkRef> NextChunks(std::vector<Sequence>& ps, int per_pass,
                                                std::vector<size_t>* which) {
  std::vector<Engine::ChunkRef> chunks;
  which->clear();
  for (size_t i = 0; i < ps.size(); ++i) {
    const int total = static_cast<int>(ps[i].tokens.size());
    if (ps[i].computed == total) continue;
    chunks.push_back({&ps[i], std::min(total, ps[i].computed + per_pass)});
    which->push_back(i);
  }
  return chunks;
}

}  // namespace testing
}  // namespace sparsex

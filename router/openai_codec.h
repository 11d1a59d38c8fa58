// The OpenAI JSON <-> SparseX proto mapping of the HTTP front end (http_frontend.cc keeps only
// civetweb: routes, bodies, SSE framing and the Status -> HTTP status mapping). Requests to
// POST /v1/completions and /v1/chat/completions become a v1::GenerateRequest plus what only the
// HTTP layer acts on (stream, stream_options.include_usage, stop strings); responses and
// streamed chunks are built from the router's v1::GenerateResponse pieces. No exceptions: a bad
// request is INVALID_ARGUMENT, its message naming the field ('top_k' must be ...) and the field
// also in the status (ErrorParam) for OpenAI's error.param. Body text is checked before it is
// parsed: valid UTF-8 and at most kMaxJsonDepth levels of nesting (common/json_depth.h).
//
//   ASSIGN_OR_RETURN(openai::Request r, openai::ParseRequest(body, openai::Endpoint::kChat));
//   router->Generate(r.req, sink, ctl);                    // r.stream, r.stop, r.include_usage
//   openai::StopFilter stop(r.stop);                       // per streamed chunk: stop.Push(...)
//   openai::ResponseMeta meta{id, created, model, /*chat=*/true};
//   openai::LogprobsTracker lp(meta.chat);                 // with r.req.logprobs()
//   json j = openai::Response(meta, text, "stop", usage, worker, lp.Take(text.size(), true));
//   // on error: HTTP status from the code, error.param = openai::ErrorParam(status)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "model/chat_template.h"
#include "model/model_info.h"
#include "proto/sparsex.pb.h"

namespace sparsex::router::openai {

enum class Endpoint { kCompletions, kChat };

// Log probabilities (OpenAI's limits): /v1/completions "logprobs": N alternatives, N in [0, 5];
// /v1/chat/completions "logprobs": true with "top_logprobs": N in [0, 20]. Both become
// GenerateRequest.logprobs / top_logprobs.
inline constexpr int kMaxCompletionLogprobs = 5;
inline constexpr int kMaxChatTopLogprobs = 20;

// The texts of a vocabulary's special (control) tokens, longest first per first byte.
struct SpecialTokens;

// How /v1/chat/completions turns messages into a prompt: the model's chat template, parsed once.
// Special-token text ("<|im_start|>", "<|start_header_id|>") becomes a control token only where
// the template wrote it; inside a message's content it is plain text, so a client cannot forge
// a turn of another role. A template that transforms content so that the client's special-token
// text cannot be kept apart (it cuts or re-encodes it) refuses such a message (INVALID_ARGUMENT
// naming messages[i].content); other messages are rendered as before.
struct ChatFormat {
  std::shared_ptr<const ChatTemplate> tmpl;  // null: no template (or one that did not parse)
  absl::Status template_error;               // the model's template did not parse: why
  ChatTemplateVars vars;                     // bos_token / eos_token text
  const Tokenizer* tokenizer = nullptr;      // encodes the rendered spans, special tokens parsed
  // The tokenizer's special tokens (MakeChatFormat); null: found from `tokenizer` per request.
  std::shared_ptr<const SpecialTokens> specials;
};
// A template that does not parse is kept as template_error: chat requests then fail saying why
// (UNIMPLEMENTED), never served without the template; /v1/completions is unaffected.
ChatFormat MakeChatFormat(const ModelInfo& model);

// Bounds checked on the request's text before any templating or tokenization.
inline constexpr size_t kDefaultMaxPromptBytes = size_t{4} << 20;  // 4 MiB
struct ParseLimits {
  // Prompt text: "prompt", segment texts and chat message contents together, in bytes; more is
  // INVALID_ARGUMENT naming the limit (the router's --max_prompt_bytes). Default: 4 MiB
  size_t max_prompt_bytes = kDefaultMaxPromptBytes;
};

// An OpenAI request mapped onto the public API.
struct Request {
  v1::GenerateRequest req;
  bool stream = false;             // "stream": server-sent events
  bool include_usage = false;      // "stream_options": {"include_usage"}: a final usage chunk
  std::vector<std::string> stop;   // "stop" strings (applied by StopFilter), empty ones dropped
  // Served, but not as the client may expect: the HTTP front end sends it as the response's
  // X-SparseX-Warning header (kNoChatTemplateWarning). "" when none.
  std::string warning;
};

// A chat request to a model without a chat template (a base model) is served with the
// messages' contents joined as plain text: no roles, no turn markers. It says so in this header
// value rather than being refused, so base models stay usable through chat clients.
inline constexpr char kNoChatTemplateWarning[] =
    "model has no chat template; messages joined as plain text";

// The body text of a request to `endpoint`: UTF-8, nesting depth, JSON syntax, a JSON object,
// then the fields as ParseCompletion / ParseChat. Every error is INVALID_ARGUMENT (but see
// ChatFormat). `chat` null: as a model without a chat template.
absl::StatusOr<Request> ParseRequest(std::string_view body, Endpoint endpoint,
                                     const ChatFormat* chat = nullptr,
                                     const ParseLimits& limits = {});

// POST /v1/completions: "prompt" (a string, token ids, or a one-element array of either) or the
// SparseX "segments" (strings, token-id arrays or {text, cacheable} objects), never both.
// Special-token text in a prompt or a segment's text stays text, as in OpenAI's and vLLM's
// completions: control tokens are sent as token ids.
absl::StatusOr<Request> ParseCompletion(const nlohmann::json& body,
                                        const ParseLimits& limits = {});
// POST /v1/chat/completions. Roles must be system, user, assistant, tool or developer.
// With a chat template: the prompt is the rendered conversation (generation prompt included),
// one token segment per message's rendered span (role header included) and the generation
// prompt last (not cacheable), so a re-sent turn or a repeated system prompt keeps its segment
// fingerprint; a template whose renderings are not prefix-stable gives the whole rendering as
// one plain prompt (chunked like /v1/completions). A BOS the template emits becomes add_bos
// (the shared sink), never a doubled token; add_bos defaults to whether the template emits it.
// Without a template (base models): each non-empty message's content is one segment, and
// Request::warning is kNoChatTemplateWarning.
absl::StatusOr<Request> ParseChat(const nlohmann::json& body, const ChatFormat* chat = nullptr,
                                  const ParseLimits& limits = {});

// The request field a parse error names (OpenAI's error.param, e.g. "reuse.full_layers"), ""
// when none or for a status that did not come from this codec.
std::string ErrorParam(const absl::Status& status);

// Applies stop strings to a growing text, holding back what could start a stop string.
//
//   StopFilter f({"\n\n"});
//   emit(f.Push(chunk_text, finished));  // text safe to emit; "" once stopped
//   if (f.stopped()) ...                 // a stop string was found: end the request
class StopFilter {
 public:
  explicit StopFilter(std::vector<std::string> stops);
  // New text in; text safe to emit out. `stopped` once a stop string was found.
  std::string Push(const std::string& text, bool final);
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  size_t hold_ = 0;
  std::string pending_;
  bool stopped_ = false;
};

// The log probabilities of a response in the endpoint's shape, for the tokens whose text
// reached the client. Completions (legacy): {tokens, token_logprobs, top_logprobs (a
// {token: logprob} object per token: the alternatives and the token itself), text_offset};
// chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
// refusal: null}. A -inf log-probability (a masked token) is written as -9999.0, as OpenAI does.
// text_offset: the characters (code points) of the earlier tokens' strings of this response.
//
//   LogprobsTracker lp(/*chat=*/false);
//   lp.Add(msg);                                    // each worker message's entries
//   json j = lp.Take(emitted_bytes, /*all=*/false);  // entries whose text is out; null if none
class LogprobsTracker {
 public:
  explicit LogprobsTracker(bool chat) : chat_(chat) {}
  void Add(const v1::GenerateResponse& m);
  // Takes the pending entries whose text starts before byte `emitted` of the output text (the
  // bytes released to the client so far, measured by the tokens' bytes), or all of them with
  // `all`, in the endpoint's shape; null when there are none. A stop string that cut the output
  // leaves the tokens past the cut pending, never reported. `empty`: an empty object of the
  // shape instead of null when there is nothing (a whole response without tokens).
  nlohmann::json Take(size_t emitted, bool all, bool empty = false);

 private:
  bool chat_;
  std::vector<v1::TokenLogprob> pending_;
  size_t start_ = 0;         // byte offset in the output of pending_[0]'s text
  int64_t text_offset_ = 0;  // completions: characters of the tokens taken so far
};

// What every chunk of one response repeats.
struct ResponseMeta {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
  bool chat = false;    // chat.completion(.chunk) rather than text_completion
};

// OpenAI usage plus cached_tokens and the SparseX breakdown (under "sparsex").
nlohmann::json UsageJson(const v1::Usage& usage, const std::string& worker);
// One streamed chunk carrying `delta`; finish_reason null until the last one.
// `logprobs`: LogprobsTracker::Take's (null: none).
nlohmann::json StreamChunk(const ResponseMeta& meta, const std::string& delta,
                           const nlohmann::json& finish_reason = nullptr,
                           const nlohmann::json& logprobs = nullptr);
// Chat's first streamed chunk: the assistant role with empty content.
nlohmann::json StreamRoleChunk(const ResponseMeta& meta);
// The final usage chunk of stream_options.include_usage (no choices).
nlohmann::json StreamUsageChunk(const ResponseMeta& meta, const v1::Usage& usage,
                                const std::string& worker);
// The whole response of a request that did not stream.
nlohmann::json Response(const ResponseMeta& meta, const std::string& text,
                        const std::string& finish_reason, const v1::Usage& usage,
                        const std::string& worker, const nlohmann::json& logprobs = nullptr);

}  // namespace sparsex::router::openai

// Chat templates: the Jinja subset that models ship in tokenizer_config.json "chat_template"
// and GGUF "tokenizer.chat_template" (Llama-3, Qwen2.5 / ChatML, Mistral, Gemma, Phi-3), with
// the environment Hugging Face transformers renders them in (trim_blocks, lstrip_blocks, no
// autoescape, tojson keeping non-ASCII, raise_exception, break/continue), so a prompt is
// byte for byte what the model was trained on. Own implementation: no C++ Jinja is packaged.
//
//   ASSIGN_OR_RETURN(auto t, ChatTemplate::Parse(source));
//   ASSIGN_OR_RETURN(std::string prompt,
//                    t->Render(messages, {.add_generation_prompt = true, .bos_token = "<s>"}));
//   ASSIGN_OR_RETURN(ChatSpans s, RenderChatSpans(*t, messages, vars));  // one span per message
//
// Supported: {{ }}, {% for/if/elif/else/set/break/continue/macro/generation %}, {# #}, whitespace
// control (-, +), loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem,
// namespace(), range(), strftime_now(), literals (string, int, float, bool, none, list, tuple,
// dict), attribute and subscript access, slices, + - * / // % ** ~, comparisons, and/or/not,
// in, a if b else c, tests (defined, none, string, number, mapping, sequence, ...), filters
// (trim, tojson, length, default, string, upper/lower, join, replace, first/last, list, map,
// select/selectattr and reject..., sort, unique, dictsort, min/max/sum, indent, items, int,
// float, ...) and string / dict methods (strip, split, startswith, replace, items, get, ...).
// Anything else (include, import, call blocks, caller()) is a parse error naming it. Case mapping covers
// Latin-1, Latin Extended-A, Greek and Cyrillic. Errors are INVALID_ARGUMENT with the template
// line; nothing throws out of this API.
//
// Bounded: the source size, nesting depth (blocks and expressions), loop iterations per render
// and output size are limited (ChatTemplateLimits); exceeding one is a clear error.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace sparsex {

struct ChatMessage {
  std::string role;
  std::string content;
};

struct ChatTemplateLimits {
  size_t max_source_bytes = size_t{1} << 20;   // Default: 1 MiB
  int max_depth = 64;                          // nested blocks / expressions. Default: 64
  // Macro calls in progress at once (each may nest max_depth deep: the product bounds the
  // renderer's stack). Default: 16
  int max_macro_depth = 16;
  int64_t max_iterations = 1 << 20;            // loop iterations per render. Default: 1M
  size_t max_output_bytes = size_t{64} << 20;  // per render. Default: 64 MiB
};

// The variables a chat template sees besides `messages`.
struct ChatTemplateVars {
  bool add_generation_prompt = false;
  std::string bos_token;  // the text of the model's BOS token ("" when it has none)
  std::string eos_token;
};

struct ChatSpans;
class ChatTemplate;
absl::StatusOr<ChatSpans> RenderChatSpans(const ChatTemplate& t,
                                          std::span<const ChatMessage> messages,
                                          const ChatTemplateVars& vars);

class ChatTemplate {
 public:
  // A parse error (syntax, unknown tag, filter or test) is INVALID_ARGUMENT naming the line.
  static absl::StatusOr<std::shared_ptr<const ChatTemplate>> Parse(
      std::string_view source, const ChatTemplateLimits& limits = {});
  ~ChatTemplate();

  // raise_exception("...") in the template becomes INVALID_ARGUMENT "chat template: ...".
  absl::StatusOr<std::string> Render(std::span<const ChatMessage> messages,
                                     const ChatTemplateVars& vars) const;
  // Any JSON object as the variables (tools, documents, extra message fields): tests and tools.
  absl::StatusOr<std::string> RenderJson(std::string_view context_json) const;

  struct Impl;

 private:
  friend absl::StatusOr<ChatSpans> RenderChatSpans(const ChatTemplate&,
                                                   std::span<const ChatMessage>,
                                                   const ChatTemplateVars&);
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A conversation rendered so that each message's text (its role header included) is a span of
// its own, so a re-sent turn or a repeated system prompt renders to the same span in every
// request. Spans are the differences of renderings of messages[0..i] (without the generation
// prompt); they need each rendering to be a prefix of the next. Templates that end a
// conversation with EOS when no generation prompt is asked (Phi-3) are tried again with that
// trailing EOS cut. When neither holds, `per_message` is false and `text` is the only span; so
// too past 256 messages (the spans cost a rendering per message, so they grow with the square
// of the conversation).
struct ChatSpans {
  std::string text;                // the whole prompt (vars.add_generation_prompt as given)
  bool per_message = false;
  std::vector<std::string> spans;  // per_message: one per message (some may be empty)
  std::string suffix;              // per_message: what follows the last message's span
  std::string fallback_reason;     // !per_message: why
};
absl::StatusOr<ChatSpans> RenderChatSpans(const ChatTemplate& t,
                                          std::span<const ChatMessage> messages,
                                          const ChatTemplateVars& vars);

}  // namespace sparsex

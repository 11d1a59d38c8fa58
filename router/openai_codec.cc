#include "router/openai_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "common/json_depth.h"
#include "common/random.h"
#include "common/usage.h"
#include "common/utf8.h"

namespace sparsex::router::openai {
namespace {

using json = nlohmann::json;

// The status payload that carries the field at fault (OpenAI's error.param).
constexpr char kParamUrl[] = "type.sparsex.dev/openai.error.param";

absl::Status FieldError(const std::string& param, const std::string& message) {
  absl::Status s = absl::InvalidArgumentError(message);
  if (!param.empty()) s.SetPayload(kParamUrl, absl::Cord(param));
  return s;
}

// The prompt-size bound, checked on the raw text before any templating or tokenization.
absl::Status CheckPromptBytes(const char* field, size_t bytes, const ParseLimits& limits) {
  if (bytes <= limits.max_prompt_bytes) return absl::OkStatus();
  return FieldError(field, absl::StrCat("prompt text of ", bytes,
                                        " bytes exceeds this router's limit of ",
                                        limits.max_prompt_bytes, " bytes (max_prompt_bytes)"));
}

// Field readers: a wrong type is INVALID_ARGUMENT naming the field.
absl::Status TypeError(const std::string& field, const std::string& want) {
  return FieldError(field, absl::StrCat("'", field, "' must be ", want));
}

// A JSON integer read into a field of type T: an integer literal, or a number with no fraction
// (2.0), within [lo, hi] (by default T's whole range). Anything else is INVALID_ARGUMENT naming
// the field: a value that does not fit is refused, never narrowed (2^32 + 403 is not token 403).
template <typename T>
absl::StatusOr<T> CheckedInt(const json& v, const std::string& field,
                             T lo = std::numeric_limits<T>::min(),
                             T hi = std::numeric_limits<T>::max()) {
  const auto bad = [&] {
    return TypeError(field, absl::StrCat("an integer in [", lo, ", ", hi, "]"));
  };
  __int128 x = 0;
  if (v.is_number_unsigned()) {
    x = v.get<uint64_t>();
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    // Whole numbers within +-2^64 (beyond, no T of ours fits; the cast below stays defined).
    if (!std::isfinite(d) || d != std::trunc(d) || std::fabs(d) >= 18446744073709551616.0) {
      return bad();
    }
    x = static_cast<__int128>(d);
  } else {
    return bad();
  }
  if (x < static_cast<__int128>(lo) || x > static_cast<__int128>(hi)) return bad();
  return static_cast<T>(x);
}

// Optional top-level fields: absent or null is nullopt.
bool Present(const json& b, const char* f) { return b.contains(f) && !b[f].is_null(); }

absl::StatusOr<std::optional<double>> OptNumber(const json& b, const char* f) {
  if (!Present(b, f)) return std::nullopt;
  if (!b[f].is_number()) return TypeError(f, "a number");
  return b[f].get<double>();
}

absl::StatusOr<std::optional<int64_t>> OptInt(const json& b, const char* f, int64_t lo,
                                              int64_t hi) {
  if (!Present(b, f)) return std::nullopt;
  ASSIGN_OR_RETURN(int64_t v, CheckedInt<int64_t>(b[f], f, lo, hi));
  return v;
}

absl::StatusOr<std::optional<bool>> OptBool(const json& b, const char* f) {
  if (!Present(b, f)) return std::nullopt;
  if (!b[f].is_boolean()) return TypeError(f, "a boolean");
  return b[f].get<bool>();
}

absl::Status ParseReuse(const json& ro, v1::ReuseOptions* o) {
  if (!ro.is_object()) return TypeError("reuse", "an object");
  // Inside "reuse", present means set: null is a type error, as for any other wrong type.
  const auto rb = [&](const char* f, void (v1::ReuseOptions::*set)(bool)) -> absl::Status {
    if (!ro.contains(f)) return absl::OkStatus();
    if (!ro[f].is_boolean()) return TypeError(absl::StrCat("reuse.", f), "a boolean");
    (o->*set)(ro[f].get<bool>());
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(rb("enable", &v1::ReuseOptions::set_enable));
  RETURN_IF_ERROR(rb("store_new_segments", &v1::ReuseOptions::set_store_new_segments));
  RETURN_IF_ERROR(rb("register_prefix", &v1::ReuseOptions::set_register_prefix));
  if (ro.contains("full_layers")) {
    ASSIGN_OR_RETURN(int32_t v, CheckedInt<int32_t>(ro["full_layers"], "reuse.full_layers"));
    o->set_full_layers(v);
  }
  if (ro.contains("store_after_misses")) {
    ASSIGN_OR_RETURN(int32_t v, CheckedInt<int32_t>(ro["store_after_misses"],
                                                    "reuse.store_after_misses"));
    o->set_store_after_misses(v);
  }
  if (ro.contains("recompute_ratio")) {
    if (!ro["recompute_ratio"].is_number()) {
      return TypeError("reuse.recompute_ratio", "a number");
    }
    o->set_recompute_ratio(ro["recompute_ratio"].get<float>());
  }
  if (ro.contains("selector")) {
    if (!ro["selector"].is_string()) return TypeError("reuse.selector", "a string");
    o->set_selector(ro["selector"].get<std::string>());
  }
  return absl::OkStatus();
}

// A value that asks for nothing: null, false, 0, "", [] or {}.
bool Neutral(const json& v) {
  if (v.is_null()) return true;
  if (v.is_boolean()) return !v.get<bool>();
  if (v.is_number()) return v.get<double>() == 0;
  if (v.is_string()) return v.get<std::string>().empty();
  if (v.is_array() || v.is_object()) return v.empty();
  return false;
}

// OpenAI request fields SparseX does not implement are refused with a 400 naming the field
// instead of being ignored (a client relying on one would silently get something else); at
// their neutral value (null, false, 0, empty; tool_choice "none"; response_format text;
// best_of 1; modalities ["text"]) they are accepted. `user` is accepted (a string, unused);
// logit_bias, the penalties and logprobs are implemented (ParseCommon, ParseLogprobs).
// Fields OpenAI does not define are ignored, as other OpenAI-compatible servers do.
absl::Status RefuseUnimplemented(const json& b) {
  for (const char* f : {"tools", "functions", "function_call", "parallel_tool_calls"}) {
    if (b.contains(f) && !Neutral(b[f])) {
      return FieldError(f, absl::StrCat("'", f, "': tool and function calling are not supported"));
    }
  }
  if (b.contains("tool_choice") && !Neutral(b["tool_choice"]) && b["tool_choice"] != "none") {
    return FieldError("tool_choice", "'tool_choice': tool calling is not supported");
  }
  if (Present(b, "response_format")) {
    const json& rf = b["response_format"];
    if (!rf.is_object() || !rf.contains("type") || rf["type"] != "text") {
      return FieldError("response_format",
                        "'response_format': only {\"type\": \"text\"} is supported (no JSON "
                        "mode or schema)");
    }
  }
  if (b.contains("suffix") && !Neutral(b["suffix"])) {
    return FieldError("suffix", "'suffix': insertion (suffix) is not supported");
  }
  if (Present(b, "best_of") && b["best_of"] != 1) {
    return FieldError("best_of", "'best_of': only best_of = 1 is supported");
  }
  if (Present(b, "modalities")) {
    const json& m = b["modalities"];
    if (!(m.is_array() && (m.empty() || (m.size() == 1 && m[0] == "text")))) {
      return FieldError("modalities", "'modalities': only [\"text\"] is supported");
    }
  }
  for (const char* f : {"audio", "prediction"}) {
    if (b.contains(f) && !Neutral(b[f])) {
      return FieldError(f, absl::StrCat("'", f, "' is not supported"));
    }
  }
  if (Present(b, "user") && !b["user"].is_string()) return TypeError("user", "a string");
  return absl::OkStatus();
}

// Log probabilities. /v1/completions (legacy): "logprobs" an integer in [0, 5], the number of
// alternatives ("top_logprobs" is not a field of that endpoint). /v1/chat/completions:
// "logprobs" a boolean and "top_logprobs" an integer in [0, 20], > 0 only with "logprobs": true.
absl::Status ParseLogprobs(const json& b, v1::GenerateRequest* r, bool chat) {
  if (!chat) {
    if (b.contains("top_logprobs") && !Neutral(b["top_logprobs"])) {
      return FieldError("top_logprobs",
                        "'top_logprobs' is a chat completions field; /v1/completions takes "
                        "'logprobs': N (alternatives per token, 0 to 5)");
    }
    ASSIGN_OR_RETURN(std::optional<int64_t> n, OptInt(b, "logprobs", 0, kMaxCompletionLogprobs));
    if (n) {
      r->set_logprobs(true);
      r->set_top_logprobs(static_cast<int32_t>(*n));
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::optional<bool> lp, OptBool(b, "logprobs"));
  ASSIGN_OR_RETURN(std::optional<int64_t> top, OptInt(b, "top_logprobs", 0, kMaxChatTopLogprobs));
  if (top && *top > 0 && !(lp && *lp)) {  // as vLLM: top_logprobs 0 asks for nothing
    return FieldError("top_logprobs", "'top_logprobs' requires 'logprobs': true");
  }
  if (lp && *lp) {
    r->set_logprobs(true);
    r->set_top_logprobs(static_cast<int32_t>(top.value_or(0)));
  }
  return absl::OkStatus();
}

// Sampling, reuse and the SparseX extensions shared by both endpoints. The fields are checked
// in a fixed order; the first bad one is the error.
absl::Status ParseCommon(const json& b, Request* p, bool chat) {
  RETURN_IF_ERROR(RefuseUnimplemented(b));
  v1::GenerateRequest& r = p->req;
  if (b.contains("model")) {
    if (!b["model"].is_string()) return TypeError("model", "a string");
    r.set_model(b["model"].get<std::string>());
  }
  v1::SamplingParams* s = r.mutable_sampling();
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  // OpenAI defaults: temperature 1, top_p 1, max_tokens 16.
  ASSIGN_OR_RETURN(std::optional<double> temperature, OptNumber(b, "temperature"));
  s->set_temperature(static_cast<float>(temperature.value_or(1.0)));
  ASSIGN_OR_RETURN(std::optional<double> top_p, OptNumber(b, "top_p"));
  if (top_p) s->set_top_p(static_cast<float>(*top_p));
  ASSIGN_OR_RETURN(std::optional<int64_t> top_k, OptInt(b, "top_k", 0, kInt32Max));
  if (top_k) s->set_top_k(static_cast<int32_t>(*top_k));
  if (Present(b, "seed")) {
    ASSIGN_OR_RETURN(uint64_t seed, CheckedInt<uint64_t>(b["seed"], "seed"));
    s->set_seed(seed);
  }
  // max_completion_tokens (OpenAI's newer name) on both endpoints; both given must agree.
  const char* mt_field = "max_tokens";
  if (Present(b, "max_tokens") && Present(b, "max_completion_tokens") &&
      b["max_tokens"] != b["max_completion_tokens"]) {
    return FieldError("max_completion_tokens",
                      "'max_completion_tokens' and 'max_tokens' disagree; set one");
  }
  if (!Present(b, mt_field)) mt_field = "max_completion_tokens";
  ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens, OptInt(b, mt_field, 1, 1 << 20));
  if (max_tokens) s->set_max_tokens(static_cast<int32_t>(*max_tokens));
  if (Present(b, "logit_bias")) {
    const json& lb = b["logit_bias"];
    if (!lb.is_object()) return TypeError("logit_bias", "an object of token id -> bias");
    if (lb.size() > 1024) return FieldError("logit_bias", "'logit_bias': at most 1024 entries");
    for (const auto& [key, val] : lb.items()) {
      int64_t id = -1;
      if (!absl::SimpleAtoi(key, &id) || id < 0 || id > kInt32Max) {
        return FieldError("logit_bias",
                          absl::StrCat("'logit_bias': key '", key, "' is not a token id"));
      }
      if (!val.is_number() || !(val.get<double>() >= -100.0 && val.get<double>() <= 100.0)) {
        return TypeError("logit_bias", "an object of token id -> a number in [-100, 100]");
      }
      (*s->mutable_logit_bias())[static_cast<int32_t>(id)] = val.get<float>();
    }
  }
  for (const char* f : {"presence_penalty", "frequency_penalty"}) {
    if (!Present(b, f)) continue;
    if (!b[f].is_number()) return TypeError(f, "a number in [-2, 2]");
    const double v = b[f].get<double>();
    if (!(v >= -2.0 && v <= 2.0)) return TypeError(f, "a number in [-2, 2]");
    if (std::string(f) == "presence_penalty") {
      s->set_presence_penalty(static_cast<float>(v));
    } else {
      s->set_frequency_penalty(static_cast<float>(v));
    }
  }
  ASSIGN_OR_RETURN(std::optional<bool> ignore_eos, OptBool(b, "ignore_eos"));
  if (ignore_eos) s->set_ignore_eos(*ignore_eos);
  ASSIGN_OR_RETURN(std::optional<int64_t> n,
                   OptInt(b, "n", std::numeric_limits<int64_t>::min(),
                          std::numeric_limits<int64_t>::max()));
  if (n && *n != 1) return FieldError("n", "only n = 1 is supported");
  ASSIGN_OR_RETURN(std::optional<bool> echo, OptBool(b, "echo"));
  if (echo && *echo) return FieldError("echo", "echo is not supported");
  ASSIGN_OR_RETURN(std::optional<bool> stream, OptBool(b, "stream"));
  if (stream) p->stream = *stream;
  // Lenient, as OpenAI's clients send it: anything but {"include_usage": <bool>} is ignored.
  if (b.contains("stream_options") && b["stream_options"].is_object()) {
    const json& so = b["stream_options"];
    if (so.contains("include_usage") && so["include_usage"].is_boolean()) {
      p->include_usage = so["include_usage"].get<bool>();
    }
  }
  if (Present(b, "stop")) {
    const json& st = b["stop"];
    if (st.is_string()) {
      p->stop.push_back(st.get<std::string>());
    } else if (st.is_array()) {
      for (const json& x : st) {
        if (!x.is_string()) return TypeError("stop", "a string or an array of strings");
        p->stop.push_back(x.get<std::string>());
      }
    } else {
      return TypeError("stop", "a string or an array of strings");
    }
    std::erase_if(p->stop, [](const std::string& x) { return x.empty(); });
  }
  RETURN_IF_ERROR(ParseLogprobs(b, &r, chat));
  ASSIGN_OR_RETURN(std::optional<bool> add_bos, OptBool(b, "add_bos"));
  if (add_bos) r.set_add_bos(*add_bos);
  if (Present(b, "reuse")) RETURN_IF_ERROR(ParseReuse(b["reuse"], r.mutable_reuse()));
  return absl::OkStatus();
}

absl::Status AddSegments(const json& segs, v1::GenerateRequest* r) {
  if (!segs.is_array()) return TypeError("segments", "an array of strings or token-id arrays");
  for (const json& s : segs) {
    v1::Segment* seg = r->add_segments();
    if (s.is_string()) {
      seg->set_text(s.get<std::string>());
    } else if (s.is_array()) {
      for (const json& t : s) {
        ASSIGN_OR_RETURN(int32_t id, CheckedInt<int32_t>(t, "segments[][]"));
        seg->mutable_ids()->add_ids(id);
      }
    } else if (s.is_object() && s.contains("text") && s["text"].is_string()) {
      seg->set_text(s["text"].get<std::string>());
      if (s.contains("cacheable") && s["cacheable"].is_boolean()) {
        seg->set_cacheable(s["cacheable"].get<bool>());
      }
    } else {
      return TypeError("segments", "strings, token-id arrays or {text, cacheable} objects");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> MessageText(const json& content) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return std::string();
  if (content.is_array()) {
    std::string out;
    for (const json& part : content) {
      if (part.is_object() && part.contains("type") && part["type"] == "text" &&
          part.contains("text") && part["text"].is_string()) {
        out += part["text"].get<std::string>();
      } else {
        return TypeError("messages[].content", "a string or an array of text parts");
      }
    }
    return out;
  }
  return TypeError("messages[].content", "a string or an array of text parts");
}

json ChoiceBase(const json& finish_reason) {
  return json{{"index", 0}, {"finish_reason", finish_reason}};
}

json Envelope(const ResponseMeta& meta, const char* object, json choices) {
  return json{{"id", meta.id},
              {"object", object},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", std::move(choices)}};
}

const char* ChunkObject(const ResponseMeta& meta) {
  return meta.chat ? "chat.completion.chunk" : "text_completion";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Chat content kept apart from the template's own special tokens.
//
// A rendered chat is tokenized with special-token parsing (the template writes its control
// tokens as text: "<|im_start|>", "<|start_header_id|>"), so the same text inside a message would
// become the same control tokens and let a client forge a system turn. The guard: a message
// whose content holds special-token text is rendered a second time with its content wrapped in
// two random markers (inside its leading and trailing whitespace, so that trim/strip act as on
// the plain content); the markers removed, that rendering must equal the plain one, and the
// spans between markers are the client's text, where no special token is matched. A template
// that cuts or re-encodes content breaks the equality: such a message is refused rather than
// served with tokens the client forged. Messages without special-token text take the plain
// path unchanged (their tokens are exactly those of transformers' apply_chat_template).

struct SpecialTokens {
  struct Entry {
    std::string text;
    int32_t id;
  };
  std::array<std::vector<Entry>, 256> by_first;  // longest first within each first byte
  // The longest special token at `pos` that ends at or before `end`, or null.
  const Entry* At(std::string_view text, size_t pos, size_t end) const {
    for (const Entry& e : by_first[static_cast<unsigned char>(text[pos])]) {
      if (pos + e.text.size() <= end && text.compare(pos, e.text.size(), e.text) == 0) return &e;
    }
    return nullptr;
  }
  // The first special token in `text`, or null.
  const Entry* Find(std::string_view text, size_t* pos) const {
    for (size_t i = 0; i < text.size(); ++i) {
      if (const Entry* e = At(text, i, text.size())) {
        *pos = i;
        return e;
      }
    }
    return nullptr;
  }
};

namespace {

std::shared_ptr<const SpecialTokens> CollectSpecialTokens(const Tokenizer& tok) {
  auto out = std::make_shared<SpecialTokens>();
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    if (!tok.IsSpecial(id)) continue;
    std::string text = tok.SpecialText(id);
    if (text.empty()) continue;
    out->by_first[static_cast<unsigned char>(text[0])].push_back({std::move(text), id});
  }
  for (auto& bucket : out->by_first) {
    std::stable_sort(bucket.begin(), bucket.end(), [](const auto& a, const auto& b) {
      return a.text.size() > b.text.size();
    });
  }
  return out;
}

// A byte range [begin, end) of a rendered piece that holds client text.
struct Range {
  size_t begin, end;
};
// One piece of the prompt and the client-text ranges in it (sorted, disjoint).
struct Piece {
  std::string text;
  std::vector<Range> client;
};

// Private-use code points around a per-request random number: no client can write them.
struct Markers {
  std::string open, close;
  Markers() {
    const std::string nonce = absl::StrCat(RandomU64());
    open = absl::StrCat("\xEE\x80\x80", nonce, "\xEE\x80\x81");   // U+E000 nonce U+E001
    close = absl::StrCat("\xEE\x80\x82", nonce, "\xEE\x80\x83");  // U+E002 nonce U+E003
  }
};

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string MarkContent(const std::string& content, const Markers& m) {
  size_t b = 0, e = content.size();
  while (b < e && IsAsciiSpace(content[b])) ++b;
  while (e > b && IsAsciiSpace(content[e - 1])) --e;
  return absl::StrCat(content.substr(0, b), m.open, content.substr(b, e - b), m.close,
                      content.substr(e));
}

// Removes the markers from a marked rendering: the text and its client ranges; false when the
// markers are not whole, paired and in order (the template cut or moved them).
bool Unmark(std::string_view marked, const Markers& m, Piece* out) {
  out->text.clear();
  out->client.clear();
  size_t pos = 0;
  for (;;) {
    const size_t o = marked.find(m.open, pos);
    const size_t c = marked.find(m.close, pos);
    if (o == std::string_view::npos) {
      if (c != std::string_view::npos) return false;
      out->text.append(marked.substr(pos));
      return true;
    }
    if (c == std::string_view::npos || c < o) return false;
    out->text.append(marked.substr(pos, o - pos));
    const size_t body = o + m.open.size();
    const size_t next_open = marked.find(m.open, body);
    if (next_open != std::string_view::npos && next_open < c) return false;  // nested
    const size_t begin = out->text.size();
    out->text.append(marked.substr(body, c - body));
    out->client.push_back({begin, out->text.size()});
    pos = c + m.close.size();
  }
}

// Encodes a piece: special tokens matched only outside its client ranges (and never across
// one), every other run of text encoded without special-token parsing, as the tokenizer itself
// splits a text at its special tokens.
std::vector<int32_t> EncodeGuarded(const Tokenizer& tok, const SpecialTokens& sp,
                                   const Piece& piece) {
  std::vector<int32_t> out;
  const std::string_view text = piece.text;
  size_t run = 0, i = 0, r = 0;
  const auto flush = [&](size_t end) {
    if (end > run) {
      const std::vector<int32_t> ids =
          tok.Encode(text.substr(run, end - run), /*add_bos=*/false, /*parse_special=*/false);
      out.insert(out.end(), ids.begin(), ids.end());
    }
  };
  while (i < text.size()) {
    // Ranges behind i (an empty one, where a template dropped the content, included) are
    // done; the next one bounds a match, so that none spans client text.
    while (r < piece.client.size() && piece.client[r].end <= i) ++r;
    if (r < piece.client.size() && piece.client[r].begin <= i) {  // inside client text
      i = piece.client[r].end;
      continue;
    }
    const size_t limit = r < piece.client.size() ? piece.client[r].begin : text.size();
    const SpecialTokens::Entry* e = sp.At(text, i, limit);
    if (e == nullptr) {
      ++i;
      continue;
    }
    flush(i);
    out.push_back(e->id);
    i += e->text.size();
    run = i;
  }
  flush(text.size());
  return out;
}

// The prompt's pieces as rendered: one per message span plus the generation prompt
// (`per_message`), or the whole rendering as one. Messages holding special-token text are
// rendered again with their content marked (see above); a rendering the markers do not
// survive exactly refuses the first such message.
absl::StatusOr<std::vector<Piece>> RenderPieces(const ChatTemplate& tmpl,
                                                const std::vector<ChatMessage>& messages,
                                                const ChatTemplateVars& vars,
                                                const SpecialTokens& sp, bool* per_message) {
  const auto pieces_of = [](ChatSpans& spans) {
    std::vector<std::string> out;
    if (spans.per_message) {
      out = std::move(spans.spans);
      out.push_back(std::move(spans.suffix));
    } else {
      // Not prefix-stable (e.g. Mistral v0.3 moves the system prompt into the last user turn):
      // the whole rendering is one plain prompt, which content-defined chunking still splits
      // so that repeated stretches are found again.
      out.push_back(std::move(spans.text));
    }
    return out;
  };
  absl::StatusOr<ChatSpans> spans = RenderChatSpans(tmpl, messages, vars);
  if (!spans.ok()) return FieldError("messages", std::string(spans.status().message()));
  *per_message = spans->per_message;
  std::vector<Piece> pieces;
  for (std::string& t : pieces_of(*spans)) pieces.push_back({std::move(t), {}});
  std::vector<size_t> suspects;
  std::string first_token;
  for (size_t i = 0; i < messages.size(); ++i) {
    size_t pos = 0;
    const SpecialTokens::Entry* e = sp.Find(messages[i].content, &pos);
    if (e == nullptr) continue;
    if (suspects.empty()) first_token = e->text;
    suspects.push_back(i);
  }
  if (suspects.empty()) return pieces;
  const size_t first = suspects[0];
  const Markers markers;
  std::vector<ChatMessage> marked = messages;
  for (size_t i : suspects) marked[i].content = MarkContent(messages[i].content, markers);
  absl::StatusOr<ChatSpans> mspans = RenderChatSpans(tmpl, marked, vars);
  bool same = mspans.ok() && mspans->per_message == spans->per_message;
  if (same) {
    std::vector<std::string> mpieces = pieces_of(*mspans);
    same = mpieces.size() == pieces.size();
    for (size_t k = 0; same && k < pieces.size(); ++k) {
      Piece clean;
      same = Unmark(mpieces[k], markers, &clean) && clean.text == pieces[k].text;
      if (same) pieces[k].client = std::move(clean.client);
    }
  }
  if (!same) {
    const std::string field = absl::StrCat("messages[", first, "].content");
    return FieldError(field, absl::StrCat(
        "'", field, "' holds the special token '", first_token,
        "' as text, and this model's chat template transforms message content so that the "
        "router cannot keep it apart from the template's own tokens; remove it, or send the "
        "prompt as token ids to /v1/completions"));
  }
  return pieces;
}

}  // namespace

ChatFormat MakeChatFormat(const ModelInfo& model) {
  ChatFormat f;
  f.vars.bos_token = model.bos_token;
  f.vars.eos_token = model.eos_token;
  f.tokenizer = model.tokenizer.get();
  if (f.tokenizer != nullptr) f.specials = CollectSpecialTokens(*f.tokenizer);
  if (model.chat_template.empty()) return f;
  absl::StatusOr<std::shared_ptr<const ChatTemplate>> t = ChatTemplate::Parse(model.chat_template);
  if (t.ok()) {
    f.tmpl = *std::move(t);
  } else {
    f.template_error = t.status();
  }
  return f;
}

absl::StatusOr<Request> ParseRequest(std::string_view body, Endpoint endpoint,
                                     const ChatFormat* chat, const ParseLimits& limits) {
  if (!IsValidUtf8(body)) return FieldError("", "request body is not valid UTF-8");
  // Depth first: nesting thousands of levels deep would exhaust the stack in the parser or in
  // any recursive walk or copy of the parsed value (the caller bounds the size).
  if (absl::Status s = CheckJsonDepth(body, kMaxJsonDepth); !s.ok()) {
    return FieldError("", absl::StrCat("request body: ", s.message()));
  }
  const json b = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (b.is_discarded()) return FieldError("", "malformed JSON in request body");
  if (!b.is_object()) return FieldError("", "request body must be a JSON object");
  return endpoint == Endpoint::kChat ? ParseChat(b, chat, limits) : ParseCompletion(b, limits);
}

absl::StatusOr<Request> ParseCompletion(const json& b, const ParseLimits& limits) {
  Request p;
  RETURN_IF_ERROR(ParseCommon(b, &p, false));
  v1::GenerateRequest& r = p.req;
  const bool has_prompt = Present(b, "prompt");
  if (b.contains("segments") && has_prompt) {
    // Never drop one of the two silently: the client would get an answer to another prompt.
    return FieldError("prompt", "set either 'segments' or 'prompt', not both");
  }
  if (b.contains("segments")) {
    RETURN_IF_ERROR(AddSegments(b["segments"], &r));
    size_t bytes = 0;
    for (const v1::Segment& s : r.segments()) bytes += s.text().size();
    RETURN_IF_ERROR(CheckPromptBytes("segments", bytes, limits));
    return p;
  }
  if (!b.contains("prompt")) return FieldError("prompt", "'prompt' is required");
  const json& pr = b["prompt"];
  const json* one = &pr;
  if (pr.is_array() && !pr.empty() && (pr[0].is_string() || pr[0].is_array())) {
    if (pr.size() != 1) return FieldError("prompt", "only one prompt per request is supported");
    one = &pr[0];
  }
  if (one->is_string()) {
    RETURN_IF_ERROR(CheckPromptBytes("prompt", one->get_ref<const std::string&>().size(), limits));
    r.set_prompt(one->get<std::string>());
  } else if (one->is_array()) {
    for (const json& t : *one) {
      ASSIGN_OR_RETURN(int32_t id, CheckedInt<int32_t>(t, "prompt[]"));
      r.add_prompt_ids(id);
    }
  } else {
    return TypeError("prompt", "a string or an array of token ids");
  }
  if (r.prompt().empty() && r.prompt_ids_size() == 0) {
    return FieldError("prompt", "'prompt' is empty");
  }
  return p;
}

absl::StatusOr<Request> ParseChat(const json& b, const ChatFormat* chat,
                                  const ParseLimits& limits) {
  Request p;
  RETURN_IF_ERROR(ParseCommon(b, &p, true));
  if (!b.contains("messages") || !b["messages"].is_array() || b["messages"].empty()) {
    return FieldError("messages", "'messages' must be a non-empty array");
  }
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < b["messages"].size(); ++i) {
    const json& m = b["messages"][i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return TypeError("messages[]", "objects with a string 'role'");
    }
    // A role the model was never trained on would be rendered (or, without a template, served)
    // as if it meant something: refused, naming it.
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" &&
        role != "developer") {
      const std::string field = absl::StrCat("messages[", i, "].role");
      return FieldError(field, absl::StrCat("'", field, "': unknown role '", role,
                                            "' (system, user, assistant, tool or developer)"));
    }
    static const json kNoContent;  // a reference, not a (recursive) copy of the content
    ASSIGN_OR_RETURN(std::string text,
                     MessageText(m.contains("content") ? m["content"] : kNoContent));
    messages.push_back({role, std::move(text)});
  }
  // Before any rendering: a template's work and the tokenizer's grow with the text.
  size_t bytes = 0;
  for (const ChatMessage& m : messages) bytes += m.content.size();
  RETURN_IF_ERROR(CheckPromptBytes("messages", bytes, limits));
  if (chat != nullptr && !chat->template_error.ok()) {
    return absl::UnimplementedError(absl::StrCat(
        "this model's chat template cannot be rendered (", chat->template_error.message(),
        "); send a rendered prompt to /v1/completions"));
  }
  if (chat == nullptr || chat->tmpl == nullptr) {
    // No chat template (base models): each message's content is one segment, so a message
    // repeated in any later conversation reuses its KV.
    for (const ChatMessage& m : messages) {
      if (!m.content.empty()) p.req.add_segments()->set_text(m.content);
    }
    if (p.req.segments_size() == 0) return FieldError("messages", "every message is empty");
    p.warning = kNoChatTemplateWarning;
    return p;
  }
  if (chat->tokenizer == nullptr) return absl::InternalError("chat format without a tokenizer");
  ChatTemplateVars vars = chat->vars;
  vars.add_generation_prompt = true;
  std::shared_ptr<const SpecialTokens> specials = chat->specials;
  if (specials == nullptr) specials = CollectSpecialTokens(*chat->tokenizer);
  bool per_message = false;
  ASSIGN_OR_RETURN(std::vector<Piece> pieces,
                   RenderPieces(*chat->tmpl, messages, vars, *specials, &per_message));
  // The BOS the template writes is the shared attention sink (add_bos), not text of the first
  // message's segment: so that segment's fingerprint does not depend on being first, and the
  // BOS is never doubled. BOS text of the client's is text, never the sink.
  bool template_bos = false;
  const std::string& bos = chat->vars.bos_token;
  for (Piece& piece : pieces) {
    if (piece.text.empty()) continue;
    const bool client_first = !piece.client.empty() && piece.client[0].begin < bos.size();
    if (!bos.empty() && !client_first && piece.text.compare(0, bos.size(), bos) == 0) {
      piece.text.erase(0, bos.size());
      for (Range& r : piece.client) {
        r.begin -= bos.size();
        r.end -= bos.size();
      }
      template_bos = true;
    }
    break;
  }
  if (!p.req.has_add_bos()) p.req.set_add_bos(template_bos);
  const Tokenizer& tok = *chat->tokenizer;
  // Special tokens in the template's text (<|im_start|>, [INST]...) are their ids, as when
  // transformers tokenizes a rendered chat; in the client's text they are text.
  const auto encode = [&](const Piece& piece) {
    return piece.client.empty()
               ? tok.Encode(piece.text, /*add_bos=*/false, /*parse_special=*/true)
               : EncodeGuarded(tok, *specials, piece);
  };
  if (!per_message) {
    std::vector<int32_t> ids = encode(pieces[0]);
    if (ids.empty()) return FieldError("messages", "the rendered prompt is empty");
    p.req.mutable_prompt_ids()->Add(ids.begin(), ids.end());
    return p;
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::vector<int32_t> ids = encode(pieces[i]);
    if (ids.empty()) continue;
    v1::Segment* seg = p.req.add_segments();
    seg->mutable_ids()->mutable_ids()->Add(ids.begin(), ids.end());
    // The generation prompt: a few tokens, cheaper to compute than to look up and store.
    if (i + 1 == pieces.size()) seg->set_cacheable(false);
  }
  if (p.req.segments_size() == 0) return FieldError("messages", "the rendered prompt is empty");
  return p;
}

std::string ErrorParam(const absl::Status& status) {
  const auto p = status.GetPayload(kParamUrl);  // absl::optional: not std:: in Debian's abseil
  return p.has_value() ? std::string(*p) : std::string();
}

StopFilter::StopFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_) hold_ = std::max(hold_, s.size() - 1);
}

std::string StopFilter::Push(const std::string& text, bool final) {
  pending_ += text;
  if (stopped_) return "";
  size_t cut = std::string::npos;
  for (const auto& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  size_t keep = final ? 0 : std::min(hold_, pending_.size());
  size_t emit = pending_.size() - keep;
  // Never split a UTF-8 character.
  while (emit > 0 && emit < pending_.size() &&
         (static_cast<unsigned char>(pending_[emit]) & 0xC0) == 0x80) {
    --emit;
  }
  std::string out = pending_.substr(0, emit);
  pending_.erase(0, emit);
  return out;
}

json UsageJson(const v1::Usage& u, const std::string& worker) {
  // The figures are common/usage.h's list: OpenAI's at the top level, SparseX's in "sparsex".
  json j, sx;
#define SPX_USAGE_FIELD(name, type, def) j[#name] = u.name();
  SPARSEX_USAGE_OPENAI(SPX_USAGE_FIELD)
#undef SPX_USAGE_FIELD
#define SPX_USAGE_FIELD(name, type, def) sx[#name] = u.name();
  SPARSEX_USAGE_DETAIL(SPX_USAGE_FIELD)
#undef SPX_USAGE_FIELD
  sx["worker"] = worker;
  j["total_tokens"] = u.prompt_tokens() + u.completion_tokens();
  // cached_tokens: prompt tokens whose KV came from a cache and was used as it was, without
  // recompute: the exact prefix plus the reused tokens sparse recompute did not select. The
  // selected ones (recomputed_tokens, a subset of the reused) are reported apart: counting them
  // as cached would overstate what the cache saved. Clamped, so a worker reporting more
  // recomputed than reused tokens never gives a negative count.
  const int reused = std::max(0, u.reused_tokens());
  const int recomputed = std::clamp(u.recomputed_tokens(), 0, reused);
  const int cached = std::max(0, u.prefix_tokens()) + reused - recomputed;
  j["prompt_tokens_details"] = {{"cached_tokens", cached}, {"recomputed_tokens", recomputed}};
  j["sparsex"] = std::move(sx);
  return j;
}

namespace {

// OpenAI writes -9999.0 for a log-probability too small to show; JSON has no -inf.
double JsonLogprob(float v) { return std::isfinite(v) ? static_cast<double>(v) : -9999.0; }

json Bytes(const std::string& b) {
  json out = json::array();
  for (const char c : b) out.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return out;
}

int64_t CodePoints(const std::string& s) {
  int64_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
  return n;
}

}  // namespace

void LogprobsTracker::Add(const v1::GenerateResponse& m) {
  pending_.insert(pending_.end(), m.logprobs().begin(), m.logprobs().end());
}

json LogprobsTracker::Take(size_t emitted, bool all, bool empty) {
  size_t n = 0;
  size_t start = start_;
  while (n < pending_.size() && (all || start < emitted)) {
    start += pending_[n].token_bytes().size();
    ++n;
  }
  if (n == 0 && !empty) return nullptr;
  start_ = start;
  json out;
  if (chat_) {
    json content = json::array();
    for (size_t i = 0; i < n; ++i) {
      const v1::TokenLogprob& e = pending_[i];
      json top = json::array();
      for (const v1::TopLogprob& t : e.top_logprobs()) {
        top.push_back({{"token", t.token()},
                       {"logprob", JsonLogprob(t.logprob())},
                       {"bytes", Bytes(t.token_bytes())}});
      }
      content.push_back({{"token", e.token()},
                         {"logprob", JsonLogprob(e.logprob())},
                         {"bytes", Bytes(e.token_bytes())},
                         {"top_logprobs", std::move(top)}});
    }
    out = {{"content", std::move(content)}, {"refusal", nullptr}};
  } else {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    for (size_t i = 0; i < n; ++i) {
      const v1::TokenLogprob& e = pending_[i];
      tokens.push_back(e.token());
      token_logprobs.push_back(JsonLogprob(e.logprob()));
      // The alternatives and the token itself (OpenAI: up to logprobs + 1 entries). Two tokens
      // with the same text share a key: the more likely one's value is kept.
      json alts = json::object();
      for (const v1::TopLogprob& t : e.top_logprobs()) {
        alts.emplace(t.token(), JsonLogprob(t.logprob()));
      }
      alts.emplace(e.token(), JsonLogprob(e.logprob()));
      top.push_back(std::move(alts));
      offsets.push_back(text_offset_);
      text_offset_ += CodePoints(e.token());
    }
    out = {{"tokens", std::move(tokens)},
           {"token_logprobs", std::move(token_logprobs)},
           {"top_logprobs", std::move(top)},
           {"text_offset", std::move(offsets)}};
  }
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
  return out;
}

json StreamChunk(const ResponseMeta& meta, const std::string& delta, const json& finish_reason,
                 const json& logprobs) {
  json choice = ChoiceBase(finish_reason);
  if (meta.chat) {
    choice["delta"] = json::object();
    if (!delta.empty()) choice["delta"]["content"] = delta;
  } else {
    choice["text"] = delta;
  }
  choice["logprobs"] = logprobs;
  return Envelope(meta, ChunkObject(meta), json::array({choice}));
}

json StreamRoleChunk(const ResponseMeta& meta) {
  json first = StreamChunk(meta, "", nullptr);
  first["choices"][0]["delta"] = {{"role", "assistant"}, {"content", ""}};
  return first;
}

json StreamUsageChunk(const ResponseMeta& meta, const v1::Usage& usage,
                      const std::string& worker) {
  json u = Envelope(meta, ChunkObject(meta), json::array());
  u["usage"] = UsageJson(usage, worker);
  return u;
}

json Response(const ResponseMeta& meta, const std::string& text,
              const std::string& finish_reason, const v1::Usage& usage,
              const std::string& worker, const json& logprobs) {
  json choice = ChoiceBase(finish_reason);
  if (meta.chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = logprobs;
  json resp = Envelope(meta, meta.chat ? "chat.completion" : "text_completion",
                       json::array({choice}));
  resp["usage"] = UsageJson(usage, worker);
  return resp;
}

}  // namespace sparsex::router::openai

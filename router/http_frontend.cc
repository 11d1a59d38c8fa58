// OpenAI-compatible HTTP API over civetweb (see frontends.h and docs/api.md).
#include <civetweb.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>
#include <mutex>
#include <random>

#include <nlohmann/json.hpp>

#include "common/json_depth.h"
#include "common/metrics/metrics.h"
#include "common/utf8.h"
#include "router/frontends.h"
#include "router/router.h"

namespace sparsex::router {
namespace {

using json = nlohmann::json;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string RandomId(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 g(std::random_device{}());
  std::lock_guard<std::mutex> l(mu);
  static const char* kAlnum = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::string s = prefix;
  for (int i = 0; i < 24; ++i) s += kAlnum[g() % 36];
  return s;
}

// A request error with its HTTP status and OpenAI error fields.
struct HttpError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
};

int HttpStatusFor(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange: return 400;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kCancelled: return 499;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

HttpError FromStatus(const absl::Status& s) {
  HttpError e;
  e.status = HttpStatusFor(s.code());
  e.message = std::string(s.message());
  if (e.status == 429) e.type = "rate_limit_error";
  else if (e.status >= 500) e.type = "server_error";
  if (e.status == 400 && e.message.rfind("unknown model", 0) == 0) {
    e.status = 404;
    e.code = "model_not_found";
  }
  return e;
}

json ErrorJson(const HttpError& e) {
  json err{{"message", e.message}, {"type", e.type}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return json{{"error", err}};
}

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Error";
  }
}

void Reply(mg_connection* c, int status, const std::string& type, const std::string& body) {
  mg_printf(c,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            status, Reason(status), type.c_str(), body.size());
  mg_write(c, body.data(), body.size());
}

void ReplyJson(mg_connection* c, int status, const json& j) {
  Reply(c, status, "application/json", Dump(j));
}

void ReplyError(mg_connection* c, const HttpError& e) { ReplyJson(c, e.status, ErrorJson(e)); }

// Field readers: a wrong type is a 400 naming the field.
HttpError TypeError(const std::string& field, const std::string& want) {
  HttpError e;
  e.message = "'" + field + "' must be " + want;
  e.param = field;
  return e;
}

// A JSON integer read into a field of type T: an integer literal, or a number with no fraction
// (2.0), within [lo, hi] (by default T's whole range). Anything else is a 400 naming the field:
// a value that does not fit is refused, never narrowed (2^32 + 403 is not token 403).
template <typename T>
T CheckedInt(const json& v, const std::string& field, T lo = std::numeric_limits<T>::min(),
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
      throw bad();
    }
    x = static_cast<__int128>(d);
  } else {
    throw bad();
  }
  if (x < static_cast<__int128>(lo) || x > static_cast<__int128>(hi)) throw bad();
  return static_cast<T>(x);
}

struct Parsed {
  v1::GenerateRequest req;
  bool stream = false;
  bool include_usage = false;
  std::vector<std::string> stop;
};

// Sampling, reuse and the SparseX extensions shared by both endpoints.
void ParseCommon(const json& b, Parsed* p, bool chat) {
  v1::GenerateRequest& r = p->req;
  if (b.contains("model")) {
    if (!b["model"].is_string()) throw TypeError("model", "a string");
    r.set_model(b["model"].get<std::string>());
  }
  v1::SamplingParams* s = r.mutable_sampling();
  auto num = [&](const char* f) -> std::optional<double> {
    if (!b.contains(f) || b[f].is_null()) return std::nullopt;
    if (!b[f].is_number()) throw TypeError(f, "a number");
    return b[f].get<double>();
  };
  auto integer = [&](const char* f, int64_t lo, int64_t hi) -> std::optional<int64_t> {
    if (!b.contains(f) || b[f].is_null()) return std::nullopt;
    return CheckedInt<int64_t>(b[f], f, lo, hi);
  };
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  auto boolean = [&](const char* f) -> std::optional<bool> {
    if (!b.contains(f) || b[f].is_null()) return std::nullopt;
    if (!b[f].is_boolean()) throw TypeError(f, "a boolean");
    return b[f].get<bool>();
  };
  // OpenAI defaults: temperature 1, top_p 1, max_tokens 16.
  s->set_temperature(static_cast<float>(num("temperature").value_or(1.0)));
  if (auto v = num("top_p")) s->set_top_p(static_cast<float>(*v));
  if (auto v = integer("top_k", 0, kInt32Max)) s->set_top_k(static_cast<int32_t>(*v));
  if (b.contains("seed") && !b["seed"].is_null()) {
    s->set_seed(CheckedInt<uint64_t>(b["seed"], "seed"));
  }
  const char* mt_field = "max_tokens";
  if (chat && (!b.contains(mt_field) || b[mt_field].is_null())) mt_field = "max_completion_tokens";
  if (auto mt = integer(mt_field, 1, 1 << 20)) s->set_max_tokens(static_cast<int32_t>(*mt));
  if (auto v = boolean("ignore_eos")) s->set_ignore_eos(*v);
  if (auto v = integer("n", std::numeric_limits<int64_t>::min(),
                       std::numeric_limits<int64_t>::max());
      v && *v != 1) {
    HttpError e;
    e.message = "only n = 1 is supported";
    e.param = "n";
    throw e;
  }
  if (auto v = boolean("echo"); v && *v) {
    HttpError e;
    e.message = "echo is not supported";
    e.param = "echo";
    throw e;
  }
  if (auto v = boolean("stream")) p->stream = *v;
  if (b.contains("stream_options") && b["stream_options"].is_object()) {
    const json& so = b["stream_options"];
    if (so.contains("include_usage") && so["include_usage"].is_boolean()) {
      p->include_usage = so["include_usage"].get<bool>();
    }
  }
  if (b.contains("stop") && !b["stop"].is_null()) {
    const json& st = b["stop"];
    if (st.is_string()) {
      p->stop.push_back(st.get<std::string>());
    } else if (st.is_array()) {
      for (const json& x : st) {
        if (!x.is_string()) throw TypeError("stop", "a string or an array of strings");
        p->stop.push_back(x.get<std::string>());
      }
    } else {
      throw TypeError("stop", "a string or an array of strings");
    }
    std::erase_if(p->stop, [](const std::string& x) { return x.empty(); });
  }
  if (auto v = boolean("add_bos")) r.set_add_bos(*v);
  if (b.contains("reuse") && !b["reuse"].is_null()) {
    const json& ro = b["reuse"];
    if (!ro.is_object()) throw TypeError("reuse", "an object");
    v1::ReuseOptions* o = r.mutable_reuse();
    auto rb = [&](const char* f) -> std::optional<bool> {
      if (!ro.contains(f)) return std::nullopt;
      if (!ro[f].is_boolean()) throw TypeError(std::string("reuse.") + f, "a boolean");
      return ro[f].get<bool>();
    };
    if (auto v = rb("enable")) o->set_enable(*v);
    if (auto v = rb("store_new_segments")) o->set_store_new_segments(*v);
    if (auto v = rb("register_prefix")) o->set_register_prefix(*v);
    if (ro.contains("full_layers")) {
      o->set_full_layers(CheckedInt<int32_t>(ro["full_layers"], "reuse.full_layers"));
    }
    if (ro.contains("recompute_ratio")) {
      if (!ro["recompute_ratio"].is_number()) throw TypeError("reuse.recompute_ratio", "a number");
      o->set_recompute_ratio(ro["recompute_ratio"].get<float>());
    }
    if (ro.contains("selector")) {
      if (!ro["selector"].is_string()) throw TypeError("reuse.selector", "a string");
      o->set_selector(ro["selector"].get<std::string>());
    }
  }
}

void AddSegments(const json& segs, v1::GenerateRequest* r) {
  if (!segs.is_array()) throw TypeError("segments", "an array of strings or token-id arrays");
  for (const json& s : segs) {
    v1::Segment* seg = r->add_segments();
    if (s.is_string()) {
      seg->set_text(s.get<std::string>());
    } else if (s.is_array()) {
      for (const json& t : s) {
        seg->mutable_ids()->add_ids(CheckedInt<int32_t>(t, "segments[][]"));
      }
    } else if (s.is_object() && s.contains("text") && s["text"].is_string()) {
      seg->set_text(s["text"].get<std::string>());
      if (s.contains("cacheable") && s["cacheable"].is_boolean()) {
        seg->set_cacheable(s["cacheable"].get<bool>());
      }
    } else {
      throw TypeError("segments", "strings, token-id arrays or {text, cacheable} objects");
    }
  }
}

Parsed ParseCompletion(const json& b) {
  Parsed p;
  ParseCommon(b, &p, false);
  v1::GenerateRequest& r = p.req;
  const bool has_prompt = b.contains("prompt") && !b["prompt"].is_null();
  if (b.contains("segments") && has_prompt) {
    // Never drop one of the two silently: the client would get an answer to another prompt.
    HttpError e;
    e.message = "set either 'segments' or 'prompt', not both";
    e.param = "prompt";
    throw e;
  }
  if (b.contains("segments")) {
    AddSegments(b["segments"], &r);
  } else {
    if (!b.contains("prompt")) {
      HttpError e;
      e.message = "'prompt' is required";
      e.param = "prompt";
      throw e;
    }
    const json& pr = b["prompt"];
    const json* one = &pr;
    if (pr.is_array() && !pr.empty() && (pr[0].is_string() || pr[0].is_array())) {
      if (pr.size() != 1) {
        HttpError e;
        e.message = "only one prompt per request is supported";
        e.param = "prompt";
        throw e;
      }
      one = &pr[0];
    }
    if (one->is_string()) {
      r.set_prompt(one->get<std::string>());
    } else if (one->is_array()) {
      for (const json& t : *one) r.add_prompt_ids(CheckedInt<int32_t>(t, "prompt[]"));
    } else {
      throw TypeError("prompt", "a string or an array of token ids");
    }
    if (r.prompt().empty() && r.prompt_ids_size() == 0) {
      HttpError e;
      e.message = "'prompt' is empty";
      e.param = "prompt";
      throw e;
    }
  }
  return p;
}

std::string MessageText(const json& content) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (content.is_array()) {
    std::string out;
    for (const json& part : content) {
      if (part.is_object() && part.value("type", "") == "text" && part.contains("text") &&
          part["text"].is_string()) {
        out += part["text"].get<std::string>();
      } else {
        throw TypeError("messages[].content", "a string or an array of text parts");
      }
    }
    return out;
  }
  throw TypeError("messages[].content", "a string or an array of text parts");
}

Parsed ParseChat(const json& b) {
  Parsed p;
  ParseCommon(b, &p, true);
  if (!b.contains("messages") || !b["messages"].is_array() || b["messages"].empty()) {
    HttpError e;
    e.message = "'messages' must be a non-empty array";
    e.param = "messages";
    throw e;
  }
  // No chat template (base models): each message's content is one segment, so a message
  // repeated in any later conversation reuses its KV.
  for (const json& m : b["messages"]) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      throw TypeError("messages[]", "objects with a string 'role'");
    }
    static const json kNoContent;  // a reference, not a (recursive) copy of the content
    std::string text = MessageText(m.contains("content") ? m["content"] : kNoContent);
    if (text.empty()) continue;
    p.req.add_segments()->set_text(text);
  }
  if (p.req.segments_size() == 0) {
    HttpError e;
    e.message = "every message is empty";
    e.param = "messages";
    throw e;
  }
  return p;
}

// Applies stop strings to a growing text, holding back what could start a stop string.
class StopFilter {
 public:
  explicit StopFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {
    for (const auto& s : stops_) hold_ = std::max(hold_, s.size() - 1);
  }
  // New text in; text safe to emit out. `stopped` once a stop string was found.
  std::string Push(const std::string& text, bool final) {
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
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  size_t hold_ = 0;
  std::string pending_;
  bool stopped_ = false;
};

json UsageJson(const v1::Usage& u, const std::string& worker) {
  return json{{"prompt_tokens", u.prompt_tokens()},
              {"completion_tokens", u.completion_tokens()},
              {"total_tokens", u.prompt_tokens() + u.completion_tokens()},
              {"prompt_tokens_details", {{"cached_tokens", u.prefix_tokens() + u.reused_tokens()}}},
              {"sparsex",
               {{"prefix_tokens", u.prefix_tokens()},
                {"reused_tokens", u.reused_tokens()},
                {"recomputed_tokens", u.recomputed_tokens()},
                {"new_tokens", u.new_tokens()},
                {"segments_hit", u.segments_hit()},
                {"segments_fetched", u.segments_fetched()},
                {"fetch_failures", u.fetch_failures()},
                {"ttft_ms", u.ttft_ms()},
                {"total_ms", u.total_ms()},
                {"worker", worker}}}};
}

}  // namespace

struct HttpFrontend::Impl {
  Router* router = nullptr;
  mg_context* ctx = nullptr;

  static bool ReadBody(mg_connection* c, size_t max, std::string* out) {
    char buf[16384];
    for (;;) {
      int n = mg_read(c, buf, sizeof buf);
      if (n <= 0) return true;
      out->append(buf, static_cast<size_t>(n));
      if (out->size() > max) return false;
    }
  }

  // Writes one chunk of a chunked body; false when the client is gone.
  static bool Chunk(mg_connection* c, const std::string& data) {
    char head[32];
    const int hn = std::snprintf(head, sizeof head, "%zx\r\n", data.size());
    std::string frame(head, static_cast<size_t>(hn));
    frame += data;
    frame += "\r\n";
    return mg_write(c, frame.data(), frame.size()) == static_cast<int>(frame.size());
  }
  static bool Event(mg_connection* c, const json& j) {
    return Chunk(c, "data: " + Dump(j) + "\n\n");
  }

  int HandleGenerate(mg_connection* c, bool chat) {
    const mg_request_info* ri = mg_get_request_info(c);
    if (std::strcmp(ri->request_method, "POST") != 0) {
      HttpError e;
      e.status = 405;
      e.message = "use POST";
      ReplyError(c, e);
      return 405;
    }
    std::string body;
    if (!ReadBody(c, router->options().max_body_bytes, &body)) {
      HttpError e;
      e.status = 413;
      e.message = "request body too large";
      ReplyError(c, e);
      return 413;
    }
    Parsed p;
    try {
      if (!IsValidUtf8(body)) {
        HttpError e;
        e.message = "request body is not valid UTF-8";
        throw e;
      }
      // Depth first: nesting thousands of levels deep would exhaust the stack in the parser or
      // in any recursive walk or copy of the parsed value (the size is bounded by ReadBody).
      if (absl::Status s = CheckJsonDepth(body, kMaxJsonDepth); !s.ok()) {
        HttpError e;
        e.message = "request body: " + std::string(s.message());
        throw e;
      }
      json b = json::parse(body, nullptr, false);
      if (b.is_discarded()) {
        HttpError e;
        e.message = "malformed JSON in request body";
        throw e;
      }
      if (!b.is_object()) {
        HttpError e;
        e.message = "request body must be a JSON object";
        throw e;
      }
      p = chat ? ParseChat(b) : ParseCompletion(b);
    } catch (const HttpError& e) {
      ReplyError(c, e);
      return e.status;
    } catch (const json::exception& x) {
      HttpError e;
      e.message = std::string("bad request: ") + x.what();
      ReplyError(c, e);
      return 400;
    }
    if (absl::Status s = router->CheckModel(p.req.model()); !s.ok()) {
      HttpError e = FromStatus(s);
      ReplyError(c, e);
      return e.status;
    }
    CallControl ctl;
    ctl.api = "http";
    if (const char* t = mg_get_header(c, "X-Request-Timeout-Ms"); t != nullptr) {
      int ms = std::atoi(t);
      if (ms > 0) ctl.deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
    }
    const std::string id = RandomId(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = static_cast<int64_t>(std::time(nullptr));
    const std::string model = router->model_name();
    const char* object = chat ? "chat.completion.chunk" : "text_completion";
    StopFilter stop(p.stop);
    std::string text, finish_reason, worker;
    v1::Usage usage;
    bool headers_sent = false, client_gone = false;

    auto chunk_json = [&](const std::string& delta_text, const json& finish) {
      json choice{{"index", 0}, {"finish_reason", finish}};
      if (chat) {
        choice["delta"] = json::object();
        if (!delta_text.empty()) choice["delta"]["content"] = delta_text;
      } else {
        choice["text"] = delta_text;
        choice["logprobs"] = nullptr;
      }
      return json{{"id", id}, {"object", object}, {"created", created}, {"model", model},
                  {"choices", json::array({choice})}};
    };
    auto start_stream = [&]() -> bool {
      if (headers_sent) return true;
      headers_sent = true;
      mg_printf(c,
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
      if (chat) {
        json first = chunk_json("", nullptr);
        first["choices"][0]["delta"] = {{"role", "assistant"}, {"content", ""}};
        return Event(c, first);
      }
      return true;
    };

    absl::Status st = router->Generate(
        p.req,
        [&](const v1::GenerateResponse& m) {
          std::string out = stop.Push(m.text(), m.finished());
          text += out;
          if (m.finished()) {
            finish_reason = m.finish_reason();
            usage = m.usage();
            worker = m.worker();
          }
          if (p.stream && !out.empty()) {
            if (!start_stream() || !Event(c, chunk_json(out, nullptr))) {
              client_gone = true;
              return false;
            }
          }
          return !stop.stopped();  // a stop string ends the request (cancels the worker)
        },
        ctl);
    if (stop.stopped() && (st.ok() || st.code() == absl::StatusCode::kCancelled)) {
      st = absl::OkStatus();
      finish_reason = "stop";
    }
    if (client_gone) return 499;
    if (!st.ok()) {
      HttpError e = FromStatus(st);
      if (headers_sent) {
        Event(c, ErrorJson(e));
        Chunk(c, "data: [DONE]\n\n");
        Chunk(c, "");
      } else {
        ReplyError(c, e);
      }
      return e.status;
    }
    if (p.stream) {
      if (!start_stream()) return 499;
      Event(c, chunk_json("", finish_reason));
      if (p.include_usage) {
        json u{{"id", id}, {"object", object}, {"created", created}, {"model", model},
               {"choices", json::array()}, {"usage", UsageJson(usage, worker)}};
        Event(c, u);
      }
      Chunk(c, "data: [DONE]\n\n");
      Chunk(c, "");
      return 200;
    }
    json choice{{"index", 0}, {"finish_reason", finish_reason}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
      choice["logprobs"] = nullptr;
    } else {
      choice["text"] = text;
      choice["logprobs"] = nullptr;
    }
    json resp{{"id", id},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", json::array({choice})},
              {"usage", UsageJson(usage, worker)}};
    ReplyJson(c, 200, resp);
    return 200;
  }

  int HandleModels(mg_connection* c) {
    v1::ListModelsResponse lm = router->ListModels();
    json data = json::array();
    for (const auto& m : lm.models()) {
      data.push_back({{"id", m.id()},
                      {"object", "model"},
                      {"created", 0},
                      {"owned_by", "sparsex"},
                      {"context_length", m.context_length()},
                      {"workers", m.workers()}});
    }
    const mg_request_info* ri = mg_get_request_info(c);
    std::string uri = ri->local_uri ? ri->local_uri : "";
    const std::string prefix = "/v1/models/";
    // civetweb matches handler patterns by prefix: "/v1/modelsXYZ" lands here too. Only
    // /v1/models and /v1/models/{id} exist.
    if (uri != "/v1/models" && uri.rfind(prefix, 0) != 0) return OnOther(c, nullptr);
    if (uri.rfind(prefix, 0) == 0) {
      const std::string want = uri.substr(prefix.size());
      for (const json& d : data) {
        if (d["id"] == want) {
          ReplyJson(c, 200, d);
          return 200;
        }
      }
      HttpError e;
      e.status = 404;
      e.message = "unknown model '" + want + "'";
      e.code = "model_not_found";
      ReplyError(c, e);
      return 404;
    }
    ReplyJson(c, 200, json{{"object", "list"}, {"data", data}});
    return 200;
  }

  static int OnCompletions(mg_connection* c, void* d) {
    return static_cast<Impl*>(d)->HandleGenerate(c, false);
  }
  static int OnChat(mg_connection* c, void* d) {
    return static_cast<Impl*>(d)->HandleGenerate(c, true);
  }
  static int OnModels(mg_connection* c, void* d) { return static_cast<Impl*>(d)->HandleModels(c); }
  static int OnHealth(mg_connection* c, void* d) {
    v1::HealthResponse h = static_cast<Impl*>(d)->router->Health();
    int healthy = 0;
    for (const auto& w : h.workers()) healthy += w.healthy() ? 1 : 0;
    const int status = h.serving() ? 200 : 503;
    Reply(c, status, "application/json",
          Dump(json{{"status", h.serving() ? "ok" : "no healthy worker"},
                    {"workers", h.workers_size()},
                    {"healthy_workers", healthy}}));
    return status;
  }
  static int OnMetrics(mg_connection* c, void* d) {
    Reply(c, 200, "text/plain; version=0.0.4; charset=utf-8",
          static_cast<Impl*>(d)->router->registry().Render());
    return 200;
  }
  static int OnOther(mg_connection* c, void*) {
    const mg_request_info* ri = mg_get_request_info(c);
    HttpError e;
    e.status = 404;
    e.message = std::string("no route for ") + ri->request_method + " " +
                (ri->local_uri ? ri->local_uri : "");
    ReplyError(c, e);
    return 404;
  }
};

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(Router* router,
                                                                  const std::string& address,
                                                                  int threads) {
  static std::once_flag once;
  std::call_once(once, [] { mg_init_library(0); });
  std::unique_ptr<HttpFrontend> f(new HttpFrontend());
  f->impl_ = std::make_unique<Impl>();
  f->impl_->router = router;
  const std::string nthreads = std::to_string(threads < 2 ? 2 : threads);
  const char* opts[] = {"listening_ports", address.c_str(),
                        "num_threads", nthreads.c_str(),
                        "request_timeout_ms", "3600000",
                        "enable_keep_alive", "no",
                        nullptr};
  mg_callbacks cb;
  std::memset(&cb, 0, sizeof cb);
  f->impl_->ctx = mg_start(&cb, nullptr, opts);
  if (f->impl_->ctx == nullptr) {
    return absl::UnavailableError("router: cannot listen on " + address + " (HTTP)");
  }
  Impl* impl = f->impl_.get();
  mg_set_request_handler(impl->ctx, "/v1/completions$", &Impl::OnCompletions, impl);
  mg_set_request_handler(impl->ctx, "/v1/chat/completions$", &Impl::OnChat, impl);
  mg_set_request_handler(impl->ctx, "/v1/models", &Impl::OnModels, impl);
  mg_set_request_handler(impl->ctx, "/healthz$", &Impl::OnHealth, impl);
  mg_set_request_handler(impl->ctx, "/metrics$", &Impl::OnMetrics, impl);
  mg_set_request_handler(impl->ctx, "/", &Impl::OnOther, impl);
  mg_server_port ports[4];
  const int n = mg_get_server_ports(impl->ctx, 4, ports);
  if (n < 1) return absl::InternalError("router: cannot determine the HTTP port");
  f->port_ = ports[0].port;
  return f;
}

HttpFrontend::~HttpFrontend() { Shutdown(); }

void HttpFrontend::Shutdown() {
  if (impl_ && impl_->ctx) {
    mg_stop(impl_->ctx);
    impl_->ctx = nullptr;
  }
}

}  // namespace sparsex::router

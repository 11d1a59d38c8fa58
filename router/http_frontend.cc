// OpenAI-compatible HTTP API over civetweb (see frontends.h and docs/api.md): routes, request
// bodies, SSE framing and the Status -> HTTP status mapping. The OpenAI JSON <-> proto mapping
// is openai_codec.h.
#include <civetweb.h>

#include <chrono>
#include <cstring>
#include <ctime>
#include <mutex>
#include <random>

#include <nlohmann/json.hpp>

#include "common/metrics/metrics.h"
#include "router/frontends.h"
#include "router/openai_codec.h"
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
  e.param = openai::ErrorParam(s);
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
    absl::StatusOr<openai::Request> parsed;
    try {
      parsed = openai::ParseRequest(
          body, chat ? openai::Endpoint::kChat : openai::Endpoint::kCompletions);
    } catch (const json::exception& x) {
      // The codec makes no throwing nlohmann call; should one slip in, the client gets a 400
      // rather than the exception unwinding through civetweb's C frames (std::terminate).
      HttpError e;
      e.message = std::string("bad request: ") + x.what();
      ReplyError(c, e);
      return 400;
    }
    if (!parsed.ok()) {
      HttpError e = FromStatus(parsed.status());
      ReplyError(c, e);
      return e.status;
    }
    openai::Request& p = *parsed;
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
    const openai::ResponseMeta meta{RandomId(chat ? "chatcmpl-" : "cmpl-"),
                                    static_cast<int64_t>(std::time(nullptr)),
                                    router->model_name(), chat};
    openai::StopFilter stop(p.stop);
    std::string text, finish_reason, worker;
    v1::Usage usage;
    bool headers_sent = false, client_gone = false;

    auto start_stream = [&]() -> bool {
      if (headers_sent) return true;
      headers_sent = true;
      mg_printf(c,
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
      if (chat) return Event(c, openai::StreamRoleChunk(meta));
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
            if (!start_stream() || !Event(c, openai::StreamChunk(meta, out))) {
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
      Event(c, openai::StreamChunk(meta, "", finish_reason));
      if (p.include_usage) Event(c, openai::StreamUsageChunk(meta, usage, worker));
      Chunk(c, "data: [DONE]\n\n");
      Chunk(c, "");
      return 200;
    }
    ReplyJson(c, 200, openai::Response(meta, text, finish_reason, usage, worker));
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

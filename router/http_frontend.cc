// OpenAI-compatible HTTP API (see frontends.h and docs/api.md): a small HTTP/1.1 server of its
// own, the routes, SSE framing and the Status -> HTTP status mapping. The OpenAI JSON <-> proto
// mapping is openai_codec.h.
//
// Why not a thread per connection (civetweb, as before): a connection held a thread from
// accept to close, with a one-hour read timeout, so 70 idle or trickling connections (or 70
// long streams) took every thread and /healthz, /metrics and new completions timed out. Here:
//   - One I/O thread (epoll) owns every socket. It reads each request whole (head and body)
//     under an idle timeout (silence) and a read timeout (the whole request), refuses a
//     connection over the limit with 503 at once, and writes small replies without blocking.
//   - /healthz, /metrics, /v1/models and every error before a completion starts are answered on
//     the I/O thread: they never wait for a generation thread.
//   - A complete completion request goes to one of `threads` generation threads (more wait in
//     a queue, already read). The thread writes the response with a write timeout; the I/O
//     thread keeps watching the socket and cancels the request (CallCancel) when the client
//     closes it, streaming or not.
//   - After the response the I/O thread closes the connection (shutdown, then a short linger
//     reading what the client still sends, so the reply is not lost to a reset).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <iostream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "common/random.h"
#include "router/frontends.h"
#include "router/openai_codec.h"
#include "router/router.h"

namespace sparsex::router {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string RandomId(const char* prefix) { return prefix + RandomHex(24); }

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
  if (s.code() == absl::StatusCode::kUnauthenticated) {
    e.status = 401;  // OpenAI's answer to a missing or wrong key
    e.code = "invalid_api_key";
  }
  if (e.status == 400 && e.message.rfind("unknown model", 0) == 0) {
    e.status = 404;
    e.code = "model_not_found";
  }
  return e;
}

HttpError Error(int status, std::string message) {
  HttpError e;
  e.status = status;
  e.message = std::move(message);
  if (status >= 500 || status == 408) e.type = "server_error";
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
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
  }
}

std::string Response(int status, const std::string& type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, " ", Reason(status), "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n", body);
}
std::string JsonResponse(int status, const json& j) {
  return Response(status, "application/json", Dump(j));
}
std::string ErrorResponse(const HttpError& e) { return JsonResponse(e.status, ErrorJson(e)); }

// One parsed request (one per connection: every reply says Connection: close).
struct HttpRequest {
  std::string method;
  std::string path;  // percent-decoded, without the query
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  const std::string* Header(const std::string& lower) const {
    auto it = headers.find(lower);
    return it == headers.end() ? nullptr : &it->second;
  }
};

int Hex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Parses the request line and headers (`head` without the final CRLF CRLF).
absl::Status ParseHead(std::string_view head, HttpRequest* r) {
  size_t eol = head.find("\r\n");
  std::string_view line = head.substr(0, eol);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || sp1 == 0) {
    return absl::InvalidArgumentError("malformed request line");
  }
  r->method = std::string(line.substr(0, sp1));
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string_view version = line.substr(sp2 + 1);
  if (version.rfind("HTTP/1.", 0) != 0) return absl::UnimplementedError("HTTP version");
  if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0) {  // absolute form
    const size_t slash = target.find('/', target.find("//") + 2);
    target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
  }
  target = target.substr(0, target.find_first_of("?#"));
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] == '%') {
      if (i + 2 >= target.size()) {
        return absl::InvalidArgumentError("malformed percent escape in the path");
      }
      const int h = Hex(target[i + 1]), l = Hex(target[i + 2]);
      if (h < 0 || l < 0) return absl::InvalidArgumentError("malformed percent escape in the path");
      r->path += static_cast<char>(h * 16 + l);
      i += 2;
    } else {
      r->path += target[i];
    }
  }
  if (r->path.empty() || r->path[0] != '/') return absl::InvalidArgumentError("malformed path");
  while (eol != std::string_view::npos) {
    const size_t start = eol + 2;
    eol = head.find("\r\n", start);
    std::string_view h = head.substr(start, eol == std::string_view::npos ? eol : eol - start);
    if (h.empty()) continue;
    const size_t colon = h.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError("malformed header line");
    }
    std::string name = absl::AsciiStrToLower(std::string(h.substr(0, colon)));
    std::string value(absl::StripAsciiWhitespace(std::string(h.substr(colon + 1))));
    auto [it, fresh] = r->headers.emplace(name, value);
    if (!fresh) {
      if (name == "content-length" && it->second != value) {
        return absl::InvalidArgumentError("conflicting Content-Length headers");
      }
      it->second += ", " + value;
    }
  }
  return absl::OkStatus();
}

// Blocking writes of a generation thread (SO_SNDTIMEO bounds each one).
class Sender {
 public:
  explicit Sender(int fd) : fd_(fd) {}
  bool Send(std::string_view d) {
    if (failed_) return false;
    size_t off = 0;
    while (off < d.size()) {
      const ssize_t n = ::send(fd_, d.data() + off, d.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        timed_out_ = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
        failed_ = true;
        return false;
      }
    }
    return true;
  }
  bool timed_out() const { return timed_out_; }

 private:
  int fd_;
  bool failed_ = false, timed_out_ = false;
};

}  // namespace

struct HttpFrontend::Impl {
  Router* router = nullptr;
  int threads = 64;
  int max_connections = 1000;
  std::chrono::milliseconds idle_timeout{10000}, read_timeout{30000}, write_timeout{30000};
  static constexpr std::chrono::milliseconds kLinger{1000};
  static constexpr size_t kMaxHead = 64 << 10;
  size_t max_body = size_t{16} << 20;
  size_t max_prompt_bytes = openai::kDefaultMaxPromptBytes;
  // The admin listener (StartAdmin): /healthz and /metrics only, no generation threads.
  bool admin = false;
  // Per source address (IPv4 / IPv6 address, without the port): open connections and HTTP
  // completions in flight (queued or running); 0 = no limit.
  int max_connections_per_client = 0;
  int max_streams_per_client = 0;
  struct ClientUse {
    int connections = 0;
  };
  std::unordered_map<std::string, ClientUse> clients;  // I/O thread only
  // Completions in flight per client, queued or running. Counted up by the I/O thread when it
  // admits one and down by the generation thread as soon as the completion is over, before the
  // I/O thread hears of it: a client that sends its next request the moment the previous answer
  // arrived must find its slot free (counting down on the I/O thread's wake-up raced with that
  // next request and answered it 429).
  std::mutex streams_mu;
  std::unordered_map<std::string, int> streams_in_flight;

  int listen_fd = -1, ep = -1, wake_fd = -1;
  std::thread io;
  std::vector<std::thread> gen_threads;
  std::atomic<bool> stopping{false};
  bool stopped = false;

  // Metrics (the router's registry).
  metrics::Gauge* open_conns = nullptr;
  metrics::Family<metrics::Counter>* closed = nullptr;
  metrics::Family<metrics::Gauge>* completions = nullptr;

  // ---- connections: owned by the I/O thread ----
  enum class St { kReading, kWriting, kLinger, kHandedOff };
  struct Conn {
    uint64_t id = 0;
    int fd = -1;
    St st = St::kReading;
    std::string in;
    bool head_done = false, chunked = false, continue_sent = false;
    size_t pos = 0;             // parse position in `in` (past the head)
    size_t content_length = 0;  // when not chunked
    size_t chunk_left = 0;      // chunked: bytes left in this chunk
    bool chunk_crlf = false;    // chunked: CRLF after a chunk's data pending
    bool trailer = false;       // chunked: reading the trailer
    HttpRequest req;
    std::string out;
    size_t out_off = 0;
    Clock::time_point opened, last_byte, deadline;
    std::shared_ptr<CallCancel> cancel;
    std::string client;          // source address (ClientOf)
  };
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns;
  uint64_t next_id = 2;  // 0: the listening socket, 1: the wake-up eventfd
  bool accept_paused = false;
  Clock::time_point accept_resume;

  // ---- completions: I/O thread -> generation threads -> I/O thread ----
  struct Job {
    uint64_t id;
    int fd;
    HttpRequest req;
    bool chat;
    std::shared_ptr<CallCancel> cancel;
    std::shared_ptr<const Tenant> tenant;  // from the Authorization header
    std::string client;                    // source address: its streams_in_flight slot
  };
  std::mutex jobs_mu;
  std::condition_variable jobs_cv;
  std::deque<Job> jobs;
  bool jobs_stop = false;
  std::mutex done_mu;
  std::vector<uint64_t> done;
  std::atomic<int> running{0};

  // ------------------------------------------------------------------------------------------
  // Handlers

  // `done` frees the client's stream slot; it runs before the last bytes go out (a client that
  // sends its next request as soon as it has the answer finds its slot free) and is idempotent.
  int HandleGenerate(const HttpRequest& rq, bool chat, Sender& out,
                     std::shared_ptr<CallCancel> cancel, std::shared_ptr<const Tenant> tenant,
                     const std::function<void()>& done) {
    absl::StatusOr<openai::Request> parsed;
    try {
      parsed = openai::ParseRequest(
          rq.body, chat ? openai::Endpoint::kChat : openai::Endpoint::kCompletions,
          &router->chat_format(), {.max_prompt_bytes = max_prompt_bytes});
    } catch (const json::exception& x) {
      // The codec makes no throwing nlohmann call; should one slip in, the client gets a 400.
      done();
      out.Send(ErrorResponse(Error(400, std::string("bad request: ") + x.what())));
      return 400;
    }
    if (!parsed.ok()) {
      HttpError e = FromStatus(parsed.status());
      done();
      out.Send(ErrorResponse(e));
      return e.status;
    }
    openai::Request& p = *parsed;
    if (absl::Status s = router->CheckModel(p.req.model()); !s.ok()) {
      HttpError e = FromStatus(s);
      done();
      out.Send(ErrorResponse(e));
      return e.status;
    }
    CallControl ctl;
    ctl.api = "http";
    ctl.cancel = std::move(cancel);
    ctl.tenant = std::move(tenant);
    if (const std::string* t = rq.Header("x-request-timeout-ms"); t != nullptr) {
      int ms = std::atoi(t->c_str());
      if (ms > 0) ctl.deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
    }
    const openai::ResponseMeta meta{RandomId(chat ? "chatcmpl-" : "cmpl-"),
                                    static_cast<int64_t>(std::time(nullptr)),
                                    router->model_name(), chat};
    openai::StopFilter stop(p.stop);
    // Log probabilities travel with the text they belong to: without stop strings every
    // token's text is out as soon as it arrives; with them, a token's entry waits until its
    // text passed the stop filter, and the tokens after a stop string are never reported.
    const bool want_logprobs = p.req.logprobs();
    openai::LogprobsTracker logprobs(chat);
    size_t emitted = 0;  // bytes of text released to the client
    std::string text, finish_reason, worker;
    v1::Usage usage;
    bool headers_sent = false, client_gone = false;

    // A worker that fails mid-generation before anything reached the client (always, for a
    // non-streaming request): drop what was buffered and let the router start over elsewhere.
    ctl.restart = [&]() -> bool {
      if (headers_sent) return false;
      text.clear();
      finish_reason.clear();
      worker.clear();
      usage.Clear();
      stop = openai::StopFilter(p.stop);
      logprobs = openai::LogprobsTracker(chat);
      emitted = 0;
      return true;
    };
    auto chunk = [&](const std::string& data) {
      return out.Send(absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n"));
    };
    auto event = [&](const json& j) { return chunk("data: " + Dump(j) + "\n\n"); };
    // A request served otherwise than the client may expect (openai::Request::warning, e.g.
    // chat without a chat template) says so in a header of its 200 response.
    const std::string warning_header =
        p.warning.empty() ? "" : absl::StrCat("X-SparseX-Warning: ", p.warning, "\r\n");
    auto start_stream = [&]() -> bool {
      if (headers_sent) return true;
      headers_sent = true;
      if (!out.Send(absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n",
                                 warning_header,
                                 "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                                 "Connection: close\r\n\r\n"))) {
        return false;
      }
      if (chat) return event(openai::StreamRoleChunk(meta));
      return true;
    };

    absl::Status st = router->Generate(
        p.req,
        [&](const v1::GenerateResponse& m) {
          std::string o = stop.Push(m.text(), m.finished());
          text += o;
          emitted += o.size();
          if (m.finished()) {
            finish_reason = m.finish_reason();
            usage = m.usage();
            worker = m.worker();
          }
          json lp;  // this chunk's log probabilities (streaming)
          if (want_logprobs) {
            logprobs.Add(m);
            if (p.stream) lp = logprobs.Take(emitted, p.stop.empty() && !stop.stopped());
          }
          if (p.stream && (!o.empty() || !lp.is_null())) {
            if (!start_stream() || !event(openai::StreamChunk(meta, o, nullptr, lp))) {
              client_gone = true;
              return false;
            }
          }
          if (ctl.cancel->cancelled()) {  // the connection closed (non-streaming)
            client_gone = true;
            return false;
          }
          return !stop.stopped();  // a stop string ends the request (cancels the worker)
        },
        ctl);
    done();  // the generation is over; what is left is writing its end
    if (stop.stopped() && (st.ok() || st.code() == absl::StatusCode::kCancelled)) {
      st = absl::OkStatus();
      finish_reason = "stop";
    }
    if (client_gone || ctl.cancel->cancelled()) return 499;
    if (!st.ok()) {
      HttpError e = FromStatus(st);
      if (headers_sent) {
        event(ErrorJson(e));
        chunk("data: [DONE]\n\n");
        chunk("");
      } else {
        out.Send(ErrorResponse(e));
      }
      return e.status;
    }
    if (p.stream) {
      if (!start_stream()) return 499;
      // What the stop filter held back until the end (none when a stop string cut it).
      json lp = want_logprobs ? logprobs.Take(emitted, !stop.stopped()) : json();
      event(openai::StreamChunk(meta, "", finish_reason, lp));
      if (p.include_usage) event(openai::StreamUsageChunk(meta, usage, worker));
      chunk("data: [DONE]\n\n");
      chunk("");
      return 200;
    }
    json lp = want_logprobs ? logprobs.Take(emitted, !stop.stopped(), /*empty=*/true) : json();
    std::string resp =
        JsonResponse(200, openai::Response(meta, text, finish_reason, usage, worker, lp));
    if (!warning_header.empty()) resp.insert(resp.find("\r\n") + 2, warning_header);
    out.Send(resp);
    return 200;
  }

  std::string HandleModels(const HttpRequest& rq, const Tenant* caller) {
    v1::ListModelsResponse lm = router->ListModels(caller);
    json data = json::array();
    for (const auto& m : lm.models()) {
      // context_length is what this server accepts (prompt plus generated tokens);
      // max_model_len repeats it under vLLM's name for the clients that read that one;
      // trained_context_length is what the model's metadata states, null when it states none
      // (context_length is then the loader's default).
      data.push_back({{"id", m.id()},
                      {"object", "model"},
                      {"created", 0},
                      {"owned_by", "sparsex"},
                      {"context_length", m.context_length()},
                      {"max_model_len", m.context_length()},
                      {"trained_context_length", m.has_trained_context_length()
                                                     ? json(m.trained_context_length())
                                                     : json(nullptr)},
                      {"workers", m.workers()}});
    }
    const std::string prefix = "/v1/models/";
    if (rq.path.rfind(prefix, 0) == 0) {
      const std::string want = rq.path.substr(prefix.size());
      for (const json& d : data) {
        if (d["id"] == want) return JsonResponse(200, d);
      }
      HttpError e = Error(404, "unknown model '" + want + "'");
      e.code = "model_not_found";
      return ErrorResponse(e);
    }
    return JsonResponse(200, json{{"object", "list"}, {"data", data}});
  }

  std::string HandleHealth() {
    v1::HealthResponse h = router->Health();
    int healthy = 0;
    for (const auto& w : h.workers()) healthy += w.healthy() ? 1 : 0;
    const int status = h.serving() ? 200 : 503;
    return Response(status, "application/json",
                    Dump(json{{"status", h.serving() ? "ok" : "no healthy worker"},
                              {"workers", h.workers_size()},
                              {"healthy_workers", healthy}}));
  }

  std::string Unauthorized(const absl::Status& s) {
    std::string r = ErrorResponse(FromStatus(s));
    // RFC 6750: a 401 names the scheme it wants.
    const size_t eol = r.find("\r\n");
    if (eol != std::string::npos) r.insert(eol + 2, "WWW-Authenticate: Bearer\r\n");
    return r;
  }

  // ---- the admin listener (StartAdmin): probes and monitoring, apart from the API's
  // connections and limits, so that no API client can make them fail.

  const Impl* watched = nullptr;  // admin: the API front end whose I/O loop /livez checks
  std::atomic<int64_t> loop_turn_ns{0};  // steady clock of the I/O loop's last turn
  static constexpr std::chrono::seconds kLoopStall{5};

  std::string HandleLive() {
    if (watched != nullptr) {
      const auto stalled = std::chrono::nanoseconds(Clock::now().time_since_epoch().count() -
                                                    watched->loop_turn_ns.load());
      if (stalled > kLoopStall) {
        return Response(503, "application/json",
                        Dump(json{{"status", "HTTP API I/O loop stalled"},
                                  {"stalled_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                                     stalled).count()}}));
      }
    }
    return Response(200, "application/json", Dump(json{{"status", "alive"}}));
  }

  std::string AdminRoute(const HttpRequest& rq) {
    const std::string& p = rq.path;
    if (p == "/healthz") return HandleHealth();
    if (p == "/livez") return HandleLive();
    if (p == "/metrics") {
      return Response(200, "text/plain; version=0.0.4; charset=utf-8",
                      router->registry().Render());
    }
    return ErrorResponse(Error(404, "no route for " + rq.method + " " + p +
                                        " (the admin listener serves /healthz, /livez and "
                                        "/metrics)"));
  }

  // Everything but a completion, answered on the I/O thread.
  std::string Light(const HttpRequest& rq) {
    const std::string& p = rq.path;
    if (p == "/healthz") return HandleHealth();
    if (p == "/metrics") {
      return Response(200, "text/plain; version=0.0.4; charset=utf-8",
                      router->registry().Render());
    }
    // Everything below needs an API key (when keys are configured); /healthz and /metrics
    // above are for probes and the monitoring system.
    const std::string* authz = rq.Header("authorization");
    auto tenant = router->auth().Authenticate(authz ? *authz : std::string());
    if (!tenant.ok()) return Unauthorized(tenant.status());
    if (p == "/v1/models" || p.rfind("/v1/models/", 0) == 0) return HandleModels(rq, tenant->get());
    if (p == "/v1/completions" || p == "/v1/chat/completions") {
      return ErrorResponse(Error(405, "use POST"));
    }
    return ErrorResponse(Error(404, "no route for " + rq.method + " " + p));
  }

  // ------------------------------------------------------------------------------------------
  // The I/O thread

  void Watch(Conn& c, uint32_t events, bool add = false) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = c.id;
    ::epoll_ctl(ep, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c.fd, &ev);
  }

  void Close(uint64_t id, const char* reason) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    Conn& c = *it->second;
    ::epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
    if (reason != nullptr) closed->Get({reason}).Inc();
    ReleaseClient(c);
    conns.erase(it);
    open_conns->Set(static_cast<double>(conns.size()));
  }

  // Starts writing `resp` without blocking; the connection closes once it is out.
  void Respond(Conn& c, std::string resp) {
    c.st = St::kWriting;
    c.out = std::move(resp);
    c.out_off = 0;
    c.in.clear();
    c.in.shrink_to_fit();
    c.deadline = Clock::now() + write_timeout;
    Flush(c);
  }
  void Fail(Conn& c, const HttpError& e, const char* reason) {
    closed->Get({reason}).Inc();
    Respond(c, ErrorResponse(e));
  }

  void Flush(Conn& c) {
    while (c.out_off < c.out.size()) {
      const ssize_t n = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_off += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        Watch(c, EPOLLOUT);
        return;
      } else {
        Close(c.id, nullptr);
        return;
      }
    }
    Linger(c);
  }

  // The response is out: half-close, and read (and drop) whatever the client still sends
  // until it closes or kLinger passes, so that closing never resets the reply away.
  void Linger(Conn& c) {
    ::shutdown(c.fd, SHUT_WR);
    c.st = St::kLinger;
    c.out.clear();
    c.out.shrink_to_fit();
    c.deadline = Clock::now() + kLinger;
    Watch(c, EPOLLIN | EPOLLRDHUP);
  }

  // ---- per-client limits (I/O thread)

  // The source address of a connection: the unit of the per-client limits. An IPv6 client
  // counts by its /64 (one host is commonly given a whole /64, so its addresses are many).
  static std::string ClientOf(const sockaddr_storage& ss) {
    char buf[INET6_ADDRSTRLEN] = "";
    if (ss.ss_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
    } else if (ss.ss_family == AF_INET6) {
      in6_addr a = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
      if (IN6_IS_ADDR_V4MAPPED(&a)) {  // a dual-stack socket: the IPv4 client's own address
        ::inet_ntop(AF_INET, &a.s6_addr[12], buf, sizeof buf);
      } else {
        std::memset(&a.s6_addr[8], 0, 8);
        ::inet_ntop(AF_INET6, &a, buf, sizeof buf);
        return std::string(buf) + "/64";
      }
    }
    return buf;
  }

  // A new connection from `client`: false (answered 429 and closed) when that client holds
  // max_connections_per_client already, so that one client's idle connections cannot fill the
  // server (the global limit, max_connections, is every client's).
  bool AdmitConnection(int fd, const std::string& client) {
    ClientUse& u = clients[client];
    if (max_connections_per_client > 0 && u.connections >= max_connections_per_client) {
      const std::string r = ErrorResponse(Error(
          429, absl::StrCat("too many connections from ", client, " (at most ",
                            max_connections_per_client,
                            " per client, http_max_connections_per_client); retry later")));
      (void)::send(fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::shutdown(fd, SHUT_WR);
      ::close(fd);
      closed->Get({"client_connection_limit"}).Inc();
      if (u.connections == 0) clients.erase(client);
      return false;
    }
    ++u.connections;
    return true;
  }

  // A completion from c's client: false (answered 429) when the client has
  // max_streams_per_client completions in flight already (queued or running), so that one
  // client cannot take every generation thread.
  bool AdmitStream(Conn& c) {
    std::unique_lock<std::mutex> l(streams_mu);
    int& n = streams_in_flight[c.client];
    if (max_streams_per_client > 0 && n >= max_streams_per_client) {
      if (n == 0) streams_in_flight.erase(c.client);
      l.unlock();
      HttpError e = Error(429, absl::StrCat("too many concurrent completions from ", c.client,
                                            " (at most ", max_streams_per_client,
                                            " per client, http_max_streams_per_client); "
                                            "retry when one has finished"));
      e.type = "rate_limit_error";
      e.code = "too_many_streams";
      Fail(c, e, "client_stream_limit");
      return false;
    }
    ++n;
    return true;
  }

  // The generation thread, once a completion is over (answered, failed or cancelled).
  void StreamDone(const std::string& client) {
    std::lock_guard<std::mutex> l(streams_mu);
    auto it = streams_in_flight.find(client);
    if (it != streams_in_flight.end() && --it->second <= 0) streams_in_flight.erase(it);
  }

  void ReleaseClient(Conn& c) {
    auto it = clients.find(c.client);
    if (it == clients.end()) return;
    if (--it->second.connections <= 0) clients.erase(it);
  }

  void Accept() {
    for (;;) {
      sockaddr_storage peer{};
      socklen_t peer_len = sizeof peer;
      const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &peer_len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop accepting for a moment (a level-triggered listening
          // socket would otherwise spin); pending connections wait in the backlog.
          ::epoll_ctl(ep, EPOLL_CTL_DEL, listen_fd, nullptr);
          accept_paused = true;
          accept_resume = Clock::now() + std::chrono::milliseconds(100);
          closed->Get({"no_descriptors"}).Inc();
        }
        return;
      }
      if (static_cast<int>(conns.size()) >= max_connections) {
        // Over the limit: refuse at once (best effort, the socket buffer takes it).
        static const std::string k503 = ErrorResponse(
            Error(503, "too many connections to this router; retry later"));
        (void)::send(fd, k503.data(), k503.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::shutdown(fd, SHUT_WR);
        ::close(fd);
        closed->Get({"connection_limit"}).Inc();
        continue;
      }
      const std::string client = ClientOf(peer);
      if (!AdmitConnection(fd, client)) continue;
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      // TCP keepalive: a client that vanished without a FIN (host gone, network cut) shows as
      // a socket error after ~1 min, which cancels its completion like a close.
      const int idle_s = 30, intvl_s = 10, cnt = 3;
      ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl_s, sizeof intvl_s);
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
      auto c = std::make_unique<Conn>();
      c->id = next_id++;
      c->fd = fd;
      c->client = client;
      c->opened = c->last_byte = Clock::now();
      Conn& ref = *c;
      conns.emplace(c->id, std::move(c));
      Watch(ref, EPOLLIN | EPOLLRDHUP, /*add=*/true);
      open_conns->Set(static_cast<double>(conns.size()));
    }
  }

  // Reads what is there (kept in c.in with `keep`).
  enum class Read { kOpen, kEof, kError };
  Read ReadSome(Conn& c, bool keep) {
    char buf[16384];
    for (;;) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        if (keep) c.in.append(buf, static_cast<size_t>(n));
        c.last_byte = Clock::now();
        if (keep && c.in.size() > kMaxHead + max_body + 64 * 1024) return Read::kOpen;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Read::kOpen;
      return n == 0 ? Read::kEof : Read::kError;
    }
  }

  enum class Body { kMore, kDone };

  // Chunked request body (RFC 9112 7.1), decoded incrementally from c.pos.
  absl::StatusOr<Body> Chunked(Conn& c) {
    for (;;) {
      if (c.trailer) {
        const size_t le = c.in.find("\r\n", c.pos);
        if (le == std::string::npos) return Body::kMore;
        const bool last = le == c.pos;
        c.pos = le + 2;
        if (last) return Body::kDone;
        continue;
      }
      if (c.chunk_left > 0) {
        const size_t take = std::min(c.chunk_left, c.in.size() - c.pos);
        c.req.body.append(c.in, c.pos, take);
        c.pos += take;
        c.chunk_left -= take;
        if (c.req.body.size() > max_body) return absl::ResourceExhaustedError("too large");
        if (c.chunk_left > 0) return Body::kMore;
        c.chunk_crlf = true;
      }
      if (c.chunk_crlf) {
        if (c.in.size() - c.pos < 2) return Body::kMore;
        if (c.in.compare(c.pos, 2, "\r\n") != 0) {
          return absl::InvalidArgumentError("malformed chunked body");
        }
        c.pos += 2;
        c.chunk_crlf = false;
      }
      const size_t le = c.in.find("\r\n", c.pos);
      if (le == std::string::npos) {
        if (c.in.size() - c.pos > 1024) return absl::InvalidArgumentError("malformed chunk size");
        return Body::kMore;
      }
      size_t size = 0;
      size_t i = c.pos;
      for (; i < le && Hex(c.in[i]) >= 0; ++i) {
        size = size * 16 + static_cast<size_t>(Hex(c.in[i]));
        if (size > max_body) return absl::ResourceExhaustedError("too large");
      }
      if (i == c.pos || (i < le && c.in[i] != ';' && c.in[i] != ' ' && c.in[i] != '\t')) {
        return absl::InvalidArgumentError("malformed chunk size");
      }
      c.pos = le + 2;
      if (size == 0) {
        c.trailer = true;
      } else {
        c.chunk_left = size;
      }
    }
  }

  void Input(Conn& c) {
    if (!c.head_done) {
      const size_t e = c.in.find("\r\n\r\n");
      if (e == std::string::npos) {
        if (c.in.size() > kMaxHead) Fail(c, Error(431, "request head too large"), "bad_request");
        return;
      }
      if (e + 4 > kMaxHead) {
        Fail(c, Error(431, "request head too large"), "bad_request");
        return;
      }
      if (absl::Status s = ParseHead(std::string_view(c.in).substr(0, e), &c.req); !s.ok()) {
        Fail(c, Error(s.code() == absl::StatusCode::kUnimplemented ? 505 : 400,
                      std::string(s.message())),
             "bad_request");
        return;
      }
      c.head_done = true;
      c.pos = e + 4;
      if (const std::string* te = c.req.Header("transfer-encoding"); te != nullptr) {
        if (absl::AsciiStrToLower(*te) != "chunked") {
          Fail(c, Error(501, "unsupported Transfer-Encoding " + *te), "bad_request");
          return;
        }
        c.chunked = true;
      } else if (const std::string* cl = c.req.Header("content-length"); cl != nullptr) {
        if (cl->empty() || cl->size() > 18 ||
            !std::all_of(cl->begin(), cl->end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
          Fail(c, Error(400, "malformed Content-Length"), "bad_request");
          return;
        }
        c.content_length = std::stoull(*cl);
      }
      if (c.content_length > max_body) {
        Fail(c, Error(413, "request body too large"), "too_large");
        return;
      }
      const std::string* ex = c.req.Header("expect");
      if (ex != nullptr && absl::AsciiStrToLower(*ex) == "100-continue" &&
          (c.chunked || c.content_length > 0) && !c.continue_sent) {
        static const char k100[] = "HTTP/1.1 100 Continue\r\n\r\n";
        (void)::send(c.fd, k100, sizeof k100 - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        c.continue_sent = true;
      }
    }
    if (c.chunked) {
      absl::StatusOr<Body> b = Chunked(c);
      if (!b.ok()) {
        if (b.status().code() == absl::StatusCode::kResourceExhausted) {
          Fail(c, Error(413, "request body too large"), "too_large");
        } else {
          Fail(c, Error(400, std::string(b.status().message())), "bad_request");
        }
        return;
      }
      if (*b == Body::kMore) return;
    } else {
      if (c.in.size() - c.pos < c.content_length) return;
      c.req.body = c.in.substr(c.pos, c.content_length);
    }
    Dispatch(c);
  }

  void Dispatch(Conn& c) {
    if (admin) {
      Respond(c, AdminRoute(c.req));
      return;
    }
    const std::string& p = c.req.path;
    const bool chat = p == "/v1/chat/completions";
    if ((chat || p == "/v1/completions") && c.req.method == "POST") {
      const std::string* authz = c.req.Header("authorization");
      auto tenant = router->auth().Authenticate(authz ? *authz : std::string());
      if (!tenant.ok()) {
        Respond(c, Unauthorized(tenant.status()));
        return;
      }
      if (!AdmitStream(c)) return;
      HandOff(c, chat, *tenant);
      return;
    }
    Respond(c, Light(c.req));
  }

  void HandOff(Conn& c, bool chat, std::shared_ptr<const Tenant> tenant) {
    c.st = St::kHandedOff;
    c.in.clear();
    c.in.shrink_to_fit();
    c.cancel = std::make_shared<CallCancel>();
    // The generation thread writes with blocking sends, each bounded by the write timeout.
    ::fcntl(c.fd, F_SETFL, ::fcntl(c.fd, F_GETFL) & ~O_NONBLOCK);
    timeval tv{};
    tv.tv_sec = write_timeout.count() / 1000;
    tv.tv_usec = (write_timeout.count() % 1000) * 1000;
    ::setsockopt(c.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    // Watched for the client closing (once; the request is cancelled then).
    Watch(c, EPOLLRDHUP | EPOLLONESHOT);
    {
      std::lock_guard<std::mutex> l(jobs_mu);
      jobs.push_back(
          Job{c.id, c.fd, std::move(c.req), chat, c.cancel, std::move(tenant), c.client});
      completions->Get({"queued"}).Set(static_cast<double>(jobs.size()));
    }
    jobs_cv.notify_one();
  }

  void Event(uint64_t id, uint32_t events) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    Conn& c = *it->second;
    switch (c.st) {
      case St::kReading: {
        const Read r = ReadSome(c, true);
        if (r == Read::kError) {
          Close(id, nullptr);
          return;
        }
        // A client may half-close after its request: what it sent is still served (a
        // completion of such a client is cancelled at once, as its connection reads closed).
        Input(c);
        if (r == Read::kEof) {
          auto again = conns.find(id);
          if (again != conns.end() && again->second->st == St::kReading) Close(id, nullptr);
        }
        return;
      }
      case St::kWriting:
        if (events & (EPOLLERR | EPOLLHUP)) {
          Close(id, nullptr);
          return;
        }
        Flush(c);
        return;
      case St::kLinger:
        if (ReadSome(c, false) != Read::kOpen) Close(id, nullptr);
        return;
      case St::kHandedOff:
        if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
          closed->Get({"client_gone"}).Inc();
          c.cancel->Cancel();
        }
        return;
    }
  }

  void Finished() {
    uint64_t v;
    (void)::read(wake_fd, &v, sizeof v);
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> l(done_mu);
      ids.swap(done);
    }
    for (uint64_t id : ids) {
      auto it = conns.find(id);
      if (it == conns.end()) continue;
      Conn& c = *it->second;
      ::fcntl(c.fd, F_SETFL, ::fcntl(c.fd, F_GETFL) | O_NONBLOCK);
      Linger(c);
    }
  }

  void Sweep() {
    const Clock::time_point now = Clock::now();
    if (accept_paused && now >= accept_resume) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = 0;
      ::epoll_ctl(ep, EPOLL_CTL_ADD, listen_fd, &ev);
      accept_paused = false;
    }
    std::vector<std::pair<uint64_t, const char*>> expired;
    std::vector<std::pair<uint64_t, const char*>> timed_out;
    for (auto& [id, c] : conns) {
      switch (c->st) {
        case St::kReading:
          if (now - c->last_byte > idle_timeout) timed_out.push_back({id, "idle_timeout"});
          else if (now - c->opened > read_timeout) timed_out.push_back({id, "read_timeout"});
          break;
        case St::kWriting:
          if (now > c->deadline) expired.push_back({id, "write_timeout"});
          break;
        case St::kLinger:
          if (now > c->deadline) expired.push_back({id, nullptr});
          break;
        case St::kHandedOff: break;
      }
    }
    for (auto& [id, why] : expired) Close(id, why);
    for (auto& [id, why] : timed_out) {
      auto it = conns.find(id);
      if (it == conns.end()) continue;
      Fail(*it->second,
           Error(408, std::string(why) == "idle_timeout"
                          ? "no request data for " + std::to_string(idle_timeout.count()) + " ms"
                          : "request not received within " +
                                std::to_string(read_timeout.count()) + " ms"),
           why);
    }
  }

  void IoLoop() {
    epoll_event evs[256];
    Clock::time_point last_sweep = Clock::now();
    while (!stopping.load()) {
      loop_turn_ns.store(Clock::now().time_since_epoch().count());
      const int n = ::epoll_wait(ep, evs, 256, 50);
      for (int i = 0; i < n; ++i) {
        const uint64_t id = evs[i].data.u64;
        if (id == 0) Accept();
        else if (id == 1) Finished();
        else Event(id, evs[i].events);
      }
      if (Clock::now() - last_sweep >= std::chrono::milliseconds(50)) {
        Sweep();
        last_sweep = Clock::now();
      }
    }
    // Stopping: no new connection; completions in progress are cancelled (their threads
    // finish soon); every other connection closes now.
    ::epoll_ctl(ep, EPOLL_CTL_DEL, listen_fd, nullptr);
    std::vector<uint64_t> others;
    for (auto& [id, c] : conns) {
      if (c->st == St::kHandedOff) c->cancel->Cancel();
      else others.push_back(id);
    }
    for (uint64_t id : others) Close(id, nullptr);
  }

  void GenLoop() {
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> l(jobs_mu);
        jobs_cv.wait(l, [this] { return jobs_stop || !jobs.empty(); });
        if (jobs.empty()) return;
        j = std::move(jobs.front());
        jobs.pop_front();
        completions->Get({"queued"}).Set(static_cast<double>(jobs.size()));
      }
      completions->Get({"running"}).Set(++running);
      Sender s(j.fd);
      bool released = false;
      const std::function<void()> release = [&] {
        if (!released) StreamDone(j.client);
        released = true;
      };
      try {
        HandleGenerate(j.req, j.chat, s, j.cancel, j.tenant, release);
      } catch (const std::exception& x) {
        std::cerr << "[router] HTTP completion failed: " << x.what() << std::endl;
      }
      release();  // a completion that threw
      if (s.timed_out()) closed->Get({"write_timeout"}).Inc();
      completions->Get({"running"}).Set(--running);
      {
        std::lock_guard<std::mutex> l(done_mu);
        done.push_back(j.id);
      }
      const uint64_t one = 1;
      (void)::write(wake_fd, &one, sizeof one);
    }
  }

  void Stop() {
    if (stopped) return;
    stopped = true;
    stopping = true;
    if (io.joinable()) io.join();
    {
      std::lock_guard<std::mutex> l(jobs_mu);
      jobs_stop = true;
      for (Job& j : jobs) j.cancel->Cancel();  // queued: answered quickly, then closed
    }
    jobs_cv.notify_all();
    for (std::thread& t : gen_threads) t.join();
    for (auto& [id, c] : conns) ::close(c->fd);
    conns.clear();
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
    if (ep >= 0) ::close(ep);
    listen_fd = wake_fd = ep = -1;
  }
};

namespace {

// "host:port", "[v6]:port" or "port" (every interface). Port 0: any free port.
absl::StatusOr<int> Listen(const std::string& address) {
  std::string host, port;
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find("]:");
    if (close == std::string::npos) return absl::InvalidArgumentError("bad address " + address);
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else if (const size_t colon = address.rfind(':'); colon != std::string::npos) {
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  } else {
    port = address;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return absl::InvalidArgumentError("cannot resolve " + address);
  }
  int fd = -1;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return absl::UnavailableError("router: cannot listen on " + address + " (HTTP)");
  return fd;
}

// The per-client limits and the prompt bound of the API listener (RouterOptions).
void ApplyClientLimits(const RouterOptions& o, HttpFrontend::Impl* s) {
  s->max_prompt_bytes = o.max_prompt_bytes;
  s->max_connections_per_client = std::max(0, o.http_max_connections_per_client);
  s->max_streams_per_client = o.http_max_streams_per_client < 0   ? 0
                              : o.http_max_streams_per_client > 0 ? o.http_max_streams_per_client
                                                                  : std::max(1, s->threads / 4);
}

int BoundPort(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(Router* router,
                                                                  const std::string& address,
                                                                  int threads) {
  std::unique_ptr<HttpFrontend> f(new HttpFrontend());
  f->impl_ = std::make_unique<Impl>();
  Impl& s = *f->impl_;
  const RouterOptions& o = router->options();
  s.router = router;
  s.threads = std::max(1, threads);
  s.max_body = o.max_body_bytes;
  s.idle_timeout = std::chrono::milliseconds(std::max(1, o.http_idle_timeout_ms));
  s.read_timeout = std::chrono::milliseconds(std::max(1, o.http_read_timeout_ms));
  s.write_timeout = std::chrono::milliseconds(std::max(1, o.http_write_timeout_ms));
  s.max_connections = std::max(1, o.http_max_connections);
  ApplyClientLimits(o, &s);
  // Each connection is a descriptor: keep the limit below the process's own.
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
      static_cast<rlim_t>(s.max_connections) + 128 > rl.rlim_cur) {
    const int cap = std::max<int>(16, static_cast<int>(rl.rlim_cur) - 128);
    std::cerr << "[router] --http_max_connections " << s.max_connections
              << " is above the descriptor limit (" << rl.rlim_cur << "): using " << cap
              << std::endl;
    s.max_connections = cap;
  }
  metrics::Registry& r = router->registry();
  s.open_conns = &r.AddGauge("sparsex_router_http_connections", "Open HTTP connections.").Get();
  s.closed = &r.AddCounter("sparsex_router_http_closed_total",
                           "HTTP connections refused or closed early, by reason "
                           "(connection_limit, idle_timeout, read_timeout, write_timeout, "
                           "bad_request, too_large, client_gone, no_descriptors, "
                           "client_connection_limit, client_stream_limit).",
                           {"reason"});
  for (const char* reason : {"connection_limit", "idle_timeout", "read_timeout", "write_timeout",
                             "bad_request", "too_large", "client_gone",
                             "client_connection_limit", "client_stream_limit"}) {
    s.closed->Get({reason});
  }
  s.completions = &r.AddGauge("sparsex_router_http_completions",
                              "HTTP completions being served (running) or read and waiting "
                              "for a generation thread (queued).",
                              {"state"});
  s.completions->Get({"running"}).Set(0);
  s.completions->Get({"queued"}).Set(0);

  ASSIGN_OR_RETURN(s.listen_fd, Listen(address));
  f->port_ = BoundPort(s.listen_fd);
  if (f->port_ == 0) return absl::InternalError("router: cannot determine the HTTP port");
  s.ep = ::epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s.ep < 0 || s.wake_fd < 0) return absl::InternalError("router: epoll/eventfd failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  ::epoll_ctl(s.ep, EPOLL_CTL_ADD, s.listen_fd, &ev);
  ev.data.u64 = 1;
  ::epoll_ctl(s.ep, EPOLL_CTL_ADD, s.wake_fd, &ev);
  Impl* impl = &s;
  for (int i = 0; i < s.threads; ++i) s.gen_threads.emplace_back([impl] { impl->GenLoop(); });
  s.io = std::thread([impl] { impl->IoLoop(); });
  return f;
}

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::StartAdmin(Router* router,
                                                                       const std::string& address,
                                                                       const HttpFrontend* api) {
  std::unique_ptr<HttpFrontend> f(new HttpFrontend());
  f->impl_ = std::make_unique<Impl>();
  Impl& s = *f->impl_;
  const RouterOptions& o = router->options();
  s.router = router;
  s.admin = true;
  s.threads = 0;
  s.watched = api != nullptr ? api->impl_.get() : nullptr;
  // Probes and scrapes: small requests, few clients; limits of their own.
  s.max_body = 64 << 10;
  s.max_connections = 64;
  s.idle_timeout = std::chrono::milliseconds(std::max(1, o.http_idle_timeout_ms));
  s.read_timeout = std::chrono::milliseconds(std::max(1, o.http_read_timeout_ms));
  s.write_timeout = std::chrono::milliseconds(std::max(1, o.http_write_timeout_ms));
  metrics::Registry& r = router->registry();
  s.open_conns =
      &r.AddGauge("sparsex_router_admin_connections", "Open admin listener connections.").Get();
  s.closed = &r.AddCounter("sparsex_router_admin_closed_total",
                           "Admin listener connections refused or closed early, by reason "
                           "(as sparsex_router_http_closed_total).",
                           {"reason"});
  s.closed->Get({"connection_limit"});
  ASSIGN_OR_RETURN(s.listen_fd, Listen(address));
  f->port_ = BoundPort(s.listen_fd);
  if (f->port_ == 0) return absl::InternalError("router: cannot determine the admin port");
  s.ep = ::epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s.ep < 0 || s.wake_fd < 0) return absl::InternalError("router: epoll/eventfd failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  ::epoll_ctl(s.ep, EPOLL_CTL_ADD, s.listen_fd, &ev);
  ev.data.u64 = 1;
  ::epoll_ctl(s.ep, EPOLL_CTL_ADD, s.wake_fd, &ev);
  Impl* impl = &s;
  s.io = std::thread([impl] { impl->IoLoop(); });
  return f;
}

HttpFrontend::~HttpFrontend() { Shutdown(); }

void HttpFrontend::Shutdown() {
  if (impl_) impl_->Stop();
}

}  // namespace sparsex::router

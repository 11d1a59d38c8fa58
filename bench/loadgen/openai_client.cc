#include "bench/loadgen/openai_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace sparsex::loadgen {

using json = nlohmann::json;

std::vector<std::pair<Role, std::string>> ChatMessages(const RequestSpec& r) {
  std::vector<std::pair<Role, std::string>> out;
  for (const SegmentSpec& s : r.segments) {
    const Role role = RoleOf(s.kind);
    if (out.empty() || out.back().first != role) out.emplace_back(role, std::string());
    out.back().second += s.text;
  }
  return out;
}

std::string ChatBody(const RequestSpec& r, const ChatOptions& o) {
  json j;
  if (!o.model.empty()) j["model"] = o.model;
  json msgs = json::array();
  for (const auto& [role, text] : ChatMessages(r)) {
    msgs.push_back({{"role", RoleName(role)}, {"content", text}});
  }
  j["messages"] = std::move(msgs);
  j["max_tokens"] = o.max_tokens;
  j["temperature"] = o.temperature;
  if (o.seed >= 0) j["seed"] = o.seed;
  if (o.ignore_eos) j["ignore_eos"] = true;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  json reuse = json::object();
  if (!o.reuse_enable) reuse["enable"] = false;
  if (!o.selector.empty()) reuse["selector"] = o.selector;
  if (o.recompute_ratio >= 0) reuse["recompute_ratio"] = o.recompute_ratio;
  if (o.store_after_misses > 0) reuse["store_after_misses"] = o.store_after_misses;
  if (!reuse.empty()) j["reuse"] = std::move(reuse);
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::Status HttpResponseDecoder::ParseHead() {
  const size_t end = buf_.find("\r\n\r\n");
  if (end == std::string::npos) {
    if (buf_.size() > (64 << 10)) return absl::DataLossError("HTTP response head over 64 KiB");
    return absl::OkStatus();
  }
  const std::string head = buf_.substr(0, end);
  buf_.erase(0, end + 4);
  size_t pos = head.find("\r\n");
  const std::string status_line = head.substr(0, pos);
  if (status_line.rfind("HTTP/1.", 0) != 0 || status_line.size() < 12 ||
      !absl::SimpleAtoi(status_line.substr(9, 3), &status_)) {
    return absl::DataLossError(absl::StrCat("bad HTTP status line '", status_line, "'"));
  }
  while (pos != std::string::npos) {
    const size_t next = head.find("\r\n", pos + 2);
    const std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos
                                                                            : next - pos - 2);
    pos = next;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    headers_[absl::AsciiStrToLower(line.substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  head_done_ = true;
  if (auto te = headers_.find("transfer-encoding"); te != headers_.end()) {
    if (absl::AsciiStrToLower(te->second) != "chunked") {
      return absl::UnimplementedError(
          absl::StrCat("unsupported Transfer-Encoding '", te->second, "'"));
    }
    chunked_ = true;
  } else if (auto cl = headers_.find("content-length"); cl != headers_.end()) {
    if (!absl::SimpleAtoi(cl->second, &length_left_)) {
      return absl::DataLossError(absl::StrCat("bad Content-Length '", cl->second, "'"));
    }
    has_length_ = true;
    done_ = length_left_ == 0;
  }
  return absl::OkStatus();
}

absl::Status HttpResponseDecoder::FeedBody(absl::string_view bytes) {
  if (!chunked_) {
    if (has_length_) {
      const size_t n = std::min(bytes.size(), length_left_);
      if (n > 0) on_body_(bytes.substr(0, n));
      length_left_ -= n;
      done_ = length_left_ == 0;
    } else if (!bytes.empty()) {
      on_body_(bytes);
    }
    return absl::OkStatus();
  }
  buf_.append(bytes.data(), bytes.size());
  size_t p = 0;
  while (!done_ && p < buf_.size()) {
    if (chunk_state_ == ChunkState::kData) {
      const size_t n = std::min(buf_.size() - p, chunk_left_);
      on_body_(absl::string_view(buf_).substr(p, n));
      p += n;
      chunk_left_ -= n;
      if (chunk_left_ == 0) chunk_state_ = ChunkState::kDataCrlf;
      continue;
    }
    const size_t eol = buf_.find("\r\n", p);
    if (eol == std::string::npos) break;
    const std::string line = buf_.substr(p, eol - p);
    p = eol + 2;
    if (chunk_state_ == ChunkState::kDataCrlf) {
      if (!line.empty()) return absl::DataLossError("malformed chunked body (no CRLF after data)");
      chunk_state_ = ChunkState::kSize;
    } else if (chunk_state_ == ChunkState::kSize) {
      const std::string size_str = line.substr(0, line.find(';'));
      size_t size = 0;
      if (size_str.empty() || size_str.size() > 15 ||
          !absl::SimpleHexAtoi(absl::StripAsciiWhitespace(size_str), &size)) {
        return absl::DataLossError(absl::StrCat("malformed chunk size '", line, "'"));
      }
      if (size == 0) {
        chunk_state_ = ChunkState::kTrailer;
      } else {
        chunk_left_ = size;
        chunk_state_ = ChunkState::kData;
      }
    } else {  // trailer: header lines until a blank one
      if (line.empty()) done_ = true;
    }
  }
  buf_.erase(0, p);
  return absl::OkStatus();
}

absl::Status HttpResponseDecoder::Feed(absl::string_view bytes) {
  if (done_) return absl::OkStatus();
  if (!head_done_) {
    buf_.append(bytes.data(), bytes.size());
    if (absl::Status s = ParseHead(); !s.ok()) return s;
    if (!head_done_) return absl::OkStatus();
    std::string rest;
    rest.swap(buf_);
    return FeedBody(rest);
  }
  return FeedBody(bytes);
}

absl::Status HttpResponseDecoder::Finish() const {
  if (!head_done_) return absl::DataLossError("connection closed before an HTTP response");
  if (done_ || (!chunked_ && !has_length_)) return absl::OkStatus();
  return absl::DataLossError("connection closed mid-response");
}

std::vector<std::string> SseDecoder::Feed(absl::string_view bytes) {
  std::vector<std::string> events;
  for (char c : bytes) {
    if (c != '\n') {
      line_ += c;
      continue;
    }
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    if (line_.empty()) {
      if (has_data_) events.push_back(std::move(data_));
      data_.clear();
      has_data_ = false;
    } else if (line_.rfind("data:", 0) == 0) {
      absl::string_view v = absl::string_view(line_).substr(5);
      if (!v.empty() && v[0] == ' ') v.remove_prefix(1);
      if (has_data_) data_ += '\n';
      data_.append(v.data(), v.size());
      has_data_ = true;
    }  // other fields (event:, id:, retry:, comments) carry nothing for this client
    line_.clear();
  }
  return events;
}

absl::StatusOr<ChatChunk> ParseChatChunk(const std::string& data) {
  ChatChunk c;
  if (data == "[DONE]") {
    c.done = true;
    return c;
  }
  const json j = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(absl::StrCat("stream event is not a JSON object: ",
                                            data.substr(0, 200)));
  }
  if (j.contains("error")) {
    const json& e = j["error"];
    c.error = e.is_object() && e.contains("message") && e["message"].is_string()
                  ? e["message"].get<std::string>()
                  : e.dump();
    return c;
  }
  if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
    const json& ch = j["choices"][0];
    if (ch.contains("delta") && ch["delta"].is_object() && ch["delta"].contains("content") &&
        ch["delta"]["content"].is_string()) {
      c.content = ch["delta"]["content"].get<std::string>();
    }
    if (ch.contains("finish_reason") && ch["finish_reason"].is_string()) {
      c.finish_reason = ch["finish_reason"].get<std::string>();
    }
  }
  if (j.contains("usage") && j["usage"].is_object()) {
    const json& u = j["usage"];
    c.has_usage = true;
    for (const char* k : {"prompt_tokens", "completion_tokens"}) {
      if (u.contains(k) && u[k].is_number()) c.usage[k] = u[k].get<double>();
    }
    if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
      const json& d = u["prompt_tokens_details"];
      if (d.contains("cached_tokens") && d["cached_tokens"].is_number()) {
        c.usage["cached_tokens"] = d["cached_tokens"].get<double>();
      }
    }
    if (u.contains("sparsex") && u["sparsex"].is_object()) {
      for (const auto& [k, v] : u["sparsex"].items()) {
        if (v.is_number()) c.usage[k] = v.get<double>();
        if (k == "worker" && v.is_string()) c.worker = v.get<std::string>();
      }
    }
  }
  return c;
}

std::string HttpErrorMessage(const std::string& body) {
  const json j = json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    return j["error"]["message"].get<std::string>();
  }
  return body.substr(0, 300);
}

namespace {
using Clock = std::chrono::steady_clock;

int MsLeft(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, left));
}

// Waits until fd is ready for `events` or the deadline passes.
absl::Status Wait(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, MsLeft(deadline));
    if (r > 0) return absl::OkStatus();
    if (r == 0) return absl::DeadlineExceededError(absl::StrCat("deadline while ", what));
    if (errno != EINTR) return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno)));
  }
}
}  // namespace

namespace {
absl::Status Exchange(const char* method, const std::string& host, int port,
                      const std::string& path, const std::string& body, int timeout_ms,
                      const std::string& api_key,
                      const std::function<void(int, absl::string_view)>& on_body,
                      int* http_status) {
  *http_status = 0;
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int e = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); e != 0) {
    return absl::UnavailableError(absl::StrCat("resolve ", host, ": ", gai_strerror(e)));
  }
  int fd = -1;
  absl::Status conn = absl::UnavailableError(absl::StrCat("connect ", host, ":", port));
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      conn = absl::UnavailableError(absl::StrCat("connect ", host, ":", port, ": ", strerror(errno)));
      ::close(fd);
      fd = -1;
      continue;
    }
    conn = Wait(fd, POLLOUT, deadline, "connecting");
    int err = 0;
    socklen_t len = sizeof err;
    if (conn.ok() && (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
      conn = absl::UnavailableError(absl::StrCat("connect ", host, ":", port, ": ", strerror(err)));
    }
    if (!conn.ok()) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return conn;
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  const std::string req = absl::StrCat(
      method, " ", path, " HTTP/1.1\r\nHost: ", host, ":", port,
      "\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n"
      "X-Request-Timeout-Ms: ", timeout_ms, "\r\n",
      api_key.empty() ? std::string() : absl::StrCat("Authorization: Bearer ", api_key, "\r\n"),
      "Content-Length: ", body.size(), "\r\n\r\n", body);
  absl::Status st;
  for (size_t off = 0; off < req.size() && st.ok();) {
    const ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      st = Wait(fd, POLLOUT, deadline, "sending the request");
    } else {
      st = absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
    }
  }
  HttpResponseDecoder dec([&](absl::string_view b) { on_body(dec.status(), b); });
  char buf[16384];
  while (st.ok() && !dec.done()) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) {
      st = dec.Feed(absl::string_view(buf, static_cast<size_t>(n)));
      *http_status = dec.status();
    } else if (n == 0) {
      st = dec.Finish();
      break;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      st = Wait(fd, POLLIN, deadline, "reading the response");
    } else {
      st = absl::UnavailableError(absl::StrCat("recv: ", strerror(errno)));
    }
  }
  ::close(fd);  // closing it first cancels the request at the worker (docs/api.md)
  return st;
}
}  // namespace

absl::Status PostStream(const std::string& host, int port, const std::string& path,
                        const std::string& body, int timeout_ms, const std::string& api_key,
                        const std::function<void(int, absl::string_view)>& on_body,
                        int* http_status) {
  return Exchange("POST", host, port, path, body, timeout_ms, api_key, on_body, http_status);
}

absl::Status HttpGet(const std::string& host, int port, const std::string& path, int timeout_ms,
                     int* http_status, std::string* body) {
  body->clear();
  return Exchange(
      "GET", host, port, path, "", timeout_ms, "",
      [body](int, absl::string_view b) { body->append(b.data(), b.size()); }, http_status);
}

}  // namespace sparsex::loadgen

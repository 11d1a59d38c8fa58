#include "common/etcd/http_client.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"

namespace sparsex::http {
namespace {

using Clock = std::chrono::steady_clock;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

int RemainingMs(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms < 0 ? 0 : static_cast<int>(ms);
}

absl::Status Connect(const std::string& host_port, Clock::time_point deadline, Fd* out) {
  std::string hp = host_port;
  if (hp.rfind("http://", 0) == 0) hp = hp.substr(7);
  while (!hp.empty() && hp.back() == '/') hp.pop_back();
  const size_t colon = hp.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("address '", host_port, "' has no port"));
  }
  const std::string host = hp.substr(0, colon), port = hp.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(absl::StrCat("resolve ", host_port, ": ", gai_strerror(rc)));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat("connect ", host_port, ": no address"));
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd;
    fd.fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd.fd < 0) continue;
    fcntl(fd.fd, F_SETFL, fcntl(fd.fd, F_GETFL) | O_NONBLOCK);
    int rc = connect(fd.fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS) {
      last = absl::UnavailableError(absl::StrCat("connect ", host_port, ": ", strerror(errno)));
      continue;
    }
    if (rc != 0) {
      pollfd p{fd.fd, POLLOUT, 0};
      rc = poll(&p, 1, RemainingMs(deadline));
      if (rc == 0) {
        last = absl::DeadlineExceededError(absl::StrCat("connect ", host_port, ": timeout"));
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(fd.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last = absl::UnavailableError(absl::StrCat("connect ", host_port, ": ", strerror(err)));
        continue;
      }
    }
    out->fd = fd.fd;
    fd.fd = -1;
    freeaddrinfo(res);
    return absl::OkStatus();
  }
  freeaddrinfo(res);
  return last;
}

absl::Status SendAll(int fd, const std::string& data, Clock::time_point deadline) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
    }
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, RemainingMs(deadline)) == 0) return absl::DeadlineExceededError("send timeout");
  }
  return absl::OkStatus();
}

// Reads more bytes into buf; false at EOF. Error on timeout.
absl::StatusOr<bool> ReadMore(int fd, std::string* buf, Clock::time_point deadline) {
  char tmp[16384];
  for (;;) {
    ssize_t n = recv(fd, tmp, sizeof tmp, 0);
    if (n > 0) {
      buf->append(tmp, static_cast<size_t>(n));
      return true;
    }
    if (n == 0) return false;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("recv: ", strerror(errno)));
    }
    pollfd p{fd, POLLIN, 0};
    const int ms = RemainingMs(deadline);
    if (ms == 0 || poll(&p, 1, ms) == 0) return absl::DeadlineExceededError("http reply timeout");
  }
}

}  // namespace

std::string HttpResponse::Header(const std::string& lower_name) const {
  for (const auto& [k, v] : headers) {
    if (k == lower_name) return v;
  }
  return "";
}

absl::StatusOr<HttpResponse> HttpStream(const std::string& host_port, const std::string& method,
                                        const std::string& path, const std::string& body,
                                        const HttpRequestOptions& options,
                                        const std::function<bool(std::string_view)>& on_data) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  Fd fd;
  RETURN_IF_ERROR(Connect(host_port, deadline, &fd));
  std::string hp = host_port.rfind("http://", 0) == 0 ? host_port.substr(7) : host_port;
  std::string req = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: ", hp,
                                 "\r\nConnection: close\r\nAccept: */*\r\n");
  if (!body.empty() || method == "POST" || method == "PUT") {
    absl::StrAppend(&req, "Content-Type: ", options.content_type, "\r\nContent-Length: ",
                    body.size(), "\r\n");
  }
  for (const auto& [k, v] : options.headers) absl::StrAppend(&req, k, ": ", v, "\r\n");
  req += "\r\n";
  req += body;
  RETURN_IF_ERROR(SendAll(fd.fd, req, deadline));

  std::string buf;
  size_t hdr_end;
  while ((hdr_end = buf.find("\r\n\r\n")) == std::string::npos) {
    ASSIGN_OR_RETURN(bool more, ReadMore(fd.fd, &buf, deadline));
    if (!more) return absl::DataLossError("http: connection closed before the headers");
  }
  HttpResponse resp;
  {
    std::string head = buf.substr(0, hdr_end);
    size_t line_end = head.find("\r\n");
    std::string status_line = head.substr(0, line_end);
    const size_t sp = status_line.find(' ');
    if (sp == std::string::npos ||
        !absl::SimpleAtoi(status_line.substr(sp + 1, 3), &resp.status)) {
      return absl::DataLossError(absl::StrCat("http: bad status line '", status_line, "'"));
    }
    size_t pos = line_end == std::string::npos ? head.size() : line_end + 2;
    while (pos < head.size()) {
      size_t e = head.find("\r\n", pos);
      if (e == std::string::npos) e = head.size();
      std::string line = head.substr(pos, e - pos);
      const size_t c = line.find(':');
      if (c != std::string::npos) {
        std::string k = absl::AsciiStrToLower(line.substr(0, c));
        std::string v(absl::StripAsciiWhitespace(line.substr(c + 1)));
        resp.headers.emplace_back(std::move(k), std::move(v));
      }
      pos = e + 2;
    }
  }
  buf.erase(0, hdr_end + 4);
  const bool chunked = absl::AsciiStrToLower(resp.Header("transfer-encoding")) == "chunked";
  int64_t content_length = -1;
  if (std::string cl = resp.Header("content-length"); !cl.empty()) {
    if (!absl::SimpleAtoi(cl, &content_length)) return absl::DataLossError("http: bad length");
  }
  if (method == "HEAD" || resp.status == 204 || resp.status == 304) return resp;

  if (chunked) {
    for (;;) {
      size_t le;
      while ((le = buf.find("\r\n")) == std::string::npos) {
        ASSIGN_OR_RETURN(bool more, ReadMore(fd.fd, &buf, deadline));
        if (!more) return absl::DataLossError("http: truncated chunk header");
      }
      std::string size_hex = buf.substr(0, le);
      if (size_t semi = size_hex.find(';'); semi != std::string::npos) size_hex.resize(semi);
      uint64_t n = 0;
      if (!absl::SimpleHexAtoi(absl::StripAsciiWhitespace(size_hex), &n)) {
        return absl::DataLossError("http: bad chunk size");
      }
      buf.erase(0, le + 2);
      if (n == 0) return resp;
      while (buf.size() < n + 2) {
        ASSIGN_OR_RETURN(bool more, ReadMore(fd.fd, &buf, deadline));
        if (!more) return absl::DataLossError("http: truncated chunk");
      }
      if (!on_data(std::string_view(buf.data(), n))) return resp;
      buf.erase(0, n + 2);
    }
  }
  int64_t got = 0;
  for (;;) {
    if (!buf.empty()) {
      std::string_view piece(buf);
      if (content_length >= 0 && got + static_cast<int64_t>(piece.size()) > content_length) {
        piece = piece.substr(0, static_cast<size_t>(content_length - got));
      }
      got += static_cast<int64_t>(piece.size());
      if (!on_data(piece)) return resp;
      buf.clear();
    }
    if (content_length >= 0 && got >= content_length) return resp;
    ASSIGN_OR_RETURN(bool more, ReadMore(fd.fd, &buf, deadline));
    if (!more) {
      if (content_length >= 0 && got < content_length) {
        return absl::DataLossError("http: body shorter than Content-Length");
      }
      return resp;
    }
  }
}

absl::StatusOr<HttpResponse> HttpRequest(const std::string& host_port, const std::string& method,
                                         const std::string& path, const std::string& body,
                                         const HttpRequestOptions& options) {
  std::string out;
  ASSIGN_OR_RETURN(HttpResponse r, HttpStream(host_port, method, path, body, options,
                                              [&out](std::string_view d) {
                                                out.append(d);
                                                return true;
                                              }));
  r.body = std::move(out);
  return r;
}

}  // namespace sparsex::http

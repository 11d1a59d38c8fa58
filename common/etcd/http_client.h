// A minimal blocking HTTP/1.1 client over TCP sockets (IPv4 / host names), enough for etcd's
// JSON gateway, health probes and tests: one request per connection (Connection: close),
// Content-Length and chunked replies, a timeout on the whole exchange.
//
//   ASSIGN_OR_RETURN(HttpResponse r, HttpRequest("127.0.0.1:2379", "POST", "/v3/kv/put", body));
//   if (r.status != 200) ...
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace sparsex::http {

struct HttpResponse {
  int status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  std::string Header(const std::string& lower_name) const;
};

struct HttpRequestOptions {
  int timeout_ms = 5000;  // connect + send + whole reply. Default: 5000
  std::string content_type = "application/json";  // Default: application/json
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers. Default: none
};

// `host_port`: "host:port" (an optional "http://" prefix is accepted). UNAVAILABLE when the
// connection fails, DEADLINE_EXCEEDED on timeout, DATA_LOSS on a malformed reply.
absl::StatusOr<HttpResponse> HttpRequest(const std::string& host_port, const std::string& method,
                                         const std::string& path, const std::string& body = "",
                                         const HttpRequestOptions& options = {});

// Streams the reply body to `on_data` as it arrives (de-chunked); on_data returns false to stop
// reading. Returns the status line and headers (body empty).
absl::StatusOr<HttpResponse> HttpStream(const std::string& host_port, const std::string& method,
                                        const std::string& path, const std::string& body,
                                        const HttpRequestOptions& options,
                                        const std::function<bool(std::string_view)>& on_data);

}  // namespace sparsex::http

// HTTP endpoint for Prometheus scrapes (civetweb): GET /metrics renders a Registry, GET /healthz
// answers 200 "ok" while the health callback returns true and 503 otherwise.
//
//   metrics::Registry reg;
//   metrics::HttpServerOptions opt;  // 127.0.0.1, any free port
//   ASSIGN_OR_RETURN(auto http, metrics::HttpServer::Start(opt, &reg, [] { return true; }));
//   LOG << "metrics on port " << http->port();
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/metrics/metrics.h"
#include "common/status.h"

namespace sparsex::metrics {

struct HttpServerOptions {
  // Address to bind (civetweb here has no IPv6). Default: "127.0.0.1".
  std::string address = "127.0.0.1";
  // Port; 0 picks a free one (see HttpServer::port()). Default: 0.
  int port = 0;
  // Worker threads serving requests. Default: 2.
  int num_threads = 2;
};

class HttpServer {
 public:
  // `registry` must outlive the server. `healthy` may be empty (always healthy).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           const Registry* registry,
                                                           std::function<bool()> healthy = {});
  ~HttpServer();  // stops serving (civetweb's mg_stop takes up to a few seconds)
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

  // Internal: request handlers (civetweb C callbacks).
  struct Impl;

 private:
  HttpServer() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace sparsex::metrics

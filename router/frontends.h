// The router's two front ends over Router (router.h):
//   GrpcFrontend  the public gRPC API (proto/sparsex.proto: Generate, Tokenize, ListModels,
//                 Health), deadlines and cancellation propagated to the worker call.
//   HttpFrontend  OpenAI-compatible HTTP: POST /v1/completions and /v1/chat/completions (SSE
//                 with "stream": true; each chat message becomes a segment), GET /v1/models,
//                 /healthz and the Prometheus /metrics. docs/api.md. Its own HTTP/1.1 server
//                 (one request per connection): one epoll thread reads every request whole,
//                 under idle and read timeouts and a connection limit, and answers /healthz,
//                 /metrics and /v1/models itself, so they never wait for a generation thread;
//                 completions go to `threads` generation threads. A client that closes its
//                 connection cancels its request, streaming or not.
//
//   ASSIGN_OR_RETURN(auto g, GrpcFrontend::Start(router.get(), "127.0.0.1:50051"));
//   ASSIGN_OR_RETURN(auto h, HttpFrontend::Start(router.get(), "127.0.0.1:8000", 64));
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace sparsex::router {

class Router;

class GrpcFrontend {
 public:
  // `address` "host:port" (port 0 picks a free one, see port()).
  static absl::StatusOr<std::unique_ptr<GrpcFrontend>> Start(Router* router,
                                                             const std::string& address);
  ~GrpcFrontend();
  void Shutdown();
  int port() const { return port_; }
  struct Impl;

 private:
  GrpcFrontend() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

class HttpFrontend {
 public:
  // `threads` generation threads; the other limits come from router->options() (http_*,
  // max_body_bytes, max_prompt_bytes), per-client ones included: connections and completions in
  // flight per source address, over which a client is answered 429.
  static absl::StatusOr<std::unique_ptr<HttpFrontend>> Start(Router* router,
                                                             const std::string& address,
                                                             int threads);
  // The admin listener: GET /healthz (as on the API port), /livez (200 while `api`'s I/O loop
  // turns; `api` may be null) and /metrics, on connections and limits of its own (at most 64
  // connections), so that no API client (idle connections, streams) can make a probe fail.
  static absl::StatusOr<std::unique_ptr<HttpFrontend>> StartAdmin(Router* router,
                                                                  const std::string& address,
                                                                  const HttpFrontend* api);
  ~HttpFrontend();
  void Shutdown();
  int port() const { return port_; }
  struct Impl;

 private:
  HttpFrontend() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace sparsex::router

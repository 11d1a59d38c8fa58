#include "common/metrics/http_server.h"

#include <civetweb.h>

#include <cstring>
#include <mutex>

namespace sparsex::metrics {

struct HttpServer::Impl {
  const Registry* registry = nullptr;
  std::function<bool()> healthy;
  mg_context* ctx = nullptr;

  static void Reply(mg_connection* conn, int code, const char* reason, const char* type,
                    const std::string& body, bool head) {
    mg_printf(conn,
              "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
              "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
              code, reason, type, body.size());
    if (!head) mg_write(conn, body.data(), body.size());
  }

  static bool MethodOk(mg_connection* conn, bool* head) {
    const mg_request_info* ri = mg_get_request_info(conn);
    *head = std::strcmp(ri->request_method, "HEAD") == 0;
    if (*head || std::strcmp(ri->request_method, "GET") == 0) return true;
    Reply(conn, 405, "Method Not Allowed", "text/plain", "GET only\n", false);
    return false;
  }

  static int HandleMetrics(mg_connection* conn, void* cbdata) {
    auto* self = static_cast<Impl*>(cbdata);
    bool head = false;
    if (!MethodOk(conn, &head)) return 405;
    Reply(conn, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", self->registry->Render(),
          head);
    return 200;
  }

  static int HandleHealth(mg_connection* conn, void* cbdata) {
    auto* self = static_cast<Impl*>(cbdata);
    bool head = false;
    if (!MethodOk(conn, &head)) return 405;
    const bool ok = !self->healthy || self->healthy();
    if (ok) {
      Reply(conn, 200, "OK", "text/plain", "ok\n", head);
      return 200;
    }
    Reply(conn, 503, "Service Unavailable", "text/plain", "unhealthy\n", head);
    return 503;
  }
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              const Registry* registry,
                                                              std::function<bool()> healthy) {
  static std::once_flag init_once;
  std::call_once(init_once, [] { mg_init_library(0); });
  if (registry == nullptr) return absl::InvalidArgumentError("http server: null registry");
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("http server: bad port ", options.port));
  }
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->impl_ = std::make_unique<Impl>();
  server->impl_->registry = registry;
  server->impl_->healthy = std::move(healthy);

  const std::string ports = absl::StrCat(options.address, ":", options.port);
  const std::string threads = absl::StrCat(options.num_threads < 1 ? 1 : options.num_threads);
  const char* mg_options[] = {"listening_ports", ports.c_str(),
                              "num_threads", threads.c_str(),
                              "request_timeout_ms", "10000",
                              "enable_keep_alive", "no",
                              nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof callbacks);
  char error[256] = "";
  mg_init_data init;
  std::memset(&init, 0, sizeof init);
  init.callbacks = &callbacks;
  init.configuration_options = mg_options;
  mg_error_data err;
  std::memset(&err, 0, sizeof err);
  err.text = error;
  err.text_buffer_size = sizeof error;
  mg_context* ctx = mg_start2(&init, &err);
  if (ctx == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("http server: cannot listen on ", ports, ": ", error));
  }
  server->impl_->ctx = ctx;
  mg_set_request_handler(ctx, "/metrics$", &Impl::HandleMetrics, server->impl_.get());
  mg_set_request_handler(ctx, "/healthz$", &Impl::HandleHealth, server->impl_.get());

  mg_server_port sp[4];
  const int n = mg_get_server_ports(ctx, 4, sp);
  if (n < 1 || sp[0].port <= 0) {
    return absl::InternalError("http server: cannot determine the listening port");
  }
  server->port_ = sp[0].port;
  return server;
}

HttpServer::~HttpServer() {
  if (impl_ && impl_->ctx != nullptr) mg_stop(impl_->ctx);
}

}  // namespace sparsex::metrics

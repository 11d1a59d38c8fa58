#include "cache_server/server.h"

#include "common/random.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "cache_server/service.h"
#include "cache_client/transport.h"
#include "common/metrics/http_server.h"
#include "common/metrics/metrics.h"
#include "proto/grpc_health.h"
#include "proto/grpc_tls.h"

namespace sparsex::cache {

struct CacheServer::State {
  ServerOptions options;
  metrics::Registry registry;
  std::unique_ptr<ServerTransport> transport;
  std::unique_ptr<BlockCache> cache;
  std::unique_ptr<CacheServiceImpl> service;
  std::unique_ptr<grpc::Server> grpc;
  std::unique_ptr<metrics::HttpServer> http;
  int grpc_port = 0;
  std::string server_id;
  uint64_t instance_id = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool shut_down = false;
};

namespace {
// Random and non-zero, so that two starts (even within one process, as in tests) differ.
uint64_t NewInstanceId() {
  const uint64_t v = RandomU64();
  return v == 0 ? 1 : v;
}
}  // namespace

CacheServer::CacheServer() : s_(std::make_unique<State>()) {}

CacheServer::~CacheServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<CacheServer>> CacheServer::Start(const ServerOptions& options) {
  std::unique_ptr<CacheServer> server(new CacheServer());
  State& s = *server->s_;
  s.options = options;
  s.instance_id = NewInstanceId();
  const CacheOptions& co = options.cache;
  if (co.memory_capacity_bytes == 0) {
    return absl::InvalidArgumentError("memory_capacity_bytes must be positive");
  }
  ASSIGN_OR_RETURN(s.transport, CreateServerTransport(options.transport, co.memory_capacity_bytes));
  ASSIGN_OR_RETURN(s.cache, BlockCache::Open(co, s.transport->arena(),
                                             s.transport->arena_bytes(), &s.registry));

  if (!options.tls.enabled()) {
    RETURN_IF_ERROR(CheckPlaintextAllowed(options.insecure_loopback, "insecure_loopback",
                                          {absl::StrCat(options.address, ":0")}));
  }
  ASSIGN_OR_RETURN(auto creds, ServerCredentials(options.tls, /*require_client_cert=*/true));
  EnableGrpcStandardServices();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options.address, ":", options.grpc_port), creds,
                           &s.grpc_port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // The id defaults to address:port, known only once the port is bound (SetServerId below).
  s.service = std::make_unique<CacheServiceImpl>(
      s.cache.get(), s.transport->endpoint(), options.server_id, co.layout_version,
      std::min(co.max_block_bytes, co.memory_capacity_bytes), s.instance_id, &s.registry);
  builder.RegisterService(s.service.get());
  s.grpc = builder.BuildAndStart();
  if (s.grpc == nullptr || s.grpc_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.address, ":", options.grpc_port));
  }
  s.server_id = options.server_id.empty() ? absl::StrCat(options.address, ":", s.grpc_port)
                                          : options.server_id;
  s.service->SetServerId(s.server_id);
  if (options.metrics_port >= 0) {
    metrics::HttpServerOptions ho;
    ho.address = options.address;
    ho.port = options.metrics_port;
    CacheServiceImpl* svc = s.service.get();
    auto http = metrics::HttpServer::Start(ho, &s.registry, [svc] { return svc->serving(); });
    if (!http.ok()) {
      s.grpc->Shutdown();
      return http.status();
    }
    s.http = std::move(*http);
  }
  return server;
}

void CacheServer::Shutdown() {
  std::unique_lock<std::mutex> lock(s_->mu);
  if (s_->shut_down) return;
  s_->shut_down = true;
  lock.unlock();
  if (s_->service) s_->service->SetServing(false);
  // grpc.health.v1 (the Kubernetes probes) says NOT_SERVING at the same moment as /healthz.
  SetGrpcServing(s_->grpc.get(), false);
  if (s_->grpc) s_->grpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  s_->http.reset();
  s_->cache.reset();
  s_->transport.reset();
  s_->cv.notify_all();
}

void CacheServer::Wait() {
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->shut_down; });
}

int CacheServer::grpc_port() const { return s_->grpc_port; }
int CacheServer::metrics_port() const { return s_->http ? s_->http->port() : -1; }
std::string CacheServer::grpc_address() const {
  return absl::StrCat(s_->options.address, ":", s_->grpc_port);
}
const std::string& CacheServer::server_id() const { return s_->server_id; }
uint64_t CacheServer::instance_id() const { return s_->instance_id; }
bool CacheServer::cuda_pinned() const { return s_->transport && s_->transport->cuda_pinned(); }
BlockCache* CacheServer::cache() { return s_->cache.get(); }
metrics::Registry* CacheServer::registry() { return &s_->registry; }

}  // namespace sparsex::cache

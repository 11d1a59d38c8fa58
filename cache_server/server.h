// The cache server process in one object: data-plane transport (arena), BlockCache, gRPC
// CacheService and the Prometheus endpoint. `sparsex-cache-server` is a thin main around it;
// tests can also run it in-process.
//
//   ServerOptions o;
//   o.cache.disk_path = "/var/lib/sparsex/cache";
//   ASSIGN_OR_RETURN(auto server, CacheServer::Start(o));
//   std::cout << "grpc " << server->grpc_port() << " metrics " << server->metrics_port();
//   server->Wait();  // until Shutdown() from another thread / a signal handler
#pragma once

#include <memory>
#include <string>

#include "cache_server/block_cache.h"
#include "cache_server/options.h"
#include "common/status.h"

namespace sparsex::metrics {
class Registry;
}

namespace sparsex::cache {

class CacheServer {
 public:
  static absl::StatusOr<std::unique_ptr<CacheServer>> Start(const ServerOptions& options);
  ~CacheServer();  // Shutdown()
  CacheServer(const CacheServer&) = delete;
  CacheServer& operator=(const CacheServer&) = delete;

  // Stops accepting RPCs (in-flight ones finish), stops the metrics endpoint, closes the
  // store. Idempotent; safe from any thread except a gRPC handler.
  void Shutdown();
  // Blocks until Shutdown() has been called.
  void Wait();

  int grpc_port() const;
  int metrics_port() const;  // -1 when disabled
  std::string grpc_address() const;  // "address:port"
  const std::string& server_id() const;
  // This process's incarnation: random, non-zero, new on every start (proto/cache.proto).
  uint64_t instance_id() const;
  bool cuda_pinned() const;  // arena page-locked for CUDA
  BlockCache* cache();
  metrics::Registry* registry();

  struct State;

 private:
  CacheServer();
  std::unique_ptr<State> s_;
};

}  // namespace sparsex::cache

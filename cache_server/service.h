// gRPC CacheService over a BlockCache (internal to the server; include server.h instead).
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <memory>
#include <string>

#include "cache_server/block_cache.h"
#include "cache_client/transport.h"
#include "proto/cache.grpc.pb.h"

namespace sparsex::metrics {
class Registry;
}

namespace sparsex::cache {

class CacheServiceImpl final : public sparsex::cache::v1::CacheService::Service {
 public:
  // `instance_id`: this process's incarnation (non-zero), returned by GetEndpoint, Health,
  // Lookup, Reserve and Lease so that clients notice a restart (proto/cache.proto).
  CacheServiceImpl(BlockCache* cache, EndpointInfo endpoint, std::string server_id,
                   uint32_t layout_version, uint64_t max_block_bytes, uint64_t instance_id,
                   metrics::Registry* registry);
  ~CacheServiceImpl() override;

  void SetServing(bool serving);
  void SetServerId(std::string id);
  bool serving() const;

  using Ctx = grpc::ServerContext;
  grpc::Status Lookup(Ctx*, const v1::LookupRequest*, v1::LookupResponse*) override;
  grpc::Status Reserve(Ctx*, const v1::ReserveRequest*, v1::ReserveResponse*) override;
  grpc::Status Commit(Ctx*, const v1::CommitRequest*, v1::CommitResponse*) override;
  grpc::Status Abort(Ctx*, const v1::AbortRequest*, v1::AbortResponse*) override;
  grpc::Status Lease(Ctx*, const v1::LeaseRequest*, v1::LeaseResponse*) override;
  grpc::Status RenewLease(Ctx*, const v1::RenewLeaseRequest*, v1::RenewLeaseResponse*) override;
  grpc::Status ReleaseLease(Ctx*, const v1::ReleaseLeaseRequest*,
                            v1::ReleaseLeaseResponse*) override;
  grpc::Status Read(Ctx*, const v1::ReadRequest*, v1::ReadResponse*) override;
  grpc::Status Evict(Ctx*, const v1::EvictRequest*, v1::EvictResponse*) override;
  grpc::Status Stats(Ctx*, const v1::StatsRequest*, v1::StatsResponse*) override;
  grpc::Status Health(Ctx*, const v1::HealthRequest*, v1::HealthResponse*) override;
  grpc::Status GetEndpoint(Ctx*, const v1::EndpointRequest*, v1::EndpointResponse*) override;

  struct Metrics;

 private:
  template <typename Fn>
  grpc::Status Run(int method, Fn&& fn);

  BlockCache* cache_;
  EndpointInfo endpoint_;
  mutable std::mutex id_mu_;
  std::string server_id_;
  uint32_t layout_version_;
  uint64_t max_block_bytes_;
  uint64_t instance_id_;
  std::chrono::steady_clock::time_point start_;
  std::unique_ptr<Metrics> m_;
  std::atomic<bool> serving_{true};
};

}  // namespace sparsex::cache

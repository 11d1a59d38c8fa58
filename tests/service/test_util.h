// Helpers shared by the worker-service tests: the scheduler tests' (tests/scheduler/test_util.h:
// draining a request's token stream) and an in-process cache server on a memory disk tier.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cache_server/server.h"
#include "gpu_worker/scheduler/scheduler.h"
#include "gtest/gtest.h"
#include "tests/scheduler/test_util.h"

namespace sparsex::service::testutil {

// A cache server on 127.0.0.1 (ephemeral gRPC port, no metrics) with a 64 MiB memory tier and
// an in-memory disk tier.
inline absl::StatusOr<std::unique_ptr<cache::CacheServer>> StartMemoryCacheServer() {
  cache::ServerOptions o;
  o.insecure_loopback = true;  // a loopback test cluster
  o.grpc_port = 0;
  o.metrics_port = -1;
  o.cache.memory_capacity_bytes = 64 << 20;
  o.cache.disk_backend = "memory";
  return cache::CacheServer::Start(o);
}

}  // namespace sparsex::service::testutil

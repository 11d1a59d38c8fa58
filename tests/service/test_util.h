// Helpers shared by the worker-service tests: draining a request's token stream, and an
// in-process cache server on a memory disk tier.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cache_server/server.h"
#include "gpu_worker/service/scheduler.h"
#include "gtest/gtest.h"

namespace sparsex::service::testutil {

struct Collected {
  std::vector<int32_t> ids;
  std::string text;
  std::vector<TokenLogprobs> logprobs;  // WorkItem::logprobs >= 0
  StreamChunk final;
  int chunks = 0;
};

// Everything a request streams until its final chunk (a test failure after `timeout`).
inline Collected Drain(RequestHandle& h,
                       std::chrono::seconds timeout = std::chrono::seconds(60)) {
  Collected c;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<StreamChunk> got;
  while (std::chrono::steady_clock::now() < deadline) {
    got.clear();
    h.Wait(&got, std::chrono::milliseconds(50));
    for (auto& ch : got) {
      c.ids.insert(c.ids.end(), ch.ids.begin(), ch.ids.end());
      c.text += ch.text;
      c.logprobs.insert(c.logprobs.end(), ch.logprobs.begin(), ch.logprobs.end());
      ++c.chunks;
      if (ch.final) {
        c.final = ch;
        return c;
      }
    }
  }
  ADD_FAILURE() << "request did not finish in time";
  return c;
}

// A cache server on 127.0.0.1 (ephemeral gRPC port, no metrics) with a 64 MiB memory tier and
// an in-memory disk tier.
inline absl::StatusOr<std::unique_ptr<cache::CacheServer>> StartMemoryCacheServer() {
  cache::ServerOptions o;
  o.grpc_port = 0;
  o.metrics_port = -1;
  o.cache.memory_capacity_bytes = 64 << 20;
  o.cache.disk_backend = "memory";
  return cache::CacheServer::Start(o);
}

}  // namespace sparsex::service::testutil

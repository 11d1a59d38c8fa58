// Helpers shared by the scheduler tests (and the worker-service tests): draining a request's
// token stream.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "gpu_worker/scheduler/scheduler.h"
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

}  // namespace sparsex::service::testutil

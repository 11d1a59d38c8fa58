// Helpers shared by the scheduler tests (and the worker-service tests): draining a request's
// token stream.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>
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

// Polls `done` until it holds or `timeout` passes; returns whether it held. The bound is
// generous because it only matters when a test fails: under ThreadSanitizer on a 2-core CI
// machine background work (uploads, stores) takes many times as long as natively.
inline bool WaitUntil(const std::function<bool()>& done,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace sparsex::service::testutil

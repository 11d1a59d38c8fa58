// A segment's bf16 KV arriving layer by layer from a cluster fetch: the fetch's threads fill a
// layer's K and V and mark each half done (ClusterKvTier::FetchMissing in streaming mode); the
// engine thread reads a layer once Ready (ReuseEngine: a reuse prefill's sparse layer l waits
// only for layer l of its streamed segments, so the prefill runs beside the fetch). A layer is
// final once ready; Fail() says the remaining layers will not come. Thread-safe as described.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "gpu_worker/reuse/segment_store.h"

namespace sparsex {

class StreamedSegment {
 public:
  StreamedSegment(int n_tokens, int n_layers, int kv_dim)
      : halves_(static_cast<size_t>(n_layers)) {
    kv_.n_tokens = n_tokens;
    kv_.n_layers = n_layers;
    kv_.kv_dim = kv_dim;
    kv_.k.resize(static_cast<size_t>(n_layers));
    kv_.v.resize(static_cast<size_t>(n_layers));
  }
  // The writers' view: layer l's k[l] and v[l], each written by one thread before HalfDone(l).
  SegmentKvBf16& kv() { return kv_; }
  const SegmentKvBf16& kv() const { return kv_; }
  int n_tokens() const { return kv_.n_tokens; }
  int n_layers() const { return kv_.n_layers; }
  // K or V of `layer` is in place (any thread). True for the one call that completed the
  // segment (its last missing half).
  bool HalfDone(int layer) {
    if (halves_[static_cast<size_t>(layer)].fetch_add(1, std::memory_order_acq_rel) + 1 != 2) {
      return false;
    }
    const bool last = complete_.fetch_add(1, std::memory_order_acq_rel) + 1 == kv_.n_layers;
    Notify();
    return last;
  }
  void Fail() {
    failed_.store(true, std::memory_order_release);
    Notify();
  }
  bool Ready(int layer) const {
    return halves_[static_cast<size_t>(layer)].load(std::memory_order_acquire) == 2;
  }
  bool Failed() const { return failed_.load(std::memory_order_acquire); }
  bool Complete() const { return complete_.load(std::memory_order_acquire) == kv_.n_layers; }
  // Waits until `layer` is ready or the segment failed, at most `timeout`; true when ready.
  bool Wait(int layer, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, timeout, [&] { return Ready(layer) || Failed(); });
    return Ready(layer);
  }

 private:
  void Notify() {
    { std::lock_guard<std::mutex> l(mu_); }  // a waiter between its check and its wait sees it
    cv_.notify_all();
  }
  SegmentKvBf16 kv_;
  std::vector<std::atomic<int>> halves_;  // per layer: 0, 1 or 2 halves in place
  std::atomic<int> complete_{0};          // layers with both halves
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace sparsex

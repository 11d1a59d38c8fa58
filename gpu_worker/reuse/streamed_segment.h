// A segment's bf16 KV arriving layer by layer from a cluster fetch: the fetch's threads fill a
// layer's K and V and mark each half done (ClusterKvTier::FetchMissing in streaming mode); the
// engine thread reads a layer once Ready (ReuseEngine: a reuse prefill's sparse layer l waits
// only for layer l of its streamed segments, so the prefill runs beside the fetch). A layer is
// final once ready; Fail() says the remaining layers will not come. Thread-safe as described.
//
// Its memory is either one block the caller provides (ReuseEngine::NewStreamedSegment: pinned
// host memory the GPU copies from directly, given back when the segment goes) or, without
// one, a pageable vector per layer and half, sized by its writer. In a block each layer is a
// frame: kLayerPrefixBytes of room, then K, then V, which is a fetched bf16 KV block's own
// layout (common/kv_block.h: a 128-byte header, then the layer's K and V), so the transport
// can write a block straight into its layer (LayerFrame) and nothing is copied after it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "common/huge_pages.h"
#include "gpu_worker/reuse/segment_store.h"

namespace sparsex {

class StreamedSegment {
 public:
  // Pageable memory.
  StreamedSegment(int n_tokens, int n_layers, int kv_dim)
      : StreamedSegment(n_tokens, n_layers, kv_dim, nullptr, {}) {}
  // In mem (Bytes(n_tokens, n_layers, kv_dim), layer-major frames: the prefix, K then V of
  // layer 0, then layer 1, ...); release runs when the segment goes (after every reader: the
  // last reference).
  StreamedSegment(int n_tokens, int n_layers, int kv_dim, uint16_t* mem,
                  std::function<void()> release)
      : halves_(static_cast<size_t>(n_layers)), mem_(mem), release_(std::move(release)) {
    kv_.n_tokens = n_tokens;
    kv_.n_layers = n_layers;
    kv_.kv_dim = kv_dim;
    if (mem_ == nullptr) {
      kv_.k.resize(static_cast<size_t>(n_layers));
      kv_.v.resize(static_cast<size_t>(n_layers));
    }
  }
  ~StreamedSegment() {
    if (release_) release_();
  }
  StreamedSegment(const StreamedSegment&) = delete;
  StreamedSegment& operator=(const StreamedSegment&) = delete;
  // Room in front of each layer of a block: a KV block header (common/kv_block.h
  // kKvBlockHeaderBytes; kv_tier.cc checks the two agree).
  static constexpr size_t kLayerPrefixBytes = 128;
  static size_t Bytes(int n_tokens, int n_layers, int kv_dim) {
    return static_cast<size_t>(n_layers) * FrameBytes(n_tokens, kv_dim);
  }
  int n_tokens() const { return kv_.n_tokens; }
  int n_layers() const { return kv_.n_layers; }
  int kv_dim() const { return kv_.kv_dim; }
  // Whether the memory is the caller's block (pinned, for ReuseEngine's segments).
  bool in_block() const { return mem_ != nullptr; }

  // The writers' view: where layer's K (half 0) or V (half 1) goes, written by one thread
  // before HalfDone(layer).
  std::span<uint16_t> Half(int layer, int half) {
    const size_t n = HalfElems(kv_.n_tokens, kv_.kv_dim);
    if (mem_ != nullptr) return {BlockHalf(layer, half), n};
    std::vector<uint16_t>& v = half == 0 ? kv_.k[layer] : kv_.v[layer];
    ResizeHuge(v, n);
    return v;
  }
  // In a block: layer's whole frame (the prefix, K, V), where the writer may put a fetched
  // block as it is and then mark both halves done; empty for pageable memory.
  std::span<uint8_t> LayerFrame(int layer) {
    if (mem_ == nullptr) return {};
    const size_t f = FrameBytes(kv_.n_tokens, kv_.kv_dim);
    return {reinterpret_cast<uint8_t*>(mem_) + static_cast<size_t>(layer) * f, f};
  }
  // The readers' view of a ready layer.
  std::span<const uint16_t> k(int layer) const { return Get(layer, 0); }
  std::span<const uint16_t> v(int layer) const { return Get(layer, 1); }
  // The whole KV as vectors (moved out of pageable memory, copied out of a block), for a
  // complete segment that goes to a tier whole; the segment is empty afterwards.
  SegmentKvBf16 TakeKv() {
    if (mem_ == nullptr) return std::move(kv_);
    SegmentKvBf16 out;
    out.n_tokens = kv_.n_tokens;
    out.n_layers = kv_.n_layers;
    out.kv_dim = kv_.kv_dim;
    for (int l = 0; l < kv_.n_layers; ++l) {
      out.k.emplace_back(k(l).begin(), k(l).end());
      out.v.emplace_back(v(l).begin(), v(l).end());
    }
    return out;
  }

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
  static size_t HalfElems(int n_tokens, int kv_dim) {
    return static_cast<size_t>(n_tokens) * static_cast<size_t>(kv_dim);
  }
  static size_t FrameBytes(int n_tokens, int kv_dim) {
    return kLayerPrefixBytes + 2 * HalfElems(n_tokens, kv_dim) * sizeof(uint16_t);
  }
  uint16_t* BlockHalf(int layer, int half) const {
    const size_t f = FrameBytes(kv_.n_tokens, kv_.kv_dim);
    uint8_t* k = reinterpret_cast<uint8_t*>(mem_) + static_cast<size_t>(layer) * f +
                 kLayerPrefixBytes;
    return reinterpret_cast<uint16_t*>(k) + half * HalfElems(kv_.n_tokens, kv_.kv_dim);
  }
  std::span<const uint16_t> Get(int layer, int half) const {
    const size_t n = HalfElems(kv_.n_tokens, kv_.kv_dim);
    if (mem_ != nullptr) return {BlockHalf(layer, half), n};
    return half == 0 ? kv_.k[layer] : kv_.v[layer];
  }
  void Notify() {
    { std::lock_guard<std::mutex> l(mu_); }  // a waiter between its check and its wait sees it
    cv_.notify_all();
  }
  SegmentKvBf16 kv_;  // the shape, and the pageable memory
  std::vector<std::atomic<int>> halves_;  // per layer: 0, 1 or 2 halves in place
  std::atomic<int> complete_{0};          // layers with both halves
  std::atomic<bool> failed_{false};
  uint16_t* const mem_;
  std::function<void()> release_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace sparsex

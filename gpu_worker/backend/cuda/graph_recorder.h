// The CUDA backend's recorded scopes (Backend::BeginGraph/EndGraph; internal to
// gpu_worker/backend/cuda). Inside a scope every operation validates and stages its arrays when
// it is called but its launch is only queued (Run); the queue runs at the scope's end (Flush):
// as a graph captured before when the queue's signature (every launch's operation, buffers,
// shapes and parameters, staged arrays by address) matches one, captured into a new graph the
// second time a signature is seen, else launched one by one. Tensors, workspaces and index
// arrays of a scope live in a GraphArena, so that a recurring sequence gets the same addresses.
//
//   GraphRecorder rec(&stager);
//   RETURN_IF_ERROR(rec.Init(stream, /*enabled=*/true, /*first_segment=*/8));
//   RETURN_IF_ERROR(rec.Begin());
//   RETURN_IF_ERROR(rec.Run("Add", [=] { return kernels::Add(...); }, a.data, a.rows, a.cols));
//   RETURN_IF_ERROR(rec.End());  // launched; errors of queued launches surface here
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/hash.h"
#include "common/range_allocator.h"
#include "common/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cuda/cuda_status.h"
#include "gpu_worker/backend/cuda/device_scratch.h"
#include "gpu_worker/backend/cuda/index_stager.h"
#include "kernels/attention.h"

namespace sparsex::cuda_internal {

inline size_t RoundUpPow2(size_t v) {
  size_t r = 1;
  while (r < v) r <<= 1;
  return r;
}

// Device memory for the tensors and index arrays of recorded scopes (Backend::BeginGraph):
// one allocation carved first-fit on the host, so that the same sequence of requests gets the
// same addresses every time (what lets a recorded sequence recur) and no allocation call is
// captured into a graph. Reuse in program order is safe: everything runs in order on the
// backend's stream.
class GraphArena {
 public:
  GraphArena() = default;
  GraphArena(const GraphArena&) = delete;
  GraphArena& operator=(const GraphArena&) = delete;
  ~GraphArena() {
    if (base_) cudaFree(base_);
  }
  size_t size() const { return size_; }
  size_t live() const { return ranges_.live(); }
  // Replaces the memory (none may be live).
  absl::Status Reserve(size_t bytes);
  bool Owns(const void* p) const {
    return base_ != nullptr && p >= base_ && p < base_ + size_;
  }
  void* Take(size_t bytes);
  void Give(void* p);

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
  RangeAllocator ranges_;
};

class GraphRecorder {
 public:
  // Stages through `stager` where a scope runs out of its own pinned area or arena.
  explicit GraphRecorder(IndexStager* stager) : stager_(stager) {}
  GraphRecorder(const GraphRecorder&) = delete;
  GraphRecorder& operator=(const GraphRecorder&) = delete;
  ~GraphRecorder() { Release(); }

  // Launches on `stream`; enabled = false runs scopes as plain launches. A scope's first
  // segment holds first_segment launches, each next one twice as many up to 64
  // (CudaBackendOptions::graph_first_segment).
  absl::Status Init(cudaStream_t stream, bool enabled, int first_segment);
  // Destroys the graphs and frees the pinned area; the stream must be idle. Idempotent.
  void Release();

  // Backend::BeginGraph, EndGraph and graph_stats.
  absl::Status Begin();
  absl::Status End();
  Backend::GraphStats stats() const { return gstats_; }
  bool recording() const { return recording_; }

  // Ends the recording scope: enqueues its queued launches (see above) and gives its arena
  // memory back. Every operation that waits for the device calls it first.
  absl::Status Flush();
  // Keeps the first error of a Flush that cannot report it (it surfaces at End).
  void KeepError(absl::Status s) {
    if (!s.ok() && kept_error_.ok()) kept_error_ = std::move(s);
  }

  // Launches f now, or (recording) queues it under a signature of what it launches.
  template <class F, class... A>
  absl::Status Run(const char* what, F&& f, const A&... sig) {
    if (!recording_) {
      CUDA_RETURN(f(), what);
      return absl::OkStatus();
    }
    sig_->Str(what);
    SigAll(sig...);
    pending_.push_back({std::function<cudaError_t()>(std::forward<F>(f)), what});
    // A long scope goes out in segments, each replayed as its own graph: the device runs one
    // segment while the host records the next. The first segments are short (by default 8,
    // 16, 32, then 64 launches), so the device starts after about one layer of host work
    // instead of a whole segment's (an H100 decode trace: each step's device sat idle
    // ~0.15 ms at batch 1 and ~0.85 ms at batch 32 while the host recorded the first 64).
    if (pending_.size() >= segment_limit_) return FlushSegment();
    return absl::OkStatus();
  }

  // Memory for a tensor allocated in a scope: from the arena (given back by GiveTensor), or
  // nullptr outside a scope. Out of arena, the scope ends here (a larger arena next time) and
  // runs as launched; nullptr then too.
  absl::StatusOr<void*> TakeTensor(size_t bytes);
  bool InArena(const void* p) const { return arena_.Owns(p); }
  // Later users of the memory are enqueued after this tensor's last reader.
  void GiveTensor(void* p) { arena_.Give(p); }
  // Device scratch for one operation: from the arena inside a scope (given back when the
  // scope's launches are enqueued), else the growing scratch.
  absl::StatusOr<void*> Workspace(DeviceScratch& scratch, size_t bytes);

  // The device copies of arrays with these bytes staged earlier in this scope (and so
  // checked), or null. One comparison serves the check and the staging (a decode step's slot
  // tables are ~1 MB at batch 32, compared once a layer).
  const std::vector<void*>* StagedInScope(const std::vector<HostSpan>& spans,
                                          uint64_t domain) const {
    const ScopeStage* e = FindScopeStage(spans, domain);
    return e != nullptr ? &e->dev : nullptr;
  }
  // Stage inside a scope: the bytes go to the scope's pinned area and a queued kernel copies
  // them to arena memory. The copy covers a power-of-two capacity, so arrays that grow from
  // step to step (slot tables) keep their launch until the capacity is outgrown. Arrays with
  // the same bytes as earlier ones in the scope share their copy.
  absl::StatusOr<std::vector<void*>> StageRecorded(const std::vector<HostSpan>& spans,
                                                   uint64_t domain);

 private:
  // Graphs kept (least recently used replaced); launches per segment of a scope.
  static constexpr size_t kMaxGraphs = 256;
  static constexpr size_t kSegmentLaunches = 64;
  struct Pending {
    std::function<cudaError_t()> launch;
    const char* what;
  };
  struct GraphEntry {
    Hash128 sig;
    cudaGraphExec_t exec = nullptr;
    uint64_t used = 0;
  };
  struct ScopeStage {
    uint64_t domain = 0;
    std::vector<size_t> sizes;
    const char* pinned = nullptr;  // the bytes as staged
    std::vector<void*> dev;
  };

  template <class T>
  void SigOne(const T& v) {
    if constexpr (std::is_same_v<T, kernels::PagedAttentionParams>) {
      SigAll(v.q, v.q_stride, v.out, v.out_stride, v.q_pos, v.num_q, v.k_pool, v.v_pool,
             v.kv_stride, v.ctx_slots, v.ctx_len, v.n_heads, v.n_kv_heads, v.head_dim, v.scale,
             v.lse, v.warps, v.impl, v.key_group, v.q_group, v.out_cross, v.num_seqs, v.seq_rows,
             v.seq_ctx_start, v.seq_ctx_len, v.max_seq_ctx);
    } else {
      static_assert(std::is_arithmetic_v<T> || std::is_pointer_v<T> || std::is_enum_v<T>);
      sig_->Bytes(&v, sizeof v);
    }
  }
  template <class... A>
  void SigAll(const A&... a) {
    (SigOne(a), ...);
  }
  const ScopeStage* FindScopeStage(const std::vector<HostSpan>& spans, uint64_t domain) const;
  // Enqueues the launches queued since the last segment: a graph replayed, a new graph
  // captured, or one launch each.
  absl::Status FlushSegment();
  // How often this signature ended a scope (counting this time).
  int Seen(const Hash128& sig);
  absl::Status Capture(const Hash128& sig, const std::function<absl::Status()>& run_all);

  IndexStager* stager_;
  cudaStream_t stream_ = nullptr;
  bool graphs_enabled_ = true;
  bool recording_ = false;
  bool scope_replayed_ = false;  // every segment of this scope so far was a replay
  size_t first_segment_ = kSegmentLaunches;  // launches of a scope's first segment (Init)
  size_t segment_limit_ = kSegmentLaunches;  // launches of the scope's next segment
  std::unique_ptr<Hasher> sig_;
  std::vector<Pending> pending_;
  std::vector<ScopeStage> scope_stages_;
  std::vector<void*> scope_temps_;  // arena memory given back at the scope's end
  GraphArena arena_;
  size_t arena_want_ = 64u << 20;
  void* graph_pinned_ = nullptr;
  size_t graph_pinned_size_ = 0, graph_pinned_off_ = 0, graph_pinned_want_ = 4u << 20;
  cudaEvent_t graph_done_ = nullptr;
  std::vector<GraphEntry> graphs_;
  std::vector<std::pair<Hash128, int>> seen_;
  uint64_t graph_tick_ = 0;
  Backend::GraphStats gstats_;
  absl::Status kept_error_;
};

}  // namespace sparsex::cuda_internal

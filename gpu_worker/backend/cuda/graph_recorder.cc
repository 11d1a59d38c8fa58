#include "gpu_worker/backend/cuda/graph_recorder.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/ops.h"

namespace sparsex::cuda_internal {

// ---- GraphArena ----

absl::Status GraphArena::Reserve(size_t bytes) {
  if (base_) cudaFree(base_);
  base_ = nullptr;
  size_ = 0;
  ranges_.Reset(0);
  CUDA_RETURN(cudaMalloc(&base_, bytes), "graph arena alloc");
  size_ = bytes;
  ranges_.Reset(bytes);
  return absl::OkStatus();
}

void* GraphArena::Take(size_t bytes) {
  bytes = std::max<size_t>((bytes + 255) / 256 * 256, 256);
  const std::optional<size_t> off = ranges_.Take(bytes);
  return off ? base_ + *off : nullptr;
}

void GraphArena::Give(void* p) { ranges_.Give(static_cast<size_t>(static_cast<char*>(p) - base_)); }

// ---- GraphRecorder ----

absl::Status GraphRecorder::Init(cudaStream_t stream, bool enabled, int first_segment) {
  stream_ = stream;
  graphs_enabled_ = enabled;
  first_segment_ = static_cast<size_t>(std::clamp<int>(first_segment, 1,
                                                       static_cast<int>(kSegmentLaunches)));
  CUDA_RETURN(cudaEventCreateWithFlags(&graph_done_, cudaEventDisableTiming), "graph event");
  return absl::OkStatus();
}

void GraphRecorder::Release() {
  for (GraphEntry& g : graphs_) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
  if (graph_done_) cudaEventDestroy(graph_done_);
  graph_done_ = nullptr;
  if (graph_pinned_) cudaFreeHost(graph_pinned_);
  graph_pinned_ = nullptr;
  graph_pinned_size_ = 0;
}

absl::Status GraphRecorder::Begin() {
  RETURN_IF_ERROR(Flush());
  if (!graphs_enabled_) return absl::OkStatus();
  // The pinned area is rewritten below: the last launch must have read it.
  CUDA_RETURN(cudaEventSynchronize(graph_done_), "graph: wait");
  if (arena_.live() == 0 && arena_.size() < arena_want_) {
    CUDA_RETURN(cudaStreamSynchronize(stream_), "graph arena: sync");
    RETURN_IF_ERROR(arena_.Reserve(arena_want_));
  }
  if (graph_pinned_size_ < graph_pinned_want_) {
    if (graph_pinned_) cudaFreeHost(graph_pinned_);
    graph_pinned_ = nullptr;
    graph_pinned_size_ = 0;
    CUDA_RETURN(cudaMallocHost(&graph_pinned_, graph_pinned_want_), "graph pinned alloc");
    graph_pinned_size_ = graph_pinned_want_;
  }
  graph_pinned_off_ = 0;
  sig_ = std::make_unique<Hasher>();
  recording_ = true;
  scope_replayed_ = true;
  segment_limit_ = first_segment_;
  return absl::OkStatus();
}

absl::Status GraphRecorder::End() {
  absl::Status s = Flush();
  if (s.ok()) s = kept_error_;
  kept_error_ = absl::OkStatus();
  return s;
}

absl::Status GraphRecorder::Flush() {
  if (!recording_) return absl::OkStatus();
  absl::Status st = FlushSegment();
  recording_ = false;
  scope_stages_.clear();
  ++gstats_.scopes;
  if (st.ok() && scope_replayed_) ++gstats_.replayed;
  for (void* p : scope_temps_) arena_.Give(p);
  scope_temps_.clear();
  if (cudaError_t e = cudaEventRecord(graph_done_, stream_); e != cudaSuccess && st.ok()) {
    st = CudaError(e, "graph: record");
  }
  return st;
}

absl::Status GraphRecorder::FlushSegment() {
  if (pending_.empty()) return absl::OkStatus();
  const Hash128 sig = sig_->Finish();
  sig_ = std::make_unique<Hasher>();
  std::vector<Pending> work = std::move(pending_);
  pending_.clear();
  segment_limit_ = std::min(kSegmentLaunches, 2 * segment_limit_);
  auto run_all = [&]() -> absl::Status {
    for (Pending& w : work) CUDA_RETURN(w.launch(), w.what);
    return absl::OkStatus();
  };
  absl::Status st;
  GraphEntry* hit = nullptr;
  for (GraphEntry& g : graphs_) {
    if (g.sig == sig) hit = &g;
  }
  scope_replayed_ = scope_replayed_ && hit != nullptr;
  if (hit != nullptr) {
    hit->used = ++graph_tick_;
    ++gstats_.graph_launches;
    cudaError_t e = cudaGraphLaunch(hit->exec, stream_);
    st = e == cudaSuccess ? absl::OkStatus() : CudaError(e, "graph launch");
  } else if (Seen(sig) >= 2) {
    st = Capture(sig, run_all);
  } else {
    st = run_all();
  }
  return st;
}

int GraphRecorder::Seen(const Hash128& sig) {
  for (auto& [h, n] : seen_) {
    if (h == sig) return ++n;
  }
  if (seen_.size() >= 4 * kMaxGraphs) seen_.erase(seen_.begin());
  seen_.emplace_back(sig, 1);
  return 1;
}

absl::Status GraphRecorder::Capture(const Hash128& sig,
                                    const std::function<absl::Status()>& run_all) {
  CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
              "graph: begin capture");
  absl::Status st = run_all();
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(stream_, &graph);
  if (st.ok() && e != cudaSuccess) st = CudaError(e, "graph: end capture");
  cudaGraphExec_t exec = nullptr;
  if (st.ok()) {
    e = cudaGraphInstantiate(&exec, graph, 0);
    if (e != cudaSuccess) st = CudaError(e, "graph: instantiate");
  }
  if (graph) cudaGraphDestroy(graph);
  if (!st.ok()) {
    // Nothing ran: launch the queue one by one, and never try this signature again.
    cudaGetLastError();
    for (auto& [h, n] : seen_) {
      if (h == sig) n = std::numeric_limits<int>::min() / 2;
    }
    return run_all();
  }
  if (graphs_.size() >= kMaxGraphs) {
    auto lru = std::min_element(graphs_.begin(), graphs_.end(),
                                [](const GraphEntry& a, const GraphEntry& b) {
                                  return a.used < b.used;
                                });
    CUDA_RETURN(cudaStreamSynchronize(stream_), "graph: sync");  // may still run
    cudaGraphExecDestroy(lru->exec);
    graphs_.erase(lru);
  }
  graphs_.push_back({sig, exec, ++graph_tick_});
  ++gstats_.captured;
  ++gstats_.graph_launches;
  CUDA_RETURN(cudaGraphLaunch(exec, stream_), "graph launch");
  return absl::OkStatus();
}

absl::StatusOr<void*> GraphRecorder::TakeTensor(size_t bytes) {
  if (!recording_) return nullptr;
  if (void* p = arena_.Take(bytes)) return p;
  // Out of arena: the scope ends here (a larger arena next time) and runs as launched.
  arena_want_ = std::max(arena_want_, 2 * arena_.size());
  RETURN_IF_ERROR(Flush());
  return nullptr;
}

absl::StatusOr<void*> GraphRecorder::Workspace(DeviceScratch& scratch, size_t bytes) {
  if (recording_) {
    if (void* p = arena_.Take(bytes)) {
      scope_temps_.push_back(p);
      return p;
    }
    arena_want_ = std::max(arena_want_, 2 * arena_.size());
    RETURN_IF_ERROR(Flush());
  }
  return scratch.Get(bytes, stream_);
}

const GraphRecorder::ScopeStage* GraphRecorder::FindScopeStage(const std::vector<HostSpan>& spans,
                                                               uint64_t domain) const {
  for (const ScopeStage& e : scope_stages_) {
    if (e.domain != domain || e.sizes.size() != spans.size()) continue;
    bool same = true;
    size_t off = 0;
    for (size_t i = 0; i < spans.size() && same; ++i) {
      same = e.sizes[i] == spans[i].bytes &&
             (spans[i].bytes == 0 || std::memcmp(e.pinned + off, spans[i].data,
                                                 spans[i].bytes) == 0);
      off += (spans[i].bytes + 15) / 16 * 16;
    }
    if (same) return &e;
  }
  return nullptr;
}

absl::StatusOr<std::vector<void*>> GraphRecorder::StageRecorded(
    const std::vector<HostSpan>& spans, uint64_t domain) {
  if (const ScopeStage* e = FindScopeStage(spans, domain)) return e->dev;
  size_t total = 0;
  for (const HostSpan& sp : spans) total += (sp.bytes + 15) / 16 * 16;
  const size_t cap = std::max<size_t>(RoundUpPow2(total), 256);
  void* dev = graph_pinned_off_ + cap <= graph_pinned_size_ ? arena_.Take(cap) : nullptr;
  if (dev == nullptr) {
    if (graph_pinned_off_ + cap > graph_pinned_size_) {
      graph_pinned_want_ = std::max(graph_pinned_want_, 2 * (graph_pinned_off_ + cap));
    } else {
      arena_want_ = std::max(arena_want_, 2 * arena_.size());
    }
    RETURN_IF_ERROR(Flush());
    // The scope has ended: staged as outside one (a plain array's key has domain 0).
    return stager_->Stage(spans, IndexStager::Key(spans, domain));
  }
  scope_temps_.push_back(dev);
  char* host = static_cast<char*>(graph_pinned_) + graph_pinned_off_;
  graph_pinned_off_ += cap;
  ScopeStage e;
  e.domain = domain;
  e.pinned = host;
  size_t off = 0;
  for (const HostSpan& sp : spans) {
    if (sp.bytes) std::memcpy(host + off, sp.data, sp.bytes);
    e.sizes.push_back(sp.bytes);
    e.dev.push_back(static_cast<char*>(dev) + off);
    off += (sp.bytes + 15) / 16 * 16;
  }
  RETURN_IF_ERROR(Run("stage", [=, this] {
    return kernels::CopyFromPinned(host, dev, cap, stream_);
  }, static_cast<const void*>(host), dev, cap));
  scope_stages_.push_back(std::move(e));
  return scope_stages_.back().dev;
}

}  // namespace sparsex::cuda_internal

// The CUDA backend's index staging (internal to gpu_worker/backend/cuda): host index spans
// (positions, slots, token ids, slot tables) copied through a pinned ring into device copies,
// which later requests with the same bytes reuse (every layer of a forward pass stages the same
// arrays). Outside recorded scopes only; inside one GraphRecorder::StageRecorded stages.
//
//   IndexStager stager;
//   RETURN_IF_ERROR(stager.Init(stream));
//   std::vector<HostSpan> spans = {{pos.data(), pos.size_bytes()}};
//   ASSIGN_OR_RETURN(auto d, stager.Stage(spans, IndexStager::Key(spans)));  // d[0] on device
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/hash.h"
#include "common/status.h"

namespace sparsex::cuda_internal {

// Host spans to stage in one copy; each lands 16-byte aligned in the device scratch.
struct HostSpan {
  const void* data;
  size_t bytes;
};

class IndexStager {
 public:
  IndexStager() = default;
  IndexStager(const IndexStager&) = delete;
  IndexStager& operator=(const IndexStager&) = delete;
  ~IndexStager() { Release(); }

  // Allocates the pinned ring (16 MiB to start) for copies enqueued on `stream`.
  absl::Status Init(cudaStream_t stream);
  // Frees the ring and the device copies; the stream must be idle. Idempotent.
  void Release();

  // The key of a Stage request: its bytes, and a domain (requests of different domains never
  // share a device copy; 0 for plain index arrays).
  static Hash128 Key(const std::vector<HostSpan>& spans, uint64_t domain = 0);
  // Whether a device copy staged under `key` is still held.
  bool Has(const Hash128& key) const;
  // Copies host spans into the pinned ring, then with one copy into a device buffer; returns
  // the device address of each span. The same index arrays come back for every layer of a
  // forward pass (positions, slots, slot tables): a request whose key matches a recent one
  // reuses its device copy. Stream order puts each copy after the kernels that read the
  // previous contents of its buffer. The pinned ring only wraps after a stream sync, so no
  // queued copy reads overwritten bytes.
  absl::StatusOr<std::vector<void*>> Stage(const std::vector<HostSpan>& spans,
                                           const Hash128& key);

 private:
  // Recently staged index arrays and their device copies, least recently used replaced.
  struct StageEntry {
    Hash128 key;
    void* dev = nullptr;
    size_t cap = 0;
    uint64_t used = 0;
    bool valid = false;
  };
  cudaStream_t stream_ = nullptr;
  std::array<StageEntry, 16> stage_cache_;
  uint64_t stage_tick_ = 0;
  void* pinned_ = nullptr;
  size_t pinned_size_ = 0, pinned_off_ = 0;
};

}  // namespace sparsex::cuda_internal

#include "gpu_worker/backend/cuda/index_stager.h"

#include <algorithm>
#include <cstring>

#include "gpu_worker/backend/cuda/cuda_status.h"
#include "kernels/ops.h"

namespace sparsex::cuda_internal {

absl::Status IndexStager::Init(cudaStream_t stream) {
  stream_ = stream;
  pinned_size_ = 16u << 20;
  CUDA_RETURN(cudaMallocHost(&pinned_, pinned_size_), "pinned staging alloc");
  return absl::OkStatus();
}

void IndexStager::Release() {
  if (pinned_) cudaFreeHost(pinned_);
  pinned_ = nullptr;
  pinned_size_ = pinned_off_ = 0;
  for (StageEntry& e : stage_cache_) {
    if (e.dev) cudaFree(e.dev);
    e = StageEntry{};
  }
}

Hash128 IndexStager::Key(const std::vector<HostSpan>& spans, uint64_t domain) {
  Hasher h;
  h.U64(domain);
  for (const HostSpan& s : spans) h.U64(s.bytes).Bytes(s.data, s.bytes);
  return h.Finish();
}

bool IndexStager::Has(const Hash128& key) const {
  for (const StageEntry& e : stage_cache_) {
    if (e.valid && e.key == key) return true;
  }
  return false;
}

absl::StatusOr<std::vector<void*>> IndexStager::Stage(const std::vector<HostSpan>& spans,
                                                      const Hash128& key) {
  size_t total = 0;
  for (const HostSpan& s : spans) total += (s.bytes + 15) / 16 * 16;
  total = std::max<size_t>(total, 16);
  auto pointers = [&spans](void* base) {
    std::vector<void*> out;
    size_t off = 0;
    for (const HostSpan& s : spans) {
      out.push_back(static_cast<char*>(base) + off);
      off += (s.bytes + 15) / 16 * 16;
    }
    return out;
  };
  StageEntry* victim = &stage_cache_[0];
  for (StageEntry& e : stage_cache_) {
    if (e.valid && e.key == key) {
      e.used = ++stage_tick_;
      return pointers(e.dev);
    }
    if (!e.valid || (victim->valid && e.used < victim->used)) victim = &e;
  }
  if (total > pinned_size_) {
    CUDA_RETURN(cudaStreamSynchronize(stream_), "stage: sync");
    cudaFreeHost(pinned_);
    pinned_ = nullptr;
    pinned_size_ = std::max(total, 2 * pinned_size_);
    CUDA_RETURN(cudaMallocHost(&pinned_, pinned_size_), "stage: pinned alloc");
    pinned_off_ = 0;
  } else if (pinned_off_ + total > pinned_size_) {
    CUDA_RETURN(cudaStreamSynchronize(stream_), "stage: sync");
    pinned_off_ = 0;
  }
  // Miss: the least recently used entry takes it (stream order keeps earlier readers of its
  // old contents ahead of the overwrite).
  StageEntry& e = *victim;
  e.valid = false;
  if (e.cap < total) {
    if (e.dev) cudaFreeAsync(e.dev, stream_);
    e.dev = nullptr;
    e.cap = 0;
    const size_t cap = std::max<size_t>(total, 4096);
    CUDA_RETURN(cudaMallocAsync(&e.dev, cap, stream_), "stage: alloc");
    e.cap = cap;
  }
  char* host = static_cast<char*>(pinned_) + pinned_off_;
  size_t off = 0;
  for (const HostSpan& s : spans) {
    if (s.bytes) std::memcpy(host + off, s.data, s.bytes);
    off += (s.bytes + 15) / 16 * 16;
  }
  // Copied by a kernel reading the pinned ring, not by a copy engine: Prefetch's bulk copies
  // on the other stream would otherwise hold these small ones (and the layer) behind them.
  CUDA_RETURN(kernels::CopyFromPinned(host, e.dev, off ? off : 16, stream_), "stage: copy");
  pinned_off_ += total;
  e.key = key;
  e.valid = true;
  e.used = ++stage_tick_;
  return pointers(e.dev);
}

}  // namespace sparsex::cuda_internal

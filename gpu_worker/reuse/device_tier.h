// The device tier of the segment store: segment KV resident in backend memory (bf16 on a GPU),
// pre-RoPE K and V per layer, so assembling a reused segment is a device copy plus RoPE instead
// of a host transfer. With host_memory the same tier lives in the backend's pinned host memory
// (Backend::AllocHost): larger and cheaper, copied to the device per request with
// Backend::Prefetch so the copy overlaps compute. Capacity-bounded LRU; entries in use by a running request stay alive
// (shared ownership) even if evicted meanwhile. Not thread-safe (owned by the engine thread),
// except Resident().
#pragma once

#include <list>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/reuse/segment_store.h"
#include "gpu_worker/reuse/streamed_segment.h"

namespace sparsex {

struct DeviceSegment {
  int n_tokens = 0;
  std::vector<Tensor> k, v;  // [n_layers] of [n_tokens, kv_dim]
  size_t bytes = 0;
};

class DeviceSegmentTier {
 public:
  // capacity 0 keeps nothing across requests (every Get misses; Upload still works).
  DeviceSegmentTier(Backend* be, size_t capacity_bytes, bool host_memory = false)
      : be_(be), capacity_(capacity_bytes), host_(host_memory) {}
  std::shared_ptr<const DeviceSegment> Get(const Hash128& fp);
  // Copies a host segment into backend memory, caching it when capacity allows.
  absl::StatusOr<std::shared_ptr<const DeviceSegment>> Upload(const Hash128& fp,
                                                              const SegmentKv& kv);
  // The same from a bf16 segment (a cluster fetch's, without the fp32 store).
  absl::StatusOr<std::shared_ptr<const DeviceSegment>> UploadBf16(const Hash128& fp,
                                                                  const SegmentKvBf16& kv);
  // The same from a complete streamed segment (its pinned block or pageable memory).
  absl::StatusOr<std::shared_ptr<const DeviceSegment>> UploadBf16(const Hash128& fp,
                                                                  const StreamedSegment& seg);
  // Allocates a segment's tensors in the tier's memory without caching it (a streamed fetch
  // fills it layer by layer, then Insert caches it).
  absl::StatusOr<std::shared_ptr<DeviceSegment>> Reserve(int n_tokens, int n_layers, int kv_dim);
  // Caches seg when it fits, evicting least recently used entries; false when it cannot fit.
  bool Insert(const Hash128& fp, const std::shared_ptr<DeviceSegment>& seg);
  // Takes backend tensors already holding a segment's KV (an encoding pass captured them; the
  // tier frees them); false when the segment exceeds the capacity (then nothing is kept).
  bool Adopt(const Hash128& fp, int n_tokens, std::vector<Tensor> k, std::vector<Tensor> v);
  // Get without counting a hit or touching the LRU order.
  std::shared_ptr<const DeviceSegment> Peek(const Hash128& fp) const;
  // Whether the tier holds fp, callable from any thread (the worker asks before it fetches a
  // segment from the cache cluster; the rest of the tier is the engine thread's).
  bool Resident(const Hash128& fp) const;
  size_t bytes() const { return bytes_; }
  size_t capacity() const { return capacity_; }
  bool host_memory() const { return host_; }
  int64_t hits() const { return hits_; }

 private:
  std::shared_ptr<DeviceSegment> NewSegment() const;
  template <class UploadLayer>
  absl::StatusOr<std::shared_ptr<const DeviceSegment>> UploadLayers(const Hash128& fp,
                                                                    int n_tokens, int n_layers,
                                                                    int kv_dim,
                                                                    UploadLayer upload);
  struct Entry {
    std::shared_ptr<const DeviceSegment> seg;
    std::list<Hash128>::iterator lru;
  };
  Backend* be_;
  size_t capacity_;
  bool host_;
  size_t bytes_ = 0;
  int64_t hits_ = 0;
  absl::flat_hash_map<Hash128, Entry> map_;
  std::list<Hash128> lru_;
  mutable std::mutex resident_mu_;  // guards resident_: map_'s keys, for Resident()
  absl::flat_hash_set<Hash128> resident_;
};

}  // namespace sparsex

#include "gpu_worker/reuse/device_tier.h"

namespace sparsex {

std::shared_ptr<const DeviceSegment> DeviceSegmentTier::Get(const Hash128& fp) {
  auto it = map_.find(fp);
  if (it == map_.end()) return nullptr;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  ++hits_;
  return it->second.seg;
}

std::shared_ptr<const DeviceSegment> DeviceSegmentTier::Peek(const Hash128& fp) const {
  auto it = map_.find(fp);
  return it == map_.end() ? nullptr : it->second.seg;
}

std::shared_ptr<DeviceSegment> DeviceSegmentTier::NewSegment() const {
  Backend* be = be_;
  // Frees the backend tensors when the last user (tier or request) lets go.
  return std::shared_ptr<DeviceSegment>(new DeviceSegment(), [be](DeviceSegment* s) {
    for (Tensor& t : s->k) be->Free(t);
    for (Tensor& t : s->v) be->Free(t);
    delete s;
  });
}

bool DeviceSegmentTier::Insert(const Hash128& fp, const std::shared_ptr<DeviceSegment>& seg) {
  if (seg->bytes > capacity_) return false;
  while (bytes_ + seg->bytes > capacity_ && !lru_.empty()) {
    auto it = map_.find(lru_.front());
    bytes_ -= it->second.seg->bytes;
    {
      std::lock_guard<std::mutex> l(resident_mu_);
      resident_.erase(it->first);
    }
    map_.erase(it);
    lru_.pop_front();
  }
  auto [it, inserted] = map_.try_emplace(fp);
  if (inserted) {
    it->second.seg = seg;
    it->second.lru = lru_.insert(lru_.end(), fp);
    bytes_ += seg->bytes;
    std::lock_guard<std::mutex> l(resident_mu_);
    resident_.insert(fp);
  }
  return true;
}

bool DeviceSegmentTier::Resident(const Hash128& fp) const {
  std::lock_guard<std::mutex> l(resident_mu_);
  return resident_.contains(fp);
}

absl::StatusOr<std::shared_ptr<DeviceSegment>> DeviceSegmentTier::Reserve(int n_tokens,
                                                                          int n_layers,
                                                                          int kv_dim) {
  std::shared_ptr<DeviceSegment> seg = NewSegment();
  seg->n_tokens = n_tokens;
  auto alloc = [&](int64_t rows, int64_t cols) {
    return host_ ? be_->AllocHost(rows, cols) : be_->Alloc(rows, cols);
  };
  for (int l = 0; l < n_layers; ++l) {
    ASSIGN_OR_RETURN(Tensor k, alloc(n_tokens, kv_dim));
    seg->k.push_back(k);
    ASSIGN_OR_RETURN(Tensor v, alloc(n_tokens, kv_dim));
    seg->v.push_back(v);
    seg->bytes += k.bytes() + v.bytes();
  }
  return seg;
}

// Reserves the segment, fills every layer with upload(l, k, v) and caches it when it fits:
// the one body behind Upload (fp32) and UploadBf16.
template <class UploadLayer>
absl::StatusOr<std::shared_ptr<const DeviceSegment>> DeviceSegmentTier::UploadLayers(
    const Hash128& fp, int n_tokens, int n_layers, int kv_dim, UploadLayer upload) {
  ASSIGN_OR_RETURN(std::shared_ptr<DeviceSegment> seg, Reserve(n_tokens, n_layers, kv_dim));
  for (int l = 0; l < n_layers; ++l) RETURN_IF_ERROR(upload(l, seg->k[l], seg->v[l]));
  Insert(fp, seg);
  return std::shared_ptr<const DeviceSegment>(seg);
}

absl::StatusOr<std::shared_ptr<const DeviceSegment>> DeviceSegmentTier::Upload(
    const Hash128& fp, const SegmentKv& kv) {
  return UploadLayers(fp, kv.n_tokens, kv.n_layers, kv.kv_dim,
                      [&](int l, Tensor& k, Tensor& v) -> absl::Status {
                        RETURN_IF_ERROR(be_->Upload(kv.k[l], k));
                        return be_->Upload(kv.v[l], v);
                      });
}

absl::StatusOr<std::shared_ptr<const DeviceSegment>> DeviceSegmentTier::UploadBf16(
    const Hash128& fp, const SegmentKvBf16& kv) {
  return UploadLayers(fp, kv.n_tokens, kv.n_layers, kv.kv_dim,
                      [&](int l, Tensor& k, Tensor& v) -> absl::Status {
                        RETURN_IF_ERROR(be_->UploadBf16(kv.k[l], k));
                        return be_->UploadBf16(kv.v[l], v);
                      });
}

absl::StatusOr<std::shared_ptr<const DeviceSegment>> DeviceSegmentTier::UploadBf16(
    const Hash128& fp, const StreamedSegment& seg) {
  return UploadLayers(fp, seg.n_tokens(), seg.n_layers(), seg.kv_dim(),
                      [&](int l, Tensor& k, Tensor& v) -> absl::Status {
                        RETURN_IF_ERROR(be_->UploadBf16(seg.k(l), k));
                        return be_->UploadBf16(seg.v(l), v);
                      });
}

bool DeviceSegmentTier::Adopt(const Hash128& fp, int n_tokens, std::vector<Tensor> k,
                              std::vector<Tensor> v) {
  std::shared_ptr<DeviceSegment> seg = NewSegment();
  seg->n_tokens = n_tokens;
  seg->k = std::move(k);
  seg->v = std::move(v);
  for (const Tensor& t : seg->k) seg->bytes += t.bytes();
  for (const Tensor& t : seg->v) seg->bytes += t.bytes();
  return Insert(fp, seg);  // not kept: seg's deleter frees the tensors now
}

}  // namespace sparsex

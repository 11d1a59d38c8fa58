// BlockCache is a facade: the state and the lifecycles behind it (index, reservations, leases,
// tiering, metrics) are internal::CacheCore in cache_server/internal/ (map: block_index.h).
// This file validates Open's arguments and forwards each method.
#include "cache_server/block_cache.h"

#include <memory>
#include <utility>

#include "cache_server/internal/block_index.h"

namespace sparsex::cache {

class BlockCache::Impl : public internal::CacheCore {
 public:
  using CacheCore::CacheCore;
};

BlockCache::BlockCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BlockCache::~BlockCache() = default;

absl::StatusOr<std::unique_ptr<BlockCache>> BlockCache::Open(const CacheOptions& options,
                                                             uint8_t* arena,
                                                             uint64_t arena_bytes,
                                                             metrics::Registry* registry) {
  if (arena == nullptr || arena_bytes == 0) return absl::InvalidArgumentError("no arena");
  if (options.arena_alignment == 0 ||
      (options.arena_alignment & (options.arena_alignment - 1)) != 0) {
    return absl::InvalidArgumentError("arena_alignment must be a power of two");
  }
  if (options.memory_capacity_bytes < options.arena_alignment) {
    return absl::InvalidArgumentError("memory_capacity_bytes is smaller than one allocation");
  }
  auto impl = std::make_unique<Impl>(options, arena, arena_bytes);
  RETURN_IF_ERROR(impl->Init(registry));
  return std::unique_ptr<BlockCache>(new BlockCache(std::move(impl)));
}

absl::StatusOr<std::vector<LookupEntry>> BlockCache::Lookup(const Hash128& model_fp,
                                                            uint32_t layout_version,
                                                            std::span<const BlockKey> keys) {
  return impl_->Lookup(model_fp, layout_version, keys);
}
absl::StatusOr<Reservation> BlockCache::Reserve(const Hash128& model_fp, uint32_t layout_version,
                                                const BlockKey& key, uint64_t size, double cost,
                                                const std::string& client) {
  return impl_->Reserve(model_fp, layout_version, key, size, cost, client);
}
absl::Status BlockCache::Commit(uint64_t id, uint64_t checksum,
                                std::span<const uint8_t> inline_data, bool has_inline) {
  return impl_->Commit(id, checksum, inline_data, has_inline);
}
absl::Status BlockCache::Abort(uint64_t id) { return impl_->Abort(id); }
absl::StatusOr<LeaseGrant> BlockCache::Lease(const Hash128& model_fp, uint32_t layout_version,
                                             std::span<const BlockKey> keys, uint32_t ttl_ms,
                                             bool partial) {
  return impl_->Lease(model_fp, layout_version, keys, ttl_ms, partial);
}
absl::StatusOr<uint64_t> BlockCache::RenewLease(uint64_t id, uint32_t ttl_ms) {
  return impl_->RenewLease(id, ttl_ms);
}
absl::Status BlockCache::ReleaseLease(uint64_t id) { return impl_->ReleaseLease(id); }
absl::StatusOr<std::string> BlockCache::Read(uint64_t id, uint32_t index) {
  return impl_->Read(id, index);
}
absl::StatusOr<uint32_t> BlockCache::Evict(std::span<const BlockKey> keys, bool all,
                                           bool corrupt) {
  return impl_->Evict(keys, all, corrupt);
}
CacheStats BlockCache::Stats() const { return impl_->Stats(); }
DiskHealth BlockCache::disk_health() const { return impl_->disk_health(); }
void BlockCache::RecheckDisk() { impl_->RecheckDisk(); }
void BlockCache::Sweep() { impl_->Sweep(); }
bool BlockCache::WarmLoadDone() const { return impl_->WarmLoadDone(); }

}  // namespace sparsex::cache

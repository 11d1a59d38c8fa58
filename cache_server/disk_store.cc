#include "cache_server/disk_store.h"

#include <cstring>
#include <map>
#include <mutex>

namespace sparsex::cache {
namespace {

constexpr uint8_t kMetaVersion = 1;
constexpr size_t kMetaBytes = 1 + 8 + 8 + 8 + 16 + 4 + 8;

void Put64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t Get64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

class MemoryDiskStore final : public DiskStore {
 public:
  std::string name() const override { return "memory"; }
  absl::Status Put(const BlockKey& k, const DiskMeta& meta,
                   std::span<const uint8_t> value) override {
    std::lock_guard<std::mutex> lock(mu_);
    map_[EncodeStoreKey(k)] = {meta, std::string(reinterpret_cast<const char*>(value.data()),
                                                  value.size())};
    return absl::OkStatus();
  }
  absl::Status Read(const BlockKey& k, std::span<uint8_t> dst) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(EncodeStoreKey(k));
    if (it == map_.end()) return absl::NotFoundError("not on disk");
    if (it->second.second.size() != dst.size()) return absl::DataLossError("size mismatch");
    std::memcpy(dst.data(), it->second.second.data(), dst.size());
    return absl::OkStatus();
  }
  absl::Status Delete(const BlockKey& k) override {
    std::lock_guard<std::mutex> lock(mu_);
    map_.erase(EncodeStoreKey(k));
    return absl::OkStatus();
  }
  absl::Status ForEachMeta(
      const std::function<void(const BlockKey&, const DiskMeta&)>& fn) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, v] : map_) {
      auto key = DecodeStoreKey(k);
      if (key.ok()) fn(*key, v.first);
    }
    return absl::OkStatus();
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::pair<DiskMeta, std::string>> map_;
};

}  // namespace

std::string EncodeDiskMeta(const DiskMeta& m) {
  std::string s;
  s.reserve(kMetaBytes);
  s.push_back(static_cast<char>(kMetaVersion));
  Put64(&s, m.size);
  Put64(&s, m.checksum);
  uint64_t cost_bits;
  std::memcpy(&cost_bits, &m.cost, 8);
  Put64(&s, cost_bits);
  Put64(&s, m.model_fp.hi);
  Put64(&s, m.model_fp.lo);
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(m.layout_version >> (8 * i)));
  Put64(&s, m.commit_unix_ms);
  return s;
}

absl::StatusOr<DiskMeta> DecodeDiskMeta(std::string_view s) {
  if (s.size() != kMetaBytes || static_cast<uint8_t>(s[0]) != kMetaVersion) {
    return absl::DataLossError("malformed disk meta record");
  }
  const char* p = s.data() + 1;
  DiskMeta m;
  m.size = Get64(p);
  m.checksum = Get64(p + 8);
  uint64_t cost_bits = Get64(p + 16);
  std::memcpy(&m.cost, &cost_bits, 8);
  m.model_fp = {Get64(p + 24), Get64(p + 32)};
  m.layout_version = 0;
  for (int i = 3; i >= 0; --i) {
    m.layout_version = (m.layout_version << 8) | static_cast<uint8_t>(p[40 + i]);
  }
  m.commit_unix_ms = Get64(p + 44);
  return m;
}

namespace internal {
std::unique_ptr<DiskStore> NewMemoryDiskStore() { return std::make_unique<MemoryDiskStore>(); }
#if !SPARSEX_WITH_ROCKSDB
absl::StatusOr<std::unique_ptr<DiskStore>> OpenRocksDbStore(const DiskStoreOptions&) {
  return absl::UnimplementedError("built without RocksDB (SPARSEX_WITH_ROCKSDB=OFF)");
}
#endif
}  // namespace internal

absl::StatusOr<std::unique_ptr<DiskStore>> OpenDiskStore(const DiskStoreOptions& options) {
  if (options.backend == "none") return std::unique_ptr<DiskStore>();
  if (options.backend == "memory") return internal::NewMemoryDiskStore();
  if (options.backend == "rocksdb") return internal::OpenRocksDbStore(options);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown disk backend '", options.backend, "' (rocksdb, memory, none)"));
}

}  // namespace sparsex::cache

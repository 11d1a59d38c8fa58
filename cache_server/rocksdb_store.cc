// RocksDB backend of the disk tier. Two column families: "default" holds the encoded blocks
// (integrated BlobDB: large values live in blob files, the LSM holds small indexes) and "meta"
// holds a DiskMeta per key, written in the same WriteBatch.
#include "cache_server/disk_store.h"

#if SPARSEX_WITH_ROCKSDB
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <cstring>
#include <vector>

namespace sparsex::cache::internal {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (s.IsNotFound()) code = absl::StatusCode::kNotFound;
  else if (s.IsCorruption()) code = absl::StatusCode::kDataLoss;
  else if (s.IsIOError()) code = absl::StatusCode::kUnavailable;
  else if (s.IsInvalidArgument()) code = absl::StatusCode::kInvalidArgument;
  return absl::Status(code, absl::StrCat("rocksdb ", absl::string_view(what.data(), what.size()), ": ", s.ToString()));
}

class RocksDbStore final : public DiskStore {
 public:
  ~RocksDbStore() override {
    if (db_ != nullptr) {
      for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
      db_->Close();
      delete db_;
    }
  }

  static absl::StatusOr<std::unique_ptr<DiskStore>> Open(const DiskStoreOptions& o) {
    if (o.path.empty()) return absl::InvalidArgumentError("rocksdb: disk_path is empty");
    rocksdb::DBOptions dbo;
    dbo.create_if_missing = true;
    dbo.create_missing_column_families = true;
    dbo.max_background_jobs = 2;
    rocksdb::ColumnFamilyOptions data;
    data.enable_blob_files = true;
    data.min_blob_size = 4096;
    data.blob_file_size = 256ull << 20;
    data.enable_blob_garbage_collection = true;
    data.write_buffer_size = 128ull << 20;
    rocksdb::ColumnFamilyOptions meta;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, data}, {"meta", meta}};
    auto store = std::unique_ptr<RocksDbStore>(new RocksDbStore());
    rocksdb::Status s = rocksdb::DB::Open(dbo, o.path, cfs, &store->handles_, &store->db_);
    if (!s.ok()) return FromRocks(s, "open " + o.path);
    store->write_.sync = o.sync;
    return std::unique_ptr<DiskStore>(std::move(store));
  }

  std::string name() const override { return "rocksdb"; }

  absl::Status Put(const BlockKey& k, const DiskMeta& m,
                   std::span<const uint8_t> value) override {
    const std::string key = EncodeStoreKey(k);
    rocksdb::WriteBatch batch;
    batch.Put(handles_[0], key,
              rocksdb::Slice(reinterpret_cast<const char*>(value.data()), value.size()));
    batch.Put(handles_[1], key, EncodeDiskMeta(m));
    return FromRocks(db_->Write(write_, &batch), "put");
  }

  absl::Status Read(const BlockKey& k, std::span<uint8_t> dst) override {
    rocksdb::PinnableSlice v;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[0], EncodeStoreKey(k), &v);
    if (s.IsNotFound()) return absl::NotFoundError("not on disk");
    RETURN_IF_ERROR(FromRocks(s, "get"));
    if (v.size() != dst.size()) {
      return absl::DataLossError(
          absl::StrCat("rocksdb value of ", v.size(), " bytes, meta says ", dst.size()));
    }
    std::memcpy(dst.data(), v.data(), dst.size());
    return absl::OkStatus();
  }

  absl::Status Delete(const BlockKey& k) override {
    const std::string key = EncodeStoreKey(k);
    rocksdb::WriteBatch batch;
    batch.Delete(handles_[0], key);
    batch.Delete(handles_[1], key);
    return FromRocks(db_->Write(write_, &batch), "delete");
  }

  absl::Status ForEachMeta(
      const std::function<void(const BlockKey&, const DiskMeta&)>& fn) override {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), handles_[1]));
    std::vector<std::string> bad;
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      auto key = DecodeStoreKey(it->key().ToStringView());
      auto meta = DecodeDiskMeta(it->value().ToStringView());
      if (!key.ok() || !meta.ok()) {
        bad.push_back(it->key().ToString());
        continue;
      }
      fn(*key, *meta);
    }
    RETURN_IF_ERROR(FromRocks(it->status(), "scan"));
    for (const auto& k : bad) {
      rocksdb::WriteBatch batch;
      batch.Delete(handles_[0], k);
      batch.Delete(handles_[1], k);
      (void)db_->Write(write_, &batch);
    }
    return absl::OkStatus();
  }

 private:
  RocksDbStore() = default;
  rocksdb::DB* db_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  rocksdb::WriteOptions write_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DiskStore>> OpenRocksDbStore(const DiskStoreOptions& options) {
  return RocksDbStore::Open(options);
}

}  // namespace sparsex::cache::internal
#endif  // SPARSEX_WITH_ROCKSDB

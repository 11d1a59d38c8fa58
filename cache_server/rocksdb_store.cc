// RocksDB backend of the disk tier. Two column families: "default" holds the encoded blocks
// (integrated BlobDB: large values live in blob files, the LSM holds small indexes) and "meta"
// holds a DiskMeta per key, written in the same WriteBatch.
//
// A full disk: "no space" is RESOURCE_EXHAUSTED "disk_full:" (the cache then stops
// writing and serves from memory; it keeps a reserve of free space so that RocksDB normally
// never meets a full disk). Opening for writing replays the WAL into new files, so a database
// is opened for writing only when the filesystem has room for its WAL files plus the reserve;
// otherwise it is opened read-only (nothing written: its blocks are still served) and
// Recover() reopens it read-write once there is room. Recover() also clears RocksDB's
// background error of a failed flush (DB::Resume).
//
// One error is not recoverable in-process: a failed WAL append. RocksDB 7.x (as packaged, with
// assertions on) aborts on any later use of that WAL writer (WritableFileWriter::
// AssertFalseAndGetStatusForPrevError: "sync_without_flush_called_"), and its own automatic
// recovery, a Resume, a later write and even DB::Close flush it: that was the exit 134. So
// after a WAL write error the store is never written, resumed or closed again (the process
// leaks it at exit; the WAL up to the failed record is on disk and replays at the next open),
// RocksDB's automatic recovery is turned off (we recover only what is safe), and the disk
// tier stays off until the server restarts. Reads keep working.
//
// RocksDB's own info log ("LOG") is the one file RocksDB writes by itself at any time, outside
// the reserve's checks: a periodic flush every 10 s, and on the next line logged 5 s after the
// last flush. Its default logger (EnvLogger) writes through the same asserting writer, so one
// flush on a full disk and then any later line (DB::Resume logs "Resuming DB" when the disk
// tier recovers) aborted the server in 4 of 10 disk-full runs, depending on
// whether a 10 s tick fell while the disk was full. The store logs through InfoLog instead.
#include "cache_server/disk_store.h"

#if SPARSEX_WITH_ROCKSDB
#include <rocksdb/db.h>
#include <rocksdb/listener.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <shared_mutex>
#include <vector>

namespace sparsex::cache::internal {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNoSpace()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "disk_full: rocksdb ", absl::string_view(what.data(), what.size()), ": ", s.ToString()));
  }
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (s.IsNotFound()) code = absl::StatusCode::kNotFound;
  else if (s.IsCorruption()) code = absl::StatusCode::kDataLoss;
  else if (s.IsIOError()) code = absl::StatusCode::kUnavailable;
  else if (s.IsInvalidArgument()) code = absl::StatusCode::kInvalidArgument;
  return absl::Status(code, absl::StrCat("rocksdb ", absl::string_view(what.data(), what.size()), ": ", s.ToString()));
}

// RocksDB's info log with plain write(2) calls whose errors are ignored: on a full disk lines
// are dropped (and counted in the next line that gets through), never fatal. One line is one
// O_APPEND write, so threads need no lock. The previous log is kept as LOG.old.
class InfoLog final : public rocksdb::Logger {
 public:
  InfoLog(const std::string& path, rocksdb::InfoLogLevel level) : rocksdb::Logger(level) {
    (void)std::rename(path.c_str(), (path + ".old").c_str());
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  }
  ~InfoLog() override {
    if (fd_ >= 0) ::close(fd_);
  }

  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    if (fd_ < 0) return;
    struct timeval tv{};
    gettimeofday(&tv, nullptr);
    struct tm t{};
    localtime_r(&tv.tv_sec, &t);
    char head[96];
    int n = std::snprintf(head, sizeof(head), "%04d/%02d/%02d-%02d:%02d:%02d.%06ld %lx ",
                          t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min,
                          t.tm_sec, static_cast<long>(tv.tv_usec),
                          static_cast<unsigned long>(gettid()));
    std::string line(head, std::clamp<int>(n, 0, sizeof(head) - 1));
    if (const uint64_t lost = dropped_.load(std::memory_order_relaxed); lost > 0) {
      line += "[" + std::to_string(lost) + " earlier lines dropped: write failed] ";
    }
    va_list copy;
    va_copy(copy, ap);
    char body[1024];
    const int len = std::vsnprintf(body, sizeof(body), format, copy);
    va_end(copy);
    if (len < 0) return;
    if (static_cast<size_t>(len) < sizeof(body)) {
      line.append(body, len);
    } else {
      const size_t at = line.size();
      line.resize(at + len + 1);
      std::vsnprintf(line.data() + at, len + 1, format, ap);
      line.resize(at + len);
    }
    if (line.empty() || line.back() != '\n') line.push_back('\n');
    if (::write(fd_, line.data(), line.size()) == static_cast<ssize_t>(line.size())) {
      dropped_.store(0, std::memory_order_relaxed);
    } else {
      dropped_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  size_t GetLogFileSize() const override {
    struct stat st{};
    return fd_ >= 0 && fstat(fd_, &st) == 0 ? static_cast<size_t>(st.st_size) : 0;
  }

 private:
  int fd_ = -1;
  std::atomic<uint64_t> dropped_{0};
};

// Notes a failed WAL write (see the top of this file) and keeps RocksDB from recovering by
// itself: RocksDbStore::Recover decides.
class ErrorListener final : public rocksdb::EventListener {
 public:
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason, rocksdb::Status* s) override {
    if (s != nullptr && !s->ok() &&
        (reason == rocksdb::BackgroundErrorReason::kWriteCallback ||
         reason == rocksdb::BackgroundErrorReason::kMemTable)) {
      wal_failed.store(true);
    }
  }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason, rocksdb::Status bg_error,
                            bool* auto_recovery) override {
    bg_error.PermitUncheckedError();
    if (auto_recovery != nullptr) *auto_recovery = false;
  }
  std::atomic<bool> wal_failed{false};
};

class RocksDbStore final : public DiskStore {
 public:
  ~RocksDbStore() override {
    if (listener_->wal_failed.load()) {
      // Closing would flush the failed WAL writer, which aborts: leave it to process exit.
      db_ = nullptr;
      handles_.clear();
      return;
    }
    CloseLocked();
  }

  static absl::StatusOr<std::unique_ptr<DiskStore>> Open(const DiskStoreOptions& o) {
    if (o.path.empty()) return absl::InvalidArgumentError("rocksdb: disk_path is empty");
    auto store = std::unique_ptr<RocksDbStore>(new RocksDbStore());
    store->path_ = o.path;
    store->dbo_.create_if_missing = true;
    store->dbo_.create_missing_column_families = true;
    store->dbo_.max_background_jobs = 2;
    store->dbo_.listeners.push_back(store->listener_);
    const uint64_t write_buffer = std::max<uint64_t>(o.write_buffer_bytes, 1ull << 20);
    // Every batch writes both column families, and a WAL file goes only once both have
    // flushed past it. The small "meta" family would otherwise reach its memtable limit only
    // after millions of blocks, so every block would stay on disk twice (WAL and blob file)
    // up to RocksDB's default WAL cap of 4 x the write buffers: flush it along.
    store->dbo_.max_total_wal_size = 2 * write_buffer;
    rocksdb::ColumnFamilyOptions data;
    data.enable_blob_files = true;
    data.min_blob_size = 4096;
    data.blob_file_size = 256ull << 20;
    data.enable_blob_garbage_collection = true;
    data.write_buffer_size = write_buffer;
    rocksdb::ColumnFamilyOptions meta;
    store->cfs_ = {{rocksdb::kDefaultColumnFamilyName, data}, {"meta", meta}};
    store->write_.sync = o.sync;
    store->reserve_ = o.reserve_bytes;
    std::error_code ec;
    const bool exists = std::filesystem::exists(o.path + "/CURRENT", ec);
    const uint64_t free = store->FreeBytes().value_or(UINT64_MAX);
    if (!exists && free < kMinFreeToCreate) {
      // Even a new, empty database writes a few files; on a full disk RocksDB may abort.
      return absl::ResourceExhaustedError(absl::StrCat(
          "disk_full: ", free, " bytes free in ", o.path, ", too little to create the disk tier"));
    }
    // Not RocksDB's own logger, which aborts after one failed write (see the top of this
    // file). One logger for the store's life: reopening appends to the same LOG.
    std::filesystem::create_directories(o.path, ec);
    store->dbo_.info_log = std::make_shared<InfoLog>(o.path + "/LOG", store->dbo_.info_log_level);
    if (exists && !store->RoomToOpenWritable()) {
      // The blocks are there: serve them read-only until Recover() finds the room.
      rocksdb::Status ro = store->OpenLocked(/*read_only=*/true);
      if (!ro.ok()) return FromRocks(ro, "open read-only " + o.path);
      return std::unique_ptr<DiskStore>(std::move(store));
    }
    rocksdb::Status s = store->OpenLocked(/*read_only=*/false);
    if (s.IsNoSpace() && !store->listener_->wal_failed.load()) {
      rocksdb::Status ro = store->OpenLocked(/*read_only=*/true);
      if (ro.ok()) return std::unique_ptr<DiskStore>(std::move(store));
    }
    if (!s.ok()) return FromRocks(s, "open " + o.path);
    return std::unique_ptr<DiskStore>(std::move(store));
  }

  std::string name() const override { return "rocksdb"; }

  bool read_only() const override {
    std::shared_lock<std::shared_mutex> lock(mu_);
    return read_only_;
  }

  absl::StatusOr<uint64_t> FreeBytes() override {
    struct statvfs v{};
    if (statvfs(path_.c_str(), &v) != 0) {
      return absl::UnavailableError(absl::StrCat("statvfs ", path_, ": ", strerror(errno)));
    }
    return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  }

  absl::Status Recover() override {
    RETURN_IF_ERROR(NotPoisoned());
    {
      std::shared_lock<std::shared_mutex> lock(mu_);
      if (db_ != nullptr && !read_only_) return FromRocks(db_->Resume(), "resume");
    }
    // Read-only (or closed): reopen for writing once there is room to replay the WAL; back to
    // read-only if that still fails.
    if (!RoomToOpenWritable()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "disk_full: opened read-only; reopening for writing needs ", WalBytes(), " + ",
          reserve_, " bytes free"));
    }
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (db_ != nullptr && !read_only_) return absl::OkStatus();
    CloseLocked();
    rocksdb::Status s = OpenLocked(/*read_only=*/false);
    if (s.ok()) return absl::OkStatus();
    (void)OpenLocked(/*read_only=*/true);
    return FromRocks(s, "reopen " + path_);
  }

  absl::Status Put(const BlockKey& k, const DiskMeta& m,
                   std::span<const uint8_t> value) override {
    std::shared_lock<std::shared_mutex> lock(mu_);
    RETURN_IF_ERROR(Writable());
    const std::string key = EncodeStoreKey(k);
    rocksdb::WriteBatch batch;
    batch.Put(handles_[0], key,
              rocksdb::Slice(reinterpret_cast<const char*>(value.data()), value.size()));
    batch.Put(handles_[1], key, EncodeDiskMeta(m));
    std::lock_guard<std::mutex> w(write_mu_);
    return FromRocks(db_->Write(write_, &batch), "put");
  }

  absl::Status Read(const BlockKey& k, std::span<uint8_t> dst) override {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (db_ == nullptr) return absl::UnavailableError("rocksdb: database closed");
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
    std::shared_lock<std::shared_mutex> lock(mu_);
    RETURN_IF_ERROR(Writable());
    const std::string key = EncodeStoreKey(k);
    rocksdb::WriteBatch batch;
    batch.Delete(handles_[0], key);
    batch.Delete(handles_[1], key);
    std::lock_guard<std::mutex> w(write_mu_);
    return FromRocks(db_->Write(write_, &batch), "delete");
  }

  absl::Status ForEachMeta(
      const std::function<void(const BlockKey&, const DiskMeta&)>& fn) override {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (db_ == nullptr) return absl::UnavailableError("rocksdb: database closed");
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
    if (read_only_ || listener_->wal_failed.load()) return absl::OkStatus();
    for (const auto& k : bad) {
      rocksdb::WriteBatch batch;
      batch.Delete(handles_[0], k);
      batch.Delete(handles_[1], k);
      std::lock_guard<std::mutex> w(write_mu_);
      (void)db_->Write(write_, &batch);
    }
    return absl::OkStatus();
  }

 private:
  RocksDbStore() = default;

  absl::Status NotPoisoned() const {
    if (listener_->wal_failed.load()) {
      return absl::FailedPreconditionError(
          "disk_failed: a RocksDB WAL write failed (disk full); this RocksDB cannot be written, "
          "resumed or closed safely any more: the disk tier stays off until the server restarts");
    }
    return absl::OkStatus();
  }

  absl::Status Writable() const {
    RETURN_IF_ERROR(NotPoisoned());
    if (db_ == nullptr) return absl::UnavailableError("rocksdb: database closed");
    if (read_only_) {
      return absl::ResourceExhaustedError(
          "disk_full: rocksdb was opened read-only (disk full at open); not writable yet");
    }
    return absl::OkStatus();
  }

  static constexpr uint64_t kMinFreeToCreate = 1ull << 20;

  // Bytes of WAL files, which opening for writing replays into new files.
  uint64_t WalBytes() const {
    uint64_t n = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(path_, ec)) {
      if (e.path().extension() == ".log") n += e.file_size(ec);
    }
    return n;
  }
  bool RoomToOpenWritable() {
    auto free = FreeBytes();
    return !free.ok() || *free >= WalBytes() + reserve_;
  }

  // mu_ held exclusively (or not shared yet).
  rocksdb::Status OpenLocked(bool read_only) {
    handles_.clear();
    rocksdb::Status s =
        read_only ? rocksdb::DB::OpenForReadOnly(dbo_, path_, cfs_, &handles_, &db_)
                  : rocksdb::DB::Open(dbo_, path_, cfs_, &handles_, &db_);
    if (!s.ok()) {
      db_ = nullptr;
      handles_.clear();
      return s;
    }
    read_only_ = read_only;
    return s;
  }

  void CloseLocked() {
    if (db_ == nullptr) return;
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
    handles_.clear();
    db_->Close();
    delete db_;
    db_ = nullptr;
  }

  std::shared_ptr<ErrorListener> listener_ = std::make_shared<ErrorListener>();
  mutable std::shared_mutex mu_;  // shared: every operation; exclusive: (re)open and close
  // One writer at a time into RocksDB. Its group commit merges concurrent writers' batches
  // into one owned by the DB, handing it between leader threads through atomics of its own,
  // which ThreadSanitizer cannot see (it reported the merge as a race in
  // BlockCacheTest.ConcurrentClientsThreads); RocksDB appends one WAL record at a time anyway.
  std::mutex write_mu_;
  std::string path_;
  uint64_t reserve_ = 0;
  rocksdb::DBOptions dbo_;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs_;
  rocksdb::DB* db_ = nullptr;
  bool read_only_ = false;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  rocksdb::WriteOptions write_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DiskStore>> OpenRocksDbStore(const DiskStoreOptions& options) {
  return RocksDbStore::Open(options);
}

}  // namespace sparsex::cache::internal
#endif  // SPARSEX_WITH_ROCKSDB

#include "cache_server/block_cache.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "cache_server/arena_allocator.h"
#include "cache_server/disk_store.h"
#include "cache_server/eviction.h"
#include "common/kv_block.h"
#include "common/metrics/metrics.h"

namespace sparsex::cache {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Entry {
  enum class State : uint8_t { kReserved, kCommitted };
  State state = State::kReserved;
  Hash128 model_fp;
  uint32_t layout_version = 0;
  uint64_t size = 0;
  uint64_t checksum = 0;
  double cost = 0;
  bool in_memory = false;  // arena bytes at `offset` are valid (or being written: reserved)
  uint64_t offset = 0;
  bool on_disk = false;
  bool promoting = false;  // disk -> memory copy in flight (arena range allocated)
  bool doomed = false;     // evicted while pinned: invisible, removed on the last unpin
  uint32_t pins = 0;
  uint64_t commit_unix_ms = 0;
};

struct ReservationRec {
  BlockKey key;
  Clock::time_point deadline;
  bool committing = false;
};

struct LeaseRec {
  std::vector<BlockKey> pinned;     // one entry per pin taken
  std::vector<BlockKey> keys;       // request order (for Read)
  std::vector<LeasedBlock> blocks;  // request order
  Clock::time_point deadline;
};

// Metrics of the store; null-safe wrappers so the cache also runs without a registry.
struct CacheMetrics {
  metrics::Counter* hits_memory = nullptr;
  metrics::Counter* hits_disk = nullptr;
  metrics::Counter* misses = nullptr;
  metrics::Counter* lookups_memory = nullptr;
  metrics::Counter* lookups_disk = nullptr;
  metrics::Counter* lookups_miss = nullptr;
  metrics::Counter* bytes_in = nullptr;
  metrics::Counter* bytes_out = nullptr;
  metrics::Counter* evictions_memory = nullptr;
  metrics::Counter* evictions_disk = nullptr;
  metrics::Counter* spills = nullptr;
  metrics::Counter* promotions = nullptr;
  metrics::Counter* corrupt_memory = nullptr;
  metrics::Counter* corrupt_disk = nullptr;
  metrics::Counter* reclaimed = nullptr;
  metrics::Counter* leases_expired = nullptr;
  metrics::Counter* commits_ok = nullptr;
  metrics::Counter* commits_failed = nullptr;
  metrics::Gauge* capacity_memory = nullptr;
  metrics::Gauge* capacity_disk = nullptr;
  metrics::Gauge* used_memory = nullptr;
  metrics::Gauge* used_disk = nullptr;
  metrics::Gauge* blocks_memory = nullptr;
  metrics::Gauge* blocks_disk = nullptr;
  metrics::Gauge* leases = nullptr;
  metrics::Gauge* reservations = nullptr;
  metrics::Gauge* pinned_bytes = nullptr;
  metrics::Histogram* disk_read_seconds = nullptr;
  metrics::Histogram* disk_write_seconds = nullptr;
};

void Inc(metrics::Counter* c, double v = 1) {
  if (c != nullptr) c->Inc(v);
}
void Observe(metrics::Histogram* h, Clock::time_point since) {
  if (h != nullptr) h->Observe(std::chrono::duration<double>(Clock::now() - since).count());
}

}  // namespace

class BlockCache::Impl {
 public:
  Impl(const CacheOptions& o, uint8_t* arena, uint64_t arena_bytes)
      : opt_(o),
        arena_(arena),
        alloc_(std::min<uint64_t>(arena_bytes, o.memory_capacity_bytes), o.arena_alignment),
        memory_policy_(MakeEvictionPolicy(o.eviction)),
        disk_policy_(MakeEvictionPolicy(EvictionPolicyKind::kLru)) {
    opt_.max_block_bytes = std::min(opt_.max_block_bytes, alloc_.capacity());
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    stop_cv_.notify_all();
    if (sweeper_.joinable()) sweeper_.join();
    if (warm_.joinable()) warm_.join();
    if (disk_ && !opt_.write_through) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [k, e] : entries_) {
        if (e.state == Entry::State::kCommitted && e.in_memory && !e.on_disk && !e.doomed) {
          (void)disk_->Put(k, MetaOf(e), {arena_ + e.offset, e.size});
        }
      }
    }
  }

  absl::Status Init(metrics::Registry* reg) {
    RegisterMetrics(reg);
    DiskStoreOptions dso;
    dso.backend = opt_.disk_backend;
    dso.path = opt_.disk_path;
    dso.sync = opt_.sync_writes;
    ASSIGN_OR_RETURN(disk_, OpenDiskStore(dso));
    if (disk_) {
      std::vector<std::pair<uint64_t, BlockKey>> order;
      std::vector<BlockKey> stale;
      RETURN_IF_ERROR(disk_->ForEachMeta([&](const BlockKey& k, const DiskMeta& m) {
        if (m.layout_version != opt_.layout_version || !ValidateBlockKey(k).ok() ||
            m.size == 0) {
          stale.push_back(k);
          return;
        }
        Entry e;
        e.state = Entry::State::kCommitted;
        e.model_fp = m.model_fp;
        e.layout_version = m.layout_version;
        e.size = m.size;
        e.checksum = m.checksum;
        e.cost = m.cost;
        e.on_disk = true;
        e.commit_unix_ms = m.commit_unix_ms;
        entries_[k] = e;
        disk_used_ += m.size;
        order.emplace_back(m.commit_unix_ms, k);
      }));
      for (const auto& k : stale) (void)disk_->Delete(k);
      std::sort(order.begin(), order.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
      for (const auto& [t, k] : order) disk_policy_->Insert(k, entries_[k].size, 1);
      warm_order_.reserve(order.size());
      for (auto it = order.rbegin(); it != order.rend(); ++it) warm_order_.push_back(it->second);
    }
    UpdateGauges();
    sweeper_ = std::thread([this] { SweepLoop(); });
    warm_ = std::thread([this] { WarmLoad(); });
    return absl::OkStatus();
  }

  // ---------------------------------------------------------------- lookup

  absl::StatusOr<std::vector<LookupEntry>> Lookup(const Hash128& model, uint32_t layout,
                                                  std::span<const BlockKey> keys) {
    RETURN_IF_ERROR(CheckLayout(layout));
    RETURN_IF_ERROR(CheckKeys(keys));
    std::vector<LookupEntry> out(keys.size());
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      const Entry* e = Visible(keys[i]);
      if (e == nullptr) {
        Inc(m_.lookups_miss);
        continue;
      }
      out[i].size = e->size;
      out[i].layout_version = e->layout_version;
      out[i].tier = e->in_memory ? Tier::kMemory : Tier::kDisk;
      if (e->model_fp != model) {
        out[i].code = absl::StatusCode::kFailedPrecondition;
        Inc(m_.lookups_miss);
        continue;
      }
      out[i].code = absl::StatusCode::kOk;
      Inc(e->in_memory ? m_.lookups_memory : m_.lookups_disk);
    }
    return out;
  }

  // ---------------------------------------------------------------- put

  absl::StatusOr<Reservation> Reserve(const Hash128& model, uint32_t layout,
                                      const BlockKey& key, uint64_t size, double cost) {
    RETURN_IF_ERROR(CheckLayout(layout));
    RETURN_IF_ERROR(ValidateBlockKey(key));
    if (size < kKvBlockHeaderBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad_size: a block is at least ", kKvBlockHeaderBytes, " bytes, got ", size));
    }
    if (size > opt_.max_block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("oversized: block of ", size,
                                                     " bytes, max_block_bytes is ",
                                                     opt_.max_block_bytes));
    }
    if (!(cost >= 0)) return absl::InvalidArgumentError("bad_cost: cost must be >= 0");
    std::unique_lock<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      if (it->second.doomed) {
        return absl::AbortedError(
            absl::StrCat("block_being_removed: ", key.ToString(), " is being evicted; retry"));
      }
      return absl::AlreadyExistsError(absl::StrCat(
          it->second.state == Entry::State::kCommitted ? "committed: " : "put_in_progress: ",
          key.ToString()));
    }
    ASSIGN_OR_RETURN(uint64_t off, AllocateLocked(size));
    Entry e;
    e.state = Entry::State::kReserved;
    e.model_fp = model;
    e.layout_version = layout;
    e.size = size;
    e.cost = cost;
    e.offset = off;
    entries_[key] = e;
    const uint64_t id = next_id_++;
    reservations_[id] = {key, Clock::now() + std::chrono::milliseconds(opt_.reservation_timeout_ms),
                         false};
    UpdateGauges();
    return Reservation{id, off, UnixMs() + opt_.reservation_timeout_ms};
  }

  absl::Status Commit(uint64_t id, uint64_t checksum, std::span<const uint8_t> inline_data,
                      bool has_inline) {
    BlockKey key;
    Entry snapshot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto r = reservations_.find(id);
      if (r == reservations_.end()) return UnknownId(id, "reservation");
      if (r->second.committing) {
        return absl::AbortedError(absl::StrCat("commit_in_progress: reservation ", id));
      }
      r->second.committing = true;
      key = r->second.key;
      snapshot = entries_.at(key);
    }
    uint8_t* dst = arena_ + snapshot.offset;
    absl::Status st;
    if (has_inline) {
      if (inline_data.size() != snapshot.size) {
        st = absl::InvalidArgumentError(absl::StrCat("bad_size: inline data of ",
                                                     inline_data.size(), " bytes, reserved ",
                                                     snapshot.size));
      } else {
        std::memcpy(dst, inline_data.data(), snapshot.size);
      }
    }
    std::span<const uint8_t> bytes(dst, snapshot.size);
    double cost = snapshot.cost;
    if (st.ok() && KvBlockWireChecksum(bytes) != checksum) {
      st = absl::DataLossError(absl::StrCat("checksum_mismatch: bytes of ", key.ToString(),
                                            " do not match the commit checksum"));
    }
    if (st.ok()) st = CheckBlock(key, snapshot, bytes, &cost);
    if (st.ok() && disk_ && opt_.write_through) {
      auto t0 = Clock::now();
      DiskMeta meta = MetaOf(snapshot);
      meta.checksum = checksum;
      meta.cost = cost;
      meta.commit_unix_ms = UnixMs();
      st = disk_->Put(key, meta, bytes);
      Observe(m_.disk_write_seconds, t0);
    }
    std::lock_guard<std::mutex> lock(mu_);
    reservations_.erase(id);
    Entry& e = entries_.at(key);
    if (!st.ok()) {
      alloc_.Free(e.offset, e.size);
      entries_.erase(key);
      Inc(m_.commits_failed);
      UpdateGauges();
      return st;
    }
    e.state = Entry::State::kCommitted;
    e.checksum = checksum;
    e.cost = cost;
    e.in_memory = true;
    e.commit_unix_ms = UnixMs();
    memory_policy_->Insert(key, e.size, e.cost);
    if (disk_ && opt_.write_through) {
      e.on_disk = true;
      disk_used_ += e.size;
      disk_policy_->Insert(key, e.size, 1);
      EnforceDiskCapacityLocked();
    }
    Inc(m_.bytes_in, static_cast<double>(snapshot.size));
    Inc(m_.commits_ok);
    UpdateGauges();
    return absl::OkStatus();
  }

  absl::Status Abort(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto r = reservations_.find(id);
    if (r == reservations_.end()) return UnknownId(id, "reservation");
    if (r->second.committing) {
      return absl::AbortedError(absl::StrCat("commit_in_progress: reservation ", id));
    }
    DropReservationLocked(r);
    UpdateGauges();
    return absl::OkStatus();
  }

  // ---------------------------------------------------------------- leases

  absl::StatusOr<LeaseGrant> Lease(const Hash128& model, uint32_t layout,
                                   std::span<const BlockKey> keys, uint32_t ttl_ms,
                                   bool partial) {
    RETURN_IF_ERROR(CheckLayout(layout));
    RETURN_IF_ERROR(CheckKeys(keys));
    {
      absl::flat_hash_set<BlockKey> seen;
      for (const auto& k : keys) {
        if (!seen.insert(k).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("duplicate_key: ", k.ToString(), " appears twice in one lease"));
        }
      }
    }
    ASSIGN_OR_RETURN(uint32_t ttl, CheckTtl(ttl_ms));
    LeaseRec rec;
    rec.keys.assign(keys.begin(), keys.end());
    rec.blocks.resize(keys.size());
    std::vector<size_t> promote;
    std::unique_lock<std::mutex> lock(mu_);
    auto fail = [&](absl::Status s) {
      for (const auto& k : rec.pinned) UnpinLocked(k);
      for (size_t i : promote) AbandonPromotionLocked(keys[i]);
      promo_cv_.notify_all();
      UpdateGauges();
      return s;
    };
    for (size_t i = 0; i < keys.size(); ++i) {
      const BlockKey& k = keys[i];
      auto it = entries_.find(k);
      while (it != entries_.end() && it->second.promoting) {
        promo_cv_.wait(lock);
        it = entries_.find(k);
      }
      LeasedBlock& b = rec.blocks[i];
      if (it == entries_.end() || it->second.state != Entry::State::kCommitted ||
          it->second.doomed) {
        Inc(m_.misses);
        b.code = absl::StatusCode::kNotFound;
        if (!partial) {
          return fail(absl::NotFoundError(absl::StrCat("unknown_block: ", k.ToString())));
        }
        continue;
      }
      Entry& e = it->second;
      if (e.model_fp != model) {
        Inc(m_.misses);
        b.code = absl::StatusCode::kFailedPrecondition;
        if (!partial) {
          return fail(absl::FailedPreconditionError(absl::StrCat(
              "model_mismatch: ", k.ToString(), " was stored for model ", e.model_fp.Hex(),
              ", request is for ", model.Hex())));
        }
        continue;
      }
      if (!e.in_memory) {
        // Marked first: eviction inside AllocateLocked never touches promoting entries.
        e.promoting = true;
        auto off = AllocateLocked(e.size);
        if (!off.ok()) {
          e.promoting = false;
          promo_cv_.notify_all();
          b.code = off.status().code();
          if (!partial) return fail(off.status());
          continue;
        }
        e.offset = *off;
        promote.push_back(i);
        b.tier = Tier::kDisk;
      } else {
        b.tier = Tier::kMemory;
        memory_policy_->Touch(k);
      }
      Entry& ep = entries_.at(k);
      if (ep.pins++ == 0) pinned_bytes_ += ep.size;
      rec.pinned.push_back(k);
      b.code = absl::StatusCode::kOk;
      b.offset = ep.offset;
      b.size = ep.size;
      b.checksum = ep.checksum;
    }
    if (!promote.empty()) {
      lock.unlock();
      std::vector<absl::Status> results(promote.size());
      for (size_t j = 0; j < promote.size(); ++j) {
        const LeasedBlock& b = rec.blocks[promote[j]];
        results[j] = ReadFromDisk(keys[promote[j]], b.offset, b.size, b.checksum);
      }
      lock.lock();
      bool failed = false;
      for (size_t j = 0; j < promote.size(); ++j) {
        const BlockKey& k = keys[promote[j]];
        LeasedBlock& b = rec.blocks[promote[j]];
        Entry& e = entries_.at(k);
        e.promoting = false;
        if (results[j].ok()) {
          e.in_memory = true;
          memory_policy_->Insert(k, e.size, e.cost);
          Inc(m_.promotions);
          continue;
        }
        // Corrupt (or unreadable) on disk: drop it everywhere, report a miss.
        Inc(m_.misses);
        Inc(m_.corrupt_disk);
        b = LeasedBlock{};
        b.code = absl::StatusCode::kNotFound;
        auto pin = std::find(rec.pinned.begin(), rec.pinned.end(), k);
        if (pin != rec.pinned.end()) rec.pinned.erase(pin);
        alloc_.Free(e.offset, e.size);
        if (--e.pins == 0) pinned_bytes_ -= e.size;
        e.doomed = true;
        if (e.pins == 0) RemoveEntryLocked(k);
        failed = true;
      }
      promote.clear();
      promo_cv_.notify_all();
      if (failed && !partial) {
        return fail(absl::NotFoundError(
            "unknown_block: a requested block failed verification on disk and was dropped"));
      }
    }
    LeaseGrant g;
    for (const auto& b : rec.blocks) {
      if (b.code != absl::StatusCode::kOk) continue;
      Inc(b.tier == Tier::kMemory ? m_.hits_memory : m_.hits_disk);
      Inc(m_.bytes_out, static_cast<double>(b.size));
    }
    if (!rec.pinned.empty()) {
      g.id = next_id_++;
      g.expires_unix_ms = UnixMs() + ttl;
      rec.deadline = Clock::now() + std::chrono::milliseconds(ttl);
      g.blocks = rec.blocks;
      leases_[g.id] = std::move(rec);
    } else {
      g.blocks = std::move(rec.blocks);
    }
    UpdateGauges();
    return g;
  }

  absl::StatusOr<uint64_t> RenewLease(uint64_t id, uint32_t ttl_ms) {
    ASSIGN_OR_RETURN(uint32_t ttl, CheckTtl(ttl_ms));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) return UnknownId(id, "lease");
    it->second.deadline = Clock::now() + std::chrono::milliseconds(ttl);
    return UnixMs() + ttl;
  }

  absl::Status ReleaseLease(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) return UnknownId(id, "lease");
    for (const auto& k : it->second.pinned) UnpinLocked(k);
    leases_.erase(it);
    UpdateGauges();
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Read(uint64_t id, uint32_t index) {
    LeasedBlock b;
    BlockKey key;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = leases_.find(id);
      if (it == leases_.end()) return UnknownId(id, "lease");
      if (index >= it->second.blocks.size()) {
        return absl::InvalidArgumentError(absl::StrCat("bad_index: lease ", id, " has ",
                                                       it->second.blocks.size(), " blocks"));
      }
      b = it->second.blocks[index];
      key = it->second.keys[index];
      if (b.code != absl::StatusCode::kOk) {
        return absl::NotFoundError(absl::StrCat("unknown_block: ", key.ToString()));
      }
    }
    // Pinned by the lease: the range stays valid without the lock.
    std::string out(reinterpret_cast<const char*>(arena_ + b.offset), b.size);
    if (KvBlockWireChecksum(KvBlockBytes(out)) != b.checksum) {
      std::lock_guard<std::mutex> lock(mu_);
      Inc(m_.corrupt_memory);
      DoomLocked(key);
      return absl::NotFoundError(absl::StrCat("unknown_block: ", key.ToString(),
                                              " failed verification in memory and was dropped"));
    }
    return out;
  }

  // ---------------------------------------------------------------- admin

  absl::StatusOr<uint32_t> Evict(std::span<const BlockKey> keys, bool all, bool corrupt) {
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t n = 0;
    if (all) {
      std::vector<BlockKey> victims;
      for (const auto& [k, e] : entries_) {
        if (e.state == Entry::State::kCommitted && !e.doomed) victims.push_back(k);
      }
      for (const auto& k : victims) n += DoomLocked(k) ? 1 : 0;
    }
    bool any = false;
    for (const auto& k : keys) {
      RETURN_IF_ERROR(ValidateBlockKey(k));
      if (Visible(k) == nullptr) continue;
      any = true;
      if (corrupt) Inc(m_.corrupt_memory);
      n += DoomLocked(k) ? 1 : 0;
    }
    UpdateGauges();
    if (!keys.empty() && !any && !all) {
      return absl::NotFoundError(absl::StrCat("unknown_block: none of the ", keys.size(),
                                              " keys is cached"));
    }
    return n;
  }

  CacheStats Stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    CacheStats s;
    s.memory_capacity_bytes = alloc_.capacity();
    s.memory_used_bytes = alloc_.used();
    for (const auto& [k, e] : entries_) {
      if (e.state != Entry::State::kCommitted) continue;
      if (e.in_memory) s.memory_blocks++;
      if (e.on_disk) s.disk_blocks++;
    }
    s.disk_used_bytes = disk_used_;
    auto v = [](metrics::Counter* c) { return c ? static_cast<uint64_t>(c->Value()) : 0; };
    s.hits_memory = v(m_.hits_memory);
    s.hits_disk = v(m_.hits_disk);
    s.misses = v(m_.misses);
    s.evictions = v(m_.evictions_memory) + v(m_.evictions_disk);
    s.corrupt_blocks = v(m_.corrupt_memory) + v(m_.corrupt_disk);
    s.active_leases = leases_.size();
    s.active_reservations = reservations_.size();
    s.reclaimed_reservations = v(m_.reclaimed);
    s.bytes_in = v(m_.bytes_in);
    s.bytes_out = v(m_.bytes_out);
    return s;
  }

  void Sweep() {
    std::lock_guard<std::mutex> lock(mu_);
    SweepLocked();
  }

  bool WarmLoadDone() const { return warm_done_.load(); }

 private:
  // ---------------------------------------------------------------- helpers

  absl::Status CheckLayout(uint32_t layout) const {
    if (layout != opt_.layout_version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layout_mismatch: request layout version ", layout, ", server holds version ",
          opt_.layout_version));
    }
    return absl::OkStatus();
  }

  static absl::Status CheckKeys(std::span<const BlockKey> keys) {
    if (keys.empty()) return absl::InvalidArgumentError("no_keys: request has no keys");
    for (const auto& k : keys) RETURN_IF_ERROR(ValidateBlockKey(k));
    return absl::OkStatus();
  }

  absl::StatusOr<uint32_t> CheckTtl(uint32_t ttl_ms) const {
    if (ttl_ms == 0) return opt_.default_lease_ms;
    if (ttl_ms > opt_.max_lease_ms) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad_ttl: ttl_ms ", ttl_ms, " above max_lease_ms ", opt_.max_lease_ms));
    }
    return ttl_ms;
  }

  absl::Status UnknownId(uint64_t id, const char* what) const {
    if (expired_set_.contains(id)) {
      return absl::AbortedError(absl::StrCat(what, "_expired: ", what, " ", id, " expired"));
    }
    return absl::NotFoundError(absl::StrCat("unknown_", what, ": ", what, " ", id));
  }

  void RememberExpired(uint64_t id) {
    expired_set_.insert(id);
    expired_fifo_.push_back(id);
    while (expired_fifo_.size() > 100000) {
      expired_set_.erase(expired_fifo_.front());
      expired_fifo_.pop_front();
    }
  }

  const Entry* Visible(const BlockKey& k) const {
    auto it = entries_.find(k);
    if (it == entries_.end() || it->second.state != Entry::State::kCommitted ||
        it->second.doomed) {
      return nullptr;
    }
    return &it->second;
  }

  static DiskMeta MetaOf(const Entry& e) {
    DiskMeta m;
    m.size = e.size;
    m.checksum = e.checksum;
    m.cost = e.cost;
    m.model_fp = e.model_fp;
    m.layout_version = e.layout_version;
    m.commit_unix_ms = e.commit_unix_ms;
    return m;
  }

  // Header of a committed block must describe exactly the reserved key, model and layout.
  absl::Status CheckBlock(const BlockKey& key, const Entry& e, std::span<const uint8_t> bytes,
                          double* cost) const {
    auto v = VerifyKvBlock(bytes);
    if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat("bad_block: ", v.status().message()));
    const KvBlockHeader& h = v->header;
    if (h.segment_fp != key.segment || h.layer_begin != key.layer_begin ||
        h.layer_end != key.layer_end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad_block: block header describes ", h.segment_fp.Hex(), "[", h.layer_begin, ",",
          h.layer_end, "), reserved ", key.ToString()));
    }
    if (h.model_fp != e.model_fp) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model_mismatch: block is for model ", h.model_fp.Hex(), ", reserved for ",
          e.model_fp.Hex()));
    }
    RETURN_IF_ERROR(CheckKvLayout(h, opt_.layout_version));
    if (*cost <= 0) {
      *cost = static_cast<double>(h.num_tokens) * (h.layer_end - h.layer_begin);
    }
    return absl::OkStatus();
  }

  absl::Status ReadFromDisk(const BlockKey& k, uint64_t offset, uint64_t size,
                            uint64_t checksum) {
    auto t0 = Clock::now();
    std::span<uint8_t> dst(arena_ + offset, size);
    absl::Status s = disk_ ? disk_->Read(k, dst) : absl::NotFoundError("no disk tier");
    Observe(m_.disk_read_seconds, t0);
    if (!s.ok()) return s;
    if (KvBlockWireChecksum(dst) != checksum) {
      return absl::DataLossError("checksum mismatch on disk read");
    }
    auto v = VerifyKvBlock(dst);
    if (!v.ok()) return v.status();
    if (v->header.segment_fp != k.segment || v->header.layer_begin != k.layer_begin ||
        v->header.layer_end != k.layer_end) {
      return absl::DataLossError("disk block header does not match its key");
    }
    return absl::OkStatus();
  }

  // Allocates arena space, evicting unpinned memory copies in policy order as needed.
  absl::StatusOr<uint64_t> AllocateLocked(uint64_t size) {
    for (;;) {
      if (auto off = alloc_.Allocate(size)) return *off;
      bool evicted = false;
      const uint64_t need = alloc_.Rounded(size);
      memory_policy_->ForEachCandidate([&](const BlockKey& k) {
        auto it = entries_.find(k);
        if (it == entries_.end()) return false;
        Entry& e = it->second;
        if (e.pins > 0 || e.promoting || e.state != Entry::State::kCommitted || !e.in_memory) {
          return false;
        }
        EvictFromMemoryLocked(k);
        evicted = true;
        return alloc_.largest_free() >= need;
      });
      if (!evicted) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "out_of_capacity: no room for ", size, " bytes: ", alloc_.used(), " of ",
            alloc_.capacity(), " bytes in use, the rest is leased or being written"));
      }
    }
  }

  // Drops the memory copy of a committed, unpinned block; spills it first when it is not on
  // disk yet (write-back), or forgets it when there is no disk tier.
  void EvictFromMemoryLocked(const BlockKey& k) {
    Entry& e = entries_.at(k);
    if (!e.on_disk && disk_) {
      auto t0 = Clock::now();
      DiskMeta meta = MetaOf(e);
      absl::Status s = disk_->Put(k, meta, {arena_ + e.offset, e.size});
      Observe(m_.disk_write_seconds, t0);
      if (s.ok()) {
        e.on_disk = true;
        disk_used_ += e.size;
        disk_policy_->Insert(k, e.size, 1);
        Inc(m_.spills);
      }
    }
    Inc(m_.evictions_memory);
    memory_policy_->Erase(k, /*evicted=*/true);
    alloc_.Free(e.offset, e.size);
    e.in_memory = false;
    if (!e.on_disk) {
      entries_.erase(k);
    } else {
      EnforceDiskCapacityLocked();
    }
  }

  void EnforceDiskCapacityLocked() {
    if (opt_.disk_capacity_bytes == 0 || !disk_) return;
    while (disk_used_ > opt_.disk_capacity_bytes) {
      bool removed = false;
      disk_policy_->ForEachCandidate([&](const BlockKey& k) {
        auto it = entries_.find(k);
        if (it == entries_.end()) return false;
        Entry& e = it->second;
        if (e.pins > 0 || e.promoting || !e.on_disk) return false;
        (void)disk_->Delete(k);
        disk_policy_->Erase(k, true);
        disk_used_ -= e.size;
        e.on_disk = false;
        Inc(m_.evictions_disk);
        if (!e.in_memory) entries_.erase(it);
        removed = true;
        return true;
      });
      if (!removed) return;
    }
  }

  // Removes a block from every tier (must be unpinned and not promoting).
  void RemoveEntryLocked(const BlockKey& k) {
    auto it = entries_.find(k);
    if (it == entries_.end()) return;
    Entry& e = it->second;
    if (e.in_memory) {
      alloc_.Free(e.offset, e.size);
      memory_policy_->Erase(k, false);
    }
    if (e.on_disk) {
      if (disk_) (void)disk_->Delete(k);
      disk_policy_->Erase(k, false);
      disk_used_ -= e.size;
    }
    entries_.erase(it);
  }

  // Makes a block invisible; removes it now if unpinned, else on the last unpin.
  bool DoomLocked(const BlockKey& k) {
    auto it = entries_.find(k);
    if (it == entries_.end() || it->second.state != Entry::State::kCommitted) return false;
    Entry& e = it->second;
    if (e.doomed) return false;
    e.doomed = true;
    if (e.pins == 0 && !e.promoting) RemoveEntryLocked(k);
    return true;
  }

  void UnpinLocked(const BlockKey& k) {
    auto it = entries_.find(k);
    if (it == entries_.end() || it->second.pins == 0) return;
    Entry& e = it->second;
    if (--e.pins == 0) {
      pinned_bytes_ -= e.size;
      if (e.doomed && !e.promoting) RemoveEntryLocked(k);
    }
  }

  void AbandonPromotionLocked(const BlockKey& k) {
    auto it = entries_.find(k);
    if (it == entries_.end() || !it->second.promoting) return;
    alloc_.Free(it->second.offset, it->second.size);
    it->second.promoting = false;
    if (it->second.pins == 0 && it->second.doomed) RemoveEntryLocked(k);
  }

  void DropReservationLocked(
      absl::flat_hash_map<uint64_t, ReservationRec>::iterator r) {
    auto e = entries_.find(r->second.key);
    if (e != entries_.end() && e->second.state == Entry::State::kReserved) {
      alloc_.Free(e->second.offset, e->second.size);
      entries_.erase(e);
    }
    reservations_.erase(r);
  }

  void SweepLocked() {
    const auto now = Clock::now();
    for (auto it = reservations_.begin(); it != reservations_.end();) {
      auto cur = it++;
      if (cur->second.deadline <= now && !cur->second.committing) {
        RememberExpired(cur->first);
        Inc(m_.reclaimed);
        DropReservationLocked(cur);
      }
    }
    for (auto it = leases_.begin(); it != leases_.end();) {
      auto cur = it++;
      if (cur->second.deadline <= now) {
        for (const auto& k : cur->second.pinned) UnpinLocked(k);
        RememberExpired(cur->first);
        Inc(m_.leases_expired);
        leases_.erase(cur);
      }
    }
    UpdateGauges();
  }

  void SweepLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      stop_cv_.wait_for(lock, std::chrono::milliseconds(std::max<uint32_t>(1, opt_.sweep_interval_ms)));
      if (stop_) break;
      SweepLocked();
    }
  }

  // After a restart: bring the most recently committed disk blocks back into free memory.
  void WarmLoad() {
    uint64_t budget = std::min(opt_.warm_load_bytes, alloc_.capacity());
    for (const BlockKey& k : warm_order_) {
      uint64_t off = 0, size = 0, checksum = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) break;
        auto it = entries_.find(k);
        if (it == entries_.end()) continue;
        Entry& e = it->second;
        if (e.in_memory || e.promoting || e.doomed || e.state != Entry::State::kCommitted) {
          continue;
        }
        if (e.size > budget) continue;
        auto o = alloc_.Allocate(e.size);  // never evicts
        if (!o) break;
        e.promoting = true;
        e.offset = *o;
        off = *o;
        size = e.size;
        checksum = e.checksum;
        budget -= size;
      }
      absl::Status s = ReadFromDisk(k, off, size, checksum);
      std::lock_guard<std::mutex> lock(mu_);
      Entry& e = entries_.at(k);
      e.promoting = false;
      if (s.ok()) {
        e.in_memory = true;
        memory_policy_->Insert(k, e.size, e.cost);
      } else {
        Inc(m_.corrupt_disk);
        alloc_.Free(e.offset, e.size);
        e.doomed = true;
        if (e.pins == 0) RemoveEntryLocked(k);
      }
      promo_cv_.notify_all();
      UpdateGauges();
    }
    warm_order_.clear();
    warm_done_.store(true);
  }

  void RegisterMetrics(metrics::Registry* reg) {
    if (reg == nullptr) return;
    auto& hits = reg->AddCounter("sparsex_cache_hits_total",
                                 "Blocks leased, by the tier they were found in.", {"tier"});
    m_.hits_memory = &hits.Get({"memory"});
    m_.hits_disk = &hits.Get({"disk"});
    m_.misses = &reg->AddCounter("sparsex_cache_misses_total",
                                 "Blocks requested in a lease and not served (absent, other "
                                 "model, or dropped as corrupt).")
                     .Get();
    auto& lookups = reg->AddCounter("sparsex_cache_lookups_total",
                                    "Fingerprints looked up, by result.", {"result"});
    m_.lookups_memory = &lookups.Get({"memory"});
    m_.lookups_disk = &lookups.Get({"disk"});
    m_.lookups_miss = &lookups.Get({"miss"});
    m_.bytes_in = &reg->AddCounter("sparsex_cache_bytes_in_total",
                                   "Bytes of committed puts.")
                       .Get();
    m_.bytes_out = &reg->AddCounter("sparsex_cache_bytes_out_total",
                                    "Bytes of blocks leased to readers.")
                        .Get();
    auto& ev = reg->AddCounter("sparsex_cache_evictions_total",
                               "Blocks evicted from a tier for capacity.", {"tier"});
    m_.evictions_memory = &ev.Get({"memory"});
    m_.evictions_disk = &ev.Get({"disk"});
    m_.spills = &reg->AddCounter("sparsex_cache_spills_total",
                                 "Blocks written to disk when evicted from memory.")
                     .Get();
    m_.promotions = &reg->AddCounter("sparsex_cache_promotions_total",
                                     "Disk blocks promoted into memory by a lease.")
                         .Get();
    auto& corrupt = reg->AddCounter(
        "sparsex_cache_corrupt_blocks_total",
        "Blocks that failed checksum verification and were dropped, by tier.", {"tier"});
    m_.corrupt_memory = &corrupt.Get({"memory"});
    m_.corrupt_disk = &corrupt.Get({"disk"});
    m_.reclaimed = &reg->AddCounter("sparsex_cache_reservations_reclaimed_total",
                                    "Put reservations reclaimed after their client did not "
                                    "commit in time.")
                        .Get();
    m_.leases_expired = &reg->AddCounter("sparsex_cache_leases_expired_total",
                                         "Leases that expired before release.")
                             .Get();
    auto& commits = reg->AddCounter("sparsex_cache_commits_total", "Put commits, by result.",
                                    {"result"});
    m_.commits_ok = &commits.Get({"ok"});
    m_.commits_failed = &commits.Get({"failed"});
    auto& cap = reg->AddGauge("sparsex_cache_capacity_bytes", "Capacity of a tier (0: unbounded).",
                              {"tier"});
    m_.capacity_memory = &cap.Get({"memory"});
    m_.capacity_disk = &cap.Get({"disk"});
    auto& used = reg->AddGauge("sparsex_cache_used_bytes",
                               "Bytes in use in a tier (memory includes reservations).",
                               {"tier"});
    m_.used_memory = &used.Get({"memory"});
    m_.used_disk = &used.Get({"disk"});
    auto& blocks = reg->AddGauge("sparsex_cache_blocks", "Committed blocks held in a tier.",
                                 {"tier"});
    m_.blocks_memory = &blocks.Get({"memory"});
    m_.blocks_disk = &blocks.Get({"disk"});
    m_.leases = &reg->AddGauge("sparsex_cache_active_leases", "Leases currently held.").Get();
    m_.reservations = &reg->AddGauge("sparsex_cache_active_reservations",
                                     "Put reservations awaiting commit.")
                           .Get();
    m_.pinned_bytes = &reg->AddGauge("sparsex_cache_pinned_bytes",
                                     "Bytes of memory blocks pinned by leases.")
                           .Get();
    auto b = metrics::ExponentialBuckets(1e-5, 4, 10);
    m_.disk_read_seconds = &reg->AddHistogram("sparsex_cache_disk_read_seconds",
                                              "Latency of one disk-tier block read.", {}, b)
                                .Get();
    m_.disk_write_seconds = &reg->AddHistogram("sparsex_cache_disk_write_seconds",
                                               "Latency of one disk-tier block write.", {}, b)
                                 .Get();
    m_.capacity_memory->Set(static_cast<double>(alloc_.capacity()));
    m_.capacity_disk->Set(static_cast<double>(opt_.disk_capacity_bytes));
  }

  void UpdateGauges() {
    if (m_.used_memory == nullptr) return;
    m_.used_memory->Set(static_cast<double>(alloc_.used()));
    m_.used_disk->Set(static_cast<double>(disk_used_));
    m_.blocks_memory->Set(static_cast<double>(memory_policy_->size()));
    m_.blocks_disk->Set(static_cast<double>(disk_policy_->size()));
    m_.leases->Set(static_cast<double>(leases_.size()));
    m_.reservations->Set(static_cast<double>(reservations_.size()));
    m_.pinned_bytes->Set(static_cast<double>(pinned_bytes_));
  }

  CacheOptions opt_;
  uint8_t* arena_;
  CacheMetrics m_;

  mutable std::mutex mu_;
  std::condition_variable promo_cv_, stop_cv_;
  bool stop_ = false;
  ArenaAllocator alloc_;
  std::unique_ptr<EvictionPolicy> memory_policy_;  // committed blocks in memory
  std::unique_ptr<EvictionPolicy> disk_policy_;    // blocks on disk (LRU by commit)
  std::unique_ptr<DiskStore> disk_;
  uint64_t disk_used_ = 0;
  uint64_t pinned_bytes_ = 0;  // bytes of entries with pins > 0
  std::unordered_map<BlockKey, Entry, absl::Hash<BlockKey>> entries_;
  absl::flat_hash_map<uint64_t, ReservationRec> reservations_;
  absl::flat_hash_map<uint64_t, LeaseRec> leases_;
  absl::flat_hash_set<uint64_t> expired_set_;
  std::deque<uint64_t> expired_fifo_;
  uint64_t next_id_ = 1;
  std::vector<BlockKey> warm_order_;  // most recent first
  std::atomic<bool> warm_done_{false};
  std::thread sweeper_, warm_;
};

// ------------------------------------------------------------------ forwarding

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
                                                const BlockKey& key, uint64_t size,
                                                double cost) {
  return impl_->Reserve(model_fp, layout_version, key, size, cost);
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
void BlockCache::Sweep() { impl_->Sweep(); }
bool BlockCache::WarmLoadDone() const { return impl_->WarmLoadDone(); }

}  // namespace sparsex::cache

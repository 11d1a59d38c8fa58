// BlockCache in-process: tiers, two-phase put, leases, eviction, persistence, corruption.
#include "cache_server/block_cache.h"

#include <gtest/gtest.h>
#if SPARSEX_WITH_ROCKSDB
#include <rocksdb/db.h>
#endif

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "cache_server/disk_store.h"
#include "cache_server/synthetic.h"
#include "testing/server_process.h"
#include "common/kv_block.h"
#include "common/metrics/metrics.h"

namespace sparsex::cache {
namespace {

using absl::StatusCode;

constexpr uint64_t kSeed = 42;

class BlockCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("sparsex-block-cache-");
    ASSERT_FALSE(dir_.empty());
    opt_.memory_capacity_bytes = 1 << 20;
    opt_.max_block_bytes = 256 << 10;
    opt_.disk_backend = SPARSEX_WITH_ROCKSDB ? "rocksdb" : "memory";
    opt_.disk_path = dir_ + "/db";
    opt_.warm_load_bytes = 0;
    arena_.assign(opt_.memory_capacity_bytes, 0);
    model_ = SyntheticModel(kSeed);
  }
  void TearDown() override {
    cache_.reset();
    testing::RemoveTree(dir_);
  }

  void Open() {
    cache_.reset();
    registry_ = std::make_unique<metrics::Registry>();
    auto c = BlockCache::Open(opt_, arena_.data(), arena_.size(), registry_.get());
    ASSERT_TRUE(c.ok()) << c.status();
    cache_ = std::move(*c);
  }

  std::string Block(uint64_t seg, uint32_t layer, uint32_t tokens = 16) {
    SyntheticShape s;
    s.num_tokens = tokens;
    s.kv_dim = 64;
    return SyntheticBlock(model_, kSeed, seg, layer, s);
  }

  absl::Status Put(uint64_t seg, uint32_t layer, uint32_t tokens = 16, double cost = 0) {
    std::string b = Block(seg, layer, tokens);
    auto r = cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, seg, layer),
                             b.size(), cost);
    if (!r.ok()) return r.status();
    return cache_->Commit(r->id, KvBlockWireChecksum(KvBlockBytes(b)), KvBlockBytes(b), true);
  }

  // Reads every block of the lease and checks it against the synthetic content.
  void ExpectLeasedBytes(const LeaseGrant& g, const std::vector<std::pair<uint64_t, uint32_t>>& ids) {
    ASSERT_EQ(g.blocks.size(), ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_EQ(g.blocks[i].code, StatusCode::kOk) << i;
      std::string want = Block(ids[i].first, ids[i].second);
      ASSERT_EQ(g.blocks[i].size, want.size());
      EXPECT_EQ(std::memcmp(arena_.data() + g.blocks[i].offset, want.data(), want.size()), 0);
    }
  }

  double Metric(const std::string& line_prefix) {
    std::string page = registry_->Render();
    auto p = page.find("\n" + line_prefix + " ");
    if (p == std::string::npos) return -1;
    return std::stod(page.substr(p + line_prefix.size() + 2));
  }

  std::string dir_;
  CacheOptions opt_;
  std::vector<uint8_t> arena_;
  Hash128 model_;
  std::unique_ptr<metrics::Registry> registry_;
  std::unique_ptr<BlockCache> cache_;
};

TEST_F(BlockCacheTest, PutLeaseReadRoundTrip) {
  Open();
  ASSERT_TRUE(Put(1, 0).ok());
  ASSERT_TRUE(Put(1, 1).ok());
  std::vector<BlockKey> keys = {SyntheticKey(kSeed, 1, 0), SyntheticKey(kSeed, 1, 1)};
  auto look = cache_->Lookup(model_, kKvLayoutVersion, keys);
  ASSERT_TRUE(look.ok());
  for (const auto& e : *look) {
    EXPECT_EQ(e.code, StatusCode::kOk);
    EXPECT_EQ(e.tier, Tier::kMemory);
    EXPECT_EQ(e.layout_version, kKvLayoutVersion);
    EXPECT_EQ(e.size, Block(1, 0).size());
  }
  auto g = cache_->Lease(model_, kKvLayoutVersion, keys, 0, false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_NE(g->id, 0u);
  ExpectLeasedBytes(*g, {{1, 0}, {1, 1}});
  auto r = cache_->Read(g->id, 1);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, Block(1, 1));
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  EXPECT_EQ(cache_->ReleaseLease(g->id).code(), StatusCode::kNotFound);
  auto s = cache_->Stats();
  EXPECT_EQ(s.hits_memory, 2u);
  EXPECT_EQ(s.memory_blocks, 2u);
  EXPECT_EQ(s.disk_blocks, 2u);  // write-through
}

TEST_F(BlockCacheTest, UncommittedIsInvisibleAndDuplicatePutsRefused) {
  Open();
  std::string b = Block(2, 0);
  BlockKey k = SyntheticKey(kSeed, 2, 0);
  auto r = cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0);
  ASSERT_TRUE(r.ok());
  auto look = cache_->Lookup(model_, kKvLayoutVersion, {&k, 1});
  EXPECT_EQ((*look)[0].code, StatusCode::kNotFound);
  EXPECT_EQ(cache_->Lease(model_, kKvLayoutVersion, {&k, 1}, 0, false).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0).status().code(),
            StatusCode::kAlreadyExists);
  // Data written "over the data plane", then commit.
  std::memcpy(arena_.data() + r->offset, b.data(), b.size());
  ASSERT_TRUE(cache_->Commit(r->id, KvBlockWireChecksum(KvBlockBytes(b)), {}, false).ok());
  EXPECT_EQ(cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0).status().code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(cache_->Commit(r->id, 0, {}, false).code(), StatusCode::kNotFound);
}

TEST_F(BlockCacheTest, CommitChecksAndBadRequests) {
  Open();
  std::string b = Block(3, 0);
  BlockKey k = SyntheticKey(kSeed, 3, 0);
  const uint64_t sum = KvBlockWireChecksum(KvBlockBytes(b));
  // Wrong checksum: DATA_LOSS, reservation dropped, nothing visible.
  auto r = cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(cache_->Commit(r->id, sum ^ 1, KvBlockBytes(b), true).code(), StatusCode::kDataLoss);
  EXPECT_EQ(cache_->Stats().active_reservations, 0u);
  EXPECT_EQ(cache_->Stats().memory_used_bytes, 0u);
  // Block of another key: INVALID_ARGUMENT bad_block.
  r = cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0);
  std::string other = Block(4, 0);
  auto s = cache_->Commit(r->id, KvBlockWireChecksum(KvBlockBytes(other)), KvBlockBytes(other),
                          true);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bad_block"), std::string::npos);
  // Not a KV block at all.
  r = cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0);
  std::string junk(b.size(), 'x');
  EXPECT_EQ(cache_->Commit(r->id, KvBlockWireChecksum(KvBlockBytes(junk)), KvBlockBytes(junk),
                           true)
                .code(),
            StatusCode::kInvalidArgument);
  // Inline data of the wrong size.
  r = cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0);
  EXPECT_EQ(cache_->Commit(r->id, sum, KvBlockBytes(b.substr(1)), true).code(),
            StatusCode::kInvalidArgument);
  // Model mismatch: reserved for another model.
  Hash128 other_model = SyntheticModel(7);
  r = cache_->Reserve(other_model, kKvLayoutVersion, k, b.size(), 0);
  s = cache_->Commit(r->id, sum, KvBlockBytes(b), true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("model_mismatch"), std::string::npos);
  // Layout mismatch, oversized, too small, empty layer range, bad ttl, no keys.
  s = cache_->Reserve(model_, kKvLayoutVersion + 1, k, b.size(), 0).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("layout_mismatch"), std::string::npos);
  s = cache_->Reserve(model_, kKvLayoutVersion, k, opt_.max_block_bytes + 1, 0).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("oversized"), std::string::npos);
  EXPECT_EQ(cache_->Reserve(model_, kKvLayoutVersion, k, 10, 0).status().code(),
            StatusCode::kInvalidArgument);
  BlockKey empty = k;
  empty.layer_end = empty.layer_begin;
  EXPECT_EQ(cache_->Reserve(model_, kKvLayoutVersion, empty, b.size(), 0).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(Put(3, 0).ok());
  EXPECT_EQ(cache_->Lease(model_, kKvLayoutVersion, {&k, 1}, opt_.max_lease_ms + 1, false)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Lease(model_, kKvLayoutVersion, {}, 0, false).status().code(),
            StatusCode::kInvalidArgument);
  std::vector<BlockKey> dup = {k, k};
  EXPECT_EQ(cache_->Lease(model_, kKvLayoutVersion, dup, 0, false).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Lookup(model_, kKvLayoutVersion + 1, {&k, 1}).status().code(),
            StatusCode::kFailedPrecondition);
  // Lease for another model: FAILED_PRECONDITION (or a per-block code when partial).
  s = cache_->Lease(other_model, kKvLayoutVersion, {&k, 1}, 0, false).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("model_mismatch"), std::string::npos);
  auto g = cache_->Lease(other_model, kKvLayoutVersion, {&k, 1}, 0, true);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->id, 0u);
  EXPECT_EQ(g->blocks[0].code, StatusCode::kFailedPrecondition);
  auto look = cache_->Lookup(other_model, kKvLayoutVersion, {&k, 1});
  EXPECT_EQ((*look)[0].code, StatusCode::kFailedPrecondition);
  // Unknown ids.
  EXPECT_EQ(cache_->Commit(987654, 0, {}, false).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache_->Abort(987654).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache_->RenewLease(987654, 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cache_->Read(987654, 0).status().code(), StatusCode::kNotFound);
  BlockKey unknown = SyntheticKey(kSeed, 999, 0);
  EXPECT_EQ(cache_->Evict({&unknown, 1}, false, false).status().code(), StatusCode::kNotFound);
  s = cache_->Lease(model_, kKvLayoutVersion, {&unknown, 1}, 0, false).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("unknown_block"), std::string::npos);
}

TEST_F(BlockCacheTest, AbandonedReservationIsReclaimed) {
  opt_.reservation_timeout_ms = 100;
  opt_.sweep_interval_ms = 10;
  Open();
  std::string b = Block(5, 0);
  BlockKey k = SyntheticKey(kSeed, 5, 0);
  auto r = cache_->Reserve(model_, kKvLayoutVersion, k, b.size(), 0);
  ASSERT_TRUE(r.ok());
  std::memcpy(arena_.data() + r->offset, b.data(), b.size() / 2);  // half written, then "dies"
  EXPECT_GT(cache_->Stats().memory_used_bytes, 0u);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (cache_->Stats().active_reservations != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto st = cache_->Stats();
  EXPECT_EQ(st.active_reservations, 0u);
  EXPECT_EQ(st.reclaimed_reservations, 1u);
  EXPECT_EQ(st.memory_used_bytes, 0u);
  auto s = cache_->Commit(r->id, KvBlockWireChecksum(KvBlockBytes(b)), {}, false);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("reservation_expired"), std::string::npos);
  auto look = cache_->Lookup(model_, kKvLayoutVersion, {&k, 1});
  EXPECT_EQ((*look)[0].code, StatusCode::kNotFound);
  EXPECT_TRUE(Put(5, 0).ok());  // the key is free again
}

// One client cannot reserve the whole arena. Its uncommitted bytes are
// bounded (max_client_reserved_bytes); beyond, RESOURCE_EXHAUSTED "client_quota" at once, while
// another client still reserves; a commit or abort gives the quota back.
TEST_F(BlockCacheTest, PerClientReservationQuota) {
  const size_t one = Block(1, 0).size();
  opt_.max_client_reserved_bytes = 3 * one;
  Open();
  std::vector<Reservation> held;
  for (uint32_t l = 0; l < 3; ++l) {
    auto r = cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 1, l), one, 0, "a");
    ASSERT_TRUE(r.ok()) << r.status();
    held.push_back(*r);
  }
  auto over = cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 1, 3), one, 0, "a");
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("client_quota"), std::string::npos) << over.status();
  auto other = cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 2, 0), one, 0, "b");
  EXPECT_TRUE(other.ok()) << other.status();
  // Commit one and abort one of a's: a may reserve two more, not three.
  std::string b0 = Block(1, 0);
  std::memcpy(arena_.data() + held[0].offset, b0.data(), b0.size());
  ASSERT_TRUE(cache_->Commit(held[0].id, KvBlockWireChecksum(KvBlockBytes(b0)), {}, false).ok());
  ASSERT_TRUE(cache_->Abort(held[1].id).ok());
  EXPECT_TRUE(cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 1, 4), one, 0, "a").ok());
  EXPECT_TRUE(cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 1, 5), one, 0, "a").ok());
  EXPECT_EQ(cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 1, 6), one, 0, "a")
                .status()
                .code(),
            StatusCode::kResourceExhausted);
  // In-process callers ("") have no quota.
  EXPECT_TRUE(cache_->Reserve(model_, kKvLayoutVersion, SyntheticKey(kSeed, 3, 0), one, 0).ok());
}

TEST_F(BlockCacheTest, LeaseExpiryAndRenewal) {
  opt_.sweep_interval_ms = 10;
  Open();
  ASSERT_TRUE(Put(6, 0).ok());
  BlockKey k = SyntheticKey(kSeed, 6, 0);
  auto g = cache_->Lease(model_, kKvLayoutVersion, {&k, 1}, 100, false);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(cache_->RenewLease(g->id, 300).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(cache_->Stats().active_leases, 1u);  // renewed
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  auto s = cache_->ReleaseLease(g->id);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("lease_expired"), std::string::npos);
  EXPECT_EQ(cache_->RenewLease(g->id, 0).status().code(), StatusCode::kAborted);
  EXPECT_EQ(cache_->Read(g->id, 0).status().code(), StatusCode::kAborted);
  EXPECT_EQ(cache_->Stats().active_leases, 0u);
}

TEST_F(BlockCacheTest, CapacityPressureEvictsButNeverLeased) {
  opt_.memory_capacity_bytes = 64 << 10;
  opt_.max_block_bytes = 32 << 10;
  Open();
  const uint64_t bs = Block(0, 0).size();  // 4224 bytes -> 4352 with alignment
  ASSERT_LT(bs, 8u << 10);
  // Lease the first two blocks, then overfill memory several times.
  ASSERT_TRUE(Put(100, 0).ok());
  ASSERT_TRUE(Put(101, 0).ok());
  std::vector<BlockKey> pinned = {SyntheticKey(kSeed, 100, 0), SyntheticKey(kSeed, 101, 0)};
  auto g = cache_->Lease(model_, kKvLayoutVersion, pinned, 60000, false);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(Metric("sparsex_cache_pinned_bytes"), static_cast<double>(2 * bs));
  for (uint64_t s = 0; s < 60; ++s) {
    ASSERT_TRUE(Put(200 + s, 0).ok()) << s;
    auto st = cache_->Stats();
    ASSERT_LE(st.memory_used_bytes, st.memory_capacity_bytes);
  }
  auto st = cache_->Stats();
  EXPECT_GT(st.evictions, 0u);
  EXPECT_EQ(st.disk_blocks, 62u);  // everything still on disk
  // Leased blocks kept their memory copy and their bytes.
  auto look = cache_->Lookup(model_, kKvLayoutVersion, pinned);
  EXPECT_EQ((*look)[0].tier, Tier::kMemory);
  EXPECT_EQ((*look)[1].tier, Tier::kMemory);
  ExpectLeasedBytes(*g, {{100, 0}, {101, 0}});
  // Oldest unleased block was evicted from memory, is served from disk (promoted).
  BlockKey old = SyntheticKey(kSeed, 200, 0);
  look = cache_->Lookup(model_, kKvLayoutVersion, {&old, 1});
  EXPECT_EQ((*look)[0].tier, Tier::kDisk);
  auto g2 = cache_->Lease(model_, kKvLayoutVersion, {&old, 1}, 0, false);
  ASSERT_TRUE(g2.ok()) << g2.status();
  EXPECT_EQ(g2->blocks[0].tier, Tier::kDisk);
  ExpectLeasedBytes(*g2, {{200, 0}});
  EXPECT_EQ(cache_->Stats().hits_disk, 1u);
  look = cache_->Lookup(model_, kKvLayoutVersion, {&old, 1});
  EXPECT_EQ((*look)[0].tier, Tier::kMemory);
  EXPECT_TRUE(cache_->ReleaseLease(g2->id).ok());
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  EXPECT_EQ(Metric("sparsex_cache_pinned_bytes"), 0);
}

TEST_F(BlockCacheTest, OutOfCapacityWhenEverythingIsLeased) {
  opt_.memory_capacity_bytes = 16 << 10;
  opt_.max_block_bytes = 16 << 10;
  opt_.disk_backend = "none";
  Open();
  ASSERT_TRUE(Put(1, 0).ok());
  ASSERT_TRUE(Put(2, 0).ok());
  ASSERT_TRUE(Put(3, 0).ok());
  std::vector<BlockKey> all = {SyntheticKey(kSeed, 1, 0), SyntheticKey(kSeed, 2, 0),
                               SyntheticKey(kSeed, 3, 0)};
  auto g = cache_->Lease(model_, kKvLayoutVersion, all, 0, false);
  ASSERT_TRUE(g.ok());
  auto s = Put(4, 0);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("out_of_capacity"), std::string::npos);
  ASSERT_TRUE(cache_->ReleaseLease(g->id).ok());
  EXPECT_TRUE(Put(4, 0).ok());  // now the LRU block goes (no disk: it is gone)
  BlockKey first = all[0];
  auto look = cache_->Lookup(model_, kKvLayoutVersion, {&first, 1});
  EXPECT_EQ((*look)[0].code, StatusCode::kNotFound);
}

#if SPARSEX_WITH_ROCKSDB  // needs a disk tier that outlives the cache object
TEST_F(BlockCacheTest, WriteBackSpillsOnEvictionAndAtShutdown) {
  opt_.memory_capacity_bytes = 32 << 10;
  opt_.max_block_bytes = 16 << 10;
  opt_.write_through = false;
  Open();
  for (uint64_t s = 0; s < 12; ++s) ASSERT_TRUE(Put(s, 0).ok());
  auto st = cache_->Stats();
  EXPECT_GT(st.disk_blocks, 0u);       // spilled by eviction
  EXPECT_LT(st.disk_blocks, 12u);      // the rest is memory-only
  EXPECT_GT(Metric("sparsex_cache_spills_total"), 0);
  cache_.reset();  // clean shutdown writes memory-only blocks
  Open();
  auto st2 = cache_->Stats();
  EXPECT_EQ(st2.disk_blocks, 12u);
  std::vector<BlockKey> keys;
  for (uint64_t s = 0; s < 12; ++s) keys.push_back(SyntheticKey(kSeed, s, 0));
  auto g = cache_->Lease(model_, kKvLayoutVersion, std::span(keys).subspan(0, 3), 0, false);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectLeasedBytes(*g, {{0, 0}, {1, 0}, {2, 0}});
}

#endif  // SPARSEX_WITH_ROCKSDB

#if SPARSEX_WITH_ROCKSDB  // needs a disk tier that outlives the cache object
TEST_F(BlockCacheTest, RestartComesBackWarmAndIntact) {
  opt_.warm_load_bytes = 1 << 20;
  Open();
  std::vector<std::pair<uint64_t, uint32_t>> ids;
  std::vector<BlockKey> keys;
  for (uint64_t s = 0; s < 4; ++s) {
    for (uint32_t l = 0; l < 3; ++l) {
      ASSERT_TRUE(Put(s, l).ok());
      ids.emplace_back(s, l);
      keys.push_back(SyntheticKey(kSeed, s, l));
    }
  }
  cache_.reset();
  std::fill(arena_.begin(), arena_.end(), 0);
  Open();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!cache_->WarmLoadDone() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(cache_->WarmLoadDone());
  auto look = cache_->Lookup(model_, kKvLayoutVersion, keys);
  for (const auto& e : *look) {
    EXPECT_EQ(e.code, StatusCode::kOk);
    EXPECT_EQ(e.tier, Tier::kMemory);  // warm
  }
  auto g = cache_->Lease(model_, kKvLayoutVersion, keys, 0, false);
  ASSERT_TRUE(g.ok());
  ExpectLeasedBytes(*g, ids);
}

#endif  // SPARSEX_WITH_ROCKSDB

#if SPARSEX_WITH_ROCKSDB  // needs a disk tier that outlives the cache object
TEST_F(BlockCacheTest, CorruptRocksDbValueIsAMissAndCounted) {
  Open();
  ASSERT_TRUE(Put(7, 0).ok());
  ASSERT_TRUE(Put(7, 1).ok());
  cache_.reset();
  {
    // Flip one payload byte of layer 0 directly in RocksDB.
    rocksdb::DB* db = nullptr;
    rocksdb::DBOptions dbo;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    ASSERT_TRUE(rocksdb::DB::Open(dbo, opt_.disk_path, cfs, &h, &db).ok());
    const std::string key = EncodeStoreKey(SyntheticKey(kSeed, 7, 0));
    std::string v;
    ASSERT_TRUE(db->Get({}, h[0], key, &v).ok());
    v[kKvBlockHeaderBytes + 100] ^= 0x5a;
    ASSERT_TRUE(db->Put({}, h[0], key, v).ok());
    for (auto* x : h) db->DestroyColumnFamilyHandle(x);
    delete db;
  }
  Open();
  std::vector<BlockKey> keys = {SyntheticKey(kSeed, 7, 0), SyntheticKey(kSeed, 7, 1)};
  auto g = cache_->Lease(model_, kKvLayoutVersion, keys, 0, true);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->blocks[0].code, StatusCode::kNotFound);  // a miss, never served
  EXPECT_EQ(g->blocks[1].code, StatusCode::kOk);
  EXPECT_EQ(Metric("sparsex_cache_corrupt_blocks_total{tier=\"disk\"}"), 1);
  EXPECT_EQ(cache_->Stats().corrupt_blocks, 1u);
  // Dropped everywhere: gone from lookups and from disk.
  auto look = cache_->Lookup(model_, kKvLayoutVersion, keys);
  EXPECT_EQ((*look)[0].code, StatusCode::kNotFound);
  EXPECT_EQ(cache_->Stats().disk_blocks, 1u);
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  // Non-partial lease of a corrupt block: NOT_FOUND as a whole.
  cache_.reset();
  Open();
  EXPECT_EQ(cache_->Lease(model_, kKvLayoutVersion, keys, 0, false).status().code(),
            StatusCode::kNotFound);
}
#endif  // SPARSEX_WITH_ROCKSDB

TEST_F(BlockCacheTest, CorruptMemoryCopyDetectedOnInlineRead) {
  opt_.disk_backend = "none";
  Open();
  ASSERT_TRUE(Put(8, 0).ok());
  BlockKey k = SyntheticKey(kSeed, 8, 0);
  auto g = cache_->Lease(model_, kKvLayoutVersion, {&k, 1}, 0, false);
  ASSERT_TRUE(g.ok());
  arena_[g->blocks[0].offset + 500] ^= 1;  // bit rot in memory
  EXPECT_EQ(cache_->Read(g->id, 0).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  auto look = cache_->Lookup(model_, kKvLayoutVersion, {&k, 1});
  EXPECT_EQ((*look)[0].code, StatusCode::kNotFound);
  EXPECT_EQ(Metric("sparsex_cache_corrupt_blocks_total{tier=\"memory\"}"), 1);
  EXPECT_EQ(cache_->Stats().memory_used_bytes, 0u);
}

// A client's corruption report (Evict with corrupt=true) is a hint. The cache
// verifies its own copy: one that verifies stays (the damage was the client's, or on the
// way, e.g. a stale data-plane endpoint); one that does not is dropped and counted.
TEST_F(BlockCacheTest, CorruptionReportIsAHintVerifiedAgainstTheStoredCopy) {
  Open();
  ASSERT_TRUE(Put(12, 0).ok());
  ASSERT_TRUE(Put(12, 1).ok());
  std::vector<BlockKey> keys = {SyntheticKey(kSeed, 12, 0), SyntheticKey(kSeed, 12, 1)};
  // Both intact: reports refuted, nothing dropped, nothing counted as corrupt.
  auto n = cache_->Evict(keys, false, /*corrupt=*/true);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 0u);
  auto look = cache_->Lookup(model_, kKvLayoutVersion, keys);
  EXPECT_EQ((*look)[0].code, StatusCode::kOk);
  EXPECT_EQ((*look)[1].code, StatusCode::kOk);
  EXPECT_EQ(cache_->Stats().corrupt_blocks, 0u);
  EXPECT_EQ(cache_->Stats().corrupt_reports_refuted, 2u);
  EXPECT_EQ(Metric("sparsex_cache_corrupt_reports_total{verdict=\"refuted\"}"), 2);
  // Layer 1's memory copy really is damaged (held by a lease, as when a reader reports it).
  auto g = cache_->Lease(model_, kKvLayoutVersion, std::span(keys).subspan(1, 1), 0, false);
  ASSERT_TRUE(g.ok());
  arena_[g->blocks[0].offset + 300] ^= 0x10;
  n = cache_->Evict(keys, false, /*corrupt=*/true);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1u);
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  look = cache_->Lookup(model_, kKvLayoutVersion, keys);
  EXPECT_EQ((*look)[0].code, StatusCode::kOk);
  EXPECT_EQ((*look)[1].code, StatusCode::kNotFound);
  EXPECT_EQ(cache_->Stats().corrupt_blocks, 1u);
  EXPECT_EQ(Metric("sparsex_cache_corrupt_blocks_total{tier=\"memory\"}"), 1);
  EXPECT_EQ(Metric("sparsex_cache_corrupt_reports_total{verdict=\"confirmed\"}"), 1);
  EXPECT_EQ(cache_->Stats().disk_blocks, 1u);
}

// A full disk, in-process: a disk tier whose filesystem has less free space than the
// reserve (here: a reserve larger than any disk) is not written; commits succeed in memory
// only, the state is reported, nothing aborts. (The full-disk-and-back cycle on a real small
// filesystem: ServerE2ETest.FullDiskDegradesToMemoryOnlyAndRecovers.)
TEST_F(BlockCacheTest, DiskBelowTheReserveKeepsCommitsInMemoryOnly) {
  opt_.disk_reserve_bytes = uint64_t{1} << 62;
  opt_.disk_recheck_ms = 10;
  Open();
  EXPECT_FALSE(cache_->disk_health().degraded);
  for (uint32_t l = 0; l < 3; ++l) ASSERT_TRUE(Put(13, l).ok()) << l;
  DiskHealth h = cache_->disk_health();
  EXPECT_TRUE(h.degraded);
  EXPECT_EQ(h.status.rfind("disk_full: ", 0), 0u) << h.status;
  CacheStats st = cache_->Stats();
  EXPECT_TRUE(st.disk_degraded);
  EXPECT_EQ(st.memory_only_commits, 3u);
  EXPECT_EQ(st.disk_blocks, 0u);
  EXPECT_EQ(st.memory_blocks, 3u);
  EXPECT_EQ(Metric("sparsex_cache_disk_degraded"), 1);
  EXPECT_GT(Metric("sparsex_cache_disk_free_bytes"), 0);
  cache_->RecheckDisk();  // still no room: stays degraded
  EXPECT_TRUE(cache_->disk_health().degraded);
  std::vector<BlockKey> keys = {SyntheticKey(kSeed, 13, 0), SyntheticKey(kSeed, 13, 1),
                                SyntheticKey(kSeed, 13, 2)};
  auto g = cache_->Lease(model_, kKvLayoutVersion, keys, 0, false);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectLeasedBytes(*g, {{13, 0}, {13, 1}, {13, 2}});
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  // Deleting while degraded is fine too.
  auto n = cache_->Evict(keys, false, false);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 3u);
}

#if SPARSEX_WITH_ROCKSDB
// A full disk: a server restarting on it. Opening RocksDB for writing replays its WAL
// into new files, which on a full disk ends in the packaged RocksDB's abort; the store is
// opened read-only instead (its blocks are served, commits stay in memory) and reopened for
// writing once there is room. On a real small filesystem without root: the body runs in a
// fresh process (death-test child) in user + mount namespaces of its own, with a 32 MiB tmpfs.
namespace disk_full {

#define DF_CHECK(cond)                                                            \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "check failed at line %d: %s\n", __LINE__, #cond);    \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.close();
  return static_cast<bool>(f);
}

// unshare + uid/gid maps + a tmpfs of `size` on `dir`; only in a single-threaded process.
bool MountSmallDisk(const std::string& dir, const std::string& size) {
  const uid_t uid = getuid();
  const gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
  if (!WriteFile("/proc/self/setgroups", "deny") ||
      !WriteFile("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
      !WriteFile("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
    return false;
  }
  return mount("sparsex-test-disk", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
}

void FillUp(const std::string& path) {
  int fd = open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
  std::string chunk(1 << 20, 'f');
  for (size_t n = chunk.size(); fd >= 0 && n >= 4096;) {
    if (write(fd, chunk.data(), n) <= 0) n /= 2;
  }
  if (fd >= 0) close(fd);
}

// A block cache with a RocksDB disk tier on the small disk `disk` (a 4 MiB reserve, rechecked
// every 10 ms), 16 MiB of memory and 1 MiB synthetic blocks: the full-disk tests' setup.
struct SmallDiskCache {
  explicit SmallDiskCache(const std::string& disk) {
    opt.memory_capacity_bytes = 16 << 20;
    opt.max_block_bytes = 2 << 20;
    opt.disk_backend = "rocksdb";
    opt.disk_path = disk + "/db";
    opt.disk_reserve_bytes = 4 << 20;
    opt.disk_recheck_ms = 10;
    opt.warm_load_bytes = 0;
    arena.resize(opt.memory_capacity_bytes);
  }
  absl::StatusOr<std::unique_ptr<BlockCache>> Open(metrics::Registry* reg) {
    return BlockCache::Open(opt, arena.data(), arena.size(), reg);
  }
  // Stores layer 0 of synthetic segment `seg` (memory and disk).
  absl::Status Put(BlockCache& c, uint64_t seg) {
    std::string b = SyntheticBlock(model, kSeed, seg, 0, shape);
    auto r = c.Reserve(model, kKvLayoutVersion, SyntheticKey(kSeed, seg, 0), b.size(), 0);
    if (!r.ok()) return r.status();
    return c.Commit(r->id, KvBlockWireChecksum(KvBlockBytes(b)), KvBlockBytes(b), true);
  }
  CacheOptions opt;
  std::vector<uint8_t> arena;
  const Hash128 model = SyntheticModel(kSeed);
  const SyntheticShape shape{256, 1024, KvDtype::kBF16};  // 1 MiB blocks
};

int RestartOnFullDisk(const std::string& dir) {
  const std::string disk = dir + "/disk";
  DF_CHECK(MountSmallDisk(disk, "32m"));
  SmallDiskCache sdc(disk);
  const Hash128 model = sdc.model;
  const SyntheticShape shape = sdc.shape;
  auto open = [&](metrics::Registry* reg) { return sdc.Open(reg); };
  auto put = [&](BlockCache& c, uint64_t seg) { return sdc.Put(c, seg); };
  {
    metrics::Registry reg;
    auto c = open(&reg);
    DF_CHECK(c.ok());
    for (uint64_t seg = 0; seg < 6; ++seg) DF_CHECK(put(**c, seg).ok());
    DF_CHECK((*c)->Stats().disk_blocks == 6);
  }
  FillUp(disk + "/filler");  // the server is down; the disk fills up
  metrics::Registry reg;
  auto c = open(&reg);  // the restart
  if (!c.ok()) std::fprintf(stderr, "open: %s\n", c.status().ToString().c_str());
  DF_CHECK(c.ok());
  DiskHealth h = (*c)->disk_health();
  DF_CHECK(h.degraded);
  DF_CHECK(h.status.find("read-only") != std::string::npos);
  std::vector<BlockKey> keys;
  for (uint64_t seg = 0; seg < 6; ++seg) keys.push_back(SyntheticKey(kSeed, seg, 0));
  auto g = (*c)->Lease(model, kKvLayoutVersion, keys, 0, false);  // served from disk
  DF_CHECK(g.ok());
  for (uint64_t seg = 0; seg < 6; ++seg) {
    std::string want = SyntheticBlock(model, kSeed, seg, 0, shape);
    DF_CHECK(g->blocks[seg].size == want.size());
    DF_CHECK(std::memcmp(sdc.arena.data() + g->blocks[seg].offset, want.data(), want.size()) == 0);
  }
  DF_CHECK((*c)->ReleaseLease(g->id).ok());
  for (uint64_t seg = 6; seg < 8; ++seg) DF_CHECK(put(**c, seg).ok());  // memory only
  DF_CHECK((*c)->Stats().memory_only_commits == 2);
  DF_CHECK((*c)->Stats().disk_blocks == 6);
  // Room again: reopened for writing, written to again.
  DF_CHECK(std::remove((disk + "/filler").c_str()) == 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((*c)->disk_health().degraded && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  DF_CHECK(!(*c)->disk_health().degraded);
  for (uint64_t seg = 8; seg < 10; ++seg) DF_CHECK(put(**c, seg).ok());
  DF_CHECK((*c)->Stats().disk_blocks == 8);
  c->reset();  // clean shutdown writes the two memory-only blocks
  metrics::Registry reg2;
  auto c2 = open(&reg2);
  DF_CHECK(c2.ok());
  DF_CHECK(!(*c2)->disk_health().degraded);
  DF_CHECK((*c2)->Stats().disk_blocks == 10);
  std::fprintf(stderr, "RESTART_ON_FULL_DISK_PASSED\n");
  return 0;
}

// A full disk, the abort left after the reserve: RocksDB's info log. RocksDB writes its LOG by
// itself (every 10 s, and on the next line 5 s after the last write), outside the reserve's
// checks. With RocksDB's default logger, one such write failing on a full disk made the next
// line logged (DB::Resume's "Resuming DB", i.e. the disk tier's recovery) abort the process on
// `sync_without_flush_called_`. Here the store's Recover() (which logs through DB::Resume) runs
// on a disk full to the last page for more than those 5 s, then again with room.
int InfoLogOnFullDisk(const std::string& dir) {
  const std::string disk = dir + "/disk";
  DF_CHECK(MountSmallDisk(disk, "16m"));
  DiskStoreOptions o;
  o.path = disk + "/db";
  o.write_buffer_bytes = 1 << 20;
  auto opened = OpenDiskStore(o);
  if (!opened.ok()) std::fprintf(stderr, "open: %s\n", opened.status().ToString().c_str());
  DF_CHECK(opened.ok() && *opened != nullptr);
  DiskStore& store = **opened;
  const Hash128 model = SyntheticModel(kSeed);
  SyntheticShape shape{16, 256, KvDtype::kBF16};
  auto put = [&](uint64_t seg) {
    std::string b = SyntheticBlock(model, kSeed, seg, 0, shape);
    DiskMeta m;
    m.size = b.size();
    m.model_fp = model;
    m.layout_version = kKvLayoutVersion;
    return store.Put(SyntheticKey(kSeed, seg, 0), m,
                     {reinterpret_cast<const uint8_t*>(b.data()), b.size()});
  };
  for (uint64_t seg = 0; seg < 8; ++seg) DF_CHECK(put(seg).ok());
  FillUp(disk + "/filler");
  struct statvfs v{};
  DF_CHECK(statvfs(disk.c_str(), &v) == 0 && v.f_bavail == 0);
  // Each call logs a line; past 5 s since the last write the logger writes, which fails.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(6500);
  while (std::chrono::steady_clock::now() < until) {
    (void)store.Recover();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  DF_CHECK(std::remove((disk + "/filler").c_str()) == 0);
  DF_CHECK(store.Recover().ok());  // the line that aborted
  DF_CHECK(put(8).ok());
  std::string want = SyntheticBlock(model, kSeed, 8, 0, shape);
  std::vector<uint8_t> got(want.size());
  DF_CHECK(store.Read(SyntheticKey(kSeed, 8, 0), got).ok());
  DF_CHECK(std::memcmp(got.data(), want.data(), want.size()) == 0);
  opened->reset();  // a clean close
  std::fprintf(stderr, "INFO_LOG_ON_FULL_DISK_PASSED\n");
  return 0;
}

// A delete while the disk tier is degraded (the disk may be full to the last byte, and a delete
// appends to RocksDB's WAL too) is queued and runs when the disk is writable again: the evicted
// block is gone from the disk after a restart, the others and the memory-only one are there.
int EvictWhileFull(const std::string& dir) {
  const std::string disk = dir + "/disk";
  DF_CHECK(MountSmallDisk(disk, "32m"));
  SmallDiskCache sdc(disk);
  const Hash128 model = sdc.model;
  auto open = [&](metrics::Registry* reg) { return sdc.Open(reg); };
  auto put = [&](BlockCache& c, uint64_t seg) { return sdc.Put(c, seg); };
  {
    metrics::Registry reg;
    auto c = open(&reg);
    DF_CHECK(c.ok());
    for (uint64_t seg = 0; seg < 4; ++seg) DF_CHECK(put(**c, seg).ok());
    DF_CHECK((*c)->Stats().disk_blocks == 4);
    FillUp(disk + "/filler");
    DF_CHECK(put(**c, 4).ok());  // memory only: degraded
    DF_CHECK((*c)->disk_health().degraded);
    const BlockKey gone = SyntheticKey(kSeed, 0, 0);
    auto n = (*c)->Evict({&gone, 1}, false, false);
    DF_CHECK(n.ok() && *n == 1);
    DF_CHECK((*c)->Stats().disk_blocks == 3);
    DF_CHECK(std::remove((disk + "/filler").c_str()) == 0);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((*c)->disk_health().degraded && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    DF_CHECK(!(*c)->disk_health().degraded);
  }  // a clean close writes block 4
  metrics::Registry reg;
  auto c = open(&reg);
  DF_CHECK(c.ok());
  DF_CHECK((*c)->Stats().disk_blocks == 4);
  std::vector<BlockKey> keys;
  for (uint64_t seg = 0; seg < 5; ++seg) keys.push_back(SyntheticKey(kSeed, seg, 0));
  auto look = (*c)->Lookup(model, kKvLayoutVersion, keys);
  DF_CHECK(look.ok());
  DF_CHECK((*look)[0].code == StatusCode::kNotFound);
  for (uint64_t seg = 1; seg < 5; ++seg) DF_CHECK((*look)[seg].code == StatusCode::kOk);
  std::fprintf(stderr, "EVICT_WHILE_FULL_PASSED\n");
  return 0;
}

}  // namespace disk_full

// Runs `body(dir)` in a death-test child (fresh single-threaded process: unshare needs it) and
// expects it to print `marker` and exit 0; skips where user + mount namespaces are off.
void RunInSmallDiskChild(const char* prefix, int (*body)(const std::string&),
                         const char* marker) {
  const std::string dir = testing::MakeTempDir(prefix);
  ASSERT_FALSE(dir.empty());
  std::filesystem::create_directories(dir + "/disk");
  auto probe = testing::RunCommand(
      "unshare -rm sh -c 'mount -t tmpfs -o size=1m none " + dir + "/disk' 2>&1",
      std::chrono::seconds(20));
  if (!probe.ok() || probe->first != 0) {
    testing::RemoveTree(dir);
    GTEST_SKIP() << "needs unprivileged user + mount namespaces for a small tmpfs";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto child = [&] {
    const int rc = body(dir);
    umount2((dir + "/disk").c_str(), MNT_DETACH);
    testing::RemoveTree(dir);
    std::exit(rc);
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), marker);
  testing::RemoveTree(dir);
}

TEST(BlockCacheDiskFullTest, RocksDbInfoLogOnAFullDiskNeverAborts) {
  RunInSmallDiskChild("sparsex-disk-log-", disk_full::InfoLogOnFullDisk,
                      "INFO_LOG_ON_FULL_DISK_PASSED");
}

TEST(BlockCacheDiskFullTest, DeletesWhileDegradedAreQueuedAndRunAtRecovery) {
  RunInSmallDiskChild("sparsex-disk-evict-", disk_full::EvictWhileFull,
                      "EVICT_WHILE_FULL_PASSED");
}

TEST(BlockCacheDiskFullTest, RestartOnAFullDiskServesReadOnlyAndRecovers) {
  const std::string dir = testing::MakeTempDir("sparsex-disk-full-");
  ASSERT_FALSE(dir.empty());
  std::filesystem::create_directories(dir + "/disk");
  auto probe = testing::RunCommand(
      "unshare -rm sh -c 'mount -t tmpfs -o size=1m none " + dir + "/disk' 2>&1",
      std::chrono::seconds(20));
  if (!probe.ok() || probe->first != 0) {
    testing::RemoveTree(dir);
    GTEST_SKIP() << "needs unprivileged user + mount namespaces for a small tmpfs";
  }
  // A fresh process: unshare needs a single thread (RocksDB's pools may run here already).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // (The child re-runs this function, so `dir` there is the child's own: it cleans it up.)
  auto child = [&] {
    const int rc = disk_full::RestartOnFullDisk(dir);
    umount2((dir + "/disk").c_str(), MNT_DETACH);
    testing::RemoveTree(dir);
    std::exit(rc);
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "RESTART_ON_FULL_DISK_PASSED");
  testing::RemoveTree(dir);
}
#endif  // SPARSEX_WITH_ROCKSDB

TEST_F(BlockCacheTest, EvictRemovesFromAllTiersAndDefersLeased) {
  Open();
  ASSERT_TRUE(Put(9, 0).ok());
  ASSERT_TRUE(Put(9, 1).ok());
  std::vector<BlockKey> keys = {SyntheticKey(kSeed, 9, 0), SyntheticKey(kSeed, 9, 1)};
  auto g = cache_->Lease(model_, kKvLayoutVersion, std::span(keys).subspan(1, 1), 0, false);
  ASSERT_TRUE(g.ok());
  auto n = cache_->Evict(keys, false, false);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  auto look = cache_->Lookup(model_, kKvLayoutVersion, keys);
  EXPECT_EQ((*look)[0].code, StatusCode::kNotFound);
  EXPECT_EQ((*look)[1].code, StatusCode::kNotFound);  // invisible at once
  ExpectLeasedBytes(*g, {{9, 1}});                    // but the reader's bytes stay
  EXPECT_EQ(cache_->Stats().disk_blocks, 1u);
  EXPECT_TRUE(cache_->ReleaseLease(g->id).ok());
  EXPECT_EQ(cache_->Stats().disk_blocks, 0u);
  EXPECT_EQ(cache_->Stats().memory_used_bytes, 0u);
  ASSERT_TRUE(Put(9, 0).ok());
  auto all = cache_->Evict({}, true, false);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, 1u);
}

TEST_F(BlockCacheTest, CostAwareEvictionKeepsExpensiveBlocks) {
  opt_.memory_capacity_bytes = 48 << 10;
  opt_.max_block_bytes = 16 << 10;
  opt_.eviction = EvictionPolicyKind::kCostAware;
  opt_.disk_backend = "memory";
  Open();
  ASSERT_TRUE(Put(1, 0, 16, /*cost=*/1000.0).ok());  // expensive
  for (uint64_t s = 2; s < 20; ++s) ASSERT_TRUE(Put(s, 0, 16, 1.0).ok());
  BlockKey k = SyntheticKey(kSeed, 1, 0);
  auto look = cache_->Lookup(model_, kKvLayoutVersion, {&k, 1});
  EXPECT_EQ((*look)[0].tier, Tier::kMemory);  // LRU would have evicted it first
  EXPECT_GT(cache_->Stats().evictions, 0u);
}

TEST_F(BlockCacheTest, ConcurrentClientsThreads) {
  opt_.memory_capacity_bytes = 256 << 10;
  Open();
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 50; ++i) {
        const uint64_t seg = 1000 + t * 100 + i;
        if (!Put(seg, 0).ok()) errors++;
        BlockKey k = SyntheticKey(kSeed, seg, 0);
        auto g = cache_->Lease(model_, kKvLayoutVersion, {&k, 1}, 0, false);
        if (!g.ok()) {
          errors++;
          continue;
        }
        auto r = cache_->Read(g->id, 0);
        if (!r.ok() || *r != Block(seg, 0)) errors++;
        if (!cache_->ReleaseLease(g->id).ok()) errors++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(cache_->Stats().disk_blocks, 200u);
}

}  // namespace
}  // namespace sparsex::cache

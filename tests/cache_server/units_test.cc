// Small pieces of the cache server: arena allocator, eviction policies, keys, rendezvous.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "cache_server/arena_allocator.h"
#include "cache_client/block_key.h"
#include "cache_client/cluster_client.h"
#include "cache_server/disk_store.h"
#include "cache_server/eviction.h"
#include "cache_server/synthetic.h"

namespace sparsex::cache {
namespace {

TEST(ArenaAllocatorTest, AllocatesAlignedAndCoalesces) {
  ArenaAllocator a(4096, 256);
  auto x = a.Allocate(100);
  auto y = a.Allocate(300);
  auto z = a.Allocate(256);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x % 256, 0u);
  EXPECT_EQ(*y % 256, 0u);
  EXPECT_EQ(a.used(), 256u + 512 + 256);
  a.Free(*y, 300);
  a.Free(*x, 100);
  a.Free(*z, 256);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.largest_free(), 4096u);
  EXPECT_FALSE(a.Allocate(4097));
  EXPECT_TRUE(a.Allocate(4096));
  EXPECT_FALSE(a.Allocate(1));
}

TEST(ArenaAllocatorTest, RandomizedNoOverlap) {
  ArenaAllocator a(1 << 20, 64);
  std::mt19937_64 rng(1);
  std::map<uint64_t, uint64_t> live;  // offset -> size
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 2 == 0) {
      uint64_t size = 1 + rng() % 20000;
      auto off = a.Allocate(size);
      if (!off) continue;
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + a.Rounded(size), next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + a.Rounded(prev->second), *off);
      }
      live[*off] = size;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      a.Free(it->first, it->second);
      live.erase(it);
    }
  }
  for (auto& [o, s] : live) a.Free(o, s);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_ranges(), 1u);
}

BlockKey K(uint64_t i) { return SyntheticKey(1, i, 0); }

std::vector<BlockKey> Order(EvictionPolicy& p) {
  std::vector<BlockKey> v;
  p.ForEachCandidate([&](const BlockKey& k) {
    v.push_back(k);
    return false;
  });
  return v;
}

TEST(EvictionTest, LruOrder) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kLru);
  for (uint64_t i = 0; i < 4; ++i) p->Insert(K(i), 100, 1);
  p->Touch(K(0));
  EXPECT_EQ(Order(*p), (std::vector<BlockKey>{K(1), K(2), K(3), K(0)}));
  p->Erase(K(2), true);
  EXPECT_EQ(Order(*p), (std::vector<BlockKey>{K(1), K(3), K(0)}));
  // The visitor may erase the visited key.
  p->ForEachCandidate([&](const BlockKey& k) {
    p->Erase(k, true);
    return false;
  });
  EXPECT_EQ(p->size(), 0u);
}

TEST(EvictionTest, CostAwarePrefersCheapPerByte) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kCostAware);
  p->Insert(K(0), 1000, 100);  // 0.1 per byte
  p->Insert(K(1), 1000, 1);    // 0.001 per byte: first to go
  p->Insert(K(2), 10, 1);      // 0.1 per byte
  auto o = Order(*p);
  EXPECT_EQ(o[0], K(1));
  // Aging: after evicting, fresh cheap blocks still rank above long-idle ones eventually.
  p->Erase(K(1), true);
  p->Insert(K(3), 1000, 1);
  EXPECT_EQ(Order(*p)[0], K(3));
}

TEST(BlockKeyTest, StoreKeyRoundTripAndOrder) {
  BlockKey a{{1, 2}, 0, 1}, b{{1, 2}, 1, 2}, c{{1, 3}, 0, 1};
  EXPECT_EQ(*DecodeStoreKey(EncodeStoreKey(b)), b);
  EXPECT_LT(EncodeStoreKey(a), EncodeStoreKey(b));  // layers of a segment are adjacent
  EXPECT_LT(EncodeStoreKey(b), EncodeStoreKey(c));
  EXPECT_EQ(DecodeFingerprint("short").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*DecodeFingerprint(EncodeFingerprint({7, 9})), (Hash128{7, 9}));
  EXPECT_EQ(ValidateBlockKey({{1, 1}, 3, 3}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(DiskMetaTest, RoundTrip) {
  DiskMeta m{12345, 0xdeadbeef, 2.5, {3, 4}, 1, 1700000000000ull};
  EXPECT_EQ(*DecodeDiskMeta(EncodeDiskMeta(m)), m);
  EXPECT_EQ(DecodeDiskMeta("x").status().code(), absl::StatusCode::kDataLoss);
}

TEST(RendezvousTest, DeterministicBalancedAndStable) {
  std::vector<std::string> m = {"10.0.0.1:5000", "10.0.0.2:5000", "10.0.0.3:5000",
                                "10.0.0.4:5000"};
  // Fixed value: the same in every process and on every machine.
  EXPECT_EQ(RendezvousOrder(SyntheticSegment(1, 0), m), RendezvousOrder(SyntheticSegment(1, 0), m));
  std::map<size_t, int> count;
  std::vector<size_t> owner(4000);
  for (uint64_t s = 0; s < owner.size(); ++s) {
    owner[s] = RendezvousOrder(SyntheticSegment(1, s), m)[0];
    count[owner[s]]++;
  }
  for (auto& [i, n] : count) EXPECT_NEAR(n, 1000, 150) << i;
  // Removing member 3 moves only the segments it owned.
  std::vector<std::string> m3(m.begin(), m.begin() + 3);
  int moved = 0;
  for (uint64_t s = 0; s < owner.size(); ++s) {
    size_t o = RendezvousOrder(SyntheticSegment(1, s), m3)[0];
    if (owner[s] != 3) {
      EXPECT_EQ(o, owner[s]);
    } else {
      ++moved;
    }
  }
  EXPECT_EQ(moved, count[3]);
  // Replicas are distinct members.
  auto order = RendezvousOrder(SyntheticSegment(1, 5), m);
  EXPECT_EQ(std::set<size_t>(order.begin(), order.end()).size(), 4u);
}

TEST(RendezvousTest, KnownValue) {
  // Pinned so that an accidental change of the hash (which would silently move every segment
  // of a running cluster) fails here.
  std::vector<std::string> m = {"a:1", "b:2", "c:3"};
  auto o = RendezvousOrder(Hash128{1, 2}, m);
  EXPECT_EQ(o, (std::vector<size_t>{1, 2, 0}));
  EXPECT_EQ(RendezvousWeight(Hash128{1, 2}, "a:1"), 7276596834120765290ull);
}

}  // namespace
}  // namespace sparsex::cache

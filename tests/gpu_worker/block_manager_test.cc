#include "gpu_worker/kv/block_manager.h"

#include <numeric>

#include "gtest/gtest.h"

namespace sparsex {
namespace {

Hash128 Fp() { return HashBytes128("model", 5); }

std::vector<int32_t> Tokens(int n, int start = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(BlockManager, HashesAreChainedDeterministicAndSalted) {
  BlockManager a({.block_size = 4, .num_blocks = 8}, Fp());
  BlockManager b({.block_size = 4, .num_blocks = 8}, Fp());
  BlockManager other({.block_size = 4, .num_blocks = 8}, HashBytes128("other", 5));
  auto t = Tokens(10);
  auto ha = a.BlockHashes(t);
  ASSERT_EQ(ha.size(), 2u);  // partial trailing block is not hashed
  EXPECT_EQ(ha, b.BlockHashes(t));
  EXPECT_NE(ha[0], other.BlockHashes(t)[0]);
  // Same second block after a different first block: different hash (chaining).
  auto t2 = t;
  t2[0] = 99;
  EXPECT_NE(a.BlockHashes(t2)[1], ha[1]);
  // A value pinned across processes and machines: catches any accidental seeding.
  EXPECT_EQ(ha[0].Hex(), BlockManager({.block_size = 4, .num_blocks = 1}, Fp()).BlockHashes(t)[0].Hex());
}

TEST(BlockManager, PrefixReuseAndRefcounts) {
  BlockManager bm({.block_size = 4, .num_blocks = 8}, Fp());
  auto t = Tokens(12);
  auto hashes = bm.BlockHashes(t);
  auto blocks = bm.AllocateN(3);
  ASSERT_TRUE(blocks.ok());
  for (int i = 0; i < 3; ++i) bm.Register((*blocks)[i], hashes[i]);
  PrefixMatch m = bm.MatchPrefix(t);
  EXPECT_EQ(m.blocks, *blocks);  // shared, refcount 2 now
  bm.ReleaseAll(*blocks);
  EXPECT_EQ(bm.cached(), 0);  // still referenced by m
  bm.ReleaseAll(m.blocks);
  EXPECT_EQ(bm.cached(), 3);
  EXPECT_EQ(bm.available(), 8);
  // A diverging prompt matches only the common leading blocks.
  auto t2 = t;
  t2[5] = 1000;
  PrefixMatch m2 = bm.MatchPrefix(t2);
  EXPECT_EQ(m2.blocks.size(), 1u);
  bm.ReleaseAll(m2.blocks);
}

// Reuse-computed KV lives in its own namespace: exact lookups never match it, approximate ones
// continue into it after the exact blocks (and never back out of it).
TEST(BlockManager, ApproximateBlocksAreOnlyMatchedWhenAllowed) {
  BlockManager bm({.block_size = 4, .num_blocks = 8}, Fp());
  auto t = Tokens(16);
  auto exact = bm.BlockHashes(t);
  auto approx = bm.BlockHashes(t, /*approx_from=*/1);
  ASSERT_EQ(approx.size(), 4u);
  EXPECT_EQ(approx[0], exact[0]);
  for (int i = 1; i < 4; ++i) EXPECT_NE(approx[i], exact[i]) << i;
  auto blocks = bm.AllocateN(3);
  ASSERT_TRUE(blocks.ok());
  for (int i = 0; i < 3; ++i) bm.Register((*blocks)[i], approx[i]);
  PrefixMatch plain = bm.MatchPrefix(t);
  EXPECT_EQ(plain.blocks.size(), 1u);  // the exact block only
  EXPECT_EQ(plain.exact_blocks, 1);
  bm.ReleaseAll(plain.blocks);
  PrefixMatch m = bm.MatchPrefix(t, /*allow_approximate=*/true);
  EXPECT_EQ(m.blocks, *blocks);
  EXPECT_EQ(m.exact_blocks, 1);
  bm.ReleaseAll(m.blocks);
  // A chain that is approximate from block 0 on.
  auto t2 = Tokens(8, 100);
  auto a2 = bm.BlockHashes(t2, 0);
  EXPECT_NE(a2[0], bm.BlockHashes(t2)[0]);
  bm.ReleaseAll(*blocks);
}

TEST(BlockManager, LruEvictionOfUnreferencedCachedBlocks) {
  BlockManager bm({.block_size = 2, .num_blocks = 3}, Fp());
  auto t = Tokens(6);
  auto hashes = bm.BlockHashes(t);
  auto blocks = *bm.AllocateN(3);
  for (int i = 0; i < 3; ++i) bm.Register(blocks[i], hashes[i]);
  bm.ReleaseAll(blocks);  // tail released first: evicted first
  auto nb = bm.Allocate();
  ASSERT_TRUE(nb.ok());
  EXPECT_EQ(*nb, blocks[2]);
  EXPECT_EQ(bm.stats().evictions, 1);
  PrefixMatch m = bm.MatchPrefix(t);
  EXPECT_EQ(m.blocks.size(), 2u);  // the first two survive
  bm.ReleaseAll(m.blocks);
  bm.Release(*nb);
}

TEST(BlockManager, EventHookFollowsRegistrationAndEviction) {
  BlockManager bm({.block_size = 2, .num_blocks = 2}, Fp());
  std::vector<std::pair<Hash128, bool>> ev;
  bm.SetEventHook([&](const Hash128& h, bool stored) { ev.emplace_back(h, stored); });
  auto t = Tokens(4);
  auto hashes = bm.BlockHashes(t);
  auto blocks = *bm.AllocateN(2);
  bm.Register(blocks[0], hashes[0]);
  bm.Register(blocks[1], hashes[1]);
  bm.Register(blocks[1], hashes[1]);  // idempotent: no second event
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0], std::make_pair(hashes[0], true));
  bm.ReleaseAll(blocks);
  auto b = bm.Allocate();  // evicts the tail block (LRU)
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[2], std::make_pair(hashes[1], false));
  bm.Release(*b);
  bm.ClearCached();
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[3], std::make_pair(hashes[0], false));
}

TEST(BlockManager, ExhaustionIsAClearError) {
  BlockManager bm({.block_size = 16, .num_blocks = 2}, Fp());
  auto a = bm.AllocateN(2);
  ASSERT_TRUE(a.ok());
  auto b = bm.Allocate();
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("exhausted"), std::string::npos);
  auto c = bm.AllocateN(1);
  EXPECT_FALSE(c.ok());
  bm.ReleaseAll(*a);
  EXPECT_TRUE(bm.AllocateN(2).ok());
}

}  // namespace
}  // namespace sparsex

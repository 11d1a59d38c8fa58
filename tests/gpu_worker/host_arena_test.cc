#include "gpu_worker/reuse/host_arena.h"

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace sparsex {
namespace {

constexpr size_t A = HostArena::kAlign;

TEST(HostArena, HandsOutAlignedDisjointRangesAndMergesFreedOnes) {
  std::vector<uint8_t> mem(10 * A + 100);  // the tail beyond whole pages is not used
  HostArena a(mem.data(), mem.size());
  EXPECT_EQ(a.capacity(), 10 * A);
  uint8_t* p = a.Allocate(1);
  uint8_t* q = a.Allocate(3 * A);
  uint8_t* r = a.Allocate(A + 1);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(q, nullptr);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(a.used(), 6 * A);  // 1, 3 and 2 pages
  for (uint8_t* x : {p, q, r}) EXPECT_EQ((x - mem.data()) % A, 0u);
  EXPECT_EQ(a.Allocate(5 * A), nullptr);  // 4 pages left
  EXPECT_EQ(a.Allocate(0), nullptr);
  EXPECT_EQ(a.Allocate(11 * A), nullptr);
  // Freed neighbours merge: p and q together hold 4 pages, then with the tail 8.
  a.Free(p);
  a.Free(q);
  uint8_t* big = a.Allocate(4 * A);
  EXPECT_EQ(big, p);
  a.Free(big);
  a.Free(r);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.Allocate(10 * A), mem.data());
}

TEST(HostArena, ConcurrentAllocationsNeverOverlap) {
  std::vector<uint8_t> mem(256 * A);
  HostArena a(mem.data(), mem.size());
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<uint8_t*, size_t>> held;
      for (int i = 0; i < 2000; ++i) {
        if (!held.empty() && (rng() % 2 == 0 || held.size() > 8)) {
          auto [p, n] = held.back();
          held.pop_back();
          // Nobody else wrote into the range while it was ours.
          for (size_t k = 0; k < n; k += 97) ASSERT_EQ(p[k], static_cast<uint8_t>(t + 1));
          a.Free(p);
          continue;
        }
        const size_t n = 1 + rng() % (5 * A);
        if (uint8_t* p = a.Allocate(n)) {
          std::fill(p, p + n, static_cast<uint8_t>(t + 1));
          held.emplace_back(p, n);
        }
      }
      for (auto [p, n] : held) a.Free(p);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.Allocate(256 * A), mem.data());
}

}  // namespace
}  // namespace sparsex

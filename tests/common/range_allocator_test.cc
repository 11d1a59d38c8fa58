#include "common/range_allocator.h"

#include "gtest/gtest.h"

namespace sparsex {
namespace {

// First fit, free neighbours merge, and a range given back twice (or never taken) is refused.
TEST(RangeAllocator, FirstFitMergesAndRefusesUnknownRanges) {
  RangeAllocator r;
  r.Reset(100);
  EXPECT_EQ(r.Take(10), 0u);
  EXPECT_EQ(r.Take(30), 10u);
  EXPECT_EQ(r.Take(20), 40u);
  EXPECT_EQ(r.live(), 3u);
  EXPECT_EQ(r.Take(41), std::nullopt);  // 40 left
  EXPECT_EQ(r.Give(10), 30u);
  EXPECT_EQ(r.Give(10), 0u);  // twice
  EXPECT_EQ(r.Give(5), 0u);   // never taken
  EXPECT_EQ(r.Take(25), 10u);  // first fit: the hole
  EXPECT_EQ(r.Give(0), 10u);
  EXPECT_EQ(r.Give(10), 25u);
  EXPECT_EQ(r.Take(40), 0u);  // [0, 10) and [10, 40) merged
  EXPECT_EQ(r.Give(0), 40u);
  EXPECT_EQ(r.Give(40), 20u);
  EXPECT_EQ(r.live(), 0u);
  EXPECT_EQ(r.Take(100), 0u);  // all merged again
  r.Reset(0);
  EXPECT_EQ(r.Take(1), std::nullopt);
}

}  // namespace
}  // namespace sparsex

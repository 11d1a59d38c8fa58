// DeviceSegmentTier's residency as other threads see it (Resident): what the worker consults
// before a cache-cluster fetch, so it must follow inserts and LRU evictions exactly.
#include "gpu_worker/reuse/device_tier.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace sparsex {
namespace {

SegmentKv Kv(int n_tokens, float v) {
  SegmentKv kv;
  kv.n_tokens = n_tokens;
  kv.n_layers = 2;
  kv.kv_dim = 8;
  for (int l = 0; l < 2; ++l) {
    kv.k.emplace_back(static_cast<size_t>(n_tokens) * 8, v);
    kv.v.emplace_back(static_cast<size_t>(n_tokens) * 8, -v);
  }
  return kv;
}

TEST(DeviceSegmentTier, ResidentFollowsInsertsAndEvictions) {
  auto be = CreateBackend({.kind = "cpu"});
  ASSERT_TRUE(be.ok()) << be.status();
  const size_t one = 2 * 2 * 20 * 8 * sizeof(float);  // K+V of 2 layers, 20 tokens, fp32
  DeviceSegmentTier tier(be->get(), 2 * one);
  const Hash128 a{1, 1}, b{1, 2}, c{1, 3};
  EXPECT_FALSE(tier.Resident(a));
  ASSERT_TRUE(tier.Upload(a, Kv(20, 1)).ok());
  ASSERT_TRUE(tier.Upload(b, Kv(20, 2)).ok());
  EXPECT_TRUE(tier.Resident(a));
  EXPECT_TRUE(tier.Resident(b));
  ASSERT_NE(tier.Get(a), nullptr);  // a becomes most recently used
  ASSERT_TRUE(tier.Upload(c, Kv(20, 3)).ok());  // evicts b
  EXPECT_TRUE(tier.Resident(a));
  EXPECT_FALSE(tier.Resident(b));
  EXPECT_TRUE(tier.Resident(c));
  EXPECT_EQ(tier.Resident(b), tier.Peek(b) != nullptr);

  // Readers on other threads while the owner inserts and evicts (TSan checks the locking).
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) (void)tier.Resident(a);
  });
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(tier.Upload(Hash128{2, static_cast<uint64_t>(i)}, Kv(20, 4)).ok());
  }
  done.store(true);
  reader.join();
  EXPECT_FALSE(tier.Resident(a));  // evicted by the later uploads
}

}  // namespace
}  // namespace sparsex

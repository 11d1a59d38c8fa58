// Cache events: sequence numbers, resume from a seq, snapshot fallback, eviction reconcile.
#include "gpu_worker/service/event_log.h"

#include "gtest/gtest.h"

namespace sparsex::service {
namespace {

using namespace std::chrono_literals;

Hash128 H(uint64_t i) { return Hash128{i, ~i}; }

SegmentKv Kv(int n_tokens) {
  SegmentKv kv;
  kv.n_tokens = n_tokens;
  kv.n_layers = 1;
  kv.kv_dim = 4;
  kv.k.assign(1, std::vector<float>(n_tokens * 4, 1.0f));
  kv.v.assign(1, std::vector<float>(n_tokens * 4, 2.0f));
  return kv;
}

TEST(CacheEventLogTest, SequenceNumbersAndResume) {
  CacheEventLog log("inst", 16);
  log.Stored(H(1), 10);
  log.Stored(H(1), 10);  // idempotent
  log.Stored(H(2), 20);
  log.Removed(H(1));
  log.Removed(H(7));  // unknown: nothing
  EXPECT_EQ(log.last_seq(), 3u);
  std::vector<CacheEventRecord> ev;
  ASSERT_TRUE(log.WaitAfter(1, 0ms, &ev));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].seq, 2u);
  EXPECT_EQ(ev[0].fp, H(2));
  EXPECT_EQ(ev[1].kind, EventKind::kRemoved);
  ev.clear();
  EXPECT_TRUE(log.WaitAfter(3, 10ms, &ev));  // nothing new: times out, still resumable
  EXPECT_TRUE(ev.empty());
  EXPECT_FALSE(log.WaitAfter(99, 0ms, &ev));  // from the future (another instance)
  uint64_t seq = 0;
  auto snap = log.Snapshot(&seq);
  EXPECT_EQ(seq, 3u);
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(snap[0].fp, H(2));
  EXPECT_EQ(snap[0].num_tokens, 20);
}

TEST(CacheEventLogTest, OverflowedBufferNeedsSnapshot) {
  CacheEventLog log("inst", 16);
  for (uint64_t i = 0; i < 40; ++i) log.Stored(H(i), 1);
  std::vector<CacheEventRecord> ev;
  EXPECT_FALSE(log.WaitAfter(2, 0ms, &ev));  // events 3.. were dropped from the buffer
  EXPECT_TRUE(log.WaitAfter(30, 0ms, &ev));
  EXPECT_EQ(ev.size(), 10u);
  log.Cleared();
  uint64_t seq = 0;
  EXPECT_TRUE(log.Snapshot(&seq).empty());
  EXPECT_EQ(seq, 41u);
}

TEST(CacheEventLogTest, ReconcileReportsEvictions) {
  SegmentStore store({.capacity_bytes = Kv(8).bytes() * 2 + 64});
  CacheEventLog log("inst");
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(store.Put(H(i), Kv(8)).ok());
    log.Stored(H(i), 8);
    log.Reconcile(store);
  }
  // Capacity holds two: H(0) was evicted by the third put.
  uint64_t seq = 0;
  auto snap = log.Snapshot(&seq);
  EXPECT_EQ(snap.size(), 2u);
  std::vector<CacheEventRecord> ev;
  ASSERT_TRUE(log.WaitAfter(0, 0ms, &ev));
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[3].kind, EventKind::kRemoved);
  EXPECT_EQ(ev[3].fp, H(0));
}

}  // namespace
}  // namespace sparsex::service

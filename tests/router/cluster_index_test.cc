// The router's cluster index (event application, gaps, snapshots) and the routing policy:
// affinity to the worker holding the segments, load awareness, no pile-up under skew, load
// shedding when every worker is saturated.
#include "router/cluster_index.h"

#include <map>

#include "gtest/gtest.h"

namespace sparsex::router {
namespace {

Hash128 H(uint64_t i) { return Hash128{i, i * 7 + 1}; }

TEST(ClusterIndexTest, EventsInOrderGapsAndSnapshots) {
  ClusterIndex idx;
  std::vector<IndexEntry> snap = {{H(1), 100}, {H(2), 50}};
  idx.ApplySnapshot("w", "i1", 5, snap);
  std::vector<IndexEntry> q = {{H(1), 100}, {H(2), 50}, {H(3), 30}};
  EXPECT_EQ(idx.ReusableTokens("w", q), 150);
  using K = ClusterIndex::EventKind;
  EXPECT_TRUE(idx.ApplyEvent("w", "i1", 6, K::kStored, H(3), 30));
  EXPECT_EQ(idx.ReusableTokens("w", q), 180);
  EXPECT_TRUE(idx.ApplyEvent("w", "i1", 6, K::kStored, H(3), 30));   // duplicate: ignored
  EXPECT_FALSE(idx.ApplyEvent("w", "i1", 8, K::kRemoved, H(1), 0));  // gap: needs a snapshot
  EXPECT_EQ(idx.ReusableTokens("w", q), 180);
  EXPECT_FALSE(idx.ApplyEvent("w", "i2", 7, K::kRemoved, H(1), 0));  // restarted worker
  EXPECT_TRUE(idx.ApplyEvent("w", "i1", 7, K::kRemoved, H(1), 0));
  EXPECT_EQ(idx.ReusableTokens("w", q), 80);
  EXPECT_TRUE(idx.ApplyEvent("w", "i1", 8, K::kCleared, Hash128{}, 0));
  EXPECT_EQ(idx.ReusableTokens("w", q), 0);
  EXPECT_EQ(idx.LastSeq("w"), 8u);
  idx.ApplySnapshot("w", "i2", 1, snap);  // after a restart: replaced wholesale
  EXPECT_EQ(idx.Instance("w"), "i2");
  EXPECT_EQ(idx.ReusableTokens("w", q), 150);
  idx.RemoveWorker("w");
  EXPECT_EQ(idx.ReusableTokens("w", q), 0);
}

TEST(ClusterIndexTest, PrefixBlocksAreIndexedApartFromSegments) {
  ClusterIndex idx;
  const Hash128 seg = HashBytes128("seg", 3), blk = HashBytes128("blk", 3);
  idx.ApplySnapshot("w", "i", 0, std::vector<IndexEntry>{{seg, 40, false}});
  ASSERT_TRUE(idx.ApplyEvent("w", "i", 1, ClusterIndex::EventKind::kStored, blk, 16, true));
  EXPECT_EQ(idx.Segments("w"), 1u);  // blocks are not segments
  std::vector<IndexEntry> want = {{seg, 40, false}, {blk, 16, true}, {blk, 16, false}};
  EXPECT_EQ(idx.ReusableTokens("w", want), 56);  // the same hash as a segment is not held
  ASSERT_TRUE(idx.ApplyEvent("w", "i", 2, ClusterIndex::EventKind::kRemoved, blk, 16, true));
  EXPECT_EQ(idx.ReusableTokens("w", want), 40);
}

TEST(RoutingTest, PrefersTheWorkerHoldingTheSegmentsAtEqualLoad) {
  std::vector<RouteCandidate> c(3);
  c[0].id = "a";
  c[1].id = "b";
  c[1].reusable_tokens = 600;
  c[2].id = "c";
  c[2].reusable_tokens = 200;
  RouteDecision d = ChooseWorker(c, 700, RoutingWeights{});
  EXPECT_EQ(d.index, 1);
  EXPECT_EQ(d.reason, "reuse");
}

TEST(RoutingTest, LoadOutweighsReuseWhenTheHolderIsBusy) {
  std::vector<RouteCandidate> c(2);
  c[0].id = "holder";
  c[0].reusable_tokens = 300;
  c[0].load.running_tokens = 5000;
  c[0].load.queue_depth = 6;
  c[1].id = "idle";
  RouteDecision d = ChooseWorker(c, 400, RoutingWeights{});
  EXPECT_EQ(d.index, 1);
  EXPECT_EQ(d.reason, "load");
}

TEST(RoutingTest, SkewedLoadDoesNotPileUpOnOneWorker) {
  // Every request shares the same hot documents, which only worker 0 holds; requests stay in
  // flight (slow decode) so the load builds up. The policy must still use every worker.
  RoutingWeights w;
  std::vector<RouteCandidate> c(4);
  for (int i = 0; i < 4; ++i) c[i].id = "w" + std::to_string(i);
  c[0].reusable_tokens = 900;
  std::map<int, int> count;
  for (int r = 0; r < 40; ++r) {
    RouteDecision d = ChooseWorker(c, 1000, w);
    ASSERT_GE(d.index, 0);
    ++count[d.index];
    c[d.index].inflight++;
    c[d.index].inflight_tokens += 1000;
  }
  EXPECT_EQ(count.size(), 4u);
  for (auto [i, n] : count) EXPECT_LE(n, 16) << "worker " << i << " got " << n << " of 40";
  EXPECT_GE(count[0], count[1]);  // affinity still shows
  int mx = 0, mn = 1 << 30;
  for (const auto& x : c) {
    mx = std::max(mx, x.inflight);
    mn = std::min(mn, x.inflight);
  }
  EXPECT_LE(mx - mn, w.max_inflight_imbalance + 1);
}

TEST(RoutingTest, UnhealthyDrainingAndSaturatedWorkers) {
  RoutingWeights w;
  w.max_inflight_per_worker = 2;
  std::vector<RouteCandidate> c(3);
  c[0].id = "down";
  c[0].healthy = false;
  c[0].reusable_tokens = 1000;
  c[1].id = "draining";
  c[1].load.draining = true;
  c[1].reusable_tokens = 1000;
  c[2].id = "ok";
  RouteDecision d = ChooseWorker(c, 1000, w);
  EXPECT_EQ(d.index, 2);
  EXPECT_EQ(d.reason, "only");
  c[2].inflight = 2;
  d = ChooseWorker(c, 1000, w);
  EXPECT_EQ(d.index, -1);
  EXPECT_TRUE(d.all_saturated);
  c[2].healthy = false;
  d = ChooseWorker(c, 1000, w);
  EXPECT_EQ(d.index, -1);
  EXPECT_FALSE(d.all_saturated);  // nobody serving: UNAVAILABLE, not load shedding
  // A full worker queue counts as saturated too.
  std::vector<RouteCandidate> q(1);
  q[0].load.max_queue = 4;
  q[0].load.queue_depth = 4;
  d = ChooseWorker(q, 10, w);
  EXPECT_TRUE(d.all_saturated);
}

}  // namespace
}  // namespace sparsex::router

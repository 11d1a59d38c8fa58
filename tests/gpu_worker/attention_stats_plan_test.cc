#include "gpu_worker/backend/attention_stats_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "gtest/gtest.h"

namespace sparsex {
namespace {

constexpr int32_t kMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kMax = std::numeric_limits<int32_t>::max();

TEST(StatsTileGroups, SegmentRangesAndSharedTiles) {
  // tile 0: a shared key then segment 0; tile 1: segments 0 and 1; tile 2 (partial): segment 2.
  const std::vector<int32_t> kg = {-1, 0, 0, 0, 0, 1, 1, 1, 2, 2};
  const std::vector<int32_t> t = StatsTileGroups(kg, 4);
  EXPECT_EQ(t, (std::vector<int32_t>{kMin, kMax, 0, 1, 2, 2}));
  EXPECT_TRUE(StatsTileGroups({}, 64).empty());
  EXPECT_TRUE(StatsTileGroups(kg, 0).empty());
}

// The reuse benchmark's prompt (docs/benchmarks.md): BOS, 8 stored segments of 4064 tokens,
// 256 new tokens; the full layers compute every row after the BOS, the new rows carry the recv
// weight. A row of a segment reads its own segment and the BOS tile: about an eighth.
TEST(ComplementReadShare, SegmentsOfARagPromptReadAboutTheirOwn) {
  std::vector<int32_t> kg = {-1};
  for (int s = 0; s < 8; ++s) kg.insert(kg.end(), 4064, s);
  kg.insert(kg.end(), 256, 8);
  const int64_t ctx = static_cast<int64_t>(kg.size());
  std::vector<int32_t> pos(ctx - 1), qg(ctx - 1);
  std::vector<float> w(ctx - 1, 0.0f);
  for (int64_t i = 0; i < ctx - 1; ++i) {
    pos[i] = static_cast<int32_t>(i + 1);
    qg[i] = kg[i + 1];
    w[i] = qg[i] == 8 ? 1.0f : 0.0f;
  }
  const std::vector<int32_t> tiles = StatsTileGroups(kg, 64);
  const double share = ComplementReadShare(pos, qg, w, tiles, 64, ctx, 32);
  EXPECT_GT(share, 0.10);
  EXPECT_LT(share, 0.20);
  EXPECT_LE(share, CudaBackendOptions{}.cudnn_statistics_max_share);
  // Every row weighted (all rows new): the complement reads what the plain pass reads.
  std::vector<float> all(ctx - 1, 1.0f);
  EXPECT_DOUBLE_EQ(ComplementReadShare(pos, qg, all, tiles, 64, ctx, 32), 1.0);
  // Segments interleaved key by key: every tile holds every segment, nothing is skipped.
  std::vector<int32_t> mixed(ctx);
  for (int64_t j = 0; j < ctx; ++j) mixed[j] = static_cast<int32_t>(j % 8);
  std::vector<int32_t> mixed_q(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) mixed_q[i] = mixed[pos[i]];
  const double interleaved = ComplementReadShare(pos, mixed_q, w, StatsTileGroups(mixed, 64), 64,
                                                 ctx, 32);
  EXPECT_GT(interleaved, CudaBackendOptions{}.cudnn_statistics_max_share);
  EXPECT_EQ(ComplementReadShare({}, {}, {}, tiles, 64, ctx, 32), 0.0);
}

// The tiles a block skips (the kernel's test: tile range [lo, hi] misses the block's row
// segments [qlo, qhi], and the tile holds no shared key) never hold a key the complement needs
// (a shared key, or one of a row's own segment), over random segment layouts: runs of
// segments, interleaved keys, rows of no segment.
TEST(StatsTileGroups, SkippedTilesHoldNoNeededKey) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int ctx = 1 + static_cast<int>(rng() % 700);
    std::vector<int32_t> kg(ctx);
    int g = 0;
    for (int j = 0; j < ctx; ++j) {
      if (rng() % 50 == 0) g = static_cast<int>(rng() % 6);  // runs of one segment
      kg[j] = rng() % 40 == 0 ? -1 : (trial % 3 == 0 ? static_cast<int>(rng() % 6) : g);
    }
    const std::vector<int32_t> tiles = StatsTileGroups(kg, 64);
    // A block of rows whose segments are a few random values (-1: a row of no segment).
    std::vector<int32_t> rows_g;
    for (int i = 0; i < 1 + static_cast<int>(rng() % 4); ++i) {
      rows_g.push_back(static_cast<int32_t>(rng() % 7) - 1);
    }
    int32_t lo = std::numeric_limits<int32_t>::max(), hi = -1;
    for (int32_t q : rows_g) {
      if (q >= 0) {
        lo = std::min(lo, q);
        hi = std::max(hi, q);
      }
    }
    for (int t = 0; t * 64 < ctx; ++t) {
      const bool visited = tiles[2 * t + 1] >= lo && tiles[2 * t] <= hi;
      if (visited) continue;
      for (int j = t * 64; j < std::min(ctx, (t + 1) * 64); ++j) {
        EXPECT_GE(kg[j], 0) << "trial " << trial << ": a skipped tile holds a shared key";
        for (int32_t q : rows_g) {
          EXPECT_NE(kg[j], q) << "trial " << trial << ": a skipped tile holds a row's own key";
        }
      }
    }
  }
}

// The identity the complement pass rests on, on one row's softmax: the mass on keys of other
// segments (key_group >= 0, != the row's) is 1 minus the mass on its own segment and the shared
// keys, for a row of a segment and for a row of none (q_group < 0: only shared keys are its own).
TEST(ComplementReadShare, CrossMassIsOneMinusOwnAndShared) {
  std::mt19937 rng(7);
  std::normal_distribution<float> score(0.0f, 3.0f);
  std::uniform_int_distribution<int> group(-1, 4);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 200;
    std::vector<float> s(n);
    std::vector<int32_t> kg(n);
    for (int j = 0; j < n; ++j) {
      s[j] = score(rng);
      kg[j] = group(rng);
    }
    const float mx = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (float v : s) z += std::exp(v - mx);
    for (int32_t qg : {-1, 0, 3}) {
      double cross = 0, own = 0;
      for (int j = 0; j < n; ++j) {
        const double p = std::exp(s[j] - mx) / z;
        if (kg[j] >= 0 && kg[j] != qg) cross += p;
        if (kg[j] < 0 || kg[j] == qg) own += p;
      }
      EXPECT_NEAR(cross, 1.0 - own, 1e-12) << "trial " << trial << " q_group " << qg;
    }
  }
}

}  // namespace
}  // namespace sparsex

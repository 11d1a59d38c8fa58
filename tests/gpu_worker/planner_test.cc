// The reuse planner alone (no backend, no model): layout, tier lookups through a fake, the
// exact-prefix rules, reused positions and the missing segments.
#include "gpu_worker/reuse/planner.h"

#include <gtest/gtest.h>

#include <map>

#include "common/fingerprint.h"
#include "gpu_worker/reuse/reuse_prefill.h"

namespace sparsex {
namespace {

std::vector<int32_t> Ids(int first, int n) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(first + i);
  return v;
}

struct FakeTiers {
  std::map<std::pair<uint64_t, uint64_t>, SegmentTier> have;
  std::vector<size_t> asked;
  SegmentLookup Fn() {
    return [this](size_t s, const Hash128& fp, int) {
      asked.push_back(s);
      auto it = have.find({fp.hi, fp.lo});
      return it == have.end() ? SegmentTier::kNone : it->second;
    };
  }
  void Put(const Hash128& fp, SegmentTier t) { have[{fp.hi, fp.lo}] = t; }
};

const Hash128 kModel{1, 2};

TEST(PlannerTest, LayoutTiersAndMissing) {
  // BOS + 4 segments: a (40, in the prefix), b (20, straddles: short rest), c (50, device),
  // d (30, absent), q (8, not cacheable). Prefix: 64 tokens.
  std::vector<PromptSegment> segs = {{Ids(100, 40)}, {Ids(200, 20)}, {Ids(300, 50)},
                                     {Ids(400, 30)}, {Ids(500, 8), false}};
  FakeTiers tiers;
  tiers.Put(SegmentFingerprint(kModel, segs[2].tokens, "none"), SegmentTier::kDevice);
  tiers.Put(SegmentFingerprint(kModel, segs[1].tokens, "none"), SegmentTier::kDevice);
  ReuseOptions o;
  ReusePlan p = PlanReuse(segs, /*bos_id=*/1, /*prefix=*/48, /*block_size=*/16, o, kModel,
                          tiers.Fn());
  ASSERT_EQ(p.tokens.size(), 1u + 40 + 20 + 50 + 30 + 8);
  EXPECT_EQ(p.tokens[0], 1);
  EXPECT_EQ(p.group[0], -1);
  EXPECT_EQ(p.group[1], 0);
  EXPECT_EQ(p.segments[1].begin, 41);
  EXPECT_EQ(p.segments[1].end, 61);
  EXPECT_EQ(p.segments[0].tier, SegmentTier::kInPrefix);    // [1, 41) inside [0, 48)
  EXPECT_EQ(p.segments[1].tier, SegmentTier::kShortTail);   // 13 tokens past 48: computed
  EXPECT_EQ(p.segments[2].tier, SegmentTier::kDevice);
  EXPECT_EQ(p.segments[3].tier, SegmentTier::kNone);
  EXPECT_EQ(p.segments[4].tier, SegmentTier::kNone);
  EXPECT_EQ(tiers.asked, (std::vector<size_t>{2, 3}));       // only c and d were looked up
  EXPECT_EQ(p.segments_hit, 1);
  EXPECT_EQ(p.segments_missed, 1);
  for (int i = 61; i < 111; ++i) EXPECT_TRUE(p.reused[i]) << i;
  EXPECT_FALSE(p.reused[60]);
  EXPECT_FALSE(p.reused[111]);
  EXPECT_EQ(p.reused_tokens, 50);
  EXPECT_EQ(p.new_tokens, static_cast<int>(p.tokens.size()) - 48 - 50);
  // a, b are cacheable and not reused (the caller stores them if its store lacks them); d too.
  EXPECT_EQ(p.missing, (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(p.segments[2].fp, SegmentFingerprint(kModel, segs[2].tokens, "none"));
}

TEST(PlannerTest, LongRestPastThePrefixIsReusedAndTheLastTokenNever) {
  // A 200-token segment of which the prefix covers 32: the rest (169) is reused from 32 on.
  std::vector<PromptSegment> segs = {{Ids(100, 200)}};
  FakeTiers tiers;
  tiers.Put(SegmentFingerprint(kModel, segs[0].tokens, "none"), SegmentTier::kHostStore);
  ReuseOptions o;
  ReusePlan p = PlanReuse(segs, 1, 32, 16, o, kModel, tiers.Fn());
  EXPECT_EQ(p.segments[0].tier, SegmentTier::kHostStore);
  EXPECT_EQ(p.segments[0].reuse_begin, 32);
  EXPECT_FALSE(p.reused[31]);
  EXPECT_TRUE(p.reused[32]);
  EXPECT_FALSE(p.reused[200]);  // the prompt's last token: its logits are the answer
  EXPECT_EQ(p.reused_tokens, 200 - 32);
  EXPECT_EQ(p.new_tokens, 1);
  EXPECT_TRUE(p.missing.empty());
}

TEST(PlannerTest, ReuseOffLooksNothingUp) {
  std::vector<PromptSegment> segs = {{Ids(100, 20)}, {Ids(200, 20)}};
  FakeTiers tiers;
  tiers.Put(SegmentFingerprint(kModel, segs[0].tokens, "none"), SegmentTier::kDevice);
  ReuseOptions o;
  o.enable_reuse = false;
  ReusePlan p = PlanReuse(segs, -1, 0, 16, o, kModel, tiers.Fn());
  EXPECT_TRUE(tiers.asked.empty());
  EXPECT_EQ(p.tokens.size(), 40u);  // no BOS
  EXPECT_EQ(p.reused_tokens, 0);
  EXPECT_EQ(p.new_tokens, 40);
  EXPECT_EQ(p.missing, (std::vector<int>{0, 1}));
}

}  // namespace
}  // namespace sparsex

#include "model/prompt.h"

#include <gtest/gtest.h>

#include "common/fingerprint.h"

namespace sparsex {
namespace {

std::vector<int32_t> Range(int b, int e) {
  std::vector<int32_t> v;
  for (int i = b; i < e; ++i) v.push_back(i);
  return v;
}

TEST(PromptTest, FingerprintsAreTheCommonDefinitions) {
  const Hash128 model{1, 2};
  std::vector<PromptSegment> segs = {{Range(0, 20), true}, {Range(100, 113), false}, {{}, true},
                                     {Range(200, 231), true}};
  RequestFingerprints f = FingerprintRequest(model, segs, /*bos_id=*/1,
                                             {.block_size = 16, .encoding = "bos"});
  ASSERT_EQ(f.segments.size(), 4u);
  EXPECT_EQ(f.segments[0], SegmentFingerprint(model, segs[0].tokens, "bos"));
  EXPECT_FALSE(f.segments[1].has_value());  // not cacheable
  EXPECT_FALSE(f.segments[2].has_value());  // empty
  EXPECT_EQ(f.segments[3], SegmentFingerprint(model, segs[3].tokens, "bos"));
  // 1 + 20 + 13 + 31 = 65 tokens: blocks [0,16) [16,32) [32,48) [48,64) are full, but the one
  // holding the last token (64) is not hashed, and [48,64) precedes it: 4 blocks.
  std::vector<int32_t> all = {1};
  for (const auto& s : segs) all.insert(all.end(), s.tokens.begin(), s.tokens.end());
  ASSERT_EQ(all.size(), 65u);
  ASSERT_EQ(f.prefix_blocks.size(), 4u);
  Hash128 parent;
  for (size_t b = 0; b < 4; ++b) {
    parent = PrefixBlockHash(model, parent, std::span<const int32_t>(all.data() + 16 * b, 16));
    EXPECT_EQ(f.prefix_blocks[b], parent) << b;
  }
}

TEST(PromptTest, SegmentsOffAndNoBos) {
  std::vector<PromptSegment> segs = {{Range(0, 32), true}};
  RequestFingerprints f = FingerprintRequest(Hash128{3, 4}, segs, -1,
                                             {.block_size = 16, .segments = false});
  ASSERT_EQ(f.segments.size(), 1u);
  EXPECT_FALSE(f.segments[0].has_value());
  EXPECT_EQ(f.prefix_blocks.size(), 1u);  // [0,16); [16,32) holds the last token
}

TEST(PromptTest, ChunkPromptCoversTheIdsInOrder) {
  std::vector<int32_t> ids = Range(0, 1000);
  std::vector<PromptSegment> segs = ChunkPrompt(ids, ChunkingOptions{});
  std::vector<int32_t> joined;
  for (const auto& s : segs) {
    EXPECT_TRUE(s.cacheable);
    EXPECT_LE(s.tokens.size(), 256u);
    joined.insert(joined.end(), s.tokens.begin(), s.tokens.end());
  }
  EXPECT_EQ(joined, ids);
}

}  // namespace
}  // namespace sparsex

// The synthetic models (model/synthetic.cc): the sizes benchmarks, tests and the CPU demo name
// by `synthetic:<name>`, their numeric tokenizer, and a refused unknown name that lists the
// known ones.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model.h"

namespace sparsex {
namespace {

using ::testing::HasSubstr;

TEST(SyntheticModels, DemoIsTwelveLayersWithGroupedQueryHeads) {
  auto m = LoadModel("synthetic:demo");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  EXPECT_EQ(c.n_layers, 12);
  EXPECT_EQ(c.dim, 256);
  EXPECT_EQ(c.ffn_dim, 768);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.n_heads * c.head_dim, c.dim);
  // The demo's documents are random ids in [3, 1000): every one is a token of its own.
  EXPECT_EQ((*m)->tokenizer().Encode("3 500 999", false), (std::vector<int32_t>{3, 500, 999}));
}

TEST(SyntheticModels, EveryNameGivesItsOwnFingerprint) {
  auto demo = LoadModel("synthetic:demo");
  auto tiny = LoadModel("synthetic:tiny");
  ASSERT_TRUE(demo.ok() && tiny.ok());
  EXPECT_NE((*demo)->fingerprint(), (*tiny)->fingerprint());
}

TEST(SyntheticModels, AnUnknownNameIsRefusedWithTheKnownOnes) {
  auto m = LoadModel("synthetic:huge");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("llama3-8b, demo, small or tiny"));
}

}  // namespace
}  // namespace sparsex

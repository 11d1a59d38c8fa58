// A model's tokenizer taken from another file (LoadOptions::tokenizer_path, the CLI's and the
// worker's --tokenizer): a synthetic Llama-3-8B-shaped model with GPT-2's vocabulary tokenizes
// real text, the override enters the fingerprint, and a vocabulary larger than the model's
// embedding table is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "model/model.h"
#include "model/model_info.h"
#include "testing/models_dir.h"

namespace sparsex {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Vocab(const std::string& name) {
  return sparsex::testing::ModelsDir() + "/tokenizer-vectors/ggml-vocab-" + name + ".gguf";
}

TEST(TokenizerOverrideTest, SyntheticModelTokenizesRealText) {
  const std::string gpt2 = Vocab("gpt-2");
  if (!std::ifstream(gpt2)) GTEST_SKIP() << gpt2 << " not found";
  auto plain = LoadModel("synthetic:llama3-8b");
  ASSERT_TRUE(plain.ok()) << plain.status();
  LoadOptions lo;
  lo.tokenizer_path = gpt2;
  auto m = LoadModel("synthetic:llama3-8b", lo);
  ASSERT_TRUE(m.ok()) << m.status();
  const Tokenizer& t = (*m)->tokenizer();
  EXPECT_EQ(t.vocab_size(), 50257);
  EXPECT_THAT(t.Encode("Hello world", false), ElementsAre(15496, 995));
  EXPECT_EQ(t.Decode(t.Encode("Hello world", false)), "Hello world");
  // The tokenizer is part of the identity: KV made under one is not served under the other.
  EXPECT_NE((*m)->fingerprint(), (*plain)->fingerprint());
  auto again = LoadModel("synthetic:llama3-8b", lo);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->fingerprint(), (*m)->fingerprint());
  // Another vocabulary, another fingerprint.
  lo.tokenizer_path = Vocab("llama-spm");
  auto spm = LoadModel("synthetic:llama3-8b", lo);
  ASSERT_TRUE(spm.ok()) << spm.status();
  EXPECT_NE((*spm)->fingerprint(), (*m)->fingerprint());
  EXPECT_NE((*spm)->fingerprint(), (*plain)->fingerprint());
  // The router's view (no weights) takes the same tokenizer.
  auto info = LoadModelInfo("synthetic:llama3-8b", gpt2);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->tokenizer->Encode("Hello world", false), ElementsAre(15496, 995));
  EXPECT_EQ(info->eos_token, "<|endoftext|>");
}

TEST(TokenizerOverrideTest, LargerVocabularyIsRefused) {
  const std::string gpt2 = Vocab("gpt-2");
  if (!std::ifstream(gpt2)) GTEST_SKIP() << gpt2 << " not found";
  // synthetic:tiny has 1000 embedding rows; GPT-2's ids go to 50256.
  LoadOptions lo;
  lo.tokenizer_path = gpt2;
  auto m = LoadModel("synthetic:tiny", lo);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("50257 tokens"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("vocab_size is only 1000"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(gpt2));
  auto info = LoadModelInfo("synthetic:tiny", gpt2);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerOverrideTest, MissingOrBadTokenizerFileIsAnError) {
  LoadOptions lo;
  lo.tokenizer_path = "/nonexistent/tokenizer.json";
  EXPECT_EQ(LoadModel("synthetic:tiny", lo).status().code(), absl::StatusCode::kNotFound);
  const std::string bad = ::testing::TempDir() + "/bad-tokenizer.json";
  std::ofstream(bad) << "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}";
  lo.tokenizer_path = bad;
  auto m = LoadModel("synthetic:tiny", lo);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("Unigram"));
}

TEST(TokenizerOverrideTest, FingerprintOfATokenizer) {
  const std::string gpt2 = Vocab("gpt-2");
  if (!std::ifstream(gpt2)) GTEST_SKIP() << gpt2 << " not found";
  auto a = LoadTokenizer(gpt2), b = LoadTokenizer(gpt2), c = LoadTokenizer(Vocab("phi-3"));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(TokenizerFingerprint(**a), TokenizerFingerprint(**b));
  EXPECT_NE(TokenizerFingerprint(**a), TokenizerFingerprint(**c));
}

}  // namespace
}  // namespace sparsex

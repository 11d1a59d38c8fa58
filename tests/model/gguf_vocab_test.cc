// GGUF vocabularies against llama.cpp's tokenizer test vectors: vocabulary-only GGUF files
// (SentencePiece llama-spm and phi-3, byte-level gpt-2) with test strings (.inp, separated by
// "\n__ggml_vocab_test__\n") and the ids llama.cpp expects (.out, one line per string, no BOS).
// Every string must give exactly those ids. Also: pre-tokenizer names, hand-made byte-level
// vocabularies, bad files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/model_info.h"
#include "testing/models_dir.h"
#include "tests/model/byte_alphabet.h"

namespace sparsex {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string VectorsDir() { return sparsex::testing::ModelsDir() + "/tokenizer-vectors"; }

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

// The strings of an .inp file: separated by the marker line; the text after the last marker
// is empty and not a case (llama.cpp's reader drops it the same way).
std::vector<std::string> SplitInp(const std::string& s) {
  const std::string marker = "\n__ggml_vocab_test__\n";
  std::vector<std::string> out;
  size_t pos = 0;
  for (size_t at; (at = s.find(marker, pos)) != std::string::npos; pos = at + marker.size())
    out.push_back(s.substr(pos, at - pos));
  return out;
}

std::vector<std::vector<int32_t>> ParseOut(const std::string& s) {
  std::vector<std::vector<int32_t>> out;
  std::istringstream lines(s);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream ids(line);
    std::vector<int32_t> v;
    for (int32_t id; ids >> id;) v.push_back(id);
    out.push_back(std::move(v));
  }
  return out;
}

std::string Show(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t id : v) absl::StrAppend(&s, " ", id);
  return s;
}

class VocabVectorsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(VocabVectorsTest, EveryStringGivesLlamaCppIds) {
  const std::string base = VectorsDir() + "/ggml-vocab-" + GetParam() + ".gguf";
  std::string inp, out;
  if (!ReadFile(base + ".inp", &inp) || !ReadFile(base + ".out", &out)) {
    GTEST_SKIP() << "test vectors not found at " << base << " (set SPARSEX_MODELS)";
  }
  const std::vector<std::string> cases = SplitInp(inp);
  const std::vector<std::vector<int32_t>> want = ParseOut(out);
  ASSERT_EQ(cases.size(), want.size());
  ASSERT_GT(cases.size(), 40u);
  auto tok = LoadTokenizer(base);
  ASSERT_TRUE(tok.ok()) << tok.status();
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<int32_t> got = (*tok)->Encode(cases[i], /*add_bos=*/false);
    EXPECT_EQ(got, want[i]) << "case " << i << " \"" << cases[i] << "\"\n got:" << Show(got)
                            << "\nwant:" << Show(want[i]);
    failures += got != want[i];
    // Byte-level and byte-fallback tokenizers are lossless on these strings.
    if (got == want[i]) {
      EXPECT_EQ((*tok)->Decode(got), cases[i]) << "case " << i;
    }
  }
  EXPECT_EQ(failures, 0);
}

INSTANTIATE_TEST_SUITE_P(LlamaCpp, VocabVectorsTest,
                         ::testing::Values("llama-spm", "gpt-2", "phi-3"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '-') c = '_';
                           return s;
                         });

TEST(GgufVocabTest, Gpt2VocabularyMetadata) {
  const std::string path = VectorsDir() + "/ggml-vocab-gpt-2.gguf";
  if (!std::ifstream(path)) GTEST_SKIP() << path << " not found";
  auto tok = LoadTokenizer(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 50257);
  EXPECT_EQ((*tok)->eos_id(), 50256);
  EXPECT_TRUE((*tok)->IsSpecial(50256));
  // <|endoftext|> is a control token: text unless special parsing is asked for.
  EXPECT_THAT((*tok)->Encode("<|endoftext|>", false, /*parse_special=*/true), ElementsAre(50256));
  EXPECT_GT((*tok)->Encode("<|endoftext|>", false, /*parse_special=*/false).size(), 1u);
  EXPECT_EQ((*tok)->TokenPiece(15496), "Hello");
  EXPECT_EQ((*tok)->TokenPiece(995), " world");
  // A vocabulary-only file has no model: LoadModelInfo refuses its architecture, the
  // tokenizer-only path does not read the configuration.
  EXPECT_FALSE(LoadModelInfo(path).ok());
}

ByteLevelVocab SmallVocab();

TEST(GgufVocabTest, PreTokenizerNames) {
  ByteLevelVocab v;
  EXPECT_TRUE(ByteLevelPreTokenizer("llama-bpe", &v).ok());
  EXPECT_TRUE(v.ignore_merges);
  EXPECT_EQ(v.pre_regexes.size(), 1u);
  EXPECT_TRUE(ByteLevelPreTokenizer("gpt-2", &v).ok());
  EXPECT_FALSE(v.ignore_merges);
  EXPECT_TRUE(ByteLevelPreTokenizer("qwen2", &v).ok());
  EXPECT_TRUE(ByteLevelPreTokenizer("default", &v).ok());
  EXPECT_EQ(v.pre_regexes.size(), 4u);
  absl::Status s = ByteLevelPreTokenizer("no-such-thing", &v);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no-such-thing"));
  // llama.cpp splits these with hand-written code or over raw UTF-8: refused by name.
  for (const char* name : {"kimi-k2", "gemma4", "whitespace"}) {
    s = ByteLevelPreTokenizer(name, &v);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << name;
    EXPECT_THAT(std::string(s.message()), HasSubstr(std::string("'") + name + "'"));
  }
}

// Every pre-tokenizer name llama.cpp maps to a list of regexes is known, and each one's
// regexes compile and split text into pieces that together are the text again.
TEST(GgufVocabTest, EveryLlamaCppPreTokenizer) {
  const std::vector<std::string> names = ByteLevelPreTokenizerNames();
  for (const char* name :
       {"default", "llama-bpe", "llama3", "deepseek-llm", "deepseek-coder", "deepseek-v3",
        "falcon", "falcon3", "qwen2", "qwen35", "command-r", "gpt-4o", "llama4", "chatglm-bpe",
        "glm4", "tekken", "smollm", "starcoder", "refact", "mpt", "gpt-2", "dbrx", "smaug-bpe",
        "stablelm2", "olmo", "jais", "jais-2", "poro-chat", "viking", "bloom", "gpt3-finnish",
        "codeshell", "exaone", "exaone4", "exaone-moe", "minerva-7b", "chameleon", "megrez",
        "trillion", "bailingmoe", "seed-coder", "grok-2", "hunyuan", "kormo", "tiny_aya",
        "minimax-m2", "youtu", "spark2_5", "laguna", "minicpm5", "granite-docling", "afmoe",
        "superbpe"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  const std::string text =
      "Hello World! It's 2024: 1234567 tokens,\ttabs   and\n\nlines.\r\n Caf\xC3\xA9 "
      "\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C \xED\x95\x9C "
      "\xF0\x9F\x91\x8B HTTPServer camelCase <sentinel:12> IMGIMGABZ \xD9\x85\xD8\xB1 ";
  for (const std::string& name : names) {
    ByteLevelVocab v = SmallVocab();
    ASSERT_TRUE(ByteLevelPreTokenizer(name, &v).ok()) << name;
    auto tok = MakeByteLevelTokenizer(v);
    ASSERT_TRUE(tok.ok()) << name << ": " << tok.status();
    const std::vector<int32_t> ids = (*tok)->Encode(text, false);
    EXPECT_EQ((*tok)->Decode(ids), text) << name;
  }
}

// The pre-tokenizers' splits where they differ: merges only happen inside a piece, so the
// ids show where the text was cut.
TEST(GgufVocabTest, PreTokenizerSplitsDiffer) {
  auto ids = [](const char* pre, const std::string& text) {
    ByteLevelVocab v = SmallVocab();
    EXPECT_TRUE(ByteLevelPreTokenizer(pre, &v).ok());
    auto tok = MakeByteLevelTokenizer(v);
    return tok.ok() ? (*tok)->Encode(text, false) : std::vector<int32_t>{};
  };
  // "Ġthe" (258) needs " the" in one piece: GPT-2 and Llama-3 keep the space with the word,
  // deepseek-coder's "\s?\p{L}+" too; bloom's " ?[^(\s|...)]+" as well.
  for (const char* pre : {"gpt-2", "llama-bpe", "qwen2", "deepseek-coder", "bloom", "tekken"})
    EXPECT_THAT(ids(pre, "a the"), ElementsAre('a', 258)) << pre;
  // GPT-4o and tekken cut "tHe" before the capital: "t" never merges with "He".
  EXPECT_THAT(ids("gpt-4o", " tHe"), ElementsAre(256, 'H', 'e'));
}

// Digit runs cut into groups of three from the right: afmoe and tiny_aya by llama.cpp's
// hand-written split, superbpe by a zero-width regex. With merges that would join "12" first,
// "1234" gives 1 | 234 only when the cut is there.
TEST(GgufVocabTest, DigitGroupsFromTheRight) {
  auto ids = [](const char* pre, const std::string& text) {
    ByteLevelVocab v = SmallVocab();
    for (const char* t : {"12", "123", "23", "234"}) {
      v.tokens.push_back(t);
      v.types.push_back(1);
    }
    v.merges.insert(v.merges.end(), {"1 2", "12 3", "2 3", "23 4"});
    EXPECT_TRUE(ByteLevelPreTokenizer(pre, &v).ok()) << pre;
    auto tok = MakeByteLevelTokenizer(v);
    EXPECT_TRUE(tok.ok()) << pre << ": " << tok.status();
    return tok.ok() ? (*tok)->Encode(text, false) : std::vector<int32_t>{};
  };
  const int32_t k12 = 261, k123 = 262, k234 = 264;
  EXPECT_THAT(ids("gpt-2", "1234"), ElementsAre(k123, '4'));  // one piece: "12" merges first
  for (const char* pre : {"afmoe", "tiny_aya", "superbpe"}) {
    EXPECT_THAT(ids(pre, "1234"), ElementsAre('1', k234)) << pre;
    EXPECT_THAT(ids(pre, "x1234567"), ElementsAre('x', '1', k234, '5', '6', '7')) << pre;
    EXPECT_THAT(ids(pre, "123"), ElementsAre(k123)) << pre;
  }
  // Llama-3 takes the first three digits: 123 | 4.
  EXPECT_THAT(ids("llama-bpe", "1234"), ElementsAre(k123, '4'));
  (void)k12;
}

// Falcon's vocabulary lacks tokens for some bytes and has no unknown token: llama.cpp loads it
// and leaves such bytes out of the ids, and so do we.
TEST(GgufVocabTest, MissingByteIsDroppedAsLlamaCppDoes) {
  ByteLevelVocab v = SmallVocab();
  v.tokens[65] = "not a byte";  // byte 'A' has no token
  auto tok = MakeByteLevelTokenizer(v);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("xAy", false), ElementsAre('x', 'y'));
  EXPECT_THAT((*tok)->Encode(" theA", false), ElementsAre(258));
}

// A small byte-level vocabulary: every byte (GPT-2 alphabet), then merged pieces.
ByteLevelVocab SmallVocab() {
  ByteLevelVocab v;
  for (int b = 0; b < 256; ++b) v.tokens.push_back(testing::Gpt2ByteChar(b));
  // ids 256.. : "Ġt" (space t), "he", "Ġthe", "<|eot|>" (control), "<u>" (user-defined)
  for (const char* t : {"\xC4\xA0t", "he", "\xC4\xA0the", "<|eot|>", "<u>"}) v.tokens.push_back(t);
  v.types.assign(v.tokens.size(), 1);
  v.types[259] = 3;
  v.types[260] = 4;
  v.merges = {"\xC4\xA0 t", "h e", "\xC4\xA0t he"};
  v.eos_id = 259;
  EXPECT_TRUE(ByteLevelPreTokenizer("gpt-2", &v).ok());
  return v;
}

TEST(GgufVocabTest, HandMadeByteLevelVocabulary) {
  auto tok = MakeByteLevelTokenizer(SmallVocab());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const Tokenizer& t = **tok;
  // " the" -> "Ġthe"; "the" -> 't' + "he" (no merge of t with he).
  EXPECT_THAT(t.Encode(" the", false), ElementsAre(258));
  EXPECT_THAT(t.Encode("the", false), ElementsAre('t', 257));
  EXPECT_THAT(t.Encode("<u>", false), ElementsAre(260));  // user-defined: always matched
  EXPECT_THAT(t.Encode("<|eot|>", false, true), ElementsAre(259));
  EXPECT_EQ(t.Decode(t.Encode("x the\xFF", false)), "x the\xFF");
  EXPECT_EQ(t.StopIds(), std::vector<int32_t>{259});
}

TEST(GgufVocabTest, BadByteLevelVocabularies) {
  ByteLevelVocab v = SmallVocab();
  v.types.pop_back();
  EXPECT_EQ(MakeByteLevelTokenizer(v).status().code(), absl::StatusCode::kInvalidArgument);
  v = SmallVocab();
  v.merges.push_back("nospace");
  EXPECT_EQ(MakeByteLevelTokenizer(v).status().code(), absl::StatusCode::kInvalidArgument);
  v = SmallVocab();
  v.eos_id = 100000;
  EXPECT_EQ(MakeByteLevelTokenizer(v).status().code(), absl::StatusCode::kInvalidArgument);
  v = SmallVocab();
  v.pre_regexes = {"(unclosed"};
  EXPECT_EQ(MakeByteLevelTokenizer(v).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeByteLevelTokenizer(ByteLevelVocab{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GgufVocabTest, CutVocabularyFileIsAnError) {
  const std::string path = VectorsDir() + "/ggml-vocab-gpt-2.gguf";
  std::string bytes;
  if (!ReadFile(path, &bytes)) GTEST_SKIP() << path << " not found";
  const std::string cut = ::testing::TempDir() + "/cut-vocab.gguf";
  for (size_t keep : {size_t{3}, size_t{100}, bytes.size() / 2, bytes.size() - 1}) {
    std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(keep));
    auto tok = LoadTokenizer(cut);
    EXPECT_FALSE(tok.ok()) << keep;
  }
  EXPECT_EQ(LoadTokenizer(VectorsDir() + "/missing.gguf").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace sparsex

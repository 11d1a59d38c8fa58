// Tokenizer tests: SentencePiece BPE against the real stories260K vocabulary (tok512.bin, read
// here in llama2.c format so the GGUF loader is not needed), and byte-level BPE against a small
// hand-built tokenizer.json whose expected ids are derived by hand from the merge ranks.
#include "model/tokenizer/tokenizer.h"
#include "tests/model/byte_alphabet.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace sparsex {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::Not;
using ::testing::HasSubstr;

std::string ModelsRoot() {
  const char* env = std::getenv("SPARSEX_MODELS");
  return env && *env ? env : std::string(SPARSEX_SOURCE_DIR) + "/../shared/models";
}

std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "missing test data " << path << " (set SPARSEX_MODELS to the models folder)";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// tok512.bin: int32 max_token_length, then 512 x {float32 score, int32 len, len bytes}. Converted
// to what the GGUF of the same model holds: '▁' for spaces, <s>/</s>, types per id range.
SpmVocab LoadTok512() {
  const std::string data = ReadFileOrDie(ModelsRoot() + "/stories260K/tok512.bin");
  SpmVocab v;
  size_t off = 4;
  for (int id = 0; id < 512; ++id) {
    float score;
    int32_t len;
    if (off + 8 > data.size()) break;
    std::memcpy(&score, data.data() + off, 4);
    std::memcpy(&len, data.data() + off + 4, 4);
    off += 8;
    if (len < 0 || off + len > data.size()) break;
    std::string piece = data.substr(off, len), spm;
    off += len;
    for (char c : piece) spm += c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c);
    int32_t type = 1;
    if (id == 0) type = 2;
    if (id == 1 || id == 2) type = 3, spm = id == 1 ? "<s>" : "</s>";
    if (id >= 3 && id <= 258) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", id - 3);
      type = 6, spm = name;
    }
    v.pieces.push_back(spm);
    v.scores.push_back(score);
    v.types.push_back(type);
  }
  EXPECT_EQ(v.pieces.size(), 512u) << "tok512.bin is truncated";
  return v;
}

class SpmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = MakeSpmTokenizer(LoadTok512());
    ASSERT_TRUE(t.ok()) << t.status();
    tok = std::move(t).value();
  }
  std::unique_ptr<Tokenizer> tok;
};

TEST_F(SpmTest, KnownIds) {
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->TokenPiece(403), " Once");
  EXPECT_EQ(tok->TokenPiece(407), " upon");
  EXPECT_EQ(tok->TokenPiece(317), " Lily");
  EXPECT_EQ(tok->TokenPiece(3 + 'A'), "A");  // byte token
  EXPECT_EQ(tok->TokenPiece(1), "");
  EXPECT_EQ(tok->TokenPiece(512), "");
  std::vector<int32_t> ids = tok->Encode("Once upon a time", /*add_bos=*/true);
  ASSERT_GE(ids.size(), 4u);
  EXPECT_THAT(std::vector<int32_t>(ids.begin(), ids.begin() + 4), ElementsAre(1, 403, 407, 261));
  EXPECT_EQ(tok->Decode(ids), "Once upon a time");
}

TEST_F(SpmTest, GreedyOracleSentence) {
  const std::vector<int32_t> oracle = {403, 407, 261, 378, 432, 383, 286, 261,
                                       376, 298, 315, 421, 395, 317, 426};
  const std::string text = "Once upon a time, there was a little girl named Lily.";
  std::vector<int32_t> with_bos = {1};
  with_bos.insert(with_bos.end(), oracle.begin(), oracle.end());
  EXPECT_EQ(tok->Decode(with_bos), text);
  EXPECT_EQ(tok->Decode(oracle), text);
  EXPECT_THAT(tok->Encode(text, true), ElementsAreArray(with_bos));
}

TEST_F(SpmTest, EncodesGreedyOutputToItsIds) {
  // The model's own greedy output (345 tokens) re-encodes to exactly the ids it generated.
  const std::string dir = ModelsRoot() + "/stories260K/";
  std::string text = ReadFileOrDie(dir + "expected_greedy_t0.txt");
  if (!text.empty() && text.back() == '\n') text.pop_back();  // added when the file was written
  std::istringstream in(ReadFileOrDie(dir + "expected_greedy_t0.ids"));
  std::vector<int32_t> ids;
  for (int32_t id; in >> id;) ids.push_back(id);
  ASSERT_EQ(ids.size(), 345u);
  EXPECT_THAT(tok->Encode(text, false), ElementsAreArray(ids));
  EXPECT_EQ(tok->Decode(ids), text);
}

TEST_F(SpmTest, RoundTripsSampleText) {
  std::istringstream in(ReadFileOrDie(ModelsRoot() + "/tinystories-text/tinystories_sample.txt"));
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    ASSERT_EQ(tok->Decode(tok->Encode(line, true)), line) << "line " << lines;
    ASSERT_EQ(tok->Decode(tok->Encode(line, false)), line) << "line " << lines;
  }
  EXPECT_GT(lines, 1000);
}

TEST_F(SpmTest, InvalidUtf8UsesByteFallback) {
  const std::string text = "\xff\xfe abc\xe2\x82";  // stray bytes and a truncated sequence
  std::vector<int32_t> ids = tok->Encode(text, false);
  EXPECT_THAT(ids, Contains(3 + 0xff));
  EXPECT_THAT(ids, Contains(3 + 0xfe));
  EXPECT_EQ(tok->Decode(ids), text);
  const std::string mojibake = "\xE2\x80\x9CHi\xE2\x80\x9D \xC3\xA2\xE2\x82\xAC\xC5\x93";
  EXPECT_EQ(tok->Decode(tok->Encode(mojibake, true)), mojibake);
}

TEST_F(SpmTest, EmptyAndSpaces) {
  EXPECT_TRUE(tok->Encode("", false).empty());
  EXPECT_THAT(tok->Encode("", true), ElementsAre(1));
  EXPECT_EQ(tok->Decode({}), "");
  for (const char* s : {" ", "  leading", "trailing  ", "a  b", "\n\nx\n"})
    EXPECT_EQ(tok->Decode(tok->Encode(s, true)), s) << '"' << s << '"';
}

TEST_F(SpmTest, SpecialTokensOnlyWhenAsked) {
  EXPECT_THAT(tok->Encode("<s>", false, /*parse_special=*/true), ElementsAre(1));
  std::vector<int32_t> parsed = tok->Encode("Hi</s>", false, true);
  EXPECT_EQ(std::count(parsed.begin(), parsed.end(), 2), 1);
  EXPECT_EQ(parsed.back(), 2);
  std::vector<int32_t> plain = tok->Encode("Hi</s>", false, false);
  EXPECT_THAT(plain, Not(Contains(2)));
  EXPECT_EQ(tok->Decode(plain), "Hi</s>");
  EXPECT_TRUE(tok->IsSpecial(1));
  EXPECT_TRUE(tok->IsSpecial(2));
  EXPECT_FALSE(tok->IsSpecial(403));
  EXPECT_THAT(tok->StopIds(), ElementsAre(2));
  // BOS mid-stream: the space prefixed to the text after it is dropped again.
  EXPECT_EQ(tok->Decode({1, 403, 2, 1, 407}), "Onceupon");
}

TEST(SpmVocabTest, HighestScoreMergesFirst) {
  SpmVocab v;
  v.pieces = {"<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"};
  v.scores = {0, 0, 0, -10, -10, -10, -1, 0};
  v.types = {2, 3, 3, 1, 1, 1, 1, 1};
  v.add_space_prefix = false;
  auto t = MakeSpmTokenizer(v);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->Encode("abc", false), ElementsAre(3, 7));  // "bc" outscores "ab"
  EXPECT_THAT((*t)->Encode("xa", false), ElementsAre(0, 3));   // no byte tokens: unk
  v.scores[6] = 0, v.scores[7] = -1;
  t = MakeSpmTokenizer(v);
  ASSERT_TRUE(t.ok());
  EXPECT_THAT((*t)->Encode("abc", false), ElementsAre(6, 5));
  v.pieces.push_back("abc"), v.scores.push_back(-5), v.types.push_back(1);
  t = MakeSpmTokenizer(v);
  ASSERT_TRUE(t.ok());
  EXPECT_THAT((*t)->Encode("abc", false), ElementsAre(8));  // merges go on from "ab"
}

TEST(SpmVocabTest, RejectsBadVocab) {
  SpmVocab v;
  v.pieces = {"<unk>", "<s>", "</s>"};
  v.scores = {0, 0};
  v.types = {2, 3, 3};
  EXPECT_EQ(MakeSpmTokenizer(v).status().code(), absl::StatusCode::kInvalidArgument);
  v.scores.push_back(0);
  v.eos_id = 3;
  EXPECT_EQ(MakeSpmTokenizer(v).status().code(), absl::StatusCode::kInvalidArgument);
  v.eos_id = 2;
  EXPECT_TRUE(MakeSpmTokenizer(v).ok());
  EXPECT_EQ(MakeSpmTokenizer(SpmVocab{}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- Hugging Face byte-level BPE ----


constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Merges in rank order, as raw text pairs; the merged token of merge k gets id 256 + k.
const std::vector<std::pair<std::string, std::string>> kMerges = {
    {" ", "t"},   {"h", "e"},   {" t", "he"},   {"3", "4"},      {"1", "2"},
    {"12", "3"},  {"n", "'"},   {"'", "t"},     {"'", "S"},      {"\n", "\n"},
    {"l", "l"},   {"he", "ll"}, {"hell", "o"},  {" ", "w"},      {"o", "r"},
    {" w", "or"}, {"l", "d"},   {" wor", "ld"}, {"\xF0", "\x9F"}};
constexpr int32_t kXyz = 256 + 19;  // " xyz": in the vocabulary, reachable by no merge
// Added tokens follow the vocabulary without a gap, as in Llama-3 (HF renumbers them otherwise).
constexpr int32_t kBot = kXyz + 1, kEnd = kXyz + 2, kEot = kXyz + 3, kTool = kXyz + 4;

// Raw text -> its id in the test vocabulary (bytes are ids 0..255).
int32_t Id(const std::string& raw) {
  if (raw.size() == 1) return static_cast<unsigned char>(raw[0]);
  for (size_t k = 0; k < kMerges.size(); ++k)
    if (kMerges[k].first + kMerges[k].second == raw) return static_cast<int32_t>(256 + k);
  ADD_FAILURE() << "no token " << raw;
  return -1;
}

std::string MakeTokenizerJson(bool llama3) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[testing::Gpt2ByteChar(b)] = b;
  nlohmann::json merges = nlohmann::json::array();
  for (size_t k = 0; k < kMerges.size(); ++k) {
    const std::string l = testing::Gpt2ByteLevel(kMerges[k].first);
    const std::string r = testing::Gpt2ByteLevel(kMerges[k].second);
    vocab[l + r] = 256 + k;
    // Llama-3 files use "a b" strings, newer ones [a, b] pairs: cover both.
    merges.push_back(llama3 ? nlohmann::json(l + " " + r) : nlohmann::json::array({l, r}));
  }
  vocab[testing::Gpt2ByteLevel(" xyz")] = kXyz;
  nlohmann::json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", llama3}};
  j["added_tokens"] = nlohmann::json::array();
  auto added = [&](int id, const char* content, bool special) {
    j["added_tokens"].push_back({{"id", id}, {"content", content}, {"special", special}});
  };
  added(kBot, "<|begin_of_text|>", true);
  added(kEnd, "<|end_of_text|>", true);
  added(kEot, "<|eot_id|>", true);
  added(kTool, "<tool>", false);
  j["normalizer"] = nullptr;
  if (llama3) {
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", kLlama3Regex}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    j["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single",
                            {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  } else {
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  }
  j["decoder"] = {{"type", "ByteLevel"}};
  return j.dump();
}

class HfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = ParseHfTokenizer(MakeTokenizerJson(/*llama3=*/true));
    ASSERT_TRUE(t.ok()) << t.status();
    tok = std::move(t).value();
  }
  std::vector<int32_t> Enc(const std::string& s) { return tok->Encode(s, false); }
  std::unique_ptr<Tokenizer> tok;
};

TEST_F(HfTest, MergesByRank) {
  EXPECT_EQ(tok->vocab_size(), kTool + 1);
  EXPECT_THAT(Enc("hello world"), ElementsAre(Id("hello"), Id(" world")));
  EXPECT_THAT(Enc(" the"), ElementsAre(Id(" the")));
  EXPECT_THAT(Enc("the"), ElementsAre(Id("t"), Id("he")));
  EXPECT_THAT(Enc("\xF0\x9F\x91\x8B"), ElementsAre(Id("\xF0\x9F"), 0x91, 0x8B));  // 👋
  EXPECT_EQ(tok->TokenPiece(Id(" the")), " the");
  EXPECT_EQ(tok->TokenPiece(Id("\n\n")), "\n\n");
}

TEST_F(HfTest, Llama3PreTokenization) {
  // Contractions are split off (case-insensitively), so "n'" (rank 6) never forms.
  EXPECT_THAT(Enc("don't"), ElementsAre(Id("d"), Id("o"), Id("n"), Id("'t")));
  EXPECT_THAT(Enc("IT'S"), ElementsAre(Id("I"), Id("T"), Id("'S")));
  // Digits in groups of three: "3 4" (rank 3) would win if "1234567" were one pre-token.
  EXPECT_THAT(Enc("12345"), ElementsAre(Id("123"), Id("4"), Id("5")));
  EXPECT_THAT(Enc("1234567"), ElementsAre(Id("123"), Id("4"), Id("5"), Id("6"), Id("7")));
  EXPECT_THAT(Enc("a\n\nb"), ElementsAre(Id("a"), Id("\n\n"), Id("b")));
  // "\n", then one of the two spaces alone (\s+(?!\S)), then " world".
  EXPECT_THAT(Enc("hello\n  world"), ElementsAre(Id("hello"), Id("\n"), Id(" "), Id(" world")));
  // ignore_merges: a pre-token found whole in the vocabulary is used as is.
  EXPECT_THAT(Enc(" xyz"), ElementsAre(kXyz));
}

TEST_F(HfTest, Gpt2ByteLevelPattern) {
  auto t = ParseHfTokenizer(MakeTokenizerJson(/*llama3=*/false));
  ASSERT_TRUE(t.ok()) << t.status();
  // One pre-token of digits: "3 4" (rank 3) merges before "1 2" (rank 4).
  EXPECT_THAT((*t)->Encode("1234567", false),
              ElementsAre(Id("12"), Id("34"), Id("5"), Id("6"), Id("7")));
  // No ignore_merges: " xyz" is spelled out.
  EXPECT_THAT((*t)->Encode(" xyz", false), ElementsAre(Id(" "), Id("x"), Id("y"), Id("z")));
  EXPECT_THAT((*t)->Encode("don't", false), ElementsAre(Id("d"), Id("o"), Id("n"), Id("'t")));
  EXPECT_EQ((*t)->bos_id(), kBot);  // no template: found by name
}

TEST_F(HfTest, SpecialTokens) {
  EXPECT_EQ(tok->bos_id(), kBot);
  EXPECT_EQ(tok->eos_id(), kEnd);
  EXPECT_THAT(tok->StopIds(), ElementsAre(kEnd, kEot));
  EXPECT_THAT(tok->Encode("hi", true), ElementsAre(kBot, Id("h"), Id("i")));
  const std::string text = "<|begin_of_text|>hi<|eot_id|>";
  EXPECT_THAT(tok->Encode(text, false, true), ElementsAre(kBot, Id("h"), Id("i"), kEot));
  std::vector<int32_t> plain = tok->Encode(text, false, false);
  EXPECT_THAT(plain, Not(Contains(kBot)));
  EXPECT_THAT(plain, Not(Contains(kEot)));
  EXPECT_EQ(tok->Decode(plain), text);
  EXPECT_EQ(tok->Decode({kBot, Id("h"), Id("i"), kEot}), "hi");
  // Non-special added tokens are matched always and decode as their text.
  EXPECT_THAT(tok->Encode("<tool>x", false), ElementsAre(kTool, Id("x")));
  EXPECT_EQ(tok->Decode({kTool, Id("x")}), "<tool>x");
  EXPECT_TRUE(tok->IsSpecial(kEot));
  EXPECT_FALSE(tok->IsSpecial(kTool));
  EXPECT_EQ(tok->Decode({-1, 9999, Id("a")}), "a");
}

TEST_F(HfTest, RoundTrips) {
  for (const std::string s :
       {"", "hello world", "Hello, World! 123456789", "\xff\xfe abc", "abc\xe2\x82", "\xe2\x82",
        "h\xC3\xA9llo \xF0\x9F\x91\x8B \xE4\xB8\x96\xE7\x95\x8C", "tabs\tand\r\nCRLF  \n  ",
        "  leading", "x\x80\x80y \xC0\xAF", "It's 'quoted' -- isn't it?"}) {
    std::vector<int32_t> ids = tok->Encode(s, true);
    EXPECT_EQ(tok->Decode(ids), s) << s;
    for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < tok->vocab_size()) << s;
  }
  EXPECT_THAT(Enc("\xff"), ElementsAre(0xff));
  EXPECT_THAT(Enc("\xff\xfe abc"), ElementsAre(0xff, 0xfe, Id(" "), Id("a"), Id("b"), Id("c")));
}

TEST_F(HfTest, RoundTripsSampleText) {
  const std::string text = ReadFileOrDie(ModelsRoot() + "/tinystories-text/tinystories_sample.txt");
  EXPECT_EQ(tok->Decode(tok->Encode(text, true)), text);
}

TEST(HfLoadTest, Errors) {
  EXPECT_EQ(ParseHfTokenizer("{").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseHfTokenizer(R"({"model":{"type":"WordPiece","vocab":{}}})").status().code(),
            absl::StatusCode::kUnimplemented);
  // No ByteLevel pre-tokenizer: a BPE over characters, which loads.
  EXPECT_TRUE(ParseHfTokenizer(R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]}})").ok());
  EXPECT_EQ(LoadHfTokenizer("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
}

// Found by tests/fuzz/tokenizer_json_fuzz (corpus regress-float-token-id): a token id that is a
// JSON float was converted with get<int64_t>(), undefined behaviour for 1e300 (UBSan) and a
// silent truncation for 7.5 (served as token 7). Both are refused now.
TEST(HfLoadTest, NonIntegerTokenIdsAreRefused) {
  nlohmann::json j = nlohmann::json::parse(MakeTokenizerJson(false));
  ASSERT_TRUE(ParseHfTokenizer(j.dump()).ok());
  nlohmann::json vocab_float = j;
  vocab_float["model"]["vocab"]["a"] = 1e300;
  auto a = ParseHfTokenizer(vocab_float.dump());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << a.status();
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("bad token id"));
  nlohmann::json added_float = j;
  added_float["added_tokens"][0]["id"] = 7.5;
  auto b = ParseHfTokenizer(added_float.dump());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("bad token id"));
}

TEST(HfLoadTest, LoadsFromFile) {
  const std::string path = ::testing::TempDir() + "/sparsex_tokenizer_test.json";
  std::ofstream(path) << MakeTokenizerJson(true);
  auto t = LoadHfTokenizer(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->Encode(" the", false), ElementsAre(Id(" the")));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace sparsex

namespace sparsex {
namespace {

// 40,000 added tokens sharing a first byte (inserting them one by one once re-sorted the
// bucket each time, 71 s to load). Every one is found, and the longest match wins over its
// prefixes. The load time is printed, not asserted (speed lives in benchmarks).
TEST(HfAddedTokensTest, ManyAddedTokensLoadAndTheLongestMatchWins) {
  nlohmann::json j = nlohmann::json::parse(MakeTokenizerJson(/*llama3=*/true));
  constexpr int kMany = 40000;
  for (int i = 0; i < kMany; ++i) {
    j["added_tokens"].push_back(
        {{"id", kTool + 1 + i}, {"content", "<extra_" + std::to_string(i) + ">"}, {"special", false}});
  }
  j["added_tokens"].push_back({{"id", kTool + 1 + kMany}, {"content", "<extra_1"}, {"special", false}});
  const auto t0 = std::chrono::steady_clock::now();
  auto t = ParseHfTokenizer(j.dump());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(t.ok()) << t.status();
  std::printf("parsed %d added tokens in %.2f s\n", kMany, s);
  const std::vector<int32_t> ids = (*t)->Encode("<extra_12345><extra_1><extra_1", false);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[0], kTool + 1 + 12345);
  EXPECT_EQ(ids[1], kTool + 1 + 1);           // "<extra_1>" beats its prefix "<extra_1"
  EXPECT_EQ(ids[2], kTool + 1 + kMany);       // only the prefix is there
}

// --- tokenizer.json components ---

std::unique_ptr<Tokenizer> ParseOrDie(const nlohmann::json& j) {
  auto t = ParseHfTokenizer(j.dump());
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

nlohmann::json Llama3Json() { return nlohmann::json::parse(MakeTokenizerJson(/*llama3=*/true)); }

TEST(HfNormalizerTest, NfcIsApplied) {
  const std::string composed = "Caf\xC3\xA9", decomposed = "Cafe\xCC\x81";
  nlohmann::json j = Llama3Json();
  auto plain = ParseOrDie(j);
  ASSERT_NE(plain, nullptr);
  // Without a normalizer the two spellings are different bytes, hence different ids.
  EXPECT_NE(plain->Encode(composed, false), plain->Encode(decomposed, false));
  j["normalizer"] = {{"type", "NFC"}};
  auto nfc = ParseOrDie(j);
  ASSERT_NE(nfc, nullptr);
  EXPECT_EQ(nfc->Encode(decomposed, false), plain->Encode(composed, false));
  EXPECT_EQ(nfc->Encode(composed, false), plain->Encode(composed, false));
  j["normalizer"] = {{"type", "NFD"}};
  auto nfd = ParseOrDie(j);
  EXPECT_EQ(nfd->Encode(composed, false), plain->Encode(decomposed, false));
  // NFKC folds compatibility characters: the ligature U+FB01 becomes "fi".
  j["normalizer"] = {{"type", "NFKC"}};
  auto nfkc = ParseOrDie(j);
  EXPECT_EQ(nfkc->Encode("\xEF\xAC\x81", false), plain->Encode("fi", false));
  j["normalizer"] = {{"type", "NFKD"}};
  auto nfkd = ParseOrDie(j);
  EXPECT_EQ(nfkd->Encode("\xEF\xAC\x81" "\xC3\xA9", false), plain->Encode("fie\xCC\x81", false));
  // Invalid UTF-8 is kept as bytes around the normalized text.
  EXPECT_EQ(nfc->Encode("\xFF" "e\xCC\x81", false), plain->Encode("\xFF\xC3\xA9", false));
}

TEST(HfNormalizerTest, SequenceOfTextNormalizers) {
  nlohmann::json j = Llama3Json();
  auto plain = ParseOrDie(j);
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}},
        {{"type", "Lowercase"}},
        {{"type", "NFD"}},
        {{"type", "StripAccents"}},
        {{"type", "Replace"}, {"pattern", {{"String", "q"}}}, {"content", "w"}},
        {{"type", "Replace"}, {"pattern", {{"Regex", "[0-9]+"}}}, {"content", "#"}},
        {{"type", "Prepend"}, {"prepend", ">"}}}}};
  auto t = ParseOrDie(j);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Encode("  HELLO Qorld 123 \xC3\x89t\xC3\xA9 \t", false),
            plain->Encode(">hello world # ete", false));
  // Prepend leaves an empty section empty; Strip can empty one.
  EXPECT_TRUE(t->Encode("   ", false).empty());
}

TEST(HfNormalizerTest, BertNormalizer) {
  nlohmann::json j = Llama3Json();
  auto plain = ParseOrDie(j);
  j["normalizer"] = {{"type", "BertNormalizer"},
                     {"clean_text", true},
                     {"handle_chinese_chars", true},
                     {"strip_accents", nullptr},
                     {"lowercase", true}};
  auto t = ParseOrDie(j);
  ASSERT_NE(t, nullptr);
  // Controls removed, tabs to spaces, CJK padded, lowercased with accents stripped.
  EXPECT_EQ(t->Encode("A\x01\tB\xE4\xB8\xAD\xC3\x89", false),
            plain->Encode("a b \xE4\xB8\xAD e", false));
}

TEST(HfNormalizerTest, UnknownComponentsAreRefusedByName) {
  auto refused = [](nlohmann::json j, const std::string& name) {
    auto t = ParseHfTokenizer(j.dump());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented) << name;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(name));
  };
  nlohmann::json j = Llama3Json();
  j["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}};
  refused(j, "normalizer 'Precompiled' not supported");
  j = Llama3Json();
  j["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
  refused(j, "pre-tokenizer 'UnicodeScripts' not supported");
  j = Llama3Json();
  j["decoder"] = {{"type", "CTC"}};
  refused(j, "decoder 'CTC' not supported");
  j = Llama3Json();
  j["post_processor"] = {{"type", "RobertaProcessing"}};
  refused(j, "post-processor 'RobertaProcessing'");
  j = Llama3Json();
  j["model"]["continuing_subword_prefix"] = "##";
  refused(j, "continuing_subword_prefix");
  j = Llama3Json();
  j["model"]["dropout"] = 0.1;
  refused(j, "dropout");
  j = Llama3Json();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  refused(j, "split behavior 'Sideways'");
  j = Llama3Json();
  j["added_tokens"][0]["single_word"] = true;
  refused(j, "single_word");
  // Empty-string prefix / suffix mean none (Qwen2/3 and GPT-4o files write them so).
  j = Llama3Json();
  j["model"]["continuing_subword_prefix"] = "";
  j["model"]["end_of_word_suffix"] = "";
  j["model"]["dropout"] = nullptr;
  EXPECT_TRUE(ParseHfTokenizer(j.dump()).ok());
}

// A BPE over characters: a, b, -, and merges "a -", "- b", "a- b".
nlohmann::json CharJson(const nlohmann::json& pre) {
  nlohmann::json j;
  j["model"] = {{"type", "BPE"},
                {"vocab", {{"a", 0}, {"b", 1}, {"-", 2}, {"a-", 3}, {"-b", 4}, {"a-b", 5}}},
                {"merges", {"a -", "- b", "a- b"}}};
  j["pre_tokenizer"] = pre;
  return j;
}

TEST(HfPreTokenizerTest, SplitBehaviors) {
  auto enc = [](const nlohmann::json& pre, const std::string& text) {
    auto t = ParseOrDie(CharJson(pre));
    return t ? t->Encode(text, false) : std::vector<int32_t>{-99};
  };
  auto split = [](const char* behavior, bool invert) {
    return nlohmann::json{{"type", "Split"},
                          {"pattern", {{"String", "-"}}},
                          {"behavior", behavior},
                          {"invert", invert}};
  };
  EXPECT_THAT(enc(nullptr, "a-b"), ElementsAre(5));
  EXPECT_THAT(enc(split("Removed", false), "a-b"), ElementsAre(0, 1));
  EXPECT_THAT(enc(split("Isolated", false), "a-b"), ElementsAre(0, 2, 1));
  EXPECT_THAT(enc(split("MergedWithPrevious", false), "a-b"), ElementsAre(3, 1));
  EXPECT_THAT(enc(split("MergedWithNext", false), "a-b"), ElementsAre(0, 4));
  EXPECT_THAT(enc(split("Contiguous", false), "a--b"), ElementsAre(0, 2, 2, 1));
  EXPECT_THAT(enc(split("Removed", true), "a-b-"), ElementsAre(2, 2));  // only the matches
  // Regex patterns, Whitespace, Digits and Punctuation pre-tokenizers split the same way.
  EXPECT_THAT(enc({{"type", "Split"}, {"pattern", {{"Regex", "-+"}}}, {"behavior", "Isolated"}},
                  "a--b"),
              ElementsAre(0, 2, 2, 1));
  EXPECT_THAT(enc({{"type", "Punctuation"}}, "a-b"), ElementsAre(0, 2, 1));
  EXPECT_THAT(enc({{"type", "WhitespaceSplit"}}, "a- b"), ElementsAre(3, 1));
  EXPECT_THAT(enc({{"type", "Whitespace"}}, "a-b"), ElementsAre(0, 2, 1));
}

TEST(HfModelTest, ByteLevelPiecesDecodeWithoutADecoder) {
  nlohmann::json j = Llama3Json();
  j.erase("decoder");
  auto t = ParseOrDie(j);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->TokenPiece(Id(" the")), " the");
  EXPECT_EQ(t->Decode(t->Encode("hello\n\n world", false)), "hello\n\n world");
}

TEST(HfModelTest, ByteFallbackAndUnknown) {
  nlohmann::json j;
  j["model"] = {{"type", "BPE"},
                {"vocab", {{"<unk>", 0}, {"a", 1}, {"<0xC3>", 2}, {"<0xA9>", 3}}},
                {"merges", nlohmann::json::array()},
                {"unk_token", "<unk>"},
                {"byte_fallback", true}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  auto t = ParseOrDie(j);
  ASSERT_NE(t, nullptr);
  // é has no token: its UTF-8 bytes; ü lacks <0xBC>: the unknown token.
  EXPECT_THAT(t->Encode("a\xC3\xA9\xC3\xBC", false), ElementsAre(1, 2, 3, 0));
  EXPECT_EQ(t->Decode({1, 2, 3}), "a\xC3\xA9");
  j["model"]["byte_fallback"] = false;
  j["model"]["fuse_unk"] = true;
  t = ParseOrDie(j);
  EXPECT_THAT(t->Encode("a\xC3\xA9\xC3\xBC" "a", false), ElementsAre(1, 0, 1));
}

TEST(HfModelTest, MetaspaceLikeSentencePiece) {
  nlohmann::json j;
  const std::string sp = "\xE2\x96\x81";
  j["model"] = {{"type", "BPE"},
                {"vocab", {{sp, 0}, {"a", 1}, {"b", 2}, {sp + "a", 3}}},
                {"merges", {sp + " a"}}};
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", sp}, {"prepend_scheme", "always"}};
  j["decoder"] = {{"type", "Metaspace"}, {"replacement", sp}, {"prepend_scheme", "always"}};
  auto t = ParseOrDie(j);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("a ab", false), ElementsAre(3, 3, 2));
  EXPECT_EQ(t->TokenPiece(3), " a");
  EXPECT_EQ(t->Decode({3, 3, 2}), "a ab");
  // prepend_scheme "first": only the text's first section gets the prefix.
  j["pre_tokenizer"]["prepend_scheme"] = "first";
  j["added_tokens"] = {{{"id", 4}, {"content", "<x>"}, {"special", false}}};
  t = ParseOrDie(j);
  EXPECT_THAT(t->Encode("a<x>a", false), ElementsAre(3, 4, 1));
}

}  // namespace
}  // namespace sparsex

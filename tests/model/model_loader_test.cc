// Model loader tests: the real stories260K GGUF, synthetic GGUF files and Hugging Face
// directories written here (single and sharded safetensors, byte-level BPE tokenizer.json), and
// corrupt variants of each (truncated, bad magic, bad header length, wrong shapes, no tokenizer).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "testing/models_dir.h"
#include "model/model.h"
#include "tests/model/byte_alphabet.h"

namespace sparsex {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string StoriesPath() { return sparsex::testing::ModelsDir() + "/stories260K/stories260K.gguf"; }

// The real model is required: a missing file fails the test (never skips) and says where it
// was looked for.
#define REQUIRE_STORIES()                                                                    \
  ASSERT_TRUE(fs::exists(StoriesPath()))                                                     \
      << "test model " << StoriesPath() << " is missing; set $SPARSEX_MODELS to the folder " \
      << "that holds stories260K/ ($SPARSEX_MODELS is "                                      \
      << (std::getenv("SPARSEX_MODELS") ? std::getenv("SPARSEX_MODELS") : "unset") << ")"

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::vector<float> ToF32(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  t.ToF32(v.data());
  return v;
}

uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float BitsF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Exact for the values the tests use (normal halves: multiples of 1/64 within [-2, 2]).
uint16_t F32ToHalfExact(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffff) == 0) return static_cast<uint16_t>(u >> 16);
  uint32_t exp = (u >> 23) & 0xff;
  return static_cast<uint16_t>(((u >> 16) & 0x8000) | ((exp - 112) << 10) | ((u >> 13) & 0x3ff));
}

class ModelLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "spx_model_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

// ---------------------------------------------------------------------------------------------
// stories260K

TEST_F(ModelLoaderTest, Stories260KConfig) {
  REQUIRE_STORIES();
  auto m = LoadGguf(StoriesPath());
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.ffn_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 2048);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.rope_layout, RopeLayout::kAdjacentPairs);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_FALSE(c.tied_embeddings);  // this GGUF carries its own output.weight

  const ModelWeights& w = (*m)->weights();
  ASSERT_EQ(w.layers.size(), 5u);
  EXPECT_EQ(w.tok_embeddings.shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(w.output.shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(w.final_norm.shape, (std::vector<int64_t>{64}));
  for (const LayerWeights& l : w.layers) {
    EXPECT_EQ(l.wq.shape, (std::vector<int64_t>{64, 64}));
    EXPECT_EQ(l.wk.shape, (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(l.wv.shape, (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(l.wo.shape, (std::vector<int64_t>{64, 64}));
    EXPECT_EQ(l.w_gate.shape, (std::vector<int64_t>{172, 64}));
    EXPECT_EQ(l.w_up.shape, (std::vector<int64_t>{172, 64}));
    EXPECT_EQ(l.w_down.shape, (std::vector<int64_t>{64, 172}));
    EXPECT_EQ(l.attn_norm.dtype, DType::kF32);
  }
  EXPECT_EQ((*m)->tokenizer().vocab_size(), 512);
  EXPECT_EQ((*m)->tokenizer().bos_id(), 1);
  EXPECT_EQ((*m)->tokenizer().eos_id(), 2);
  EXPECT_EQ((*m)->source(), StoriesPath());
}

TEST_F(ModelLoaderTest, Stories260KWeightsAreTheFileBytes) {
  REQUIRE_STORIES();
  auto m = LoadGguf(StoriesPath());
  ASSERT_TRUE(m.ok()) << m.status();
  // Data section of this file starts at 14176 (tensor infos end at 14152, aligned to 32);
  // output_norm.weight sits at data offset 131072 (after the 512x64 fp32 embedding).
  std::string bytes = ReadBytes(StoriesPath());
  std::vector<float> want(64);
  std::memcpy(want.data(), bytes.data() + 14176 + 131072, 64 * 4);
  EXPECT_EQ(ToF32((*m)->weights().final_norm), want);
  EXPECT_EQ((*m)->weights().tok_embeddings.nbytes, 512u * 64 * 4);
  EXPECT_EQ((*m)->weights().layers[4].ffn_norm.nbytes, 64u * 4);
}

TEST_F(ModelLoaderTest, Stories260KFingerprintIsStable) {
  REQUIRE_STORIES();
  auto a = LoadGguf(StoriesPath());
  auto b = LoadModel(StoriesPath());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*a)->fingerprint(), (*b)->fingerprint());
  EXPECT_EQ((*a)->fingerprint().Hex().size(), 32u);
  EXPECT_NE((*a)->fingerprint(), Hash128{});

  // A copy is the same model; a copy with one changed weight byte (inside the sampled tail of
  // the last tensor) is not.
  std::string bytes = ReadBytes(StoriesPath());
  WriteBytes(Path("copy.gguf"), bytes);
  auto c = LoadGguf(Path("copy.gguf"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->fingerprint(), (*a)->fingerprint());
  bytes[bytes.size() - 3] ^= 0x40;
  WriteBytes(Path("changed.gguf"), bytes);
  auto d = LoadGguf(Path("changed.gguf"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE((*d)->fingerprint(), (*a)->fingerprint());
}

TEST_F(ModelLoaderTest, LoadModelDispatch) {
  auto missing = LoadModel(Path("nope.gguf"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  auto missing_gguf = LoadGguf(Path("nope.gguf"));
  EXPECT_EQ(missing_gguf.status().code(), absl::StatusCode::kNotFound) << missing_gguf.status();
  auto empty_dir = LoadModel(dir_);
  EXPECT_EQ(empty_dir.status().code(), absl::StatusCode::kInvalidArgument) << empty_dir.status();
  WriteBytes(Path("weights.bin"), "xxxx");
  auto other = LoadModel(Path("weights.bin"));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
}

TEST_F(ModelLoaderTest, ModelsDirFollowsEnvironment) {
  const char* old = std::getenv("SPARSEX_MODELS");
  std::string saved = old ? old : "";
  setenv("SPARSEX_MODELS", "/some/where", 1);
  EXPECT_EQ(sparsex::testing::ModelsDir(), "/some/where");
  unsetenv("SPARSEX_MODELS");
  EXPECT_EQ(sparsex::testing::ModelsDir(), std::string(SPARSEX_SOURCE_DIR) + "/../shared/models");
  if (old) setenv("SPARSEX_MODELS", saved.c_str(), 1);
}

TEST_F(ModelLoaderTest, TruncatedGguf) {
  REQUIRE_STORIES();
  std::string bytes = ReadBytes(StoriesPath());
  // Inside the magic, the header counts, the first key, the token array, the tensor infos,
  // the alignment padding, the first tensor's data and the last tensor's data.
  for (size_t cut : {size_t{0}, size_t{3}, size_t{10}, size_t{30}, size_t{2000}, size_t{14000},
                     size_t{14160}, size_t{14176 + 100}, bytes.size() - 1}) {
    WriteBytes(Path("cut.gguf"), bytes.substr(0, cut));
    auto m = LoadGguf(Path("cut.gguf"));
    ASSERT_FALSE(m.ok()) << "cut at " << cut;
    EXPECT_NE(m.status().message().find("truncated"), std::string::npos)
        << "cut at " << cut << ": " << m.status();
  }
}

TEST_F(ModelLoaderTest, WrongMagic) {
  REQUIRE_STORIES();
  std::string bytes = ReadBytes(StoriesPath());
  bytes[3] = 'X';
  WriteBytes(Path("bad.gguf"), bytes);
  auto m = LoadGguf(Path("bad.gguf"));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("magic"), std::string::npos) << m.status();
}

// ---------------------------------------------------------------------------------------------
// Synthetic GGUF

class GgufWriter {
 public:
  template <typename T>
  void Kv(const std::string& key, uint32_t type, T v) {
    Key(key, type);
    Put(kv_, v);
  }
  void KvStr(const std::string& key, const std::string& s) {
    Key(key, 8);
    Str(kv_, s);
  }
  void KvStrArr(const std::string& key, const std::vector<std::string>& v) {
    Key(key, 9);
    Put<uint32_t>(kv_, 8);
    Put<uint64_t>(kv_, v.size());
    for (const auto& s : v) Str(kv_, s);
  }
  template <typename T>
  void KvArr(const std::string& key, uint32_t elem_type, const std::vector<T>& v) {
    Key(key, 9);
    Put<uint32_t>(kv_, elem_type);
    Put<uint64_t>(kv_, v.size());
    for (T x : v) Put(kv_, x);
  }
  // Nested array (array of two u8 arrays), to exercise the recursive walk.
  void KvNested(const std::string& key) {
    Key(key, 9);
    Put<uint32_t>(kv_, 9);
    Put<uint64_t>(kv_, 2);
    for (int i = 0; i < 2; ++i) {
      Put<uint32_t>(kv_, 0);
      Put<uint64_t>(kv_, 3);
      for (uint8_t b = 0; b < 3; ++b) Put(kv_, b);
    }
  }
  // ne in ggml order (innermost first).
  void Tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, std::string data) {
    tensors_.push_back({name, std::move(ne), type, std::move(data)});
  }
  std::string Build(uint64_t alignment = 32) const {
    std::string out = "GGUF";
    Put<uint32_t>(out, 3);
    Put<uint64_t>(out, tensors_.size());
    Put<uint64_t>(out, n_kv_);
    out += kv_;
    std::string data;
    for (const auto& t : tensors_) {
      Str(out, t.name);
      Put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
      for (uint64_t d : t.ne) Put(out, d);
      Put(out, t.type);
      while (data.size() % alignment) data.push_back('\0');
      Put<uint64_t>(out, data.size());
      data += t.data;
    }
    while (out.size() % alignment) out.push_back('\0');
    return out + data;
  }

 private:
  struct T {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::string data;
  };
  template <typename V>
  static void Put(std::string& s, V v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  static void Str(std::string& s, const std::string& v) {
    Put<uint64_t>(s, v.size());
    s += v;
  }
  void Key(const std::string& key, uint32_t type) {
    Str(kv_, key);
    Put(kv_, type);
    ++n_kv_;
  }
  std::string kv_;
  uint64_t n_kv_ = 0;
  std::vector<T> tensors_;
};

struct SynthGgufOptions {
  std::string arch = "llama";
  bool tokenizer = true;
  bool output = true;       // false: tied to token_embd
  std::string wrong_shape;  // tensor whose ne0 gets one extra element
  uint32_t type = 0;        // ggml type of the 2-D tensors (0 F32, 1 F16, 30 BF16, 2 Q4_0)
  uint64_t alignment = 32;
  bool all_kv_types = false;
  size_t pad_metadata_bytes = 0;  // a general.description of this many bytes
  bool duplicate_key = false;     // llama.block_count written twice (2, then 3)
  std::string nan_tensor;         // tensor whose element 3 is NaN (in its own dtype)
  float rope_theta = 50000.0f;    // llama.rope.freq_base
  std::string chat_template;      // tokenizer.chat_template when non-empty
  bool gpt2_vocab = false;        // a byte-level (Llama-3 style) vocabulary instead of SPM
};

constexpr int kGDim = 8, kGFfn = 12, kGHeads = 2, kGKv = 1, kGLayers = 2;

// SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, a few merges.
void AddSpmVocab(GgufWriter& w) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    tokens.push_back(buf);
    scores.push_back(0);
    types.push_back(6);
  }
  for (const char* p : {"\xe2\x96\x81"
                        "a",
                        "\xe2\x96\x81"
                        "b",
                        "ab"}) {
    tokens.push_back(p);
    scores.push_back(-static_cast<float>(tokens.size()));
    types.push_back(1);
  }
  w.KvStr("tokenizer.ggml.model", "llama");
  w.KvStrArr("tokenizer.ggml.tokens", tokens);
  w.KvArr<float>("tokenizer.ggml.scores", 6, scores);
  w.KvArr<int32_t>("tokenizer.ggml.token_type", 5, types);
  w.Kv<uint32_t>("tokenizer.ggml.bos_token_id", 4, 1);
  w.Kv<uint32_t>("tokenizer.ggml.eos_token_id", 4, 2);
  w.Kv<uint32_t>("tokenizer.ggml.unknown_token_id", 4, 0);
  w.Kv<uint8_t>("tokenizer.ggml.add_space_prefix", 7, 1);
}
constexpr int kGVocab = 3 + 256 + 3;

// Byte-level BPE vocabulary as a Llama-3 GGUF stores it: the 256 byte characters of GPT-2's
// alphabet, merged pieces "Ġa" (space a) and "ab", control tokens <|begin_of_text|>, <|eot_id|>.
void AddGpt2Vocab(GgufWriter& w) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(testing::Gpt2ByteChar(b));
  tokens.push_back("\xC4\xA0" "a");  // 256
  tokens.push_back("ab");           // 257
  tokens.push_back("<|begin_of_text|>");  // 258
  tokens.push_back("<|eot_id|>");         // 259
  std::vector<int32_t> types(tokens.size(), 1);
  types[258] = types[259] = 3;
  w.KvStr("tokenizer.ggml.model", "gpt2");
  w.KvStr("tokenizer.ggml.pre", "llama-bpe");
  w.KvStrArr("tokenizer.ggml.tokens", tokens);
  w.KvArr<int32_t>("tokenizer.ggml.token_type", 5, types);
  w.KvStrArr("tokenizer.ggml.merges", {"\xC4\xA0 a", "a b"});
  w.Kv<uint32_t>("tokenizer.ggml.bos_token_id", 4, 258);
  w.Kv<uint32_t>("tokenizer.ggml.eos_token_id", 4, 259);
}

// Writes a synthetic llama GGUF and returns the fp32 values of every tensor by name.
std::map<std::string, std::vector<float>> WriteSynthGguf(const std::string& path,
                                                         const SynthGgufOptions& o) {
  GgufWriter w;
  w.KvStr("general.architecture", o.arch);
  if (o.alignment != 32) w.Kv<uint32_t>("general.alignment", 4, static_cast<uint32_t>(o.alignment));
  const std::string a = o.arch;
  w.Kv<uint32_t>(a + ".embedding_length", 4, kGDim);
  w.Kv<uint32_t>(a + ".feed_forward_length", 4, kGFfn);
  w.Kv<uint32_t>(a + ".block_count", 4, kGLayers);
  w.Kv<uint32_t>(a + ".attention.head_count", 4, kGHeads);
  w.Kv<uint32_t>(a + ".attention.head_count_kv", 4, kGKv);
  w.Kv<uint32_t>(a + ".context_length", 4, 256);
  w.Kv<uint32_t>(a + ".rope.dimension_count", 4, kGDim / kGHeads);
  w.Kv<float>(a + ".rope.freq_base", 6, o.rope_theta);
  if (o.duplicate_key) w.Kv<uint32_t>(a + ".block_count", 4, kGLayers + 1);
  w.Kv<float>(a + ".attention.layer_norm_rms_epsilon", 6, 1e-6f);
  if (o.pad_metadata_bytes > 0) w.KvStr("general.description", std::string(o.pad_metadata_bytes, 'x'));
  if (!o.chat_template.empty()) w.KvStr("tokenizer.chat_template", o.chat_template);
  if (o.all_kv_types) {
    w.Kv<uint8_t>("test.u8", 0, 1);
    w.Kv<int8_t>("test.i8", 1, -1);
    w.Kv<uint16_t>("test.u16", 2, 2);
    w.Kv<int16_t>("test.i16", 3, -2);
    w.Kv<int32_t>("test.i32", 5, -3);
    w.Kv<uint64_t>("test.u64", 10, 4);
    w.Kv<int64_t>("test.i64", 11, -4);
    w.Kv<double>("test.f64", 12, 0.5);
    w.KvArr<double>("test.f64s", 12, {1.0, 2.0});
    w.KvArr<int64_t>("test.i64s", 11, {1, -2});
    w.KvArr<uint8_t>("test.bools", 7, {1, 0, 1});
    w.KvNested("test.nested");
    w.KvStrArr("test.empty", {});
  }
  if (o.tokenizer && o.gpt2_vocab) AddGpt2Vocab(w);
  if (o.tokenizer && !o.gpt2_vocab) AddSpmVocab(w);

  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> dist(-64, 64);
  std::map<std::string, std::vector<float>> values;
  auto add = [&](const std::string& name, std::vector<uint64_t> ne, bool matrix) {
    if (name == o.wrong_shape) ne[0] += 1;
    uint64_t n = 1;
    for (uint64_t d : ne) n *= d;
    uint32_t type = matrix ? o.type : 0;  // norms stay F32, as converters write them
    std::vector<float> v(n);
    std::string bytes;
    for (auto& x : v) {
      x = static_cast<float>(dist(rng)) / 64.0f;  // exact in F16 and BF16
      if (name == o.nan_tensor && &x == &v[3]) {
        x = std::numeric_limits<float>::quiet_NaN();
        if (type == 1) {  // F16 NaN: exponent all ones, mantissa non-zero
          uint16_t h = 0x7e00;
          bytes.append(reinterpret_cast<const char*>(&h), 2);
          continue;
        }
      }
      if (type == 0) {
        bytes.append(reinterpret_cast<const char*>(&x), 4);
      } else if (type == 1) {
        uint16_t h = F32ToHalfExact(x);
        bytes.append(reinterpret_cast<const char*>(&h), 2);
      } else if (type == 30) {
        uint16_t h = static_cast<uint16_t>(F32Bits(x) >> 16);
        bytes.append(reinterpret_cast<const char*>(&h), 2);
      } else {
        bytes.append(2, '\0');  // opaque payload of an unsupported type
      }
    }
    values[name] = v;
    w.Tensor(name, std::move(ne), type, std::move(bytes));
  };
  const uint64_t d = kGDim, f = kGFfn, hd = kGDim / kGHeads;
  add("token_embd.weight", {d, kGVocab}, true);
  add("output_norm.weight", {d}, false);
  if (o.output) add("output.weight", {d, kGVocab}, true);
  for (int i = 0; i < kGLayers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    add(p + "attn_norm.weight", {d}, false);
    add(p + "attn_q.weight", {d, kGHeads * hd}, true);
    add(p + "attn_k.weight", {d, kGKv * hd}, true);
    add(p + "attn_v.weight", {d, kGKv * hd}, true);
    add(p + "attn_output.weight", {kGHeads * hd, d}, true);
    add(p + "ffn_norm.weight", {d}, false);
    add(p + "ffn_gate.weight", {d, f}, true);
    add(p + "ffn_up.weight", {d, f}, true);
    add(p + "ffn_down.weight", {f, d}, true);
  }
  WriteBytes(path, w.Build(o.alignment));
  return values;
}

void ExpectGgufValues(const Model& m, const std::map<std::string, std::vector<float>>& values) {
  const ModelWeights& w = m.weights();
  std::vector<const TensorView*> all = {&w.tok_embeddings, &w.final_norm, &w.output};
  for (const auto& l : w.layers) {
    for (const TensorView* t :
         {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down}) {
      all.push_back(t);
    }
  }
  for (const TensorView* t : all) {
    auto it = values.find(t->name);
    ASSERT_NE(it, values.end()) << t->name;
    EXPECT_EQ(ToF32(*t), it->second) << t->name;
  }
}

// The RoPE configuration changes every position's K: it is in the model fingerprint, and so in
// every KV key (tests/security/kv_identity_test.cc pairs each identity field through the tiers).
TEST_F(ModelLoaderTest, RopeConfigurationChangesTheFingerprint) {
  SynthGgufOptions a;
  WriteSynthGguf(Path("rope_a.gguf"), a);
  SynthGgufOptions b;
  b.rope_theta = 10000.0f;
  WriteSynthGguf(Path("rope_b.gguf"), b);
  auto ma = LoadModel(Path("rope_a.gguf"));
  auto mb = LoadModel(Path("rope_b.gguf"));
  auto ma2 = LoadModel(Path("rope_a.gguf"));
  ASSERT_TRUE(ma.ok() && mb.ok() && ma2.ok());
  EXPECT_EQ((*ma)->fingerprint(), (*ma2)->fingerprint());
  EXPECT_NE((*ma)->fingerprint(), (*mb)->fingerprint());
}

TEST_F(ModelLoaderTest, SyntheticGgufAllTypesAndAlignment) {
  for (uint32_t type : {0u, 1u, 30u}) {
    SynthGgufOptions o;
    o.type = type;
    o.alignment = 64;
    o.all_kv_types = true;
    auto values = WriteSynthGguf(Path("s.gguf"), o);
    auto m = LoadModel(Path("s.gguf"));
    ASSERT_TRUE(m.ok()) << "type " << type << ": " << m.status();
    const ModelConfig& c = (*m)->config();
    EXPECT_EQ(c.dim, kGDim);
    EXPECT_EQ(c.ffn_dim, kGFfn);
    EXPECT_EQ(c.n_layers, kGLayers);
    EXPECT_EQ(c.n_heads, kGHeads);
    EXPECT_EQ(c.n_kv_heads, kGKv);
    EXPECT_EQ(c.head_dim, kGDim / kGHeads);
    EXPECT_EQ(c.vocab_size, kGVocab);
    EXPECT_EQ(c.max_seq_len, 256);
    EXPECT_FLOAT_EQ(c.rope_theta, 50000.0f);
    EXPECT_FLOAT_EQ(c.rms_eps, 1e-6f);
    const DType want = type == 0 ? DType::kF32 : type == 1 ? DType::kF16 : DType::kBF16;
    EXPECT_EQ((*m)->weights().layers[1].wq.dtype, want);
    EXPECT_EQ((*m)->weights().layers[1].wk.shape, (std::vector<int64_t>{4, 8}));
    EXPECT_EQ((*m)->weights().layers[1].w_down.shape, (std::vector<int64_t>{8, 12}));
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*m)->weights().layers[0].wq.data) % 64,
              reinterpret_cast<uintptr_t>((*m)->weights().tok_embeddings.data) % 64);
    ExpectGgufValues(**m, values);
    EXPECT_EQ((*m)->tokenizer().vocab_size(), kGVocab);
  }
}

TEST_F(ModelLoaderTest, GgufWithoutOutputIsTied) {
  SynthGgufOptions o;
  o.output = false;
  WriteSynthGguf(Path("t.gguf"), o);
  auto m = LoadGguf(Path("t.gguf"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->config().tied_embeddings);
  EXPECT_EQ((*m)->weights().output.data, (*m)->weights().tok_embeddings.data);
  EXPECT_EQ((*m)->weights().output.shape, (std::vector<int64_t>{kGVocab, kGDim}));
}

TEST_F(ModelLoaderTest, GgufShapeMismatch) {
  SynthGgufOptions o;
  o.wrong_shape = "blk.1.attn_k.weight";
  WriteSynthGguf(Path("w.gguf"), o);
  auto m = LoadGguf(Path("w.gguf"));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("shape"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("blk.1.attn_k.weight"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("[4, 9]"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("[4, 8]"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, GgufWithByteLevelVocabulary) {
  SynthGgufOptions o;
  o.gpt2_vocab = true;
  auto values = WriteSynthGguf(Path("b.gguf"), o);
  auto m = LoadGguf(Path("b.gguf"));
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectGgufValues(**m, values);
  const Tokenizer& t = (*m)->tokenizer();
  EXPECT_EQ(t.vocab_size(), 260);
  EXPECT_EQ(t.bos_id(), 258);
  // Llama-3 pre-tokens " a" (a whole token) and " ab" (merged: "Ġ a" ranks before "a b").
  EXPECT_EQ(t.Encode(" a ab", /*add_bos=*/true), (std::vector<int32_t>{258, 256, 256, 'b'}));
  EXPECT_EQ(t.Decode({258, 256, ' ', 257, 259}), " a ab");
  const std::vector<int32_t> stops = t.StopIds();
  EXPECT_NE(std::find(stops.begin(), stops.end(), 259), stops.end());
  auto info = LoadModelInfo(Path("b.gguf"));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokenizer->Encode("ab", false), (std::vector<int32_t>{257}));
}

TEST_F(ModelLoaderTest, GgufMissingTokenizer) {
  SynthGgufOptions o;
  o.tokenizer = false;
  WriteSynthGguf(Path("n.gguf"), o);
  auto m = LoadGguf(Path("n.gguf"));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tokenizer"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, GgufUnsupportedTypeAndArchitecture) {
  SynthGgufOptions q;
  q.type = 3;  // Q4_1 (Q8_0, Q4_0, Q4_K and Q6_K load: tests/model/quant_test.cc)
  WriteSynthGguf(Path("q.gguf"), q);
  auto m = LoadGguf(Path("q.gguf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_NE(m.status().message().find("Q4_1"), std::string::npos) << m.status();
  // A supported block type whose rows (8 values) are not whole 32-value blocks: a clear error.
  q.type = 2;  // Q4_0
  WriteSynthGguf(Path("q2.gguf"), q);
  auto m2 = LoadGguf(Path("q2.gguf"));
  EXPECT_EQ(m2.status().code(), absl::StatusCode::kInvalidArgument) << m2.status();
  EXPECT_NE(m2.status().message().find("whole number of 32-value blocks"), std::string::npos)
      << m2.status();

  SynthGgufOptions g;
  g.arch = "gpt2";
  WriteSynthGguf(Path("g.gguf"), g);
  auto n = LoadGguf(Path("g.gguf"));
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnimplemented) << n.status();
  EXPECT_NE(n.status().message().find("gpt2"), std::string::npos) << n.status();
}

TEST_F(ModelLoaderTest, TruncatedSyntheticGgufThroughoutTheHeader) {
  // Cuts all through the metadata and tensor infos (every 17th byte) must be reported, never
  // read past.
  SynthGgufOptions o;
  o.all_kv_types = true;
  WriteSynthGguf(Path("full.gguf"), o);
  std::string bytes = ReadBytes(Path("full.gguf"));
  for (size_t cut = 0; cut < bytes.size(); cut += (cut < 8000 ? 17 : 997)) {
    WriteBytes(Path("cut.gguf"), bytes.substr(0, cut));
    auto m = LoadGguf(Path("cut.gguf"));
    ASSERT_FALSE(m.ok()) << "cut at " << cut;
    ASSERT_NE(m.status().message().find("truncated"), std::string::npos)
        << "cut at " << cut << ": " << m.status();
  }
}

// ---------------------------------------------------------------------------------------------
// Hugging Face directories

// GPT-2's byte-to-unicode table: printable bytes map to themselves, others to U+0100 onwards.
std::string ByteLevelChar(int b) {
  int cp;
  if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) {
    cp = b;
  } else {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
    }
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

json MinimalTokenizerJson() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelChar(b)] = b;
  const std::string sp = ByteLevelChar(' ');  // "Ġ"
  vocab[sp + "t"] = 256;
  vocab["he"] = 257;
  vocab[sp + "the"] = 258;
  json merges = json::array({sp + " t", "h e", sp + "t he"});
  json added = json::array();
  int id = 259;
  for (const char* s : {"<|begin_of_text|>", "<|end_of_text|>"}) {
    added.push_back({{"id", id++},
                     {"content", s},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "ByteLevel"},
            {"add_prefix_space", false},
            {"trim_offsets", true},
            {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "ByteLevel"},
            {"add_prefix_space", true},
            {"trim_offsets", true},
            {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", merges}}}};
}

struct HfTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
  std::vector<float> values;  // what ToF32 must return
};

std::string SafetensorsBytes(const std::vector<HfTensor>& ts) {
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  for (const auto& t : ts) {
    h[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::string header = h.dump();
  while (header.size() % 8) header.push_back(' ');  // as the reference writer pads
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  out += header;
  for (const auto& t : ts) out += t.bytes;
  return out;
}

struct HfOptions {
  bool sharded = false;
  bool tied = false;
  bool tokenizer = true;
  std::string wrong_shape;  // tensor whose first dimension gets one extra row
};

constexpr int kHDim = 16, kHFfn = 24, kHLayers = 2, kHHeads = 4, kHKv = 2, kHVocab = 264;

// Writes config.json, weights (F32, with BF16 MLP projections) and tokenizer.json into dir.
std::vector<HfTensor> WriteHfModel(const std::string& dir, const HfOptions& o) {
  fs::create_directories(dir);
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"model_type", "llama"},
                 {"hidden_size", kHDim},
                 {"intermediate_size", kHFfn},
                 {"num_hidden_layers", kHLayers},
                 {"num_attention_heads", kHHeads},
                 {"num_key_value_heads", kHKv},
                 {"vocab_size", kHVocab},
                 {"max_position_embeddings", 131072},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 500000.0},
                 {"hidden_act", "silu"},
                 {"attention_bias", false},
                 {"tie_word_embeddings", o.tied},
                 {"torch_dtype", "bfloat16"},
                 {"rope_scaling",
                  {{"rope_type", "llama3"},
                   {"factor", 8.0},
                   {"low_freq_factor", 1.0},
                   {"high_freq_factor", 4.0},
                   {"original_max_position_embeddings", 8192}}}};
  WriteBytes(dir + "/config.json", config.dump(2));
  if (o.tokenizer) WriteBytes(dir + "/tokenizer.json", MinimalTokenizerJson().dump());

  std::mt19937 rng(42);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<HfTensor> ts;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool bf16) {
    if (name == o.wrong_shape) shape[0] += 1;
    HfTensor t{name, bf16 ? "BF16" : "F32", shape, {}, {}};
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    for (int64_t i = 0; i < n; ++i) {
      float x = dist(rng);
      if (bf16) {
        uint16_t h = static_cast<uint16_t>(F32Bits(x) >> 16);
        t.bytes.append(reinterpret_cast<const char*>(&h), 2);
        x = BitsF32(uint32_t{h} << 16);
      } else {
        t.bytes.append(reinterpret_cast<const char*>(&x), 4);
      }
      t.values.push_back(x);
    }
    ts.push_back(std::move(t));
  };
  const int64_t hd = kHDim / kHHeads;
  add("model.embed_tokens.weight", {kHVocab, kHDim}, false);
  for (int i = 0; i < kHLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {kHDim}, false);
    add(p + "self_attn.q_proj.weight", {kHHeads * hd, kHDim}, false);
    add(p + "self_attn.k_proj.weight", {kHKv * hd, kHDim}, false);
    add(p + "self_attn.v_proj.weight", {kHKv * hd, kHDim}, false);
    add(p + "self_attn.o_proj.weight", {kHDim, kHHeads * hd}, false);
    add(p + "post_attention_layernorm.weight", {kHDim}, false);
    add(p + "mlp.gate_proj.weight", {kHFfn, kHDim}, true);
    add(p + "mlp.up_proj.weight", {kHFfn, kHDim}, true);
    add(p + "mlp.down_proj.weight", {kHDim, kHFfn}, true);
  }
  add("model.norm.weight", {kHDim}, false);
  if (!o.tied) add("lm_head.weight", {kHVocab, kHDim}, false);

  if (!o.sharded) {
    WriteBytes(dir + "/model.safetensors", SafetensorsBytes(ts));
  } else {
    const size_t half = ts.size() / 2;
    std::vector<HfTensor> a(ts.begin(), ts.begin() + half), b(ts.begin() + half, ts.end());
    const std::string fa = "model-00001-of-00002.safetensors",
                      fb = "model-00002-of-00002.safetensors";
    WriteBytes(dir + "/" + fa, SafetensorsBytes(a));
    WriteBytes(dir + "/" + fb, SafetensorsBytes(b));
    json map = json::object();
    for (const auto& t : a) map[t.name] = fa;
    for (const auto& t : b) map[t.name] = fb;
    json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", map}};
    WriteBytes(dir + "/model.safetensors.index.json", index.dump(2));
  }
  return ts;
}

std::vector<const TensorView*> AllTensors(const Model& m) {
  const ModelWeights& w = m.weights();
  std::vector<const TensorView*> all = {&w.tok_embeddings, &w.final_norm, &w.output};
  for (const auto& l : w.layers) {
    for (const TensorView* t :
         {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down}) {
      all.push_back(t);
    }
  }
  return all;
}

TEST_F(ModelLoaderTest, HfDirectoryLoads) {
  auto ts = WriteHfModel(Path("hf"), {});
  auto m = LoadModel(Path("hf"));
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  EXPECT_EQ(c.rope_layout, RopeLayout::kHalves);
  EXPECT_EQ(c.dim, kHDim);
  EXPECT_EQ(c.ffn_dim, kHFfn);
  EXPECT_EQ(c.n_layers, kHLayers);
  EXPECT_EQ(c.n_heads, kHHeads);
  EXPECT_EQ(c.n_kv_heads, kHKv);
  EXPECT_EQ(c.head_dim, kHDim / kHHeads);
  EXPECT_EQ(c.vocab_size, kHVocab);
  EXPECT_EQ(c.max_seq_len, 131072);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.0f);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_FLOAT_EQ(c.rope_scaling.factor, 8.0f);
  EXPECT_FLOAT_EQ(c.rope_scaling.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c.rope_scaling.high_freq_factor, 4.0f);
  EXPECT_EQ(c.rope_scaling.original_max_position, 8192);

  const ModelWeights& w = (*m)->weights();
  EXPECT_EQ(w.layers[1].wk.shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(w.layers[1].wo.shape, (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(w.layers[1].w_down.shape, (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(w.layers[1].w_down.dtype, DType::kBF16);
  EXPECT_EQ(w.layers[1].wq.dtype, DType::kF32);
  EXPECT_NE(w.output.data, w.tok_embeddings.data);
  std::map<std::string, const HfTensor*> by_name;
  for (const auto& t : ts) by_name[t.name] = &t;
  for (const TensorView* t : AllTensors(**m)) {
    ASSERT_TRUE(by_name.contains(t->name)) << t->name;
    EXPECT_EQ(ToF32(*t), by_name[t->name]->values) << t->name;
  }
  EXPECT_GE((*m)->tokenizer().vocab_size(), 256);
  EXPECT_EQ((*m)->fingerprint().Hex().size(), 32u);
}

TEST_F(ModelLoaderTest, HfShardedEqualsSingleFile) {
  WriteHfModel(Path("single"), {});
  HfOptions so;
  so.sharded = true;
  WriteHfModel(Path("sharded"), so);
  ASSERT_FALSE(fs::exists(Path("sharded/model.safetensors")));
  auto a = LoadHfDirectory(Path("single"));
  auto b = LoadHfDirectory(Path("sharded"));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->files_.size(), 2u);
  auto ta = AllTensors(**a), tb = AllTensors(**b);
  ASSERT_EQ(ta.size(), tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    EXPECT_EQ(ta[i]->name, tb[i]->name);
    EXPECT_EQ(ta[i]->shape, tb[i]->shape);
    EXPECT_EQ(ta[i]->dtype, tb[i]->dtype);
    EXPECT_EQ(ToF32(*ta[i]), ToF32(*tb[i])) << ta[i]->name;
  }
  // Same weights, same config: same model, however the files are split.
  EXPECT_EQ((*a)->fingerprint(), (*b)->fingerprint());
}

TEST_F(ModelLoaderTest, HfTiedEmbeddings) {
  HfOptions o;
  o.tied = true;
  WriteHfModel(Path("tied"), o);
  auto m = LoadHfDirectory(Path("tied"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->config().tied_embeddings);
  EXPECT_EQ((*m)->weights().output.data, (*m)->weights().tok_embeddings.data);
}

TEST_F(ModelLoaderTest, HfMissingTokenizer) {
  HfOptions o;
  o.tokenizer = false;
  WriteHfModel(Path("hf"), o);
  auto m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  EXPECT_NE(m.status().message().find("tokenizer"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, HfShapeMismatch) {
  HfOptions o;
  o.wrong_shape = "model.layers.1.self_attn.k_proj.weight";
  WriteHfModel(Path("hf"), o);
  auto m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("shape"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("k_proj"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, HfUnsupportedConfig) {
  WriteHfModel(Path("hf"), {});
  auto patch = [&](const std::function<void(json&)>& f) {
    json c = json::parse(ReadBytes(Path("hf/config.json")));
    f(c);
    WriteBytes(Path("hf/config.json"), c.dump());
  };
  patch([](json& c) { c["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}}; });
  auto m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_NE(m.status().message().find("yarn"), std::string::npos) << m.status();

  patch([](json& c) {
    c.erase("rope_scaling");
    c["architectures"] = {"GPT2LMHeadModel"};
    c["model_type"] = "gpt2";
  });
  m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_NE(m.status().message().find("GPT2LMHeadModel"), std::string::npos) << m.status();

  patch([](json& c) {
    c["architectures"] = {"LlamaForCausalLM"};
    c["model_type"] = "llama";
    c["num_key_value_heads"] = 3;  // 4 heads are not a multiple of 3 kv heads
  });
  m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();

  patch([](json& c) { c["hidden_size"] = "sixteen"; });
  m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("hidden_size"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, TruncatedSafetensors) {
  WriteHfModel(Path("hf"), {});
  const std::string st = ReadBytes(Path("hf/model.safetensors"));
  uint64_t hlen;
  std::memcpy(&hlen, st.data(), 8);
  // Inside the length, inside the JSON header, inside the first tensor, one byte short.
  for (size_t cut : {size_t{0}, size_t{4}, size_t{8 + 10}, size_t{8 + hlen + 5}, st.size() - 1}) {
    WriteBytes(Path("hf/model.safetensors"), st.substr(0, cut));
    auto m = LoadHfDirectory(Path("hf"));
    ASSERT_FALSE(m.ok()) << "cut at " << cut;
    EXPECT_NE(m.status().message().find("truncated"), std::string::npos)
        << "cut at " << cut << ": " << m.status();
  }
}

TEST_F(ModelLoaderTest, SafetensorsBadHeader) {
  WriteHfModel(Path("hf"), {});
  const std::string st = ReadBytes(Path("hf/model.safetensors"));
  for (uint64_t bad : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 40, ~uint64_t{0}}) {
    std::string b = st;
    std::memcpy(b.data(), &bad, 8);
    WriteBytes(Path("hf/model.safetensors"), b);
    auto m = LoadHfDirectory(Path("hf"));
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_NE(m.status().message().find("header length"), std::string::npos) << m.status();
  }
  // A length that ends inside the JSON: the header is not valid JSON.
  {
    std::string b = st;
    uint64_t shorter = 16;
    std::memcpy(b.data(), &shorter, 8);
    WriteBytes(Path("hf/model.safetensors"), b);
    auto m = LoadHfDirectory(Path("hf"));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  }
  // data_offsets that disagree with dtype * shape.
  {
    HfTensor t{"model.norm.weight", "F32", {4}, std::string(12, '\0'), {}};
    WriteBytes(Path("hf/model.safetensors"), SafetensorsBytes({t}));
    auto m = LoadHfDirectory(Path("hf"));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find("data_offsets"), std::string::npos) << m.status();
  }
}

TEST_F(ModelLoaderTest, ShardIndexNamesMissingTensor) {
  HfOptions o;
  o.sharded = true;
  WriteHfModel(Path("hf"), o);
  json index = json::parse(ReadBytes(Path("hf/model.safetensors.index.json")));
  index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors";
  WriteBytes(Path("hf/model.safetensors.index.json"), index.dump());
  auto m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  index["weight_map"]["model.extra.weight"] = "../escape.safetensors";
  WriteBytes(Path("hf/model.safetensors.index.json"), index.dump());
  m = LoadHfDirectory(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
}

// ---------------------------------------------------------------------------------------------
// dtype conversion

TEST(TensorViewTest, F16AndBF16ToF32) {
  const uint16_t h[] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF,
                        0x0400, 0x8000, 0x7C00, 0xFC00, 0x3555};
  TensorView t{"h", DType::kF16, {10}, h, sizeof h};
  std::vector<float> f = ToF32(t);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 65504.0f);
  EXPECT_EQ(f[3], std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(f[4], std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(f[5], std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(F32Bits(f[6]), 0x80000000u);      // -0
  EXPECT_EQ(f[7], INFINITY);
  EXPECT_EQ(f[8], -INFINITY);
  EXPECT_EQ(f[9], 0.333251953125f);
  const uint16_t nan = 0x7E00;
  float fn;
  TensorView{"n", DType::kF16, {1}, &nan, 2}.ToF32(&fn);
  EXPECT_TRUE(std::isnan(fn));

  const uint16_t b[] = {0x3F80, 0xC040, 0x7F80, 0x0001, 0x3EAB};
  TensorView tb{"b", DType::kBF16, {5}, b, sizeof b};
  std::vector<float> g = ToF32(tb);
  EXPECT_EQ(g[0], 1.0f);
  EXPECT_EQ(g[1], -3.0f);
  EXPECT_EQ(g[2], INFINITY);
  EXPECT_EQ(F32Bits(g[3]), 0x00010000u);
  EXPECT_EQ(F32Bits(g[4]), 0x3EAB0000u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_STREQ(DTypeName(DType::kF16), "F16");
  EXPECT_EQ(tb.numel(), 5);
}

#if defined(__FLT16_MAX__)
TEST(TensorViewTest, F16ExhaustiveAgainstCompiler) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  // Offset by one byte to check unaligned sources are handled.
  std::string buf(1 + all.size() * 2, '\0');
  std::memcpy(buf.data() + 1, all.data(), all.size() * 2);
  TensorView t{"all", DType::kF16, {65536}, buf.data() + 1, all.size() * 2};
  std::vector<float> f = ToF32(t);
  for (uint32_t i = 0; i < 65536; ++i) {
    _Float16 h;
    std::memcpy(&h, &all[i], 2);
    float want = static_cast<float>(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f[i])) << std::hex << i;
    } else {
      ASSERT_EQ(F32Bits(f[i]), F32Bits(want)) << std::hex << i;
    }
  }
}
#endif


// ---------------------------------------------------------------------------------------------
// LoadModelInfo: config and tokenizer without the weights (what the router loads)

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.ffn_dim, b.ffn_dim);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.tied_embeddings, b.tied_embeddings);
}

TEST_F(ModelLoaderTest, ModelInfoMatchesLoadModelOnStories) {
  REQUIRE_STORIES();
  auto m = LoadModel(StoriesPath());
  auto info = LoadModelInfo(StoriesPath());
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(info.ok()) << info.status();
  ExpectSameConfig((*m)->config(), info->config);
  const std::string text = "Once upon a time, there was a little girl named Lily.";
  EXPECT_EQ((*m)->tokenizer().Encode(text, true), info->tokenizer->Encode(text, true));
  EXPECT_EQ((*m)->tokenizer().bos_id(), info->tokenizer->bos_id());
}

TEST_F(ModelLoaderTest, ModelInfoReadsOnlyTheHeaderOfALargeGguf) {
  // 9 MiB of metadata: more than the first read, so the prefix grows until the header parses.
  SynthGgufOptions o;
  o.pad_metadata_bytes = size_t{9} << 20;
  WriteSynthGguf(Path("big.gguf"), o);
  auto m = LoadGguf(Path("big.gguf"));
  auto info = LoadModelInfo(Path("big.gguf"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(info.ok()) << info.status();
  ExpectSameConfig((*m)->config(), info->config);
  EXPECT_EQ((*m)->tokenizer().Encode("ab", false), info->tokenizer->Encode("ab", false));
}

TEST_F(ModelLoaderTest, ModelInfoOfATruncatedGgufIsDataLoss) {
  SynthGgufOptions o;
  o.pad_metadata_bytes = size_t{5} << 20;
  WriteSynthGguf(Path("big.gguf"), o);
  std::string bytes = ReadBytes(Path("big.gguf"));
  WriteBytes(Path("cut.gguf"), bytes.substr(0, size_t{3} << 20));  // cut inside the metadata
  auto info = LoadModelInfo(Path("cut.gguf"));
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDataLoss) << info.status();
}

TEST_F(ModelLoaderTest, ModelInfoOfAnHfDirectoryNeedsNoWeights) {
  WriteHfModel(Path("hf"), {});
  auto m = LoadModel(Path("hf"));
  ASSERT_TRUE(m.ok()) << m.status();
  std::filesystem::remove(Path("hf/model.safetensors"));
  ASSERT_FALSE(LoadModel(Path("hf")).ok());
  auto info = LoadModelInfo(Path("hf"));
  ASSERT_TRUE(info.ok()) << info.status();
  ExpectSameConfig((*m)->config(), info->config);
}

// The chat template (model/chat_template.h) and the BOS/EOS text it is rendered with.
TEST_F(ModelLoaderTest, ModelInfoCarriesTheChatTemplate) {
  SynthGgufOptions o;
  o.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}";
  WriteSynthGguf(Path("chat.gguf"), o);
  auto g = LoadModelInfo(Path("chat.gguf"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->chat_template, o.chat_template);
  EXPECT_EQ(g->bos_token, "<s>");
  EXPECT_EQ(g->eos_token, "</s>");
  WriteSynthGguf(Path("plain.gguf"), {});
  auto plain = LoadModelInfo(Path("plain.gguf"));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->chat_template, "");

  WriteHfModel(Path("hf"), {});
  auto none = LoadModelInfo(Path("hf"));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->chat_template, "");
  // A string, with AddedToken-style special tokens.
  WriteBytes(Path("hf/tokenizer_config.json"),
             R"({"chat_template": "T1", "bos_token": {"content": "<|begin|>", "lstrip": false},
                 "eos_token": "<|end|>"})");
  auto s = LoadModelInfo(Path("hf"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->chat_template, "T1");
  EXPECT_EQ(s->bos_token, "<|begin|>");
  EXPECT_EQ(s->eos_token, "<|end|>");
  // The named-list form: "default" is the chat template.
  WriteBytes(Path("hf/tokenizer_config.json"),
             R"({"chat_template": [{"name": "tool_use", "template": "T2"},
                                   {"name": "default", "template": "T3"}]})");
  auto l = LoadModelInfo(Path("hf"));
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->chat_template, "T3");
  // chat_template.jinja when tokenizer_config.json has none.
  WriteBytes(Path("hf/tokenizer_config.json"), R"({"eos_token": "</s>"})");
  WriteBytes(Path("hf/chat_template.jinja"), "T4\n");
  auto j = LoadModelInfo(Path("hf"));
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->chat_template, "T4\n");
  // A malformed field is an error naming the file.
  WriteBytes(Path("hf/tokenizer_config.json"), R"({"chat_template": 7})");
  auto bad = LoadModelInfo(Path("hf"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tokenizer_config.json"), std::string::npos);
}

TEST_F(ModelLoaderTest, ModelInfoOfSyntheticModels) {
  auto info = LoadModelInfo("synthetic:llama3-8b");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->config.n_layers, 32);
  EXPECT_EQ(info->config.vocab_size, 128256);
  EXPECT_EQ(info->tokenizer->Encode("12 7 99", false), (std::vector<int32_t>{12, 7, 99}));
}

// ---------------------------------------------------------------------------------------------
// Input hardening: deep JSON, FIFOs, non-finite weights, inconsistent files

// `levels` arrays nested inside each other: "[[[...]]]".
std::string Nested(int levels) { return std::string(levels, '[') + std::string(levels, ']'); }

TEST_F(ModelLoaderTest, DeeplyNestedConfigJsonIsRefused) {
  WriteHfModel(Path("hf"), {});
  std::string config = ReadBytes(Path("hf/config.json"));
  config.insert(config.rfind('}'), ", \"junk\": " + Nested(10000));
  WriteBytes(Path("hf/config.json"), config);
  for (const auto& s : {LoadModel(Path("hf")).status(), LoadModelInfo(Path("hf")).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("config.json"), std::string::npos) << s;
    EXPECT_NE(s.message().find("deeper than 64"), std::string::npos) << s;
  }
  // Nesting within the limit is just an unknown key.
  config = ReadBytes(Path("hf/config.json"));
  config.replace(config.find(Nested(10000)), 20000, Nested(40));
  WriteBytes(Path("hf/config.json"), config);
  EXPECT_TRUE(LoadModel(Path("hf")).ok());
}

TEST_F(ModelLoaderTest, OversizedConfigJsonIsRefused) {
  WriteHfModel(Path("hf"), {});
  std::string config = ReadBytes(Path("hf/config.json"));
  config.insert(config.rfind('}'), ", \"pad\": \"" + std::string(size_t{17} << 20, 'x') + "\"");
  WriteBytes(Path("hf/config.json"), config);
  auto s = LoadModelInfo(Path("hf")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s.message().substr(0, 200);
  EXPECT_NE(s.message().find("exceeds the limit"), std::string::npos) << s.message().substr(0, 200);
}

TEST_F(ModelLoaderTest, DeeplyNestedTokenizerJsonIsRefused) {
  WriteHfModel(Path("hf"), {});
  std::string tok = ReadBytes(Path("hf/tokenizer.json"));
  tok.insert(tok.rfind('}'), ", \"junk\": " + Nested(10000));
  WriteBytes(Path("hf/tokenizer.json"), tok);
  for (const auto& s : {LoadModel(Path("hf")).status(), LoadModelInfo(Path("hf")).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("tokenizer.json"), std::string::npos) << s;
    EXPECT_NE(s.message().find("deeper than 64"), std::string::npos) << s;
  }
  // A pre-tokenizer Sequence nested 10,000 deep (the parser's walk of it is recursive).
  json t = MinimalTokenizerJson();
  std::string seq;
  for (int i = 0; i < 10000; ++i) seq += "{\"type\":\"Sequence\",\"pretokenizers\":[";
  seq += t["pre_tokenizer"].dump();
  for (int i = 0; i < 10000; ++i) seq += "]}";
  std::string text = t.dump();
  const std::string pre = t["pre_tokenizer"].dump();
  text.replace(text.find(pre), pre.size(), seq);
  auto p = ParseHfTokenizer(text);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
  EXPECT_NE(p.status().message().find("deeper than 64"), std::string::npos) << p.status();
}

TEST_F(ModelLoaderTest, DeeplyNestedSafetensorsHeaderAndIndexAreRefused) {
  WriteHfModel(Path("hf"), {});
  std::string st = ReadBytes(Path("hf/model.safetensors"));
  uint64_t hlen;
  std::memcpy(&hlen, st.data(), 8);
  std::string header = st.substr(8, hlen);
  const std::string meta = "\"__metadata__\":{\"format\":\"pt\"}";
  ASSERT_NE(header.find(meta), std::string::npos) << header.substr(0, 100);
  header.replace(header.find(meta), meta.size(), "\"__metadata__\":" + Nested(10000));
  uint64_t n = header.size();
  WriteBytes(Path("hf/model.safetensors"),
             std::string(reinterpret_cast<const char*>(&n), 8) + header + st.substr(8 + hlen));
  auto m = LoadModel(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("deeper than 64"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("model.safetensors"), std::string::npos) << m.status();

  HfOptions o;
  o.sharded = true;
  WriteHfModel(Path("sharded"), o);
  std::string index = ReadBytes(Path("sharded/model.safetensors.index.json"));
  index.insert(index.rfind('}'), ", \"junk\": " + Nested(10000));
  WriteBytes(Path("sharded/model.safetensors.index.json"), index);
  m = LoadModel(Path("sharded"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("index.json"), std::string::npos) << m.status();
}

// Runs load() on another thread. A loader that blocks on the FIFO `fifo` fails the test and is
// released (a writer opens and closes the FIFO, so the blocked open/read sees end of file).
absl::Status LoadWithTimeout(const std::function<absl::Status()>& load, const std::string& fifo) {
  auto fut = std::async(std::launch::async, load);
  if (fut.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
    ADD_FAILURE() << "loading blocked on the FIFO " << fifo;
    while (fut.wait_for(std::chrono::milliseconds(50)) == std::future_status::timeout) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
  }
  return fut.get();
}

TEST_F(ModelLoaderTest, FifoInsteadOfAFileIsRefusedPromptly) {
  ASSERT_EQ(::mkfifo(Path("fifo.gguf").c_str(), 0600), 0);
  for (auto load : {+[](const std::string& p) { return LoadModel(p).status(); },
                    +[](const std::string& p) { return LoadModelInfo(p).status(); },
                    +[](const std::string& p) { return LoadGguf(p).status(); }}) {
    absl::Status s = LoadWithTimeout([&] { return load(Path("fifo.gguf")); }, Path("fifo.gguf"));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("FIFO"), std::string::npos) << s;
  }
  // A FIFO in place of each file of a Hugging Face directory.
  for (const char* file : {"config.json", "tokenizer.json", "model.safetensors"}) {
    const std::string dir = Path(std::string("hf_") + file);
    WriteHfModel(dir, {});
    const std::string f = dir + "/" + file;
    fs::remove(f);
    ASSERT_EQ(::mkfifo(f.c_str(), 0600), 0);
    absl::Status s = LoadWithTimeout([&] { return LoadModel(dir).status(); }, f);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << file << ": " << s;
    EXPECT_NE(s.message().find("FIFO"), std::string::npos) << file << ": " << s;
    if (std::string(file) != "model.safetensors") {
      s = LoadWithTimeout([&] { return LoadModelInfo(dir).status(); }, f);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << file << ": " << s;
    }
  }
  // A directory where a file belongs: refused, not mapped.
  WriteHfModel(Path("hf_dir"), {});
  fs::remove(Path("hf_dir/model.safetensors"));
  fs::create_directory(Path("hf_dir/model.safetensors"));
  auto m = LoadModel(Path("hf_dir"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("directory"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, NonFiniteGgufWeightsAreRefusedNamingTheTensor) {
  for (uint32_t type : {0u, 1u, 30u}) {  // F32, F16, BF16
    SynthGgufOptions o;
    o.type = type;
    o.nan_tensor = "blk.1.ffn_up.weight";
    WriteSynthGguf(Path("nan.gguf"), o);
    auto m = LoadGguf(Path("nan.gguf"));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << type << ": " << m.status();
    EXPECT_NE(m.status().message().find("blk.1.ffn_up.weight"), std::string::npos) << m.status();
    EXPECT_NE(m.status().message().find("non-finite"), std::string::npos) << m.status();
    EXPECT_NE(m.status().message().find("element 3"), std::string::npos) << m.status();
  }
  SynthGgufOptions norm;
  norm.nan_tensor = "output_norm.weight";  // F32 norms
  WriteSynthGguf(Path("nan.gguf"), norm);
  auto m = LoadGguf(Path("nan.gguf"));
  EXPECT_NE(m.status().message().find("output_norm.weight"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, NonFiniteSafetensorsWeightsAreRefusedNamingTheTensor) {
  auto ts = WriteHfModel(Path("hf"), {});
  for (auto& t : ts) {
    if (t.name == "model.layers.0.mlp.down_proj.weight") {  // BF16: +Inf is 0x7f80
      const uint16_t inf = 0x7f80;
      std::memcpy(t.bytes.data() + 2 * 5, &inf, 2);
    }
  }
  WriteBytes(Path("hf/model.safetensors"), SafetensorsBytes(ts));
  auto m = LoadModel(Path("hf"));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("model.layers.0.mlp.down_proj.weight"), std::string::npos)
      << m.status();
  EXPECT_NE(m.status().message().find("inf"), std::string::npos) << m.status();
}

TEST_F(ModelLoaderTest, InfiniteRmsEpsOrRopeThetaIsRefused) {
  ModelConfig c;
  c.n_layers = c.dim = c.ffn_dim = c.n_heads = c.n_kv_heads = c.vocab_size = 2;
  c.head_dim = 2;
  EXPECT_TRUE(ValidateConfig(c).ok());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {inf, -inf, nan, 0.0f, -1.0f}) {
    ModelConfig e = c;
    e.rms_eps = bad;
    EXPECT_EQ(ValidateConfig(e).code(), absl::StatusCode::kInvalidArgument) << bad;
    ModelConfig t = c;
    t.rope_theta = bad;
    EXPECT_EQ(ValidateConfig(t).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // config.json: 1e39 overflows a float to inf; 1e300 too.
  WriteHfModel(Path("hf"), {});
  const json good = json::parse(ReadBytes(Path("hf/config.json")));
  for (const char* key : {"rms_norm_eps", "rope_theta"}) {
    for (double v : {1e39, 1e300}) {
      json c2 = good;
      c2[key] = v;
      WriteBytes(Path("hf/config.json"), c2.dump());
      auto s = LoadModelInfo(Path("hf")).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key << " " << v << ": " << s;
      EXPECT_EQ(LoadModel(Path("hf")).status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // GGUF: an infinite llama.rope.freq_base.
  SynthGgufOptions o;
  o.rope_theta = inf;
  WriteSynthGguf(Path("inf.gguf"), o);
  EXPECT_EQ(LoadGguf(Path("inf.gguf")).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadModelInfo(Path("inf.gguf")).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelLoaderTest, DuplicateGgufMetadataKeyIsRefused) {
  SynthGgufOptions o;
  o.duplicate_key = true;
  WriteSynthGguf(Path("dup.gguf"), o);
  for (const auto& s : {LoadGguf(Path("dup.gguf")).status(),
                        LoadModelInfo(Path("dup.gguf")).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("duplicate GGUF metadata key llama.block_count"), std::string::npos)
        << s;
  }
}

TEST_F(ModelLoaderTest, MissingLmHeadIsRefusedUnlessTied) {
  auto ts = WriteHfModel(Path("hf"), {});
  std::erase_if(ts, [](const HfTensor& t) { return t.name == "lm_head.weight"; });
  WriteBytes(Path("hf/model.safetensors"), SafetensorsBytes(ts));
  // tie_word_embeddings: false, then absent (transformers' default is untied).
  json config = json::parse(ReadBytes(Path("hf/config.json")));
  for (bool erase : {false, true}) {
    if (erase) config.erase("tie_word_embeddings");
    WriteBytes(Path("hf/config.json"), config.dump());
    auto m = LoadModel(Path("hf"));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find("lm_head.weight"), std::string::npos) << m.status();
  }
  config["tie_word_embeddings"] = true;
  WriteBytes(Path("hf/config.json"), config.dump());
  auto m = LoadModel(Path("hf"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->config().tied_embeddings);
}

}  // namespace
}  // namespace sparsex

// The same trained weights in both RoPE pair layouts must give the same model: stories260K
// (GGUF, adjacent pairs) is converted here into a Hugging Face directory (halves layout, q/k
// rows permuted per head the way HF checkpoints store them) and both are run side by side.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "gpu_worker/engine/engine.h"
#include "tests/gpu_worker/reference_generate.h"
#include "tests/gpu_worker/test_util.h"

namespace sparsex {
namespace {

namespace fs = std::filesystem;

std::string ByteLevelChar(int b) {
  // GPT-2 bytes_to_unicode: printable bytes map to themselves, others to U+0100 + k.
  static std::vector<std::string> table = [] {
    std::vector<int> cps(256, -1);
    int k = 0;
    for (int x = 0; x < 256; ++x) {
      if ((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255)) cps[x] = x;
    }
    for (int x = 0; x < 256; ++x) {
      if (cps[x] < 0) cps[x] = 256 + k++;
    }
    std::vector<std::string> out(256);
    for (int x = 0; x < 256; ++x) {
      const int c = cps[x];
      std::string s;
      if (c < 0x80) {
        s.push_back(static_cast<char>(c));
      } else {
        s.push_back(static_cast<char>(0xC0 | (c >> 6)));
        s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
      out[x] = s;
    }
    return out;
  }();
  return table[b];
}

std::string JsonEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o.push_back('\\');
    o.push_back(c);
  }
  return o;
}

// GGUF stores q/k rows per head as interleaved pairs (2i, 2i+1); HF stores halves (i, i+hd/2):
// HF row h*hd/2 + i of a head is GGUF row 2i + h.
std::vector<float> ToHalves(const TensorView& w, int heads, int hd) {
  const int64_t cols = w.shape[1];
  std::vector<float> src(w.numel()), dst(w.numel());
  w.ToF32(src.data());
  for (int h = 0; h < heads; ++h) {
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < hd / 2; ++i) {
        const int64_t to = static_cast<int64_t>(h) * hd + half * (hd / 2) + i;
        const int64_t from = static_cast<int64_t>(h) * hd + 2 * i + half;
        std::memcpy(&dst[to * cols], &src[from * cols], cols * 4);
      }
    }
  }
  return dst;
}

TEST(RopeLayout, GgufAdjacentPairsEqualsHfHalves) {
  auto gguf = testing::LoadStories260K();
  ASSERT_NE(gguf, nullptr);
  const ModelConfig& c = gguf->config();
  const std::string dir = ::testing::TempDir() + "/stories260K_hf";
  fs::create_directories(dir);
  {
    std::ofstream cfg(dir + "/config.json");
    cfg << "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
        << "\"hidden_size\": " << c.dim << ", \"intermediate_size\": " << c.ffn_dim
        << ", \"num_hidden_layers\": " << c.n_layers << ", \"num_attention_heads\": " << c.n_heads
        << ", \"num_key_value_heads\": " << c.n_kv_heads << ", \"vocab_size\": " << c.vocab_size
        << ", \"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0,"
        << " \"hidden_act\": \"silu\", \"tie_word_embeddings\": false}";
  }
  {
    std::ofstream tj(dir + "/tokenizer.json");
    tj << "{\"version\": \"1.0\", \"added_tokens\": [], \"pre_tokenizer\": {\"type\": "
          "\"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}, \"model\": "
          "{\"type\": \"BPE\", \"vocab\": {";
    for (int b = 0; b < 256; ++b) tj << (b ? ", " : "") << "\"" << JsonEscape(ByteLevelChar(b)) << "\": " << b;
    tj << "}, \"merges\": []}}";
  }
  // Weights as F32 safetensors.
  std::vector<std::pair<std::string, std::vector<float>>> ts;
  std::vector<std::vector<int64_t>> shapes;
  auto add = [&](const std::string& name, const TensorView& v, std::vector<float> data = {}) {
    if (data.empty()) {
      data.resize(v.numel());
      v.ToF32(data.data());
    }
    ts.emplace_back(name, std::move(data));
    shapes.push_back(v.shape);
  };
  const ModelWeights& w = gguf->weights();
  add("model.embed_tokens.weight", w.tok_embeddings);
  add("model.norm.weight", w.final_norm);
  add("lm_head.weight", w.output);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const LayerWeights& lw = w.layers[l];
    add(p + "input_layernorm.weight", lw.attn_norm);
    add(p + "self_attn.q_proj.weight", lw.wq, ToHalves(lw.wq, c.n_heads, c.head_dim));
    add(p + "self_attn.k_proj.weight", lw.wk, ToHalves(lw.wk, c.n_kv_heads, c.head_dim));
    add(p + "self_attn.v_proj.weight", lw.wv);
    add(p + "self_attn.o_proj.weight", lw.wo);
    add(p + "post_attention_layernorm.weight", lw.ffn_norm);
    add(p + "mlp.gate_proj.weight", lw.w_gate);
    add(p + "mlp.up_proj.weight", lw.w_up);
    add(p + "mlp.down_proj.weight", lw.w_down);
  }
  {
    std::string header = "{";
    uint64_t off = 0;
    for (size_t i = 0; i < ts.size(); ++i) {
      const uint64_t n = ts[i].second.size() * 4;
      header += (i ? ", " : "") + std::string("\"") + ts[i].first + "\": {\"dtype\": \"F32\", \"shape\": [";
      for (size_t d = 0; d < shapes[i].size(); ++d) header += (d ? ", " : "") + std::to_string(shapes[i][d]);
      header += "], \"data_offsets\": [" + std::to_string(off) + ", " + std::to_string(off + n) + "]}";
      off += n;
    }
    header += "}";
    while (header.size() % 8) header.push_back(' ');
    std::ofstream st(dir + "/model.safetensors", std::ios::binary);
    const uint64_t hn = header.size();
    st.write(reinterpret_cast<const char*>(&hn), 8);
    st << header;
    for (auto& [name, data] : ts) st.write(reinterpret_cast<const char*>(data.data()), data.size() * 4);
  }
  auto hf = LoadModel(dir);
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ((*hf)->config().rope_layout, RopeLayout::kHalves);
  EXPECT_EQ(gguf->config().rope_layout, RopeLayout::kAdjacentPairs);

  auto eg = Engine::Create(*gguf, {});
  auto eh = Engine::Create(**hf, {});
  ASSERT_TRUE(eg.ok() && eh.ok());
  std::vector<int32_t> prompt = gguf->tokenizer().Encode("Once upon a time, there was a dog", true);
  auto sg = (*eg)->Admit(prompt);
  auto sh = (*eh)->Admit(prompt);
  auto lg = (*eg)->Prefill(*sg);
  auto lh = (*eh)->Prefill(*sh);
  ASSERT_TRUE(lg.ok() && lh.ok());
  float maxdiff = 0;
  for (size_t i = 0; i < lg->size(); ++i) maxdiff = std::max(maxdiff, std::abs((*lg)[i] - (*lh)[i]));
  EXPECT_LT(maxdiff, 1e-4);
  // Without the permutation the halves layout would rotate the wrong pairs: a real difference.
  GenerateRequest req{prompt, {.max_tokens = 32}};
  auto a = sparsex::testing::Generate(**eg, req, nullptr);
  auto b = sparsex::testing::Generate(**eh, req, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace sparsex

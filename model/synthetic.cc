#include <charconv>
#include <sstream>

#include "model/model.h"

namespace sparsex {
namespace {

// Ids written as decimal numbers: lets benchmarks and tests drive a weightless model by text.
class NumericTokenizer final : public Tokenizer {
 public:
  NumericTokenizer(int32_t vocab, int32_t bos, int32_t eos) : vocab_(vocab), bos_(bos), eos_(eos) {}
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, bool) const override {
    std::vector<int32_t> out;
    if (add_bos) out.push_back(bos_);
    size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && (text[i] < '0' || text[i] > '9')) ++i;
      size_t j = i;
      while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
      if (j > i) {
        int64_t v = 0;
        std::from_chars(text.data() + i, text.data() + j, v);
        out.push_back(static_cast<int32_t>(v % vocab_));
      }
      i = j;
    }
    return out;
  }
  std::string Decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (int32_t id : ids) {
      if (IsSpecial(id)) continue;
      s += " " + std::to_string(id);
    }
    return s;
  }
  std::string TokenPiece(int32_t id) const override { return " " + std::to_string(id); }
  int32_t vocab_size() const override { return vocab_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  bool IsSpecial(int32_t id) const override { return id == bos_ || id == eos_; }

 private:
  int32_t vocab_, bos_, eos_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> MakeSyntheticModel(const std::string& name) {
  auto m = std::make_unique<Model>();
  ModelConfig& c = m->config_;
  if (name == "llama3-8b") {
    c.n_layers = 32;
    c.dim = 4096;
    c.ffn_dim = 14336;
    c.n_heads = 32;
    c.n_kv_heads = 8;
    c.head_dim = 128;
    c.vocab_size = 128256;
    c.max_seq_len = 131072;
    c.rope_theta = 500000.0f;
    c.rope_layout = RopeLayout::kHalves;
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = 8.0f;
    c.rope_scaling.original_max_position = 8192;
    m->tokenizer_ = std::make_unique<NumericTokenizer>(c.vocab_size, 128000, 128001);
  } else if (name == "tiny") {
    c.n_layers = 4;
    c.dim = 128;
    c.ffn_dim = 256;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    c.vocab_size = 1000;
    c.max_seq_len = 8192;
    m->tokenizer_ = std::make_unique<NumericTokenizer>(c.vocab_size, 1, 2);
  } else if (name == "small") {
    // Head dim 128 with grouped-query heads: the shapes of the GPU's tensor-core attention
    // (batched decode, recorded decode graphs) at test size.
    c.n_layers = 2;
    c.dim = 256;
    c.ffn_dim = 512;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 128;
    c.vocab_size = 1000;
    c.max_seq_len = 8192;
    m->tokenizer_ = std::make_unique<NumericTokenizer>(c.vocab_size, 1, 2);
  } else if (name == "demo") {
    // Deep enough that the sparse layers carry most of a prefill (F = 2 of 12 layers) and wide
    // enough that a few-thousand-token prompt's prefill takes seconds on two CPU cores: the
    // size where the CPU demo's time to first token is prefill, not serving overhead.
    c.n_layers = 12;
    c.dim = 256;
    c.ffn_dim = 768;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 64;
    c.vocab_size = 1000;
    c.max_seq_len = 8192;
    m->tokenizer_ = std::make_unique<NumericTokenizer>(c.vocab_size, 1, 2);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown synthetic model '", name, "' (expected llama3-8b, demo, small or tiny)"));
  }
  // A synthetic shape's stated context is its configuration's, as a real model's metadata.
  c.trained_context_length = c.max_seq_len;
  m->synthetic_ = true;
  m->synthetic_seed_ = 1234;
  m->source_ = "synthetic:" + name;
  Hasher h;
  h.Str("sparsex.synthetic").Str(name).U64(m->synthetic_seed_);
  m->fingerprint_ = h.Finish();
  return m;
}

}  // namespace sparsex

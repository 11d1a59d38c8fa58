// Format-independent parts of model loading: dtypes, fp32 conversion, validation, fingerprint,
// dispatch. The GGUF and safetensors parsers live in gguf.cc and safetensors.cc.
#include "model/model.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"

namespace sparsex {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
  }
  return 0;
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

float BitsToF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half -> single by bit manipulation (no F16C dependency, exact for every input).
float HalfToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) return BitsToF32(sign | 0x7f800000u | (mant << 13));  // inf / nan (payload kept)
  if (exp != 0) return BitsToF32(sign | ((exp + 112) << 23) | (mant << 13));  // 127 - 15 = 112
  if (mant == 0) return BitsToF32(sign);                                      // +-0
  // Subnormal half: value = mant * 2^-24. Normalise: shift the leading 1 into bit 10.
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400) == 0);
  return BitsToF32(sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ff) << 13));
}

}  // namespace

void TensorView::ToF32(float* out) const {
  const int64_t n = numel();
  const auto* p = static_cast<const uint8_t*>(data);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
      // Tensors in safetensors may be only 2-byte aligned or not at all: memcpy every load.
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = HalfToF32(h);
      }
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = BitsToF32(static_cast<uint32_t>(h) << 16);
      }
      return;
  }
}

namespace {

std::string ShapeStr(const std::vector<int64_t>& s) { return "[" + absl::StrJoin(s, ", ") + "]"; }

absl::Status CheckTensor(const TensorView& t, const char* slot, std::vector<int64_t> want) {
  if (t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", slot, " (", t.name, ") is missing"));
  }
  if (t.shape != want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " (", slot, ") has shape ",
                                                   ShapeStr(t.shape), ", expected shape ",
                                                   ShapeStr(want)));
  }
  if (t.nbytes != static_cast<size_t>(t.numel()) * DTypeSize(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", t.name, " holds ", t.nbytes, " bytes, its shape ", ShapeStr(t.shape), " ",
        DTypeName(t.dtype), " needs ", t.numel() * DTypeSize(t.dtype)));
  }
  return absl::OkStatus();
}

void HashTensor(Hasher& h, const TensorView& t) {
  // Names, dtypes, shapes and the first and last 4 KiB: cheap (no full read of a multi-GB
  // model), deterministic, and enough to tell apart two checkpoints of the same architecture.
  constexpr size_t kSample = 4096;
  h.Str(t.name).U64(static_cast<uint64_t>(t.dtype)).U64(t.shape.size());
  for (int64_t d : t.shape) h.U64(static_cast<uint64_t>(d));
  const auto* p = static_cast<const uint8_t*>(t.data);
  size_t head = std::min(kSample, t.nbytes);
  size_t tail = std::min(kSample, t.nbytes);
  h.U64(t.nbytes);
  h.U64(Hash64(p, head));
  h.U64(Hash64(p + (t.nbytes - tail), tail));
}

// Index of the first NaN or infinity in t, or -1. IEEE floats are non-finite exactly when their
// exponent bits are all ones, so this is one pass of integer masks over the mapped bytes (no
// conversion); blocks are OR-reduced branch-free and only a hit is searched element by element.
template <typename U>
int64_t FirstNonFinite(const uint8_t* p, int64_t n, U exp_mask) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    bool bad = false;
    for (int64_t i = b; i < e; ++i) {
      U u;
      std::memcpy(&u, p + i * sizeof(U), sizeof(U));  // safetensors data may be unaligned
      bad |= (u & exp_mask) == exp_mask;
    }
    if (!bad) continue;
    for (int64_t i = b; i < e; ++i) {
      U u;
      std::memcpy(&u, p + i * sizeof(U), sizeof(U));
      if ((u & exp_mask) == exp_mask) return i;
    }
  }
  return -1;
}

absl::Status CheckFinite(const TensorView& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  const int64_t n = t.numel();
  int64_t at = -1;
  switch (t.dtype) {
    case DType::kF32:
      at = FirstNonFinite<uint32_t>(p, n, 0x7f800000u);
      break;
    case DType::kF16:
      at = FirstNonFinite<uint16_t>(p, n, 0x7c00);
      break;
    case DType::kBF16:
      at = FirstNonFinite<uint16_t>(p, n, 0x7f80);
      break;
  }
  if (at < 0) return absl::OkStatus();
  std::vector<float> v(1);
  TensorView one = t;
  one.shape = {1};
  one.data = p + at * static_cast<int64_t>(DTypeSize(t.dtype));
  one.ToF32(v.data());
  return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " holds a non-finite value (",
                                                 v[0], ") at element ", at, " of ", n,
                                                 ": the weights are corrupt"));
}

uint64_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

absl::Status ValidateConfig(const ModelConfig& c) {
  if (c.n_layers <= 0 || c.dim <= 0 || c.ffn_dim <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.head_dim <= 0 || c.vocab_size <= 0 || c.max_seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid model config: n_layers ", c.n_layers, ", dim ", c.dim, ", ffn_dim ", c.ffn_dim,
        ", n_heads ", c.n_heads, ", n_kv_heads ", c.n_kv_heads, ", head_dim ", c.head_dim,
        ", vocab_size ", c.vocab_size, ", max_seq_len ", c.max_seq_len, " (all must be > 0)"));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_heads ", c.n_heads, " is not a multiple of n_kv_heads ", c.n_kv_heads));
  }
  if (c.head_dim % 2 != 0) {  // RoPE rotates pairs
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", c.head_dim, " is odd"));
  }
  if (!(c.rms_eps > 0) || !(c.rope_theta > 0) || !std::isfinite(c.rms_eps) ||
      !std::isfinite(c.rope_theta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid rms_eps ", c.rms_eps, " or rope_theta ", c.rope_theta));
  }
  return absl::OkStatus();
}

absl::Status FinalizeModel(Model& m) {
  const ModelConfig& c = m.config_;
  RETURN_IF_ERROR(ValidateConfig(c));
  const ModelWeights& w = m.weights_;
  if (static_cast<int>(w.layers.size()) != c.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model has ", w.layers.size(),
                                                   " layers of weights, config says ", c.n_layers));
  }
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim;
  const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  RETURN_IF_ERROR(CheckTensor(w.tok_embeddings, "tok_embeddings", {c.vocab_size, c.dim}));
  RETURN_IF_ERROR(CheckTensor(w.final_norm, "final_norm", {c.dim}));
  RETURN_IF_ERROR(CheckTensor(w.output, "output", {c.vocab_size, c.dim}));
  for (const LayerWeights& l : w.layers) {
    RETURN_IF_ERROR(CheckTensor(l.attn_norm, "attn_norm", {c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.wq, "wq", {q_dim, c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.wk, "wk", {kv_dim, c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.wv, "wv", {kv_dim, c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.wo, "wo", {c.dim, q_dim}));
    RETURN_IF_ERROR(CheckTensor(l.ffn_norm, "ffn_norm", {c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.w_gate, "w_gate", {c.ffn_dim, c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.w_up, "w_up", {c.ffn_dim, c.dim}));
    RETURN_IF_ERROR(CheckTensor(l.w_down, "w_down", {c.dim, c.ffn_dim}));
  }
  RETURN_IF_ERROR(CheckTokenizerFits(m.tokenizer_.get(), c));

  // NaN or infinite weights would turn every logit into NaN (and every sampled token into 0):
  // refuse them at load, naming the tensor. Synthetic models have no weight data.
  if (!m.synthetic_) {
    RETURN_IF_ERROR(CheckFinite(w.tok_embeddings));
    RETURN_IF_ERROR(CheckFinite(w.final_norm));
    if (w.output.data != w.tok_embeddings.data) RETURN_IF_ERROR(CheckFinite(w.output));
    for (const LayerWeights& l : w.layers) {
      for (const TensorView* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm,
                                  &l.w_gate, &l.w_up, &l.w_down}) {
        RETURN_IF_ERROR(CheckFinite(*t));
      }
    }
  }

  Hasher h;
  h.Str("sparsex-model-v1").Str(c.architecture);
  for (int v : {c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
                c.max_seq_len}) {
    h.U64(static_cast<uint64_t>(v));
  }
  h.U64(FloatBits(c.rms_eps))
      .U64(FloatBits(c.rope_theta))
      .U64(static_cast<uint64_t>(c.rope_layout));
  const RopeScaling& rs = c.rope_scaling;
  h.U64(static_cast<uint64_t>(rs.type));
  if (rs.type != RopeScaling::Type::kNone) {
    h.U64(FloatBits(rs.factor)).U64(FloatBits(rs.low_freq_factor));
    h.U64(FloatBits(rs.high_freq_factor)).U64(static_cast<uint64_t>(rs.original_max_position));
  }
  h.U64(c.tied_embeddings ? 1 : 0);
  HashTensor(h, w.tok_embeddings);
  HashTensor(h, w.final_norm);
  HashTensor(h, w.output);
  for (const LayerWeights& l : w.layers) {
    for (const TensorView* t :
         {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down}) {
      HashTensor(h, *t);
    }
  }
  m.fingerprint_ = h.Finish();
  return absl::OkStatus();
}

namespace {

enum class ModelFormat { kSynthetic, kHfDirectory, kGguf };

// What LoadModel and LoadModelInfo read at `path`.
absl::StatusOr<ModelFormat> DetectFormat(const std::string& path) {
  if (absl::StartsWith(path, "synthetic:")) return ModelFormat::kSynthetic;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("model path ", path, " does not exist"));
  }
  if (S_ISDIR(st.st_mode)) {
    struct stat cfg {};
    if (::stat((path + "/config.json").c_str(), &cfg) == 0) return ModelFormat::kHfDirectory;
    return absl::InvalidArgumentError(
        absl::StrCat("model directory ", path, " has no config.json (not a Hugging Face model)"));
  }
  if (absl::EndsWith(path, ".gguf")) return ModelFormat::kGguf;
  return absl::InvalidArgumentError(
      absl::StrCat("cannot tell the format of ", path,
                   ": expected a *.gguf file or a directory with config.json"));
}

}  // namespace

absl::Status CheckTokenizerFits(const Tokenizer* tokenizer, const ModelConfig& c) {
  // A tokenizer id past the embedding table would read out of bounds; padded tables are fine.
  if (tokenizer != nullptr && tokenizer->vocab_size() > c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer has ", tokenizer->vocab_size(),
                                                   " tokens, the model's vocab_size is only ",
                                                   c.vocab_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path) {
  return LoadModel(path, LoadOptions{});
}

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path,
                                                 const LoadOptions& options) {
  ASSIGN_OR_RETURN(ModelFormat format, DetectFormat(path));
  std::unique_ptr<Model> m;
  switch (format) {
    case ModelFormat::kSynthetic: {
      ASSIGN_OR_RETURN(m, MakeSyntheticModel(path.substr(10)));
      break;
    }
    case ModelFormat::kHfDirectory: {
      ASSIGN_OR_RETURN(m, LoadHfDirectory(path));
      break;
    }
    case ModelFormat::kGguf: {
      ASSIGN_OR_RETURN(m, LoadGguf(path, options));
      break;
    }
  }
  if (!options.tokenizer_path.empty()) RETURN_IF_ERROR(OverrideTokenizer(*m, options.tokenizer_path));
  return m;
}

Hash128 TokenizerFingerprint(const Tokenizer& t) {
  Hasher h;
  h.Str("sparsex-tokenizer-v1");
  const int32_t n = t.vocab_size();
  h.U64(static_cast<uint64_t>(n)).U64(static_cast<uint64_t>(static_cast<int64_t>(t.bos_id())));
  h.U64(static_cast<uint64_t>(static_cast<int64_t>(t.eos_id())));
  for (int32_t id = 0; id < n; ++id) {
    h.U64(t.IsSpecial(id) ? 1 : 0).Str(t.IsSpecial(id) ? t.SpecialText(id) : t.TokenPiece(id));
  }
  // Letters, digits, whitespace runs, contractions, composed and decomposed accents, CJK, emoji.
  static constexpr const char* kProbe =
      "Hello World! It's 2024: 1234567 tokens,\tspaces   and\n\nlines. Caf\xC3\xA9 "
      "Cafe\xCC\x81 \xEF\xAC\x81 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x91\x8B";
  h.I32s(t.Encode(kProbe, /*add_bos=*/false));
  return h.Finish();
}

absl::Status OverrideTokenizer(Model& m, const std::string& tokenizer_path) {
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, LoadTokenizer(tokenizer_path));
  if (absl::Status s = CheckTokenizerFits(tok.get(), m.config_); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tokenizer ", tokenizer_path, ": ",
                                                   s.message()));
  }
  const Hash128 t = TokenizerFingerprint(*tok);
  Hasher h;
  h.Str("sparsex-model-tokenizer-override")
      .U64(m.fingerprint_.hi)
      .U64(m.fingerprint_.lo)
      .U64(t.hi)
      .U64(t.lo);
  m.fingerprint_ = h.Finish();
  m.tokenizer_ = std::move(tok);
  return absl::OkStatus();
}

absl::StatusOr<ModelInfo> LoadModelInfo(const std::string& path) {
  ASSIGN_OR_RETURN(ModelFormat format, DetectFormat(path));
  ModelInfo info;
  switch (format) {
    case ModelFormat::kSynthetic: {
      // Synthetic models carry shapes and a tokenizer but no weights: nothing is mapped.
      ASSIGN_OR_RETURN(std::unique_ptr<Model> m, MakeSyntheticModel(path.substr(10)));
      info.config = m->config_;
      info.tokenizer = std::move(m->tokenizer_);
      info.source = path;
      return info;
    }
    case ModelFormat::kHfDirectory: {
      ASSIGN_OR_RETURN(info, LoadHfInfo(path));
      break;
    }
    case ModelFormat::kGguf: {
      ASSIGN_OR_RETURN(info, LoadGgufInfo(path));
      break;
    }
  }
  RETURN_IF_ERROR(ValidateConfig(info.config));
  RETURN_IF_ERROR(CheckTokenizerFits(info.tokenizer.get(), info.config));
  return info;
}

absl::StatusOr<ModelInfo> LoadModelInfo(const std::string& path,
                                        const std::string& tokenizer_path) {
  ASSIGN_OR_RETURN(ModelInfo info, LoadModelInfo(path));
  if (tokenizer_path.empty()) return info;
  ASSIGN_OR_RETURN(info.tokenizer, LoadTokenizer(tokenizer_path));
  if (absl::Status s = CheckTokenizerFits(info.tokenizer.get(), info.config); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tokenizer ", tokenizer_path, ": ",
                                                   s.message()));
  }
  // The chat template's bos_token / eos_token are the new vocabulary's.
  info.bos_token = info.tokenizer->SpecialText(info.tokenizer->bos_id());
  info.eos_token = info.tokenizer->SpecialText(info.tokenizer->eos_id());
  return info;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& path) {
  if (absl::StartsWith(path, "synthetic:")) {
    ASSIGN_OR_RETURN(std::unique_ptr<Model> m, MakeSyntheticModel(path.substr(10)));
    return std::move(m->tokenizer_);
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("model path ", path, " does not exist"));
  }
  if (S_ISDIR(st.st_mode)) return LoadHfTokenizer(path + "/tokenizer.json");
  if (absl::EndsWith(path, ".json")) return LoadHfTokenizer(path);
  return LoadGgufTokenizer(path);
}

}  // namespace sparsex

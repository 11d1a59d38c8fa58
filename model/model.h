// A loaded transformer model: configuration, memory-mapped weights and tokenizer.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Model> m, LoadModel("stories260K.gguf"));
//   m->config().n_layers; m->weights().layers[0].wq; m->tokenizer().Encode("Once");
//
// Supported: GGUF (llama architecture; F32/F16/BF16 tensors, and Q8_0/Q4_0/Q4_K/Q6_K tensors
// dequantized at load into LoadOptions::dequantize_to; embedded SentencePiece or byte-level BPE
// tokenizer) and Hugging Face
// directories (config.json, one or sharded *.safetensors with model.safetensors.index.json,
// tokenizer.json). Loaders validate every offset and shape against the file size before any
// tensor is touched: a bad file yields an error naming the problem, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/hash.h"
#include "common/mapped_file.h"
#include "common/status.h"
#include "model/model_info.h"
#include "model/tokenizer/tokenizer.h"

namespace sparsex {

enum class DType { kF32, kF16, kBF16 };
size_t DTypeSize(DType t);
const char* DTypeName(DType t);

// A view of one weight tensor inside a mapped file (or owned buffer). Shapes are given
// row-major as PyTorch does: a projection is [out_features, in_features].
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
  int64_t numel() const;
  // Converts to fp32 into out (numel() floats).
  void ToF32(float* out) const;
};

struct LayerWeights {
  TensorView attn_norm;  // [dim]
  TensorView wq;         // [n_heads * head_dim, dim]
  TensorView wk;         // [n_kv_heads * head_dim, dim]
  TensorView wv;         // [n_kv_heads * head_dim, dim]
  TensorView wo;         // [dim, n_heads * head_dim]
  TensorView ffn_norm;   // [dim]
  TensorView w_gate;     // [ffn_dim, dim]
  TensorView w_up;       // [ffn_dim, dim]
  TensorView w_down;     // [dim, ffn_dim]
};

struct ModelWeights {
  TensorView tok_embeddings;  // [vocab, dim]
  TensorView final_norm;      // [dim]
  TensorView output;          // [vocab, dim]; equals tok_embeddings when tied
  std::vector<LayerWeights> layers;
};

class Model {
 public:
  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // Hash of the configuration and the weights' identity (names, shapes, dtypes and a sample of
  // the bytes of every tensor). Salts every KV hash so KV of one model is never used by another.
  const Hash128& fingerprint() const { return fingerprint_; }
  const std::string& source() const { return source_; }

  // Used by loaders and the synthetic-model generator.
  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;
  Hash128 fingerprint_;
  std::string source_;
  // Synthetic models (speed work) have shapes but no weights: backends generate seeded random
  // weights in their own memory (Backend::RandomWeights).
  bool synthetic_ = false;
  uint64_t synthetic_seed_ = 0;
  std::vector<std::unique_ptr<MappedFile>> files_;  // keeps the mappings alive
  std::vector<std::vector<uint8_t>> owned_;         // weights not backed by a file
};

// Validates the config, every weight's shape and that every weight is finite (one pass over the
// mapped data: NaN/Inf is an error naming the tensor), then computes the fingerprint.
absl::Status FinalizeModel(Model& m);

// "llama3-8b" (Llama-3.1-8B shapes: 32 layers, hidden 4096, 32 q / 8 kv heads, head dim 128,
// FFN 14336, vocab 128256, rope theta 500000, llama3 rope scaling) or "tiny" (a 4-layer model
// for tests), with a numeric tokenizer (text "12 7 99" <-> ids 12 7 99). Speed work only: the
// weights are random, so the text is meaningless.
absl::StatusOr<std::unique_ptr<Model>> MakeSyntheticModel(const std::string& name);

struct LoadOptions {
  // The dtype quantized GGUF tensors (Q8_0, Q4_0, Q4_K, Q6_K) are dequantized into at load,
  // held in Model::owned_: the backend's (F32 for the CPU backend, which is exact for every
  // quantized value; BF16 halves the memory for the CUDA backend, which computes in bf16).
  // Unquantized tensors stay mapped as stored.
  DType dequantize_to = DType::kF32;
  // A tokenizer used instead of the model's own (LoadTokenizer's paths: a GGUF vocabulary,
  // vocabulary-only files included, a tokenizer.json or a directory holding one). Refused when
  // it has more tokens than the embedding table; its identity (TokenizerFingerprint) is hashed
  // into the model fingerprint, so KV made under one tokenizer is never served under another.
  // Default: "" (the model's own).
  std::string tokenizer_path;
};

// A tokenizer's identity: its size, special ids, every token's bytes and special flag, and the
// ids of a fixed multilingual probe text (which tells apart tokenizers whose vocabularies agree
// but whose normalizers, pre-tokenizers or merges do not).
Hash128 TokenizerFingerprint(const Tokenizer& t);

// Replaces m's tokenizer by the one at tokenizer_path (see LoadOptions::tokenizer_path) and
// rehashes the fingerprint with the tokenizer's identity.
absl::Status OverrideTokenizer(Model& m, const std::string& tokenizer_path);

// Dispatches on the path: "synthetic:<name>", a *.gguf file, or a directory with config.json.
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path);
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path,
                                                 const LoadOptions& options);
absl::StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path,
                                                const LoadOptions& options = {});

// Writes a copy of the GGUF file in with every tensor whose rows are a whole number of blocks
// and that has more than one row (the projections and embeddings; not the 1-D norms) quantized
// to ggml_type (kGgmlQ8_0, kGgmlQ4_0, kGgmlQ4_K or kGgmlQ6_K from model/quant.h): the metadata
// is copied byte for byte. A reference quantizer (round to nearest) for tests and tools.
absl::Status QuantizeGgufFile(const std::string& in, const std::string& out, uint32_t ggml_type);
absl::StatusOr<std::unique_ptr<Model>> LoadHfDirectory(const std::string& dir);


}  // namespace sparsex

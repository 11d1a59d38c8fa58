// A model's identity without its weights: configuration and tokenizer. This is all the router
// needs (tokenize, chunk, check lengths and ids); it never maps a weight file. The model
// fingerprint hashes samples of the weights, so only a worker (which loads them) knows it; the
// router learns it from the workers' WorkerInfo.
//
//   ASSIGN_OR_RETURN(ModelInfo info, LoadModelInfo("Llama-3.1-8B-Instruct/"));
//   info.config.max_seq_len; info.tokenizer->Encode("Hello", /*add_bos=*/false);
//
// Reads: GGUF metadata and tensor infos (a prefix of the file), or a Hugging Face directory's
// config.json and tokenizer.json (no *.safetensors needed), or "synthetic:<name>".
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "model/tokenizer/tokenizer.h"

namespace sparsex {

// GGUF and llama2.c rotate adjacent pairs (x[2i], x[2i+1]); HF Llama rotates halves
// (x[i], x[i + d/2]).
enum class RopeLayout { kAdjacentPairs, kHalves };

struct RopeScaling {
  enum class Type { kNone, kLlama3 } type = Type::kNone;
  float factor = 1.0f;            // Default: 1 (llama3 models use 8)
  float low_freq_factor = 1.0f;   // Default: 1
  float high_freq_factor = 4.0f;  // Default: 4
  int original_max_position = 8192;
};

struct ModelConfig {
  std::string architecture = "llama";
  int n_layers = 0;
  int dim = 0;         // hidden size
  int ffn_dim = 0;     // intermediate size
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA when < n_heads)
  int head_dim = 0;
  int vocab_size = 0;
  int max_seq_len = 2048;  // the context served: prompt plus generated tokens
  // The context length the model's own metadata states (GGUF <arch>.context_length, config.json
  // max_position_embeddings: with llama3 rope scaling that is already the scaled length);
  // 0 when it states none, and max_seq_len is then the loader's default of 2048. Reported
  // beside max_seq_len by /v1/models, so a default is never passed off as the model's.
  int trained_context_length = 0;
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeLayout rope_layout = RopeLayout::kAdjacentPairs;
  RopeScaling rope_scaling;
  bool tied_embeddings = false;  // output projection shares the token embedding
};

struct ModelInfo {
  ModelConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string source;  // the path it was read from
  // The chat template (model/chat_template.h) as shipped: tokenizer_config.json "chat_template"
  // (a string, or the named-list form's "default"; else chat_template.jinja beside it) or GGUF
  // "tokenizer.chat_template". "" when the model has none (base models). Parsed by its user
  // (the router), so a template this renderer cannot handle never stops a model from loading.
  std::string chat_template;
  // The text of the BOS / EOS tokens, the template's bos_token / eos_token ("" when unknown).
  std::string bos_token, eos_token;
};

// Dispatches on the path like LoadModel; the same validation of the configuration.
absl::StatusOr<ModelInfo> LoadModelInfo(const std::string& path);
// The same with the tokenizer taken from tokenizer_path (LoadOptions::tokenizer_path; "" keeps
// the model's), refused when it has more tokens than the model's vocab_size.
absl::StatusOr<ModelInfo> LoadModelInfo(const std::string& path, const std::string& tokenizer_path);
absl::StatusOr<ModelInfo> LoadGgufInfo(const std::string& path);
absl::StatusOr<ModelInfo> LoadHfInfo(const std::string& dir);

// The tokenizer alone, for tools such as `sparsex tokenize`: a GGUF file's vocabulary (any
// architecture, vocabulary-only files included: no configuration is read or checked), a
// directory's tokenizer.json, or a synthetic model's.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& path);
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const std::string& path);

// The configuration checks every loader applies (positive sizes, head divisibility, finite
// eps and theta).
absl::Status ValidateConfig(const ModelConfig& c);
// INVALID_ARGUMENT when the tokenizer has more tokens than the embedding table (null: OK).
absl::Status CheckTokenizerFits(const Tokenizer* tokenizer, const ModelConfig& c);

}  // namespace sparsex

// Hugging Face directory loader: config.json, model.safetensors or shards listed in
// model.safetensors.index.json, tokenizer.json. Shards are memory-mapped; each header's length
// and every tensor's data_offsets are checked against the file size and against dtype * shape
// before a view is handed out. JSON is parsed without exceptions, and every field's type is
// checked before it is read, so a malformed file gives a Status naming the field. Only regular
// files are read, and JSON text is size- and depth-checked (common/json_depth.h) before parsing.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>

#include "common/json_depth.h"
#include "model/model.h"

namespace sparsex {
namespace {

using nlohmann::json;

// Exists as anything: a FIFO or a directory in a file's place is then refused by the reader
// with an error saying so (not taken for a missing file, and never opened blocking).
bool PathExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Size limits of the JSON files read here (the depth limit is kMaxJsonDepth). Real files are far
// smaller: a Llama config.json is ~1 KB, a 400-shard index ~100 KB.
constexpr size_t kMaxConfigJsonBytes = size_t{16} << 20;
constexpr size_t kMaxIndexJsonBytes = size_t{64} << 20;

// Regular files only (MappedFile refuses FIFOs and devices, which would block or never end);
// size and nesting are checked before the parser sees the text.
absl::StatusOr<json> ReadJsonFile(const std::string& path, size_t max_bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(path));
  const std::string_view text(reinterpret_cast<const char*>(f->data()), f->size());
  if (absl::Status s = CheckJsonLimits(text, max_bytes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, " is not valid JSON"));
  return j;
}

// ---- safetensors ----

struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
};
using StTensors = std::map<std::string, StTensor>;

// Bytes per element of safetensors dtypes; 0 for unknown ones (their size is not checked).
size_t StDTypeSize(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

absl::Status ParseSafetensors(const MappedFile& f, StTensors& out) {
  const std::string& path = f.path();
  if (f.size() < 8) {
    return absl::DataLossError(absl::StrCat("safetensors file ", path, " is truncated: ", f.size(),
                                            " bytes, no room for the header length"));
  }
  uint64_t hlen;
  std::memcpy(&hlen, f.data(), 8);  // little-endian u64
  // The reference implementation caps headers at 100 MB; a larger value is corruption, not a
  // reason to parse gigabytes as JSON.
  if (hlen < 2 || hlen > (uint64_t{100} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors file ", path, " has a bad header length ", hlen));
  }
  if (hlen > f.size() - 8) {
    return absl::DataLossError(absl::StrCat("safetensors file ", path,
                                            " is truncated: header length ", hlen, " exceeds the ",
                                            f.size() - 8, " bytes after it"));
  }
  const char* hdr = reinterpret_cast<const char*>(f.data()) + 8;
  if (absl::Status s = CheckJsonDepth(std::string_view(hdr, hlen), kMaxJsonDepth); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors file ", path, ": header: ", s.message()));
  }
  json j = json::parse(hdr, hdr + hlen, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors file ", path, ": header is not a JSON object"));
  }
  const uint8_t* base = f.data() + 8 + hlen;
  const uint64_t data_size = f.size() - 8 - hlen;
  for (const auto& item : j.items()) {
    // Not a structured binding: clang before 16 cannot capture one in the lambda below (the
    // fuzz targets, tests/fuzz, build this file with clang).
    const std::string& name = item.key();
    const json& e = item.value();
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors file ", path, ": tensor ", name, ": ", why));
    };
    if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() || !e.contains("shape") ||
        !e["shape"].is_array() || !e.contains("data_offsets") || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2) {
      return bad("needs dtype (string), shape (array) and data_offsets ([begin, end])");
    }
    StTensor t;
    t.dtype = e["dtype"].get<std::string>();
    uint64_t numel = 1;
    for (const json& d : e["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape has a non-integer or negative dimension");
      uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t{1} << 40) || __builtin_mul_overflow(numel, v, &numel)) {
        return bad("shape too large");
      }
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const json& off = e["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return bad("data_offsets must be non-negative integers");
    }
    uint64_t b = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (b > end) return bad(absl::StrCat("data_offsets [", b, ", ", end, "] are reversed"));
    if (end > data_size) {
      return absl::DataLossError(absl::StrCat("safetensors file ", path, " is truncated: tensor ",
                                              name, " ends at data offset ", end, " but only ",
                                              data_size, " data bytes are present"));
    }
    if (size_t es = StDTypeSize(t.dtype); es != 0) {
      uint64_t need;
      if (__builtin_mul_overflow(numel, uint64_t{es}, &need) || need != end - b) {
        return bad(absl::StrCat("data_offsets span ", end - b, " bytes, but dtype ", t.dtype,
                                " x shape needs ", numel, " x ", es));
      }
    }
    t.data = base + b;
    t.nbytes = end - b;
    if (!out.emplace(name, std::move(t)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " appears twice (", path, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status TakeTensor(const StTensors& ts, const std::string& name, TensorView* t) {
  auto it = ts.find(name);
  if (it == ts.end()) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  const StTensor& s = it->second;
  if (s.dtype == "F32") {
    t->dtype = DType::kF32;
  } else if (s.dtype == "F16") {
    t->dtype = DType::kF16;
  } else if (s.dtype == "BF16") {
    t->dtype = DType::kBF16;
  } else {
    return absl::UnimplementedError(absl::StrCat("tensor ", name, " has dtype ", s.dtype,
                                                 "; only F32, F16 and BF16 are supported"));
  }
  t->name = name;
  t->shape = s.shape;
  t->data = s.data;
  t->nbytes = s.nbytes;
  return absl::OkStatus();
}

// ---- config.json ----

// Integer field; `def` when absent or null, an error when absent without a default.
absl::StatusOr<int> IntField(const json& c, const char* key, std::optional<int> def = {}) {
  if (!c.contains(key) || c[key].is_null()) {
    if (def) return *def;
    return absl::InvalidArgumentError(absl::StrCat("config.json: missing ", key));
  }
  const json& v = c[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: ", key, " must be a small non-negative integer"));
  }
  return static_cast<int>(v.get<int64_t>());
}

absl::StatusOr<float> FloatField(const json& c, const char* key, float def) {
  if (!c.contains(key) || c[key].is_null()) return def;
  if (!c[key].is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " must be a number"));
  }
  // A double beyond float's range (1e39) would become inf: refuse it here, naming the key.
  const double d = c[key].get<double>();
  if (!std::isfinite(d) || std::fabs(d) > std::numeric_limits<float>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: ", key, " = ", d, " is not a finite 32-bit float"));
  }
  return static_cast<float>(d);
}

absl::Status ParseConfig(const json& c, ModelConfig& cfg, bool* tie) {
  if (!c.is_object()) return absl::InvalidArgumentError("config.json is not a JSON object");
  // Llama and Mistral (without a sliding window) share one architecture; anything else has
  // different tensors or attention and is refused by name.
  std::string arch = "(none named)";
  bool known = false;
  if (c.contains("architectures") && c["architectures"].is_array()) {
    for (const json& a : c["architectures"]) {
      if (!a.is_string()) continue;
      arch = a.get<std::string>();
      if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM") known = true;
    }
  }
  if (c.contains("model_type") && c["model_type"].is_string()) {
    std::string mt = c["model_type"].get<std::string>();
    if (mt == "llama" || mt == "mistral") known = true;
    if (arch == "(none named)") arch = mt;
  }
  if (!known) {
    return absl::UnimplementedError(absl::StrCat(
        "model architecture ", arch, " is not supported (LlamaForCausalLM, MistralForCausalLM)"));
  }
  cfg.architecture = "llama";
  cfg.rope_layout = RopeLayout::kHalves;
  ASSIGN_OR_RETURN(cfg.dim, IntField(c, "hidden_size"));
  ASSIGN_OR_RETURN(cfg.ffn_dim, IntField(c, "intermediate_size"));
  ASSIGN_OR_RETURN(cfg.n_layers, IntField(c, "num_hidden_layers"));
  ASSIGN_OR_RETURN(cfg.n_heads, IntField(c, "num_attention_heads"));
  if (cfg.n_heads == 0) return absl::InvalidArgumentError("config.json: num_attention_heads is 0");
  ASSIGN_OR_RETURN(cfg.n_kv_heads, IntField(c, "num_key_value_heads", cfg.n_heads));
  ASSIGN_OR_RETURN(cfg.head_dim, IntField(c, "head_dim", cfg.dim / cfg.n_heads));
  ASSIGN_OR_RETURN(cfg.vocab_size, IntField(c, "vocab_size"));
  ASSIGN_OR_RETURN(cfg.max_seq_len, IntField(c, "max_position_embeddings", 2048));
  if (c.contains("max_position_embeddings") && !c["max_position_embeddings"].is_null()) {
    cfg.trained_context_length = cfg.max_seq_len;
  }
  ASSIGN_OR_RETURN(cfg.rms_eps, FloatField(c, "rms_norm_eps", 1e-6f));  // LlamaConfig default
  ASSIGN_OR_RETURN(cfg.rope_theta, FloatField(c, "rope_theta", 10000.0f));
  *tie = c.contains("tie_word_embeddings") && c["tie_word_embeddings"].is_boolean() &&
         c["tie_word_embeddings"].get<bool>();

  // Features that would change the math: refuse rather than compute something else.
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (c.contains(key) && c[key].is_boolean() && c[key].get<bool>()) {
      return absl::UnimplementedError(absl::StrCat("config.json: ", key, " is not supported"));
    }
  }
  if (c.contains("hidden_act") && c["hidden_act"] != "silu") {
    return absl::UnimplementedError(absl::StrCat("config.json: hidden_act ", c["hidden_act"].dump(),
                                                 " is not supported (silu only)"));
  }
  if (c.contains("sliding_window") && c["sliding_window"].is_number_integer() &&
      c["sliding_window"].get<int64_t>() < cfg.max_seq_len) {
    return absl::UnimplementedError(absl::StrCat(
        "config.json: sliding_window ", c["sliding_window"].get<int64_t>(), " is not supported"));
  }
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) {
    const json& rs = c["rope_scaling"];
    if (!rs.is_object()) {
      return absl::InvalidArgumentError("config.json: rope_scaling is not an object");
    }
    std::string type;
    for (const char* key : {"rope_type", "type"}) {
      if (rs.contains(key) && rs[key].is_string()) {
        type = rs[key].get<std::string>();
        break;
      }
    }
    if (type == "llama3") {
      RopeScaling& s = cfg.rope_scaling;
      s.type = RopeScaling::Type::kLlama3;
      ASSIGN_OR_RETURN(s.factor, FloatField(rs, "factor", s.factor));
      ASSIGN_OR_RETURN(s.low_freq_factor, FloatField(rs, "low_freq_factor", s.low_freq_factor));
      ASSIGN_OR_RETURN(s.high_freq_factor, FloatField(rs, "high_freq_factor", s.high_freq_factor));
      ASSIGN_OR_RETURN(s.original_max_position,
                       IntField(rs, "original_max_position_embeddings", s.original_max_position));
      if (!(s.factor > 0) || !(s.high_freq_factor > s.low_freq_factor) ||
          s.original_max_position <= 0) {
        return absl::InvalidArgumentError("config.json: invalid llama3 rope_scaling parameters");
      }
    } else if (type != "default") {
      return absl::UnimplementedError(absl::StrCat("config.json: rope_scaling type \"", type,
                                                   "\" is not supported (llama3 only)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> LoadHfDirectory(const std::string& dir) {
  auto m = std::make_unique<Model>();
  ASSIGN_OR_RETURN(json config, ReadJsonFile(dir + "/config.json", kMaxConfigJsonBytes));
  bool tie = false;
  RETURN_IF_ERROR(ParseConfig(config, m->config_, &tie));

  // transformers prefers a single model.safetensors over an index, so do we.
  std::vector<std::string> shards;
  json weight_map;
  if (PathExists(dir + "/model.safetensors")) {
    shards.push_back("model.safetensors");
  } else if (PathExists(dir + "/model.safetensors.index.json")) {
    ASSIGN_OR_RETURN(json index,
                     ReadJsonFile(dir + "/model.safetensors.index.json", kMaxIndexJsonBytes));
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError("model.safetensors.index.json has no weight_map object");
    }
    weight_map = index["weight_map"];
    std::set<std::string> files;  // sorted: deterministic mapping order
    for (const auto& [name, file] : weight_map.items()) {
      // Shard names are plain file names; refuse paths that would leave the directory.
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>().find('/') != std::string::npos ||
          file.get<std::string>() == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat("model.safetensors.index.json: bad shard file for ", name));
      }
      files.insert(file.get<std::string>());
    }
    shards.assign(files.begin(), files.end());
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, " has neither model.safetensors nor model.safetensors.index.json"));
  }
  StTensors tensors;
  for (const std::string& s : shards) {
    ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(dir + "/" + s));
    RETURN_IF_ERROR(ParseSafetensors(*f, tensors));
    m->files_.push_back(std::move(f));
  }
  for (const auto& [name, file] : weight_map.items()) {
    if (!tensors.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", name, " listed in the index is not in ", file.get<std::string>()));
    }
  }

  ModelWeights& w = m->weights_;
  RETURN_IF_ERROR(TakeTensor(tensors, "model.embed_tokens.weight", &w.tok_embeddings));
  RETURN_IF_ERROR(TakeTensor(tensors, "model.norm.weight", &w.final_norm));
  if (tie) {
    w.output = w.tok_embeddings;
    m->config_.tied_embeddings = true;
  } else if (tensors.contains("lm_head.weight")) {
    RETURN_IF_ERROR(TakeTensor(tensors, "lm_head.weight", &w.output));
  } else {
    // transformers' default is untied: without lm_head.weight the output projection would be
    // randomly initialised there. Using the embeddings instead would serve a different model.
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor lm_head.weight is missing in ", dir,
        " and config.json does not set tie_word_embeddings: true"));
  }
  // Nine tensors per layer: a corrupt num_hidden_layers must not size a huge allocation.
  if (static_cast<uint64_t>(m->config_.n_layers) * 9 > tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat("num_hidden_layers ", m->config_.n_layers,
                                                   " but only ", tensors.size(), " tensors in ",
                                                   dir));
  }
  w.layers.resize(m->config_.n_layers);
  for (int i = 0; i < m->config_.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    RETURN_IF_ERROR(TakeTensor(tensors, p + "input_layernorm.weight", &l.attn_norm));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "self_attn.q_proj.weight", &l.wq));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "self_attn.k_proj.weight", &l.wk));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "self_attn.v_proj.weight", &l.wv));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "self_attn.o_proj.weight", &l.wo));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "post_attention_layernorm.weight", &l.ffn_norm));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "mlp.gate_proj.weight", &l.w_gate));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "mlp.up_proj.weight", &l.w_up));
    RETURN_IF_ERROR(TakeTensor(tensors, p + "mlp.down_proj.weight", &l.w_down));
  }

  const std::string tok_path = dir + "/tokenizer.json";
  if (!PathExists(tok_path)) {
    return absl::NotFoundError(absl::StrCat(tok_path, " not found: a tokenizer is required"));
  }
  ASSIGN_OR_RETURN(m->tokenizer_, LoadHfTokenizer(tok_path));
  m->source_ = dir;
  RETURN_IF_ERROR(FinalizeModel(*m));
  return m;
}

namespace {

// A special token in tokenizer_config.json: a string, or an AddedToken object {"content": ...}.
std::string TokenText(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) {
    return j["content"].get<std::string>();
  }
  return "";
}

}  // namespace

// tokenizer_config.json's chat template and BOS/EOS text, or chat_template.jinja; none is fine.
absl::Status ReadHfChatTemplate(const std::string& dir, ModelInfo* info) {
  const std::string cfg_path = dir + "/tokenizer_config.json";
  if (PathExists(cfg_path)) {
    ASSIGN_OR_RETURN(json cfg, ReadJsonFile(cfg_path, kMaxConfigJsonBytes));
    if (!cfg.is_object()) return absl::InvalidArgumentError(cfg_path + ": not a JSON object");
    const json& t = cfg.contains("chat_template") ? cfg["chat_template"] : json();
    if (t.is_string()) {
      info->chat_template = t.get<std::string>();
    } else if (t.is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
      for (const json& e : t) {
        if (e.is_object() && e.value("name", json()) == "default" && e.contains("template") &&
            e["template"].is_string()) {
          info->chat_template = e["template"].get<std::string>();
        }
      }
    } else if (!t.is_null()) {
      return absl::InvalidArgumentError(cfg_path + ": chat_template must be a string or a list");
    }
    if (cfg.contains("bos_token")) info->bos_token = TokenText(cfg["bos_token"]);
    if (cfg.contains("eos_token")) info->eos_token = TokenText(cfg["eos_token"]);
  }
  // Newer checkpoints keep the template in a file of its own.
  const std::string jinja_path = dir + "/chat_template.jinja";
  if (info->chat_template.empty() && PathExists(jinja_path)) {
    ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(jinja_path));
    if (f->size() > kMaxConfigJsonBytes) {
      return absl::InvalidArgumentError(absl::StrCat(jinja_path, " is larger than ",
                                                     kMaxConfigJsonBytes, " bytes"));
    }
    info->chat_template.assign(reinterpret_cast<const char*>(f->data()), f->size());
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelInfo> LoadHfInfo(const std::string& dir) {
  ModelInfo info;
  ASSIGN_OR_RETURN(json config, ReadJsonFile(dir + "/config.json", kMaxConfigJsonBytes));
  bool tie = false;
  RETURN_IF_ERROR(ParseConfig(config, info.config, &tie));
  info.config.tied_embeddings = tie;
  const std::string tok_path = dir + "/tokenizer.json";
  if (!PathExists(tok_path)) {
    return absl::NotFoundError(absl::StrCat(tok_path, " not found: a tokenizer is required"));
  }
  ASSIGN_OR_RETURN(info.tokenizer, LoadHfTokenizer(tok_path));
  RETURN_IF_ERROR(ReadHfChatTemplate(dir, &info));
  info.source = dir;
  return info;
}

}  // namespace sparsex

// A tiny Hugging Face model directory for the safetensors and config.json targets: a byte-level
// BPE tokenizer.json (the 256 bytes and two merges) and a config.json of one layer, hidden size
// 4, vocabulary 256; the safetensors seeds (make_seeds.py) hold exactly its tensors.
#pragma once

#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "tests/model/byte_alphabet.h"

namespace sparsex::fuzz {

inline std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// The 256 byte tokens and no merges (the config's vocabulary is 256); the added tokens <s> and
// </s> take ids 1 and 2 as specials.
inline std::string TinyTokenizerJson() {
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    if (b) vocab += ",";
    vocab += "\"" + JsonEscape(sparsex::testing::Gpt2ByteChar(b)) + "\":" + std::to_string(b);
  }
  return R"({"version":"1.0","normalizer":null,"pre_tokenizer":{"type":"ByteLevel",)"
         R"("add_prefix_space":false},"decoder":{"type":"ByteLevel"},)"
         R"("added_tokens":[{"id":1,"content":"<s>","special":true},)"
         R"({"id":2,"content":"</s>","special":true}],)"
         R"("model":{"type":"BPE","merges":[],"vocab":{)" +
         vocab + "}}}";
}

inline const char* kTinyConfigJson =
    R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4,)"
    R"("intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,)"
    R"("num_key_value_heads":1,"vocab_size":256,"max_position_embeddings":64,)"
    R"("rms_norm_eps":1e-5,"rope_theta":10000.0,"hidden_act":"silu","tie_word_embeddings":false})";

}  // namespace sparsex::fuzz

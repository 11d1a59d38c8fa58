// Tokenizers: SentencePiece-style BPE with byte fallback (from a GGUF vocabulary with scores),
// GGUF byte-level BPE (every llama.cpp pre-tokenizer that is a list of regexes), and Hugging Face
// tokenizer.json BPE with its normalizers, pre-tokenizers and decoders.
//
//   std::vector<int32_t> ids = tok.Encode("Once upon a time", /*add_bos=*/true);
//   std::string text = tok.Decode(ids);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace sparsex {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Text to ids. Invalid UTF-8 is encoded through byte fallback (SPM) or raw bytes (byte-level),
  // never rejected. Special-token strings in text (e.g. "<|eot_id|>") map to their ids when
  // parse_special is true.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                                      bool parse_special = false) const = 0;
  // Ids to text; special tokens (BOS/EOS) are skipped. Out-of-range ids decode to "".
  virtual std::string Decode(const std::vector<int32_t>& ids) const = 0;
  // The raw bytes one token stands for (used by streaming decoders); "" for special tokens.
  // SPM: the space the encoder prefixes is not stripped here, only in Decode.
  virtual std::string TokenPiece(int32_t id) const = 0;
  // A special token's name as written in the vocabulary ("<s>", "<|eot_id|>"), for displays
  // such as log-probabilities; "" for other tokens.
  virtual std::string SpecialText(int32_t /*id*/) const { return ""; }
  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when the vocabulary has none
  virtual int32_t eos_id() const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  virtual std::vector<int32_t> StopIds() const { return {eos_id()}; }
};

// SentencePiece BPE from explicit vocabulary. types follow GGUF's token_type
// (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
struct SpmVocab {
  std::vector<std::string> pieces;  // '▁' (U+2581) marks a space
  std::vector<float> scores;
  std::vector<int32_t> types;
  int32_t bos_id = 1, eos_id = 2, unk_id = 0;
  bool add_space_prefix = true;
};
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeSpmTokenizer(SpmVocab vocab);

// Byte-level BPE from explicit vocabulary: a GGUF "gpt2" tokenizer model (GPT-2, Llama-3,
// Qwen2 families). Same machinery as the tokenizer.json reader below. As in llama.cpp, a byte
// whose alphabet character is no token (Falcon's vocabulary lacks some) is left out of the ids:
// llama.cpp's BPE never emits an unknown token.
struct ByteLevelVocab {
  // Normal tokens in GPT-2's byte alphabet ("\xC4\xA0the" for " the"); control and
  // user-defined tokens as raw text (as GGUF stores them).
  std::vector<std::string> tokens;
  std::vector<int32_t> types;        // GGUF token_type, as SpmVocab (empty: all normal)
  std::vector<std::string> merges;   // "left right" in byte-alphabet pieces, by rank
  std::vector<std::string> pre_regexes;  // pre-tokenizer splits, applied in order (PCRE2)
  bool ignore_merges = false;  // Llama-3: a pre-token that is a whole token is taken as is
  // unk_id is checked for range only: like llama.cpp's BPE, encoding never emits it.
  int32_t bos_id = -1, eos_id = -1, unk_id = -1;
  std::vector<int32_t> extra_stop_ids;  // end-of-turn tokens (eot, eom) besides eos
};
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeByteLevelTokenizer(ByteLevelVocab vocab);

// The pre-tokenizer of a GGUF tokenizer.ggml.pre name, as llama.cpp defines it ("gpt-2",
// "llama-bpe" (Llama-3), "qwen2", "tekken", "gpt-4o", "default", ...): the split regexes, and
// whether whole-token pre-tokens skip the merges. UNIMPLEMENTED naming the pre-tokenizer for a
// name not known here. ByteLevelPreTokenizerNames lists the known names.
absl::Status ByteLevelPreTokenizer(std::string_view name, ByteLevelVocab* vocab);
std::vector<std::string> ByteLevelPreTokenizerNames();

// Hugging Face tokenizer.json with model.type "BPE": byte-level (ByteLevel pre-tokenizer) or over
// characters with byte fallback / unknown token. Normalizers NFC, NFD, NFKC, NFKD, Lowercase,
// Strip, StripAccents, Replace, Prepend, BertNormalizer, Sequence; pre-tokenizers Split (every
// behavior, invert), ByteLevel, Digits, Metaspace, Whitespace, WhitespaceSplit, Punctuation,
// CharDelimiterSplit, BertPreTokenizer, Sequence; decoders ByteLevel, Replace, ByteFallback, Fuse,
// Strip, Metaspace, Sequence. Any other component is refused (UNIMPLEMENTED, naming it).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& path);
absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizer(std::string_view json);

}  // namespace sparsex

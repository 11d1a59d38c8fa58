// The pre-tokenizers of GGUF byte-level vocabularies, by their tokenizer.ggml.pre name: the split
// regexes llama.cpp applies (src/llama-vocab.cpp, llm_tokenizer_bpe), each splitting the pieces
// of the one before and keeping both matches and the text between them. The patterns are
// llama.cpp's own spelling (its "adapted" forms where it rewrote a tokenizer.json pattern, e.g.
// '[sS] for (?i:'s)), so PCRE2 splits exactly where llama.cpp does.
#include <algorithm>
#include <initializer_list>
#include <string_view>

#include "model/tokenizer/bpe_util.h"
#include "model/tokenizer/tokenizer.h"

namespace sparsex {
namespace {

// English contractions, case spelled out (llama.cpp's rewrite of (?i:'s|'t|...)).
#define SPX_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

constexpr const char* kGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
constexpr const char* kLlama3 = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kJais2 = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+)"
    R"(|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S))"
    R"(|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1})";
constexpr const char* kQwen2 = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen35 = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+)"
    R"(|\s+(?!\S)|\s+)";
// Written with \x{...} escapes: several of its code points (U+1F7D, U+1FBE, U+1FD3, U+1FDB,
// U+2126, U+212A) are canonical singletons that any NFC-normalizing editor would silently turn
// into other characters, reordering the ranges.
constexpr const char* kDeepseekLlmLetters =
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293})"
    R"(\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A})"
    R"(\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556})"
    R"(\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF})"
    R"(\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})"
    R"(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-)"
    R"(\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC})"
    R"(\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC})"
    R"(\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128})"
    R"(\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E})"
    R"(\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3})"
    R"(\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E})"
    R"(\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A})"
    R"(\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-)"
    R"(\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)";
constexpr const char* kDeepseek3Words =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)"
    R"(| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kSpark25Words =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)"
    R"(| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+)";
constexpr const char* kYoutuWords =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+)" SPX_CONTRACTIONS
    R"(?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*)" SPX_CONTRACTIONS
    R"(?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kTekken =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+)"
    R"(|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*)"
    R"(|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kGpt4o =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+)" SPX_CONTRACTIONS
    R"(?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*)" SPX_CONTRACTIONS
    R"(?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kGraniteEmbMulti =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+)" SPX_CONTRACTIONS
    R"(?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*)" SPX_CONTRACTIONS
    R"(?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kTinyAyaWords =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+)" SPX_CONTRACTIONS
    R"(?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*)" SPX_CONTRACTIONS
    R"(?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kBailingMoe =
    R"('(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)";
constexpr const char* kSeedCoder = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kUfakzeka =
    R"([^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kExaoneMoe = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?)"
    R"(|\s*[\r\n]|\s+(?!\S)|\s+)";
constexpr const char* kMiniCpm5 = SPX_CONTRACTIONS
    R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kBloom = R"( ?[^(\s|.,!?…。，、।۔،)]+)";
constexpr const char* kCjk = R"([一-龥぀-ゟ゠-ヿ]+)";
// AFMoE's CJK and Asian scripts class, in escapes: U+F900 (the start of the CJK compatibility
// ideographs) is a canonical singleton that NFC-normalizing tools turn into U+8C48.
constexpr const char* kAfmoeScripts =
    R"([\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{F900}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF})"
    R"(\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{0E00}-\x{0E7F}\x{0E80}-\x{0EFF}\x{1780}-\x{17FF})"
    R"(\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+)";

#undef SPX_CONTRACTIONS

struct PreTokenizerDef {
  std::initializer_list<std::string_view> names;
  std::initializer_list<const char*> regexes;
  bool ignore_merges;
};

// Name groups as llama.cpp maps tokenizer.ggml.pre to its pre-tokenizer types.
const PreTokenizerDef kDefs[] = {
    {{"default"},
     {R"([\p{P}\$\+<=>\^~\|]+)", kGpt2, R"(\p{N}+)", "[0-9][0-9][0-9]"},
     false},
    {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"},
     {kLlama3},
     true},
    {{"dbrx", "smaug-bpe", "glm4", "chatglm-bpe"}, {kLlama3}, false},
    {{"jais-2"}, {kJais2}, false},
    {{"deepseek-llm"},
     {"[\r\n]", kDeepseekLlmLetters, R"(\s?[!-/:-~！-／：-～‘-‟　-。]+)", R"(\s+$)",
      R"([一-龥ࠀ-一가-퟿]+)", R"(\p{N}+)"},
     false},
    {{"deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"},
     {R"(\p{N}{1,3})", kCjk, kDeepseek3Words},
     false},
    {{"spark2_5"}, {R"(\p{N}{1,3})", kCjk, kSpark25Words, R"(\p{N})"}, false},
    {{"youtu"},
     {R"([가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+)", kYoutuWords},
     true},
    {{"deepseek-coder"},
     {"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", R"([一-龥ࠀ-一가-퟿]+)", R"(\p{N})"},
     false},
    {{"falcon"},
     {R"([\p{P}\$\+<=>\^~\|`]+)", kGpt2, "[0-9][0-9][0-9]"},
     false},
    {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
      "mellum2"},
     {R"(\p{N})", kGpt2},
     false},
    {{"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt",
      "olmo", "jais", "trillion", "granite-docling"},
     {kGpt2},
     false},
    {{"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
      "solar-open", "grok-2"},
     {kQwen2},
     false},
    {{"qwen35"}, {kQwen35}, false},
    {{"poro-chat", "bloom", "gpt3-finnish"}, {kBloom}, false},
    {{"viking"}, {kBloom, R"(\p{N})"}, false},
    {{"tekken"}, {kTekken}, true},
    {{"chameleon"},
     {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )",
      R"(\p{N})", R"([\p{P}!-/:-@\[-`{-~])", kGpt2},
     false},
    {{"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}, {kGpt4o}, false},
    {{"granite-embed-multi-97m"}, {kGraniteEmbMulti}, true},
    {{"tiny_aya", "cohere2moe"}, {R"(\d{1,3}(?=(?:\d{3})*\b))", kTinyAyaWords}, false},
    {{"bailingmoe", "bailingmoe2", "llada-moe"}, {kBailingMoe}, false},
    {{"seed-coder"}, {kSeedCoder}, false},
    {{"ufakzeka"}, {kUfakzeka}, false},
    {{"laguna"}, {R"([^\n]+|[\n]+)", kQwen2}, false},
    {{"exaone-moe"}, {kExaoneMoe}, false},
    {{"minicpm5"}, {R"(\p{N}{1,3})", kMiniCpm5}, true},
    // "\p{AFMoE_digits}" is no regex: llama.cpp runs hand-written code for it, and so does
    // MakeByteLevelTokenizer (the digit groups of tiny_aya's first pattern too).
    {{"afmoe"}, {R"(\p{AFMoE_digits})", kAfmoeScripts, kDeepseek3Words}, false},
    // A zero-width pattern: llama.cpp cuts at each empty match (before every group of three
    // digits counted from the right). std::regex's \d is ASCII, hence [0-9].
    {{"superbpe"}, {R"(\p{N}+)", R"((?=([0-9]{3})+(?![0-9])))"}, false},
};

}  // namespace

absl::Status ByteLevelPreTokenizer(std::string_view name, ByteLevelVocab* vocab) {
  for (const PreTokenizerDef& d : kDefs) {
    if (std::find(d.names.begin(), d.names.end(), name) == d.names.end()) continue;
    vocab->pre_regexes.assign(d.regexes.begin(), d.regexes.end());
    vocab->ignore_merges = d.ignore_merges;
    return absl::OkStatus();
  }
  // Not here: kimi-k2 (llama.cpp splits it with hand-written code for all its patterns),
  // SentencePiece-style BPE over raw UTF-8 (gemma4, sarvam-moe, granite-embed-multi-311m) and
  // the whitespace tokenizer.
  return absl::UnimplementedError(absl::StrCat("GGUF pre-tokenizer '", tok_internal::AsAbsl(name),
                                               "' (tokenizer.ggml.pre) not supported"));
}

std::vector<std::string> ByteLevelPreTokenizerNames() {
  std::vector<std::string> out;
  for (const PreTokenizerDef& d : kDefs)
    for (std::string_view n : d.names) out.emplace_back(n);
  return out;
}

}  // namespace sparsex

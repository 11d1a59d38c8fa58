// Hugging Face tokenizer.json, byte-level BPE (GPT-2, Llama-3, Qwen2 style): added tokens are cut
// out first, the rest is split into pre-tokens by regex (PCRE2), each pre-token's bytes are mapped
// to GPT-2's printable alphabet and merged by merge rank.
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "common/json_depth.h"
#include "common/mapped_file.h"
#include "model/tokenizer/bpe_util.h"
#include "model/tokenizer/tokenizer.h"

namespace sparsex {
namespace {

using json = nlohmann::json;
using tok_internal::BpeSymbol;

// Largest tokenizer.json accepted (Llama-3's is 9 MB, the largest common ones ~35 MB).
constexpr size_t kMaxTokenizerJsonBytes = size_t{256} << 20;

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes get
// code points 256.. in byte order, so every byte has a visible, non-space character.
struct ByteAlphabet {
  std::array<std::string, 256> to_char;  // byte -> UTF-8 of its character
  std::array<int16_t, 512> to_byte;      // code point -> byte, -1 when not in the alphabet
  ByteAlphabet() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : next++;
      AppendUtf8(to_char[b], cp);
      to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};
const ByteAlphabet& Alphabet() {
  static const ByteAlphabet a;
  return a;
}

// A vocabulary piece (byte-level characters) back to the bytes it stands for. Characters outside
// the alphabet are passed through as their own UTF-8.
std::string ByteLevelDecode(std::string_view piece) {
  const ByteAlphabet& a = Alphabet();
  std::string out;
  for (size_t i = 0; i < piece.size();) {
    const size_t n = tok_internal::Utf8Len(piece, i);
    uint32_t cp = 0x7FFFFFFF;
    if (n == 1) cp = static_cast<unsigned char>(piece[i]);
    if (n == 2) cp = ((piece[i] & 0x1F) << 6) | (piece[i + 1] & 0x3F);
    if (cp < a.to_byte.size() && a.to_byte[cp] >= 0) {
      out += static_cast<char>(a.to_byte[cp]);
    } else {
      out.append(piece.substr(i, std::max<size_t>(n, 1)));
    }
    i += std::max<size_t>(n, 1);
  }
  return out;
}

struct Pcre2Deleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using Regex = std::unique_ptr<pcre2_code, Pcre2Deleter>;

absl::StatusOr<Regex> CompileRegex(const std::string& pattern, uint32_t extra_options) {
  uint32_t options = PCRE2_UTF | PCRE2_UCP | extra_options;
#ifdef PCRE2_MATCH_INVALID_UTF
  options |= PCRE2_MATCH_INVALID_UTF;  // invalid bytes just never match: they end up in gaps
#endif
  int err = 0;
  PCRE2_SIZE offset = 0;
  Regex re(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                         &err, &offset, nullptr));
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return absl::InvalidArgumentError(absl::StrCat("pre-tokenizer regex error at ", offset, ": ",
                                                   reinterpret_cast<const char*>(msg), " in ",
                                                   pattern));
  }
  pcre2_jit_compile(re.get(), PCRE2_JIT_COMPLETE);  // optional speed-up; interpreter otherwise
  return re;
}

// Split with behaviour "Isolated": every match is a pre-token and so is every gap between them.
void SplitIsolated(const pcre2_code* re, std::string_view s, pcre2_match_data* md,
                   std::vector<std::string_view>& out) {
#ifdef PCRE2_MATCH_INVALID_UTF
  constexpr uint32_t kOptions = 0;
#else
  constexpr uint32_t kOptions = PCRE2_NO_UTF_CHECK;  // only valid runs get here; a check per
                                                     // call would make this quadratic
#endif
  size_t pos = 0, gap = 0;
  while (pos < s.size()) {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    int rc = pcre2_match(re, subject, s.size(), pos, kOptions, md, nullptr);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {  // e.g. JIT stack limit: retry interpreted
      rc = pcre2_match(re, subject, s.size(), pos, kOptions | PCRE2_NO_JIT, md, nullptr);
    }
    if (rc < 0) break;  // no more matches (or a hard error): the rest is one gap
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e <= b) {  // empty match: step over one character, which stays in the gap
      pos = b + 1;
      while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (b > gap) out.push_back(s.substr(gap, b - gap));
    out.push_back(s.substr(b, e - b));
    pos = gap = e;
  }
  if (gap < s.size()) out.push_back(s.substr(gap));
}

class HfTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && bos_ >= 0) out.push_back(bos_);
    std::vector<std::unique_ptr<pcre2_match_data, Pcre2Deleter>> md;
    for (const Regex& re : splits_)
      md.emplace_back(pcre2_match_data_create_from_pattern(re.get(), nullptr));
    std::string prefixed;
    std::vector<std::string_view> pieces, next;
    for (const auto& f : added_.Split(text, parse_special)) {
      if (f.id >= 0) {
        out.push_back(f.id);
        continue;
      }
      std::string_view run = f.text;
      if (add_prefix_space_ && !run.starts_with(' ')) {
        prefixed = " " + std::string(run);
        run = prefixed;
      }
      pieces.assign(1, run);
#ifndef PCRE2_MATCH_INVALID_UTF
      pieces = SplitInvalidUtf8(run);  // old PCRE2 cannot match across invalid bytes
#endif
      for (size_t r = 0; r < splits_.size(); ++r) {
        next.clear();
        for (std::string_view p : pieces) {
#ifndef PCRE2_MATCH_INVALID_UTF
          if (tok_internal::Utf8Len(p, 0) == 0) {
            next.push_back(p);
            continue;
          }
#endif
          SplitIsolated(splits_[r].get(), p, md[r].get(), next);
        }
        pieces.swap(next);
      }
      for (std::string_view p : pieces) EncodePiece(p, out);
    }
    return out;
  }

  std::string Decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids)
      if (!IsSpecial(id)) out += TokenPiece(id);
    return out;
  }
  std::string TokenPiece(int32_t id) const override {
    return id >= 0 && id < vocab_size() && !special_[id] ? pieces_[id] : std::string();
  }
  std::string SpecialText(int32_t id) const override {
    return IsSpecial(id) ? pieces_[id] : std::string();
  }
  int32_t vocab_size() const override { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  bool IsSpecial(int32_t id) const override {
    return id >= 0 && id < vocab_size() && (special_[id] || id == bos_ || id == eos_);
  }
  std::vector<int32_t> StopIds() const override { return stops_; }

 private:
  friend absl::StatusOr<std::unique_ptr<Tokenizer>> sparsex::ParseHfTokenizer(std::string_view);
  friend absl::StatusOr<std::unique_ptr<Tokenizer>> sparsex::MakeByteLevelTokenizer(
      ByteLevelVocab);

#ifndef PCRE2_MATCH_INVALID_UTF
  // Valid UTF-8 runs and single invalid bytes, in order.
  static std::vector<std::string_view> SplitInvalidUtf8(std::string_view s) {
    std::vector<std::string_view> out;
    size_t run = 0;
    for (size_t i = 0; i < s.size();) {
      const size_t n = tok_internal::Utf8Len(s, i);
      if (n > 0) {
        i += n;
        continue;
      }
      if (i > run) out.push_back(s.substr(run, i - run));
      out.push_back(s.substr(i, 1));
      run = ++i;
    }
    if (run < s.size()) out.push_back(s.substr(run));
    return out;
  }
#endif

  void EncodePiece(std::string_view p, std::vector<int32_t>& out) const {
    const ByteAlphabet& a = Alphabet();
    if (ignore_merges_) {  // Llama-3: a pre-token that is itself in the vocabulary is taken whole
      std::string mapped;
      for (char c : p) mapped += a.to_char[static_cast<unsigned char>(c)];
      if (auto it = vocab_.find(mapped); it != vocab_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<BpeSymbol> syms(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      const auto k = static_cast<int32_t>(i);
      syms[i] = {k - 1, k + 1, static_cast<uint32_t>(i), 1,
                 byte_id_[static_cast<unsigned char>(p[i])]};
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    tok_internal::BpeMerge(
        syms,
        [&](const BpeSymbol& l, const BpeSymbol& r) -> std::optional<std::pair<double, int32_t>> {
          if (l.id < 0 || r.id < 0) return std::nullopt;
          auto it = merges_.find(PairKey(l.id, r.id));
          if (it == merges_.end()) return std::nullopt;
          return std::make_pair(static_cast<double>(it->second.first), it->second.second);
        });
    for (int32_t k = 0; k >= 0; k = syms[k].next)
      out.push_back(syms[k].id >= 0 ? syms[k].id : unk_);
  }

  // byte_id_ from the vocabulary (after vocab_ and unk_ are set): each byte's character of the
  // byte alphabet; a byte the vocabulary lacks needs an unknown token (`unk_name` in the error).
  absl::Status MapBytes(const char* unk_name) {
    const ByteAlphabet& a = Alphabet();
    for (int b = 0; b < 256; ++b) {
      auto it = vocab_.find(a.to_char[b]);
      byte_id_[b] = it == vocab_.end() ? -1 : it->second;
      if (byte_id_[b] < 0 && unk_ < 0) {
        return absl::InvalidArgumentError(absl::StrCat("byte-level vocabulary lacks byte ", b,
                                                       " and has no ", unk_name,
                                                       " to stand for it"));
      }
    }
    return absl::OkStatus();
  }

  static uint64_t PairKey(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }

  absl::flat_hash_map<std::string, int32_t> vocab_;                    // byte-level piece -> id
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (l, r) -> (rank, id)
  std::array<int32_t, 256> byte_id_{};
  std::vector<std::string> pieces_;  // raw bytes per id
  std::vector<uint8_t> special_;
  std::vector<Regex> splits_;  // applied in order, each splitting the pieces of the one before
  tok_internal::TokenMatcher added_;
  bool ignore_merges_ = false, add_prefix_space_ = false;
  int32_t bos_ = -1, eos_ = -1, unk_ = -1;
  std::vector<int32_t> stops_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizer(std::string_view text) {
  auto tok = std::unique_ptr<HfTokenizer>(new HfTokenizer());
  HfTokenizer& t = *tok;
  bool byte_level = false;
  // Deep nesting would exhaust the stack in the parser or in the recursive walks below.
  if (absl::Status s = CheckJsonLimits(text, kMaxTokenizerJsonBytes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", s.message()));
  }
  try {
    const json j = json::parse(text);
    const json& model = j.at("model");
    if (model.value("type", "BPE") != "BPE") {
      return absl::UnimplementedError(
          absl::StrCat("tokenizer.json model type ", model.value("type", ""), " is not supported"));
    }
    if (!model.value("continuing_subword_prefix", json()).is_null() ||
        !model.value("end_of_word_suffix", json()).is_null()) {
      return absl::UnimplementedError("BPE subword prefixes/suffixes are not supported");
    }
    // Pre-tokenizer: Split(Regex) steps and ByteLevel (whose use_regex means the GPT-2 pattern).
    auto add_pre = [&](const json& p, auto&& self) -> absl::Status {
      if (p.is_null()) return absl::OkStatus();
      const std::string type = p.at("type").get<std::string>();
      if (type == "Sequence") {
        for (const json& q : p.at("pretokenizers")) RETURN_IF_ERROR(self(q, self));
      } else if (type == "Split") {
        if (p.value("behavior", "Isolated") != "Isolated" || p.value("invert", false)) {
          return absl::UnimplementedError("only Split with behavior Isolated is supported");
        }
        const json& pat = p.at("pattern");
        const bool literal = !pat.contains("Regex");
        ASSIGN_OR_RETURN(Regex re,
                         CompileRegex(pat.at(literal ? "String" : "Regex").get<std::string>(),
                                      literal ? PCRE2_LITERAL : 0));
        t.splits_.push_back(std::move(re));
      } else if (type == "Digits") {
        ASSIGN_OR_RETURN(
            Regex re,
            CompileRegex(p.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)", 0));
        t.splits_.push_back(std::move(re));
      } else if (type == "ByteLevel") {
        byte_level = true;
        t.add_prefix_space_ = p.value("add_prefix_space", false);
        if (p.value("use_regex", true)) {
          ASSIGN_OR_RETURN(Regex re, CompileRegex(kGpt2Pattern, 0));
          t.splits_.push_back(std::move(re));
        }
      } else {
        return absl::UnimplementedError("pre-tokenizer " + type + " is not supported");
      }
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(add_pre(j.value("pre_tokenizer", json()), add_pre));
    const json dec = j.value("decoder", json());
    if (dec.is_object() && dec.value("type", "") == "ByteLevel") byte_level = true;
    if (!byte_level)
      return absl::UnimplementedError("only byte-level BPE tokenizer.json is supported");
    const json norm = j.value("normalizer", json());
    if (!norm.is_null() && norm.value("type", "") != "NFC") {
      return absl::UnimplementedError("normalizer " + norm.value("type", std::string("?")) +
                                      " is not supported");
    }

    constexpr int64_t kMaxId = 1 << 24;  // a sanity bound so a bad id cannot allocate gigabytes
    int64_t n = 0;
    // An id must be an integer: get<int64_t>() of a float such as 1e300 would be undefined
    // behaviour (found by tests/fuzz/tokenizer_json_fuzz).
    auto check_id = [&](const json& v) -> absl::Status {
      if (!v.is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat("bad token id ", v.dump()));
      }
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= kMaxId)
        return absl::InvalidArgumentError(absl::StrCat("bad token id ", id));
      n = std::max(n, id + 1);
      return absl::OkStatus();
    };
    for (const auto& [piece, id] : model.at("vocab").items()) {
      RETURN_IF_ERROR(check_id(id));
      t.vocab_.emplace(piece, id.get<int32_t>());
    }
    const json added = j.value("added_tokens", json::array());
    for (const json& a : added) RETURN_IF_ERROR(check_id(a.at("id")));
    t.pieces_.resize(n);
    t.special_.assign(n, 0);
    for (const auto& [piece, id] : t.vocab_) t.pieces_[id] = ByteLevelDecode(piece);
    absl::flat_hash_map<std::string, int32_t> added_ids;
    for (const json& a : added) {
      const auto id = a.at("id").get<int32_t>();
      const auto content = a.at("content").get<std::string>();
      const bool special = a.value("special", false);
      t.pieces_[id] = content;  // added tokens are raw text, not byte-level characters
      t.special_[id] = special;
      t.added_.Add(content, id, /*parse_only=*/special);
      added_ids.emplace(content, id);
    }
    t.added_.Finalize();
    t.ignore_merges_ = model.value("ignore_merges", false);
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = t.vocab_.find(model["unk_token"].get<std::string>());
      if (it != t.vocab_.end()) t.unk_ = it->second;
    }

    RETURN_IF_ERROR(t.MapBytes("unk_token"));

    int32_t rank = 0;
    for (const json& m : model.value("merges", json::array())) {
      std::string l, r;
      if (m.is_string()) {  // "a b": byte-level pieces never contain a plain space
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) return absl::InvalidArgumentError("bad merge: " + s);
        l = s.substr(0, sp);
        r = s.substr(sp + 1);
      } else {
        l = m.at(0).get<std::string>();
        r = m.at(1).get<std::string>();
      }
      auto il = t.vocab_.find(l), ir = t.vocab_.find(r), im = t.vocab_.find(l + r);
      const int32_t this_rank = rank++;
      if (il == t.vocab_.end() || ir == t.vocab_.end() || im == t.vocab_.end()) continue;
      t.merges_.try_emplace(HfTokenizer::PairKey(il->second, ir->second), this_rank, im->second);
    }

    auto find = [&](std::string_view s) -> int32_t {
      if (auto it = added_ids.find(tok_internal::AsAbsl(s)); it != added_ids.end())
        return it->second;
      if (auto it = t.vocab_.find(tok_internal::AsAbsl(s)); it != t.vocab_.end()) return it->second;
      return -1;
    };
    // BOS: the special token TemplateProcessing puts before the text, else a well-known name.
    auto template_bos = [&](const json& pp, auto&& self) -> std::string {
      if (!pp.is_object()) return "";
      const std::string type = pp.value("type", "");
      if (type == "Sequence") {
        for (const json& q : pp.value("processors", json::array()))
          if (std::string s = self(q, self); !s.empty()) return s;
      } else if (type == "TemplateProcessing") {
        for (const json& item : pp.value("single", json::array())) {
          if (item.contains("Sequence")) break;
          if (item.contains("SpecialToken"))
            return item["SpecialToken"].at("id").get<std::string>();
        }
      }
      return "";
    };
    if (std::string b = template_bos(j.value("post_processor", json()), template_bos); !b.empty())
      t.bos_ = find(b);
    for (const char* name : {"<|begin_of_text|>", "<s>"})
      if (t.bos_ < 0) t.bos_ = find(name);
    for (const char* name : {"<|end_of_text|>", "</s>", "<|endoftext|>"})
      if (t.eos_ < 0) t.eos_ = find(name);
    if (t.eos_ >= 0) t.stops_.push_back(t.eos_);
    for (const char* name : {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>"}) {
      const int32_t id = find(name);
      if (id >= 0 && std::find(t.stops_.begin(), t.stops_.end(), id) == t.stops_.end())
        t.stops_.push_back(id);
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

absl::Status ByteLevelPreTokenizer(std::string_view name, ByteLevelVocab* vocab) {
  // llama.cpp's pre-tokenizer types (llama-vocab.cpp) with the regexes of the models'
  // tokenizer.json, which PCRE2 runs as written (llama.cpp rewrites some for its own engine).
  static constexpr const char* kLlama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr const char* kQwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr const char* kPunct = R"([\p{P}\$\+<=>\^~\|`]+)";
  const auto is = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  std::vector<std::string>& re = vocab->pre_regexes;
  vocab->ignore_merges = false;
  if (is({"llama3", "llama-v3", "llama-bpe", "falcon3"})) {
    re = {kLlama3};
    vocab->ignore_merges = true;
  } else if (is({"dbrx", "smaug-bpe"})) {
    re = {kLlama3};
  } else if (is({"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"})) {
    re = {kQwen2};
  } else if (is({"gpt-2", "mpt", "olmo", "jais", "trillion"})) {
    re = {kGpt2Pattern};
  } else if (is({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                 "minerva-7b"})) {
    re = {R"(\p{N})", kGpt2Pattern};
  } else if (is({"falcon"})) {
    re = {kPunct, kGpt2Pattern, "[0-9][0-9][0-9]"};
  } else if (is({"default"})) {
    re = {kPunct, kGpt2Pattern, R"(\p{N}+)", "[0-9][0-9][0-9]"};
  } else {
    return absl::UnimplementedError(absl::StrCat("GGUF pre-tokenizer \"", tok_internal::AsAbsl(name),
                                                 "\" (tokenizer.ggml.pre) is not supported"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeByteLevelTokenizer(ByteLevelVocab v) {
  enum : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5 };
  const size_t n = v.tokens.size();
  if (n == 0) return absl::InvalidArgumentError("byte-level vocabulary is empty");
  if (n > (size_t{1} << 24)) return absl::InvalidArgumentError("byte-level vocabulary too large");
  if (v.types.empty()) v.types.assign(n, kNormal);
  if (v.types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("byte-level vocabulary has ", n,
                                                   " tokens but ", v.types.size(), " types"));
  }
  const auto bad = [n](int32_t id) { return id < -1 || id >= static_cast<int64_t>(n); };
  if (bad(v.bos_id) || bad(v.eos_id) || bad(v.unk_id)) {
    return absl::InvalidArgumentError(absl::StrCat("byte-level special id out of range: bos ",
                                                   v.bos_id, ", eos ", v.eos_id, ", unk ",
                                                   v.unk_id, ", vocabulary ", n));
  }
  auto tok = std::unique_ptr<HfTokenizer>(new HfTokenizer());
  HfTokenizer& t = *tok;
  for (const std::string& p : v.pre_regexes) {
    ASSIGN_OR_RETURN(Regex re, CompileRegex(p, 0));
    t.splits_.push_back(std::move(re));
  }
  t.ignore_merges_ = v.ignore_merges;
  t.pieces_.resize(n);
  t.special_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    const std::string& s = v.tokens[i];
    switch (v.types[i]) {
      case kControl:  // raw text, matched in text only on request
        t.pieces_[i] = s;
        t.special_[i] = 1;
        t.added_.Add(s, id, /*parse_only=*/true);
        break;
      case kUserDefined:  // raw text, always matched (as llama.cpp)
        t.pieces_[i] = s;
        t.added_.Add(s, id, /*parse_only=*/false);
        break;
      case kUnknown:
        if (v.unk_id < 0) v.unk_id = id;
        t.pieces_[i] = s;
        t.special_[i] = 1;
        break;
      case kUnused:
        break;
      default:  // normal (and 0, undefined): byte-alphabet text
        t.vocab_.try_emplace(s, id);
        t.pieces_[i] = ByteLevelDecode(s);
    }
  }
  t.added_.Finalize();
  t.unk_ = v.unk_id;
  RETURN_IF_ERROR(t.MapBytes("unknown token"));
  for (size_t rank = 0; rank < v.merges.size(); ++rank) {
    const std::string& m = v.merges[rank];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad merge ", rank, ": \"", m, "\""));
    }
    const std::string l = m.substr(0, sp), r = m.substr(sp + 1);
    auto il = t.vocab_.find(l), ir = t.vocab_.find(r), im = t.vocab_.find(l + r);
    if (il == t.vocab_.end() || ir == t.vocab_.end() || im == t.vocab_.end()) continue;
    t.merges_.try_emplace(HfTokenizer::PairKey(il->second, ir->second),
                          static_cast<int32_t>(rank), im->second);
  }
  t.bos_ = v.bos_id;
  t.eos_ = v.eos_id;
  if (t.eos_ >= 0) t.stops_.push_back(t.eos_);
  for (int32_t id : v.extra_stop_ids) {
    if (id >= 0 && id < static_cast<int64_t>(n) &&
        std::find(t.stops_.begin(), t.stops_.end(), id) == t.stops_.end())
      t.stops_.push_back(id);
  }
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& path) {
  // A regular file only: a FIFO would block the read forever (MappedFile refuses it).
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(path));
  const std::string_view text(reinterpret_cast<const char*>(f->data()), f->size());
  auto tok = ParseHfTokenizer(text);
  if (!tok.ok())
    return absl::Status(tok.status().code(), path + ": " + std::string(tok.status().message()));
  return tok;
}

}  // namespace sparsex

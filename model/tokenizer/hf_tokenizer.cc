// Hugging Face tokenizer.json with a BPE model, read as the `tokenizers` library reads it:
//   1. added tokens are cut out of the raw text (those marked "normalized" after normalization),
//   2. each remaining section is normalized (NFC, NFKC, Lowercase, Replace, Prepend, ...),
//   3. split into pre-tokens (Split, ByteLevel, Metaspace, Digits, Whitespace, ...),
//   4. each pre-token is merged by BPE rank, over GPT-2's byte alphabet when a ByteLevel
//      pre-tokenizer is present, else over characters with byte fallback (<0xXX>) or <unk>.
// The GGUF "gpt2" vocabularies (model/gguf.cc) use the same machinery with llama.cpp's
// pre-tokenizer regexes (gguf_pre_tokenizers.cc). A component type or option this reader does
// not implement is refused by name, never skipped: a silently different tokenization would feed
// the model ids it was not trained on.
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <functional>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "common/json_depth.h"
#include "common/mapped_file.h"
#include "model/tokenizer/bpe_util.h"
#include "model/tokenizer/tokenizer.h"
#include "model/tokenizer/unicode_ops.h"

#ifndef PCRE2_MATCH_INVALID_UTF
#error "PCRE2 10.34 or newer is needed (PCRE2_MATCH_INVALID_UTF): Debian 12 ships 10.42"
#endif

namespace sparsex {
namespace {

using json = nlohmann::json;
using tok_internal::AppendUtf8;
using tok_internal::BpeSymbol;

// Largest tokenizer.json accepted (Llama-3's is 9 MB, Gemma-3's 33 MB).
constexpr size_t kMaxTokenizerJsonBytes = size_t{256} << 20;

// The regex of the ByteLevel pre-tokenizer's use_regex (the `tokenizers` library's).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

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
    if (n == 1 || n == 2) cp = tok_internal::DecodeUtf8At(piece, i, n);
    if (cp < a.to_byte.size() && a.to_byte[cp] >= 0) {
      out += static_cast<char>(a.to_byte[cp]);
    } else {
      out.append(piece.substr(i, std::max<size_t>(n, 1)));
    }
    i += std::max<size_t>(n, 1);
  }
  return out;
}

// "<0x41>" -> 0x41; -1 for anything else.
int ByteFallbackValue(std::string_view t) {
  if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return -1;
  int v = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = t[i];
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(s);
  std::string out;
  for (size_t pos = 0;;) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string_view::npos) {
      out.append(s.substr(pos));
      return out;
    }
    out.append(s.substr(pos, hit - pos)).append(to);
    pos = hit + from.size();
  }
}

struct Pcre2Deleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using Regex = std::shared_ptr<pcre2_code>;  // shared: normalizer closures hold them too
using MatchData = std::unique_ptr<pcre2_match_data, Pcre2Deleter>;

absl::StatusOr<Regex> CompileRegex(const std::string& pattern, uint32_t extra_options) {
  // Invalid bytes never match (they end up in gaps and reach the model as bytes).
  // (PCRE2_LITERAL refuses PCRE2_UCP, which a literal does not need.)
  const uint32_t ucp = (extra_options & PCRE2_LITERAL) ? 0 : PCRE2_UCP;
  const uint32_t options = PCRE2_UTF | ucp | PCRE2_MATCH_INVALID_UTF | extra_options;
  int err = 0;
  PCRE2_SIZE offset = 0;
  Regex re(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                         &err, &offset, nullptr),
           Pcre2Deleter());
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return absl::InvalidArgumentError(absl::StrCat("regex error at ", offset, ": ",
                                                   reinterpret_cast<const char*>(msg), " in ",
                                                   pattern));
  }
  pcre2_jit_compile(re.get(), PCRE2_JIT_COMPLETE);  // optional speed-up; interpreter otherwise
  return re;
}

// Every non-empty match of re in s as [begin, end) byte offsets; with keep_empty, empty matches
// too (as (b, b): a cut at b), as llama.cpp's std::regex splitting makes them.
void FindMatches(const pcre2_code* re, std::string_view s, pcre2_match_data* md,
                 std::vector<std::pair<size_t, size_t>>& out, bool keep_empty = false) {
  out.clear();
  size_t pos = 0;
  while (pos < s.size()) {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    int rc = pcre2_match(re, subject, s.size(), pos, 0, md, nullptr);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {  // e.g. JIT stack limit: retry interpreted
      rc = pcre2_match(re, subject, s.size(), pos, PCRE2_NO_JIT, md, nullptr);
    }
    if (rc < 0) break;  // no more matches (or a hard error): the rest is one gap
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e <= b) {  // empty match: step over one character, which stays in the gap
      if (keep_empty && b > 0 && (out.empty() || out.back().second < b)) out.emplace_back(b, b);
      pos = b + 1;
      while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
  }
}

// The `tokenizers` library's SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

absl::StatusOr<SplitBehavior> ParseBehavior(const std::string& name) {
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return absl::UnimplementedError("split behavior '" + name + "' not supported");
}

// Splits s at the matches of re the way `tokenizers` does (pattern.rs / normalizer.rs split):
// the text becomes alternating match / gap spans (is_match flipped when inverted), then the
// behavior drops, isolates or merges the matched spans. Empty pieces are dropped.
void SplitWith(const pcre2_code* re, pcre2_match_data* md, std::string_view s,
               SplitBehavior behavior, bool invert, std::vector<std::string>& out,
               std::vector<std::pair<size_t, size_t>>& scratch, bool keep_empty = false) {
  FindMatches(re, s, md, scratch, keep_empty);
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [b, e] : scratch) {
    if (b > prev) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < s.size()) spans.push_back({prev, s.size(), invert});
  std::vector<std::pair<size_t, size_t>> pieces;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Span& sp : spans)
        if (!sp.match) pieces.emplace_back(sp.b, sp.e);
      break;
    case SplitBehavior::kIsolated:
      for (const Span& sp : spans) pieces.emplace_back(sp.b, sp.e);
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (const Span& sp : spans) {
        if (sp.match && !prev_match && !pieces.empty()) {
          pieces.back().second = sp.e;
        } else {
          pieces.emplace_back(sp.b, sp.e);
        }
        prev_match = sp.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !prev_match && !pieces.empty()) {
          pieces.back().first = it->b;
        } else {
          pieces.emplace_back(it->b, it->e);
        }
        prev_match = it->match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool prev_match = false;
      for (const Span& sp : spans) {
        if (sp.match == prev_match && !pieces.empty()) {
          pieces.back().second = sp.e;
        } else {
          pieces.emplace_back(sp.b, sp.e);
        }
        prev_match = sp.match;
      }
      break;
    }
  }
  for (const auto& [b, e] : pieces)
    if (e > b) out.emplace_back(s.substr(b, e - b));
}

// llama.cpp's unicode_regex_split_custom_afmoe, which it runs for the "\p{AFMoE_digits}" and
// tiny_aya's "\d{1,3}(?=(?:\d{3})*\b)" patterns: each run of numbers (\p{N}) is cut into its
// first (length mod 3) characters, then groups of three; the text before a run is emitted with
// the run's first group (as llama.cpp does), the text after the last run on its own.
void DigitGroups(std::string_view s, std::vector<std::string>& out) {
  auto is_number = [&](size_t i, size_t* len) {
    *len = std::max<size_t>(tok_internal::Utf8Len(s, i), 1);
    return tok_internal::Utf8Len(s, i) > 0 &&
           tok_internal::IsUnicodeNumber(tok_internal::DecodeUtf8At(s, i, *len));
  };
  size_t prev = 0;
  auto emit = [&](size_t end) {
    if (end > prev) out.emplace_back(s.substr(prev, end - prev));
    prev = end;
  };
  for (size_t pos = 0; pos < s.size();) {
    size_t len = 0;
    if (!is_number(pos, &len)) {
      pos += len;
      continue;
    }
    std::vector<size_t> ends;  // byte offset after each number of the run
    while (pos < s.size() && is_number(pos, &len)) {
      pos += len;
      ends.push_back(pos);
    }
    const size_t first = ends.size() % 3;
    if (first > 0) emit(ends[first - 1]);
    for (size_t k = first + 2; k < ends.size(); k += 3) emit(ends[k]);
  }
  emit(s.size());
}

using NormalizeFn = std::function<std::string(std::string_view)>;

// One pre-tokenizer step; Sequence, ByteLevel(use_regex), Digits, Whitespace, Punctuation and
// BertPreTokenizer are expressed as Split steps.
struct PreStep {
  // kDigitGroups: llama.cpp's hand-written digit split (afmoe, tiny_aya; see DigitGroups).
  enum class Kind { kSplit, kPrefixSpace, kMetaspace, kDigitGroups } kind = Kind::kSplit;
  Regex re;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool split_at_empty = false;  // llama.cpp regexes: an empty match cuts the text there
  // Metaspace
  std::string replacement;
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = true;
};

class HfTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && bos_ >= 0) out.push_back(bos_);
    std::vector<MatchData> md;
    for (const PreStep& s : pre_)
      md.emplace_back(s.re ? pcre2_match_data_create_from_pattern(s.re.get(), nullptr) : nullptr);
    std::vector<std::string> pieces, next;
    std::vector<std::pair<size_t, size_t>> scratch;
    bool at_start = true;  // the section begins at offset 0 of the input (Metaspace "first")
    for (const auto& f : SplitAdded(added_, text, parse_special)) {
      if (f.id >= 0) {
        out.push_back(f.id);
        at_start = false;
        continue;
      }
      std::string normalized;
      std::string_view section = f.text;
      if (!normalizers_.empty()) {
        normalized = std::string(f.text);
        for (const NormalizeFn& n : normalizers_) normalized = n(normalized);
        section = normalized;
      }
      for (const auto& g : SplitAdded(added_normalized_, section, parse_special)) {
        if (g.id >= 0) {
          out.push_back(g.id);
          at_start = false;
          continue;
        }
        pieces.assign(1, std::string(g.text));
        for (size_t r = 0; r < pre_.size(); ++r) {
          next.clear();
          for (size_t k = 0; k < pieces.size(); ++k)
            ApplyStep(pre_[r], md[r].get(), pieces[k], at_start && k == 0, next, scratch);
          pieces.swap(next);
        }
        for (const std::string& p : pieces) EncodePiece(p, out);
        at_start = false;
      }
    }
    return out;
  }

  std::string Decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids)
      if (!IsSpecial(id)) out += TokenPiece(id);
    // Decoders that drop the space the encoder prefixed (Strip, Metaspace): from the whole text.
    for (int k = 0; k < strip_leading_ && !out.empty() && out[0] == ' '; ++k) out.erase(0, 1);
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
  friend class HfJsonReader;

  // Added-token split with the tokens' lstrip / rstrip: whitespace next to such a token is part
  // of its match, so it is cut from the neighbouring text.
  std::vector<tok_internal::TokenMatcher::Fragment> SplitAdded(const tok_internal::TokenMatcher& m,
                                                               std::string_view text,
                                                               bool parse_special) const {
    std::vector<tok_internal::TokenMatcher::Fragment> f = m.Split(text, parse_special);
    if (!has_strip_) return f;
    for (size_t i = 0; i < f.size(); ++i) {
      if (f[i].id < 0) continue;
      const uint8_t s = strip_[f[i].id];
      auto trim = [](std::string_view t, bool left) {
        const std::string r = tok_internal::TrimWhitespace(t, left, !left);
        return left ? t.substr(t.size() - r.size()) : t.substr(0, r.size());
      };
      if ((s & 1) && i > 0 && f[i - 1].id < 0) f[i - 1].text = trim(f[i - 1].text, false);
      if ((s & 2) && i + 1 < f.size() && f[i + 1].id < 0) f[i + 1].text = trim(f[i + 1].text, true);
    }
    std::erase_if(f, [](const auto& x) { return x.id < 0 && x.text.empty(); });
    return f;
  }

  static void ApplyStep(const PreStep& s, pcre2_match_data* md, const std::string& piece,
                        bool at_start, std::vector<std::string>& out,
                        std::vector<std::pair<size_t, size_t>>& scratch) {
    switch (s.kind) {
      case PreStep::Kind::kSplit:
        SplitWith(s.re.get(), md, piece, s.behavior, s.invert, out, scratch, s.split_at_empty);
        return;
      case PreStep::Kind::kDigitGroups:
        DigitGroups(piece, out);
        return;
      case PreStep::Kind::kPrefixSpace:  // ByteLevel's add_prefix_space
        out.push_back(piece.starts_with(' ') ? piece : " " + piece);
        return;
      case PreStep::Kind::kMetaspace: {
        std::string t = ReplaceAll(piece, " ", s.replacement);
        const bool prepend = s.prepend == PreStep::Prepend::kAlways ||
                             (s.prepend == PreStep::Prepend::kFirst && at_start);
        if (prepend && !t.starts_with(s.replacement)) t = s.replacement + t;
        if (s.split) {
          SplitWith(s.re.get(), md, t, SplitBehavior::kMergedWithNext, false, out, scratch);
        } else {
          out.push_back(std::move(t));
        }
        return;
      }
    }
  }

  // A symbol that is no token: its bytes as <0xXX> tokens (byte_fallback), else the unknown
  // token (one for a run of them with fuse_unk), else nothing, as `tokenizers` and llama.cpp do.
  void Fallback(std::string_view bytes, bool& prev_unk, std::vector<int32_t>& out) const {
    if (byte_fallback_) {
      bool all = true;
      for (char c : bytes) all = all && byte_token_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (char c : bytes) out.push_back(byte_token_[static_cast<unsigned char>(c)]);
        prev_unk = false;
        return;
      }
    }
    if (unk_ < 0) return;
    if (!(fuse_unk_ && prev_unk)) out.push_back(unk_);
    prev_unk = true;
  }

  void EncodePiece(std::string_view p, std::vector<int32_t>& out) const {
    if (p.empty()) return;
    const ByteAlphabet& a = Alphabet();
    if (ignore_merges_) {  // Llama-3: a pre-token that is itself in the vocabulary is taken whole
      std::string mapped;
      if (byte_level_) {
        for (char c : p) mapped += a.to_char[static_cast<unsigned char>(c)];
      } else {
        mapped = std::string(p);
      }
      if (auto it = vocab_.find(mapped); it != vocab_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<BpeSymbol> syms;
    syms.reserve(p.size());
    for (size_t i = 0; i < p.size();) {
      size_t n = 1;
      int32_t id;
      if (byte_level_) {
        id = byte_id_[static_cast<unsigned char>(p[i])];
      } else {  // a character (or a stray byte) of the text
        n = std::max<size_t>(tok_internal::Utf8Len(p, i), 1);
        auto it = vocab_.find(tok_internal::AsAbsl(p.substr(i, n)));
        id = it == vocab_.end() ? -1 : it->second;
      }
      const auto k = static_cast<int32_t>(syms.size());
      syms.push_back({k - 1, k + 1, static_cast<uint32_t>(i), static_cast<uint32_t>(n), id});
      i += n;
    }
    syms.back().next = -1;
    tok_internal::BpeMerge(
        syms,
        [&](const BpeSymbol& l, const BpeSymbol& r) -> std::optional<std::pair<double, int32_t>> {
          if (l.id < 0 || r.id < 0) return std::nullopt;
          auto it = merges_.find(PairKey(l.id, r.id));
          if (it == merges_.end()) return std::nullopt;
          return std::make_pair(static_cast<double>(it->second.first), it->second.second);
        });
    bool prev_unk = false;
    for (int32_t k = 0; k >= 0; k = syms[k].next) {
      if (syms[k].id >= 0) {
        out.push_back(syms[k].id);
        prev_unk = false;
      } else {
        Fallback(p.substr(syms[k].start, syms[k].len), prev_unk, out);
      }
    }
  }

  // byte_id_ (byte-level) and byte_token_ (byte fallback) from the vocabulary, after vocab_ is
  // set. A byte without a token falls back like any unknown symbol.
  void MapBytes() {
    const ByteAlphabet& a = Alphabet();
    for (int b = 0; b < 256; ++b) {
      auto it = vocab_.find(a.to_char[b]);
      byte_id_[b] = it == vocab_.end() ? -1 : it->second;
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto jt = vocab_.find(name);
      byte_token_[b] = jt == vocab_.end() ? -1 : jt->second;
    }
  }

  void AddMerge(const std::string& l, const std::string& r, int32_t rank) {
    auto il = vocab_.find(l), ir = vocab_.find(r), im = vocab_.find(l + r);
    if (il == vocab_.end() || ir == vocab_.end() || im == vocab_.end()) return;
    merges_.try_emplace(PairKey(il->second, ir->second), rank, im->second);
  }

  static uint64_t PairKey(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }

  absl::flat_hash_map<std::string, int32_t> vocab_;                    // model piece -> id
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (l, r) -> (rank, id)
  std::array<int32_t, 256> byte_id_{};     // byte-level: the byte's alphabet character's id
  std::array<int32_t, 256> byte_token_{};  // the <0xXX> token of each byte, -1 when absent
  std::vector<std::string> pieces_;        // decoded bytes per id
  std::vector<uint8_t> special_;
  std::vector<uint8_t> strip_;             // per added-token id: 1 lstrip, 2 rstrip
  bool has_strip_ = false;
  std::vector<NormalizeFn> normalizers_;
  std::vector<PreStep> pre_;
  tok_internal::TokenMatcher added_;             // matched in the raw text
  tok_internal::TokenMatcher added_normalized_;  // matched in normalized sections
  bool byte_level_ = false, ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  int strip_leading_ = 0;  // spaces Decode removes from the start of the text
  int32_t bos_ = -1, eos_ = -1, unk_ = -1;
  std::vector<int32_t> stops_;
};

// Reads the components of a tokenizer.json into an HfTokenizer.
class HfJsonReader {
 public:
  explicit HfJsonReader(HfTokenizer& t) : t_(t) {}

  absl::Status Normalizer(const json& n) {
    if (n.is_null()) return absl::OkStatus();
    const std::string type = n.at("type").get<std::string>();
    using tok_internal::UnicodeForm;
    auto form = [&](UnicodeForm f) {
      t_.normalizers_.push_back(
          [f](std::string_view s) { return tok_internal::NormalizeUnicode(s, f); });
    };
    if (type == "Sequence") {
      for (const json& q : n.at("normalizers")) RETURN_IF_ERROR(Normalizer(q));
    } else if (type == "NFC") {
      form(UnicodeForm::kNFC);
    } else if (type == "NFD") {
      form(UnicodeForm::kNFD);
    } else if (type == "NFKC") {
      form(UnicodeForm::kNFKC);
    } else if (type == "NFKD") {
      form(UnicodeForm::kNFKD);
    } else if (type == "Lowercase") {
      t_.normalizers_.push_back([](std::string_view s) { return tok_internal::LowercaseUnicode(s); });
    } else if (type == "StripAccents") {
      t_.normalizers_.push_back([](std::string_view s) { return tok_internal::RemoveMarks(s); });
    } else if (type == "Strip") {
      const bool l = n.value("strip_left", true), r = n.value("strip_right", true);
      t_.normalizers_.push_back(
          [l, r](std::string_view s) { return tok_internal::TrimWhitespace(s, l, r); });
    } else if (type == "Prepend") {
      const std::string p = n.at("prepend").get<std::string>();
      t_.normalizers_.push_back(
          [p](std::string_view s) { return s.empty() ? std::string() : p + std::string(s); });
    } else if (type == "Replace") {
      const json& pat = n.at("pattern");
      const std::string content = n.value("content", "");
      if (pat.contains("String")) {
        const std::string from = pat.at("String").get<std::string>();
        t_.normalizers_.push_back(
            [from, content](std::string_view s) { return ReplaceAll(s, from, content); });
      } else {
        ASSIGN_OR_RETURN(Regex re, CompileRegex(pat.at("Regex").get<std::string>(), 0));
        t_.normalizers_.push_back([re, content](std::string_view s) {
          MatchData md(pcre2_match_data_create_from_pattern(re.get(), nullptr));
          std::vector<std::pair<size_t, size_t>> m;
          FindMatches(re.get(), s, md.get(), m);
          std::string out;
          size_t prev = 0;
          for (const auto& [b, e] : m) {
            out.append(s.substr(prev, b - prev)).append(content);
            prev = e;
          }
          out.append(s.substr(prev));
          return out;
        });
      }
    } else if (type == "BertNormalizer") {
      const bool clean = n.value("clean_text", true);
      const bool chinese = n.value("handle_chinese_chars", true);
      const bool lower = n.value("lowercase", true);
      const json sa = n.value("strip_accents", json());
      const bool strip = sa.is_null() ? lower : sa.get<bool>();
      t_.normalizers_.push_back([=](std::string_view in) {
        std::string s;
        s.reserve(in.size());
        for (size_t i = 0; i < in.size();) {
          const size_t len = tok_internal::Utf8Len(in, i);
          if (len == 0) {
            s += in[i++];
            continue;
          }
          const uint32_t cp = tok_internal::DecodeUtf8At(in, i, len);
          i += len;
          if (clean && (cp == 0 || cp == 0xFFFD || tok_internal::IsBertControl(cp))) continue;
          if (clean && tok_internal::IsUnicodeWhitespace(cp)) {
            s += ' ';
          } else if (chinese && tok_internal::IsCjkIdeograph(cp)) {
            s += ' ';
            AppendUtf8(s, cp);
            s += ' ';
          } else {
            AppendUtf8(s, cp);
          }
        }
        if (strip) {
          s = tok_internal::RemoveNonspacingMarks(
              tok_internal::NormalizeUnicode(s, tok_internal::UnicodeForm::kNFD));
        }
        if (lower) s = tok_internal::LowercaseUnicode(s);
        return s;
      });
    } else {
      return absl::UnimplementedError("normalizer '" + type + "' not supported");
    }
    return absl::OkStatus();
  }

  absl::Status PreTokenizer(const json& p) {
    if (p.is_null()) return absl::OkStatus();
    const std::string type = p.at("type").get<std::string>();
    // ByteLevel maps the text to byte-alphabet characters; a step after it would see those, which
    // the model here does not represent (it maps bytes when it encodes).
    if (t_.byte_level_ && type != "Sequence") {
      return absl::UnimplementedError("pre-tokenizer '" + type + "' after ByteLevel not supported");
    }
    auto split = [&](const std::string& pattern, uint32_t options, SplitBehavior b,
                     bool invert) -> absl::Status {
      PreStep s;
      ASSIGN_OR_RETURN(s.re, CompileRegex(pattern, options));
      s.behavior = b;
      s.invert = invert;
      t_.pre_.push_back(std::move(s));
      return absl::OkStatus();
    };
    // Unicode punctuation plus the ASCII symbols Rust's is_ascii_punctuation counts.
    static constexpr const char* kPunct = R"([\p{P}!-/:-@\[-`{-~])";
    if (type == "Sequence") {
      for (const json& q : p.at("pretokenizers")) RETURN_IF_ERROR(PreTokenizer(q));
    } else if (type == "Split") {
      const json& pat = p.at("pattern");
      const bool literal = !pat.contains("Regex");
      ASSIGN_OR_RETURN(SplitBehavior b, ParseBehavior(p.value("behavior", "Isolated")));
      RETURN_IF_ERROR(split(pat.at(literal ? "String" : "Regex").get<std::string>(),
                            literal ? PCRE2_LITERAL : 0, b, p.value("invert", false)));
    } else if (type == "ByteLevel") {
      if (p.value("add_prefix_space", false)) {
        PreStep s;
        s.kind = PreStep::Kind::kPrefixSpace;
        t_.pre_.push_back(std::move(s));
      }
      if (p.value("use_regex", true)) {
        RETURN_IF_ERROR(split(kGpt2Pattern, 0, SplitBehavior::kIsolated, false));
      }
      t_.byte_level_ = true;
    } else if (type == "Digits") {
      RETURN_IF_ERROR(split(p.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)", 0,
                            SplitBehavior::kIsolated, false));
    } else if (type == "Whitespace") {
      RETURN_IF_ERROR(split(R"(\w+|[^\w\s]+)", 0, SplitBehavior::kRemoved, true));
    } else if (type == "WhitespaceSplit") {
      RETURN_IF_ERROR(split(R"(\s+)", 0, SplitBehavior::kRemoved, false));
    } else if (type == "CharDelimiterSplit") {
      RETURN_IF_ERROR(split(p.at("delimiter").get<std::string>(), PCRE2_LITERAL,
                            SplitBehavior::kRemoved, false));
    } else if (type == "Punctuation") {
      ASSIGN_OR_RETURN(SplitBehavior b, ParseBehavior(p.value("behavior", "Isolated")));
      RETURN_IF_ERROR(split(kPunct, 0, b, false));
    } else if (type == "BertPreTokenizer") {
      RETURN_IF_ERROR(split(R"(\s+)", 0, SplitBehavior::kRemoved, false));
      RETURN_IF_ERROR(split(kPunct, 0, SplitBehavior::kIsolated, false));
    } else if (type == "Metaspace") {
      PreStep s;
      s.kind = PreStep::Kind::kMetaspace;
      s.replacement = p.value("replacement", "\xE2\x96\x81");
      if (p.contains("prepend_scheme")) {
        const std::string scheme = p.at("prepend_scheme").get<std::string>();
        if (scheme == "always") s.prepend = PreStep::Prepend::kAlways;
        else if (scheme == "first") s.prepend = PreStep::Prepend::kFirst;
        else if (scheme == "never") s.prepend = PreStep::Prepend::kNever;
        else return absl::UnimplementedError("Metaspace prepend_scheme '" + scheme + "' not supported");
      } else if (!p.value("add_prefix_space", true)) {  // the older spelling
        s.prepend = PreStep::Prepend::kNever;
      }
      s.split = p.value("split", true);
      ASSIGN_OR_RETURN(s.re, CompileRegex(s.replacement, PCRE2_LITERAL));
      t_.pre_.push_back(std::move(s));
    } else {
      return absl::UnimplementedError("pre-tokenizer '" + type + "' not supported");
    }
    return absl::OkStatus();
  }

  // Token-level decoder steps become the per-id pieces' transformation; Strip and Metaspace also
  // drop the encoder's leading space from a decoded text.
  absl::Status Decoder(const json& d) {
    if (d.is_null()) return absl::OkStatus();
    const std::string type = d.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const json& q : d.at("decoders")) RETURN_IF_ERROR(Decoder(q));
    } else if (type == "ByteLevel") {
      steps_.push_back([](std::string s) { return ByteLevelDecode(s); });
      byte_level_decoder_ = true;
    } else if (type == "Replace") {
      const json& pat = d.at("pattern");
      if (!pat.contains("String"))
        return absl::UnimplementedError("decoder 'Replace' with a regex pattern not supported");
      const std::string from = pat.at("String").get<std::string>(), to = d.value("content", "");
      steps_.push_back([from, to](std::string s) { return ReplaceAll(s, from, to); });
    } else if (type == "ByteFallback") {
      steps_.push_back([](std::string s) {
        const int b = ByteFallbackValue(s);
        return b < 0 ? s : std::string(1, static_cast<char>(b));
      });
    } else if (type == "Fuse") {
      // Joins the tokens' strings into one: what Decode does anyway.
    } else if (type == "Strip") {
      const std::string content = d.value("content", " ");
      if (content != " " || d.value("stop", 0) != 0) {
        return absl::UnimplementedError("decoder 'Strip' other than leading spaces not supported");
      }
      t_.strip_leading_ = d.value("start", 0);
    } else if (type == "Metaspace") {
      const std::string r = d.value("replacement", "\xE2\x96\x81");
      steps_.push_back([r](std::string s) { return ReplaceAll(s, r, " "); });
      const std::string scheme = d.value("prepend_scheme", "always");
      if (scheme != "never" && d.value("add_prefix_space", true)) t_.strip_leading_ = 1;
    } else {
      return absl::UnimplementedError("decoder '" + type + "' not supported");
    }
    return absl::OkStatus();
  }

  // A byte-level model whose file names no ByteLevel decoder still stands for bytes: its pieces
  // are decoded as such (the raw alphabet characters would reach the user otherwise).
  void DefaultByteLevelDecoder() {
    if (t_.byte_level_ && !byte_level_decoder_) {
      steps_.insert(steps_.begin(), [](std::string s) { return ByteLevelDecode(s); });
      byte_level_decoder_ = true;
    }
  }

  std::string DecodePiece(std::string s) const {
    for (const auto& f : steps_) s = f(std::move(s));
    return s;
  }

 private:
  HfTokenizer& t_;
  std::vector<std::function<std::string(std::string)>> steps_;
  bool byte_level_decoder_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizer(std::string_view text) {
  auto tok = std::unique_ptr<HfTokenizer>(new HfTokenizer());
  HfTokenizer& t = *tok;
  HfJsonReader reader(t);
  // Deep nesting would exhaust the stack in the parser or in the recursive walks below.
  if (absl::Status s = CheckJsonLimits(text, kMaxTokenizerJsonBytes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", s.message()));
  }
  try {
    const json j = json::parse(text);
    const json& model = j.at("model");
    if (model.value("type", "BPE") != "BPE") {
      return absl::UnimplementedError(absl::StrCat("tokenizer.json model type '",
                                                   model.value("type", ""), "' not supported"));
    }
    // "" is how newer files spell "none" (Qwen2/3, GPT-4o style files).
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const json v = model.value(key, json());
      if (!v.is_null() && !(v.is_string() && v.get<std::string>().empty())) {
        return absl::UnimplementedError(absl::StrCat("BPE ", key, " ", v.dump(), " not supported"));
      }
    }
    // Dropout randomizes merges (training only); a file that sets it expects random encodings.
    if (const json d = model.value("dropout", json());
        !d.is_null() && !(d.is_number() && d.get<double>() == 0.0)) {
      return absl::UnimplementedError("BPE dropout " + d.dump() + " not supported");
    }
    RETURN_IF_ERROR(reader.Normalizer(j.value("normalizer", json())));
    RETURN_IF_ERROR(reader.PreTokenizer(j.value("pre_tokenizer", json())));
    RETURN_IF_ERROR(reader.Decoder(j.value("decoder", json())));
    reader.DefaultByteLevelDecoder();
    // Post-processors only add BOS/EOS-style tokens around the ids (read below for the BOS);
    // RoBERTa/BERT ones add CLS/SEP that this engine's callers never want.
    if (const json pp = j.value("post_processor", json()); pp.is_object()) {
      static const std::vector<std::string> kKnown = {"TemplateProcessing", "ByteLevel",
                                                      "Sequence"};
      const std::string type = pp.value("type", "");
      if (std::find(kKnown.begin(), kKnown.end(), type) == kKnown.end()) {
        return absl::UnimplementedError("post-processor '" + type + "' not supported");
      }
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
    t.strip_.assign(n, 0);
    for (const auto& [piece, id] : t.vocab_) t.pieces_[id] = reader.DecodePiece(piece);
    absl::flat_hash_map<std::string, int32_t> added_ids;
    for (const json& a : added) {
      const auto id = a.at("id").get<int32_t>();
      const auto content = a.at("content").get<std::string>();
      const bool special = a.value("special", false);
      if (a.value("single_word", false)) {
        return absl::UnimplementedError("added token '" + content +
                                        "' with single_word not supported");
      }
      t.pieces_[id] = content;  // added tokens are raw text, not model pieces
      t.special_[id] = special;
      t.strip_[id] = (a.value("lstrip", false) ? 1 : 0) | (a.value("rstrip", false) ? 2 : 0);
      t.has_strip_ = t.has_strip_ || t.strip_[id] != 0;
      // "normalized" tokens are found in the normalized text (their content normalized too).
      if (a.value("normalized", !special) && !t.normalizers_.empty()) {
        std::string norm = content;
        for (const NormalizeFn& f : t.normalizers_) norm = f(norm);
        t.added_normalized_.Add(norm, id, /*parse_only=*/special);
      } else {
        t.added_.Add(content, id, /*parse_only=*/special);
      }
      added_ids.emplace(content, id);
    }
    t.added_.Finalize();
    t.added_normalized_.Finalize();
    t.ignore_merges_ = model.value("ignore_merges", false);
    t.byte_fallback_ = model.value("byte_fallback", false);
    t.fuse_unk_ = model.value("fuse_unk", false);
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const std::string unk = model["unk_token"].get<std::string>();
      if (auto it = t.vocab_.find(unk); it != t.vocab_.end()) t.unk_ = it->second;
      if (auto it = added_ids.find(unk); t.unk_ < 0 && it != added_ids.end()) t.unk_ = it->second;
    }
    t.MapBytes();

    int32_t rank = 0;
    for (const json& m : model.value("merges", json::array())) {
      std::string l, r;
      if (m.is_string()) {  // "a b": model pieces never contain a plain space
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) return absl::InvalidArgumentError("bad merge: " + s);
        l = s.substr(0, sp);
        r = s.substr(sp + 1);
      } else {
        l = m.at(0).get<std::string>();
        r = m.at(1).get<std::string>();
      }
      t.AddMerge(l, r, rank++);
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
    for (const char* name : {"<|begin_of_text|>", "<s>", "<bos>"})
      if (t.bos_ < 0) t.bos_ = find(name);
    for (const char* name : {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"})
      if (t.eos_ < 0) t.eos_ = find(name);
    if (t.eos_ >= 0) t.stops_.push_back(t.eos_);
    for (const char* name :
         {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<end_of_turn>"}) {
      const int32_t id = find(name);
      if (id >= 0 && std::find(t.stops_.begin(), t.stops_.end(), id) == t.stops_.end())
        t.stops_.push_back(id);
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
  return std::unique_ptr<Tokenizer>(std::move(tok));
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
  // llama.cpp's regex engines treat '$' as the end of the piece only, and cut at empty
  // matches. Two patterns it runs as hand-written code, and so do we.
  for (const std::string& p : v.pre_regexes) {
    PreStep s;
    if (p == R"(\p{AFMoE_digits})" || p == R"(\d{1,3}(?=(?:\d{3})*\b))") {
      s.kind = PreStep::Kind::kDigitGroups;
    } else {
      ASSIGN_OR_RETURN(s.re, CompileRegex(p, PCRE2_DOLLAR_ENDONLY));
      s.split_at_empty = true;
    }
    t.pre_.push_back(std::move(s));
  }
  t.byte_level_ = true;
  t.ignore_merges_ = v.ignore_merges;
  t.pieces_.resize(n);
  t.special_.assign(n, 0);
  t.strip_.assign(n, 0);
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
  // llama.cpp's BPE never emits the unknown token: a byte whose alphabet character is no token
  // (Falcon's vocabulary lacks several) is dropped from the ids, so unk_ stays -1 here.
  t.MapBytes();
  for (size_t rank = 0; rank < v.merges.size(); ++rank) {
    const std::string& m = v.merges[rank];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad merge ", rank, ": \"", m, "\""));
    }
    t.AddMerge(m.substr(0, sp), m.substr(sp + 1), static_cast<int32_t>(rank));
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

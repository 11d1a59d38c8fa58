// SentencePiece BPE with scores and byte fallback, as llama.cpp's SPM tokenizer and llama2.c do
// it: chars are the initial symbols, the adjacent pair whose concatenation is a piece with the
// highest score merges first, and chars outside the vocabulary fall back to <0xXX> tokens.
#include <array>

#include "absl/container/flat_hash_map.h"
#include "model/tokenizer/bpe_util.h"
#include "model/tokenizer/tokenizer.h"

namespace sparsex {
namespace {

using tok_internal::BpeSymbol;

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581 '▁', SentencePiece's space mark
enum TokenType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6
};

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (s.substr(i).starts_with(from)) {
      out += to;
      i += from.size();
    } else {
      out += s[i++];
    }
  }
  return out;
}

// "<0x41>" -> 0x41; -1 when the piece is not in that form.
int ParseBytePiece(std::string_view p) {
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (p.size() != 6 || !p.starts_with("<0x") || p[5] != '>') return -1;
  const int hi = hex(p[3]), lo = hex(p[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

class SpmTokenizer final : public Tokenizer {
 public:
  explicit SpmTokenizer(SpmVocab v) : v_(std::move(v)) {
    byte_id_.fill(-1);
    const int32_t n = vocab_size();
    decoded_.resize(n);
    for (int32_t id = 0; id < n; ++id) {
      const std::string& p = v_.pieces[id];
      switch (v_.types[id]) {
        case kByte: {
          const int b = ParseBytePiece(p);
          if (b >= 0) {
            if (byte_id_[b] < 0) byte_id_[b] = id;
            decoded_[id] = std::string(1, static_cast<char>(b));
          }
          break;
        }
        case kControl:
        case kUnknown:
          // Matched in text only on request; never produced by merges (SentencePiece does not
          // merge into control pieces, and "<s>" typed by a user must stay text).
          matcher_.Add(p, id, /*parse_only=*/true);
          break;
        case kUnused:
          break;
        case kUserDefined:
          matcher_.Add(p, id, /*parse_only=*/false);  // llama.cpp matches these always
          [[fallthrough]];
        default:  // normal, and 0 (undefined) treated as normal
          piece_to_id_.try_emplace(p, id);
          decoded_[id] = ReplaceAll(p, kSpace, " ");
      }
    }
    matcher_.Finalize();
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos && v_.bos_id >= 0) out.push_back(v_.bos_id);
    // As llama.cpp: the space prefix goes before the first text run and each run that follows a
    // matched token.
    bool prefix = v_.add_space_prefix;
    for (const auto& f : matcher_.Split(text, parse_special)) {
      if (f.id >= 0) {
        out.push_back(f.id);
        prefix = v_.add_space_prefix;
      } else {
        EncodeRun(f.text, prefix, out);
        prefix = false;
      }
    }
    return out;
  }

  std::string Decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    bool strip = v_.add_space_prefix;  // the space the encoder prefixed (llama2.c semantics)
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size()) continue;
      if (id == v_.bos_id) strip = v_.add_space_prefix;
      if (IsSpecial(id)) continue;
      std::string_view piece = decoded_[id];
      if (strip && piece.starts_with(' ')) piece.remove_prefix(1);
      strip = false;
      out += piece;
    }
    return out;
  }

  std::string TokenPiece(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? decoded_[id] : std::string();
  }
  std::string SpecialText(int32_t id) const override {
    return IsSpecial(id) ? v_.pieces[id] : std::string();
  }
  int32_t vocab_size() const override { return static_cast<int32_t>(v_.pieces.size()); }
  int32_t bos_id() const override { return v_.bos_id; }
  int32_t eos_id() const override { return v_.eos_id; }
  bool IsSpecial(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return false;
    return id == v_.bos_id || id == v_.eos_id || v_.types[id] == kControl;
  }
  std::vector<int32_t> StopIds() const override {
    return v_.eos_id >= 0 ? std::vector<int32_t>{v_.eos_id} : std::vector<int32_t>{};
  }

 private:
  void EncodeRun(std::string_view text, bool prefix, std::vector<int32_t>& out) const {
    std::string s = prefix ? std::string(kSpace) : std::string();
    s += ReplaceAll(text, " ", kSpace);
    std::vector<BpeSymbol> syms;
    for (size_t i = 0; i < s.size();) {
      const size_t n = std::max<size_t>(1, tok_internal::Utf8Len(s, i));  // invalid: one byte
      const int32_t k = static_cast<int32_t>(syms.size());
      syms.push_back({k - 1, k + 1, static_cast<uint32_t>(i), static_cast<uint32_t>(n),
                      Lookup(std::string_view(s).substr(i, n))});
      i += n;
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    tok_internal::BpeMerge(
        syms,
        [&](const BpeSymbol& l, const BpeSymbol& r) -> std::optional<std::pair<double, int32_t>> {
          const int32_t id = Lookup(std::string_view(s).substr(l.start, l.len + r.len));
          if (id < 0) return std::nullopt;
          return std::make_pair(-static_cast<double>(v_.scores[id]), id);  // highest score first
        });
    for (int32_t k = 0; k >= 0; k = syms[k].next) {
      const BpeSymbol& sym = syms[k];
      if (sym.id >= 0) {
        out.push_back(sym.id);
        continue;
      }
      for (uint32_t i = sym.start; i < sym.start + sym.len; ++i) {
        const int32_t b = byte_id_[static_cast<unsigned char>(s[i])];
        if (b >= 0) {
          out.push_back(b);
        } else if (v_.unk_id >= 0) {
          out.push_back(v_.unk_id);
        }
      }
    }
  }

  int32_t Lookup(std::string_view piece) const {
    auto it = piece_to_id_.find(tok_internal::AsAbsl(piece));
    return it == piece_to_id_.end() ? -1 : it->second;
  }

  SpmVocab v_;
  absl::flat_hash_map<std::string, int32_t> piece_to_id_;  // mergeable pieces only
  std::array<int32_t, 256> byte_id_;                       // <0xXX> tokens, -1 when absent
  std::vector<std::string> decoded_;                       // TokenPiece per id
  tok_internal::TokenMatcher matcher_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeSpmTokenizer(SpmVocab vocab) {
  const size_t n = vocab.pieces.size();
  if (n == 0) return absl::InvalidArgumentError("SPM vocabulary is empty");
  if (vocab.scores.size() != n || vocab.types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("SPM vocabulary sizes differ: ", n, " pieces, ",
                                                   vocab.scores.size(), " scores, ",
                                                   vocab.types.size(), " types"));
  }
  if (n > static_cast<size_t>(INT32_MAX))
    return absl::InvalidArgumentError("SPM vocabulary too large");
  const auto bad = [n](int32_t id) { return id < -1 || id >= static_cast<int64_t>(n); };
  if (bad(vocab.bos_id) || bad(vocab.eos_id) || bad(vocab.unk_id)) {
    return absl::InvalidArgumentError(absl::StrCat("SPM special id out of range: bos ",
                                                   vocab.bos_id, ", eos ", vocab.eos_id, ", unk ",
                                                   vocab.unk_id, ", vocabulary ", n));
  }
  return std::unique_ptr<Tokenizer>(new SpmTokenizer(std::move(vocab)));
}

}  // namespace sparsex

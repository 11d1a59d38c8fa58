// Internals shared by the SentencePiece and byte-level BPE tokenizers: UTF-8 scanning, the
// priority-queue merge loop and the added/special-token splitter. Not part of the public API.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace sparsex::tok_internal {

// Debian's abseil has its own string_view (not std's), so heterogeneous lookups in absl maps
// need the conversion spelled out.
inline absl::string_view AsAbsl(std::string_view s) { return {s.data(), s.size()}; }

// Length (1-4) of the well-formed UTF-8 sequence at s[i], or 0 when none starts there
// (stray continuation, overlong form, surrogate, truncated sequence, > U+10FFFF).
inline size_t Utf8Len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // > U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  const auto c1 = static_cast<unsigned char>(s[i + 1]);
  if (c1 < lo || c1 > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  return n;
}

// One symbol of a word being merged: a byte span [start, start + len) of the word, linked to its
// live neighbours. len == 0 marks a symbol absorbed into its left neighbour.
struct BpeSymbol {
  int32_t prev, next;
  uint32_t start, len;
  int32_t id;  // token id, or -1 when the span is no token (an SPM char outside the vocabulary)
};

// Repeatedly merges the adjacent pair with the lowest priority (ties: leftmost), as SentencePiece
// and HF BPE do, in O(n log n). try_pair(left, right) returns {priority, merged id} or nullopt.
// Queue entries are never removed; an entry is stale when either side has changed since it was
// pushed, which shows as a length sum that no longer matches (a symbol only ever grows or dies).
template <typename TryPair>
void BpeMerge(std::vector<BpeSymbol>& syms, TryPair try_pair) {
  struct Cand {
    double prio;
    int32_t left, right;
    uint32_t len;
    int32_t id;
  };
  auto worse = [](const Cand& a, const Cand& b) {
    return a.prio > b.prio || (a.prio == b.prio && a.left > b.left);
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> queue(worse);
  auto push = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    std::optional<std::pair<double, int32_t>> m = try_pair(syms[l], syms[r]);
    if (m) queue.push({m->first, l, r, syms[l].len + syms[r].len, m->second});
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i)
    push(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));
  while (!queue.empty()) {
    const Cand c = queue.top();
    queue.pop();
    BpeSymbol& l = syms[c.left];
    BpeSymbol& r = syms[c.right];
    if (l.len == 0 || r.len == 0 || l.next != c.right || l.len + r.len != c.len) continue;
    l.len += r.len;
    l.id = c.id;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.left;
    push(l.prev, c.left);
    push(c.left, l.next);
  }
}

// Finds added/special token strings inside text (leftmost, then longest match) so that they map
// straight to their ids and never reach the BPE.
class TokenMatcher {
 public:
  struct Fragment {
    std::string_view text;  // the raw text when id < 0
    int32_t id;
  };

  // parse_only: matched only when the caller asks for special-token parsing. Appends: call
  // Finalize() once after the last Add (one sort per bucket; sorting on every Add was quadratic:
  // 40,000 added tokens took 71 s to load).
  void Add(std::string text, int32_t id, bool parse_only) {
    if (text.empty()) return;
    by_first_[static_cast<unsigned char>(text[0])].push_back({std::move(text), id, parse_only});
    sorted_ = false;
  }
  // Longest entries first within each first byte (stable: the first added wins a tie).
  void Finalize() {
    for (auto& bucket : by_first_) {
      std::stable_sort(bucket.begin(), bucket.end(),
                       [](const Entry& a, const Entry& b) { return a.text.size() > b.text.size(); });
    }
    sorted_ = true;
  }

  std::vector<Fragment> Split(std::string_view text, bool parse_special) const {
    std::vector<Fragment> out;
    size_t run = 0;  // start of the pending raw-text run
    for (size_t i = 0; i < text.size();) {
      const Entry* hit = nullptr;
      for (const Entry& e : by_first_[static_cast<unsigned char>(text[i])]) {
        if ((parse_special || !e.parse_only) && text.substr(i).starts_with(e.text) &&
            (hit == nullptr || e.text.size() > hit->text.size())) {
          hit = &e;
          if (sorted_) break;  // sorted: the first match is the longest
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      if (i > run) out.push_back({text.substr(run, i - run), -1});
      out.push_back({{}, hit->id});
      i += hit->text.size();
      run = i;
    }
    if (run < text.size()) out.push_back({text.substr(run), -1});
    return out;
  }

 private:
  struct Entry {
    std::string text;
    int32_t id;
    bool parse_only;
  };
  std::array<std::vector<Entry>, 256> by_first_;
  bool sorted_ = true;
};

}  // namespace sparsex::tok_internal

// ICU does the Unicode work: its normalization data and case mappings are those of the Unicode
// version Debian ships, kept current by the distribution rather than by tables copied here.
#include "model/tokenizer/unicode_ops.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <functional>
#include <vector>

#include "model/tokenizer/bpe_util.h"

namespace sparsex::tok_internal {
namespace {

using U16Transform = std::function<std::u16string(const std::u16string&)>;

std::u16string ToU16(std::string_view s) {
  std::u16string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Len(s, i);  // callers pass valid runs only
    const uint32_t cp = DecodeUtf8At(s, i, n);
    if (cp < 0x10000) {
      out.push_back(static_cast<char16_t>(cp));
    } else {
      out.push_back(static_cast<char16_t>(0xD800 + ((cp - 0x10000) >> 10)));
      out.push_back(static_cast<char16_t>(0xDC00 + ((cp - 0x10000) & 0x3FF)));
    }
    i += n;
  }
  return out;
}

std::string FromU16(const std::u16string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    uint32_t cp = s[i];
    if (cp >= 0xD800 && cp < 0xDC00 && i + 1 < s.size() && s[i + 1] >= 0xDC00 && s[i + 1] < 0xE000)
      cp = 0x10000 + ((cp - 0xD800) << 10) + (s[++i] - 0xDC00);
    AppendUtf8(out, cp);
  }
  return out;
}

// Applies f to each maximal run of well-formed UTF-8, copying invalid bytes between runs as is.
std::string OnValidRuns(std::string_view s, const U16Transform& f) {
  std::string out;
  out.reserve(s.size());
  size_t run = 0;
  auto flush = [&](size_t end) {
    if (end > run) out += FromU16(f(ToU16(s.substr(run, end - run))));
  };
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Len(s, i);
    if (n > 0) {
      i += n;
      continue;
    }
    flush(i);
    out += s[i];
    run = ++i;
  }
  flush(s.size());
  return out;
}

// Keeps the code points for which keep(cp) is true; invalid bytes are kept.
template <typename Keep>
std::string Filter(std::string_view s, Keep keep) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Len(s, i);
    if (n == 0) {
      out += s[i++];
      continue;
    }
    if (keep(DecodeUtf8At(s, i, n))) out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

uint32_t DecodeUtf8At(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  switch (n) {
    case 1: return b(0);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    case 4:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
    default: return 0xFFFD;
  }
}

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string NormalizeUnicode(std::string_view s, UnicodeForm form) {
  UErrorCode err = U_ZERO_ERROR;
  const UNormalizer2* n = nullptr;
  switch (form) {
    case UnicodeForm::kNFC: n = unorm2_getNFCInstance(&err); break;
    case UnicodeForm::kNFD: n = unorm2_getNFDInstance(&err); break;
    case UnicodeForm::kNFKC: n = unorm2_getNFKCInstance(&err); break;
    case UnicodeForm::kNFKD: n = unorm2_getNFKDInstance(&err); break;
  }
  if (U_FAILURE(err) || n == nullptr) return std::string(s);  // ICU data missing: cannot happen
                                                              // with Debian's libicu
  return OnValidRuns(s, [n](const std::u16string& in) {
    UErrorCode e = U_ZERO_ERROR;
    // Decomposition grows text by at most a small factor (18x is Unicode's stated bound for
    // NFKD of one code point); retry with the size ICU reports when the first guess is short.
    std::u16string out(in.size() * 3 + 16, u'\0');
    int32_t len = unorm2_normalize(n, reinterpret_cast<const UChar*>(in.data()),
                                   static_cast<int32_t>(in.size()),
                                   reinterpret_cast<UChar*>(out.data()),
                                   static_cast<int32_t>(out.size()), &e);
    if (e == U_BUFFER_OVERFLOW_ERROR) {
      e = U_ZERO_ERROR;
      out.assign(static_cast<size_t>(len), u'\0');
      len = unorm2_normalize(n, reinterpret_cast<const UChar*>(in.data()),
                             static_cast<int32_t>(in.size()), reinterpret_cast<UChar*>(out.data()),
                             static_cast<int32_t>(out.size()), &e);
    }
    if (U_FAILURE(e)) return in;
    out.resize(static_cast<size_t>(len));
    return out;
  });
}

std::string LowercaseUnicode(std::string_view s) {
  return OnValidRuns(s, [](const std::u16string& in) {
    UErrorCode e = U_ZERO_ERROR;
    std::u16string out(in.size() + 16, u'\0');
    int32_t len = u_strToLower(reinterpret_cast<UChar*>(out.data()),
                               static_cast<int32_t>(out.size()),
                               reinterpret_cast<const UChar*>(in.data()),
                               static_cast<int32_t>(in.size()), "", &e);
    if (e == U_BUFFER_OVERFLOW_ERROR) {
      e = U_ZERO_ERROR;
      out.assign(static_cast<size_t>(len), u'\0');
      len = u_strToLower(reinterpret_cast<UChar*>(out.data()), static_cast<int32_t>(out.size()),
                         reinterpret_cast<const UChar*>(in.data()),
                         static_cast<int32_t>(in.size()), "", &e);
    }
    if (U_FAILURE(e)) return in;
    out.resize(static_cast<size_t>(len));
    return out;
  });
}

std::string RemoveMarks(std::string_view s) {
  return Filter(s, [](uint32_t cp) {
    return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_M_MASK) == 0;
  });
}

std::string RemoveNonspacingMarks(std::string_view s) {
  return Filter(s, [](uint32_t cp) {
    return u_charType(static_cast<UChar32>(cp)) != U_NON_SPACING_MARK;
  });
}

bool IsUnicodeWhitespace(uint32_t cp) {
  return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE);
}

bool IsUnicodeNumber(uint32_t cp) {
  return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_N_MASK) != 0;
}

bool IsBertControl(uint32_t cp) {
  if (cp == '\t' || cp == '\n' || cp == '\r') return false;
  return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_C_MASK) != 0;
}

bool IsCjkIdeograph(uint32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) ||
         (cp >= 0x20000 && cp <= 0x2A6DF) || (cp >= 0x2A700 && cp <= 0x2B73F) ||
         (cp >= 0x2B740 && cp <= 0x2B81F) || (cp >= 0x2B820 && cp <= 0x2CEAF) ||
         (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
}

std::string TrimWhitespace(std::string_view s, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      const size_t n = Utf8Len(s, b);
      if (n == 0 || !IsUnicodeWhitespace(DecodeUtf8At(s, b, n))) break;
      b += n;
    }
  }
  if (right) {
    while (e > b) {
      size_t start = e - 1;  // back to the lead byte of the last character
      while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      const size_t n = Utf8Len(s, start);
      if (n == 0 || start + n != e || !IsUnicodeWhitespace(DecodeUtf8At(s, start, n))) break;
      e = start;
    }
  }
  return std::string(s.substr(b, e - b));
}

}  // namespace sparsex::tok_internal

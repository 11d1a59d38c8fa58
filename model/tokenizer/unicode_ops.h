// Unicode text operations the tokenizer.json normalizers need (ICU underneath): normalization
// forms, lowercasing, accent stripping, whitespace trimming and character classes. Every function
// takes UTF-8 that may be invalid: bytes that are not part of a well-formed sequence are passed
// through unchanged (the tokenizers encode them by byte fallback), the valid runs around them are
// transformed. Not part of the public API.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace sparsex::tok_internal {

enum class UnicodeForm { kNFC, kNFD, kNFKC, kNFKD };

// The code point of the well-formed sequence of n bytes at s[i] (n from Utf8Len).
uint32_t DecodeUtf8At(std::string_view s, size_t i, size_t n);
void AppendUtf8(std::string& out, uint32_t cp);

std::string NormalizeUnicode(std::string_view s, UnicodeForm form);
// Full lowercase mapping in the root locale (Unicode's context rule for final sigma applies, as
// in JavaScript's toLowerCase).
std::string LowercaseUnicode(std::string_view s);
// Removes every mark (general category M: Mn, Mc, Me).
std::string RemoveMarks(std::string_view s);
// Removes nonspacing marks (Mn) only: BERT's accent stripping, applied after NFD.
std::string RemoveNonspacingMarks(std::string_view s);
// Trims Unicode White_Space characters from either end.
std::string TrimWhitespace(std::string_view s, bool left, bool right);

bool IsUnicodeWhitespace(uint32_t cp);
bool IsUnicodeNumber(uint32_t cp);  // general category N (Nd, Nl, No)
// General category C* other than the three whitespace controls BERT keeps (\t, \n, \r).
bool IsBertControl(uint32_t cp);
// The CJK ideograph blocks BERT pads with spaces.
bool IsCjkIdeograph(uint32_t cp);

}  // namespace sparsex::tok_internal

// GPT-2's bytes_to_unicode, written independently of model/tokenizer/ (the tests' reference):
// printable bytes stand for themselves, the other 68 map in order to U+0100.., UTF-8 encoded.
// Byte-level vocabularies (HF tokenizer.json, GGUF "gpt2") spell their tokens in it.
#pragma once

#include <string>
#include <string_view>

namespace sparsex::testing {

inline bool Gpt2Printable(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

// The character byte b is written as.
inline std::string Gpt2ByteChar(int b) {
  int cp = b;
  if (!Gpt2Printable(b)) {
    int n = 0;
    for (int x = 0; x < b; ++x) n += Gpt2Printable(x) ? 0 : 1;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// raw bytes spelled in the alphabet.
inline std::string Gpt2ByteLevel(std::string_view raw) {
  std::string s;
  for (char c : raw) s += Gpt2ByteChar(static_cast<unsigned char>(c));
  return s;
}

}  // namespace sparsex::testing

// UTF-8 checks for API strings (proto3 strings must be valid UTF-8 on the wire).
#pragma once

#include <string>
#include <string_view>

namespace sparsex {

// False on overlongs, surrogates, code points above U+10FFFF and cut sequences.
bool IsValidUtf8(std::string_view s);
std::string SanitizeUtf8(std::string_view s);  // invalid sequences become U+FFFD

}  // namespace sparsex

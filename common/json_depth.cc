#include "common/json_depth.h"

namespace sparsex {

absl::Status CheckJsonDepth(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (ch == '\\') {
        ++i;  // the escaped character (a quote or a backslash) does not end the string
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    switch (ch) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth) {
          return absl::InvalidArgumentError(absl::StrCat(
              "JSON nests arrays/objects deeper than ", max_depth, " levels (at byte ", i, ")"));
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckJsonLimits(std::string_view text, size_t max_bytes, int max_depth) {
  if (text.size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("JSON text of ", text.size(),
                                                   " bytes exceeds the limit of ", max_bytes));
  }
  return CheckJsonDepth(text, max_depth);
}

}  // namespace sparsex

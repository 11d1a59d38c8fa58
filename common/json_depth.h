// Limits checked on JSON text before it is handed to a parser. nlohmann::json (and most DOM
// parsers) build, copy and walk nested values recursively: a small body nesting arrays ten
// thousand levels deep exhausts a thread's stack and kills the process. CheckJsonDepth is a
// cheap linear pre-scan (no allocation, no recursion) that refuses such text with a Status
// instead. Every JSON parse of outside input (HTTP bodies, config.json, tokenizer.json,
// safetensors headers) runs it first.
//
//   RETURN_IF_ERROR(CheckJsonLimits(body, max_body_bytes));   // size, then depth (64)
//   nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
#pragma once

#include <cstddef>
#include <string_view>

#include "common/status.h"

namespace sparsex {

// Deepest nesting of arrays and objects accepted by default (real configs and tokenizers nest
// fewer than 10 levels).
inline constexpr int kMaxJsonDepth = 64;

// INVALID_ARGUMENT when arrays/objects nest deeper than max_depth (a top-level object is depth
// 1). Brackets inside strings are not counted; escapes inside strings are honoured. The text is
// not otherwise validated: unbalanced or malformed text passes here and fails in the parser.
absl::Status CheckJsonDepth(std::string_view text, int max_depth);

// INVALID_ARGUMENT when text is longer than max_bytes, else CheckJsonDepth(text, max_depth).
absl::Status CheckJsonLimits(std::string_view text, size_t max_bytes,
                             int max_depth = kMaxJsonDepth);

}  // namespace sparsex

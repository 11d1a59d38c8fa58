#include "gpu_worker/service/api_convert.h"

#include <cmath>
#include <cstdint>

namespace sparsex::service {

absl::StatusOr<SamplingParams> SamplingFromProto(const v1::SamplingParams& p) {
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  s.seed = p.seed();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop_ids.assign(p.stop_ids().begin(), p.stop_ids().end());
  s.ignore_eos = p.ignore_eos();
  if (!std::isfinite(s.temperature) || s.temperature < 0 || s.temperature > 100) {
    return absl::InvalidArgumentError("sampling.temperature must be in [0, 100]");
  }
  if (s.top_k < 0) return absl::InvalidArgumentError("sampling.top_k must be >= 0");
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) {
    return absl::InvalidArgumentError("sampling.top_p must be in (0, 1]");
  }
  if (s.max_tokens < 1) return absl::InvalidArgumentError("sampling.max_tokens must be >= 1");
  RETURN_IF_ERROR(ValidateSampling(s));
  return s;
}

absl::StatusOr<ReuseOptions> ReuseFromProto(const v1::ReuseOptions& p,
                                            const ReuseOptions& defaults, int n_layers) {
  ReuseOptions o = defaults;
  if (p.has_enable()) o.enable_reuse = p.enable();
  if (p.has_full_layers()) o.full_layers = p.full_layers();
  if (!p.selector().empty()) o.selector = p.selector();
  if (p.has_recompute_ratio()) {
    if (!(p.recompute_ratio() >= 0.0f && p.recompute_ratio() <= 1.0f)) {
      return absl::InvalidArgumentError("reuse.recompute_ratio must be in [0, 1]");
    }
    o.budget.mode = BudgetOptions::Mode::kFixed;
    o.budget.ratio = p.recompute_ratio();
  }
  if (p.has_store_new_segments()) o.store_new_segments = p.store_new_segments();
  if (p.has_register_prefix()) o.register_prefix = p.register_prefix();
  absl::Status s = ValidateReuseOptions(o, n_layers);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("reuse: ", s.message()));
  return o;
}

std::string EncodeFingerprintBytes(const Hash128& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

absl::StatusOr<Hash128> DecodeFingerprintBytes(std::string_view s) {
  if (s.size() != 16) return absl::InvalidArgumentError("fingerprint must be 16 bytes");
  Hash128 h;
  for (int i = 0; i < 8; ++i) {
    h.hi = (h.hi << 8) | static_cast<unsigned char>(s[i]);
    h.lo = (h.lo << 8) | static_cast<unsigned char>(s[8 + i]);
  }
  return h;
}

namespace {

// Length of the valid UTF-8 sequence at s[i], or 0 when it is invalid (overlongs, surrogates
// and code points above U+10FFFF are invalid).
size_t Utf8SeqLen(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
      cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    return 0;
  }
  return n;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SeqLen(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string SanitizeUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SeqLen(s, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace sparsex::service

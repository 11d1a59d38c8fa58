// GGML block quantization: see quant.h for the block layouts. Written from the format's
// description; each dequantizer walks one block at a time through a bounds-checked span.
#include "model/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace sparsex {
namespace {

constexpr int64_t kQK = 32;    // values per Q8_0 / Q4_0 block
constexpr int64_t kQKK = 256;  // values per K-quant super-block
constexpr size_t kQ8_0Bytes = 2 + 32;
constexpr size_t kQ4_0Bytes = 2 + 16;
constexpr size_t kQ4_KBytes = 2 + 2 + 12 + 128;
constexpr size_t kQ6_KBytes = 128 + 64 + 16 + 2;

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);  // little-endian file, little-endian host
  return v;
}
void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
float LoadHalf(const uint8_t* p) { return HalfBitsToF32(LoadU16(p)); }

// The 6-bit scale and min of Q4_K sub-block j (0..7) from the 12 packed bytes: sub-blocks 0-3
// keep theirs in the low 6 bits of bytes j (scale) and j + 4 (min); sub-blocks 4-7 keep their
// low 4 bits in the nibbles of byte j + 4 and their high 2 bits in the top bits of bytes j - 4
// (scale) and j (min).
void Q4KScaleMin(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
void Q4KPackScaleMin(uint8_t* s, int j, int scale, int min) {
  if (j < 4) {
    s[j] = static_cast<uint8_t>((s[j] & 0xC0) | (scale & 63));
    s[j + 4] = static_cast<uint8_t>((s[j + 4] & 0xC0) | (min & 63));
  } else {
    s[j + 4] = static_cast<uint8_t>((scale & 0x0F) | ((min & 0x0F) << 4));
    s[j - 4] = static_cast<uint8_t>((s[j - 4] & 0x3F) | ((scale >> 4) << 6));
    s[j] = static_cast<uint8_t>((s[j] & 0x3F) | ((min >> 4) << 6));
  }
}

void DequantQ8_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const auto* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < kQK; ++i) y[i] = d * static_cast<float>(q[i]);
}

void DequantQ4_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < kQK / 2; ++i) {
    y[i] = d * static_cast<float>((qs[i] & 0x0F) - 8);
    y[i + kQK / 2] = d * static_cast<float>((qs[i] >> 4) - 8);
  }
}

void DequantQ4_K(const uint8_t* b, float* y) {
  const float d = LoadHalf(b), dmin = LoadHalf(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int pair = 0; pair < 4; ++pair) {  // 64 values: two sub-blocks of 32 share 32 bytes
    int s0, m0, s1, m1;
    Q4KScaleMin(scales, 2 * pair, &s0, &m0);
    Q4KScaleMin(scales, 2 * pair + 1, &s1, &m1);
    const float d0 = d * static_cast<float>(s0), c0 = dmin * static_cast<float>(m0);
    const float d1 = d * static_cast<float>(s1), c1 = dmin * static_cast<float>(m1);
    const uint8_t* q = qs + 32 * pair;
    float* out = y + 64 * pair;
    for (int l = 0; l < 32; ++l) {
      out[l] = d0 * static_cast<float>(q[l] & 0x0F) - c0;
      out[l + 32] = d1 * static_cast<float>(q[l] >> 4) - c1;
    }
  }
}

// Q6_K value i of a block (0..255): half h = i / 128, within it group g = (i % 128) / 32 and
// lane l = i % 32. Groups 0/1 use the low nibbles of ql[64h + l] / ql[64h + 32 + l], groups 2/3
// their high nibbles; the top two bits are bits 2g..2g+1 of qh[32h + l]; the scale is
// scales[i / 16].
void DequantQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = LoadHalf(b + 208);
  for (int i = 0; i < kQKK; ++i) {
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;
    const uint8_t lo_byte = ql[64 * h + 32 * (g & 1) + l];
    const int lo = g < 2 ? (lo_byte & 0x0F) : (lo_byte >> 4);
    const int hi = (qh[32 * h + l] >> (2 * g)) & 3;
    y[i] = d * static_cast<float>(sc[i / 16]) * static_cast<float>((lo | (hi << 4)) - 32);
  }
}

int RoundClamp(float v, int lo, int hi) {
  const long r = std::lrintf(v);
  return static_cast<int>(std::clamp<long>(r, lo, hi));
}

// The value of largest magnitude (with its sign) among n.
float SignedAbsMax(const float* x, int n) {
  float m = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
  return m;
}

void QuantQ8_0(const float* x, uint8_t* b) {
  float amax = 0;
  for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint16_t dh = F32ToHalfBits(amax / 127.0f);
  StoreU16(b, dh);
  const float d = HalfBitsToF32(dh);
  const float inv = d != 0 ? 1.0f / d : 0.0f;
  auto* q = reinterpret_cast<int8_t*>(b + 2);
  for (int i = 0; i < kQK; ++i) q[i] = static_cast<int8_t>(RoundClamp(x[i] * inv, -127, 127));
}

void QuantQ4_0(const float* x, uint8_t* b) {
  // The largest-magnitude value maps to nibble 0 (-8 * d); the other sign reaches +7 * d.
  const uint16_t dh = F32ToHalfBits(SignedAbsMax(x, kQK) / -8.0f);
  StoreU16(b, dh);
  const float d = HalfBitsToF32(dh);
  const float inv = d != 0 ? 1.0f / d : 0.0f;
  uint8_t* qs = b + 2;
  for (int i = 0; i < kQK / 2; ++i) {
    const int lo = RoundClamp(x[i] * inv, -8, 7) + 8;
    const int hi = RoundClamp(x[i + kQK / 2] * inv, -8, 7) + 8;
    qs[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

void QuantQ4_K(const float* x, uint8_t* b) {
  // Per sub-block of 32: x ~ step * q - offset with q in 0..15 (offset >= 0 covers the minimum).
  float step[8], offset[8];
  float max_step = 0, max_offset = 0;
  for (int j = 0; j < 8; ++j) {
    const float* v = x + 32 * j;
    float lo = 0, hi = 0;  // the range always includes 0, as the format's offsets are >= 0
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, v[l]);
      hi = std::max(hi, v[l]);
    }
    step[j] = (hi - lo) / 15.0f;
    offset[j] = -lo;
    max_step = std::max(max_step, step[j]);
    max_offset = std::max(max_offset, offset[j]);
  }
  const uint16_t dh = F32ToHalfBits(max_step / 63.0f), mh = F32ToHalfBits(max_offset / 63.0f);
  StoreU16(b, dh);
  StoreU16(b + 2, mh);
  const float d = HalfBitsToF32(dh), dmin = HalfBitsToF32(mh);
  uint8_t* scales = b + 4;
  std::memset(scales, 0, 12);
  uint8_t* qs = b + 16;
  std::memset(qs, 0, 128);
  for (int j = 0; j < 8; ++j) {
    const int s = d != 0 ? RoundClamp(step[j] / d, 0, 63) : 0;
    const int m = dmin != 0 ? RoundClamp(offset[j] / dmin, 0, 63) : 0;
    Q4KPackScaleMin(scales, j, s, m);
    const float ds = d * static_cast<float>(s), c = dmin * static_cast<float>(m);
    const float inv = ds != 0 ? 1.0f / ds : 0.0f;
    for (int l = 0; l < 32; ++l) {
      const int q = RoundClamp((x[32 * j + l] + c) * inv, 0, 15);
      qs[32 * (j / 2) + l] |= static_cast<uint8_t>(j % 2 == 0 ? q : q << 4);
    }
  }
}

void QuantQ6_K(const float* x, uint8_t* b) {
  float sub[16];  // per sub-block of 16: the largest-magnitude value maps to -32
  float amax = 0;
  for (int j = 0; j < 16; ++j) {
    sub[j] = SignedAbsMax(x + 16 * j, 16) / -32.0f;
    amax = std::max(amax, std::fabs(sub[j]));
  }
  const uint16_t dh = F32ToHalfBits(amax / 127.0f);
  const float d = HalfBitsToF32(dh);
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  auto* sc = reinterpret_cast<int8_t*>(b + 192);
  std::memset(b, 0, kQ6_KBytes);
  StoreU16(b + 208, dh);
  for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(d != 0 ? RoundClamp(sub[j] / d, -127, 127) : 0);
  for (int i = 0; i < kQKK; ++i) {
    const float ds = d * static_cast<float>(sc[i / 16]);
    const int q = (ds != 0 ? RoundClamp(x[i] / ds, -32, 31) : 0) + 32;
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;
    uint8_t& lo_byte = ql[64 * h + 32 * (g & 1) + l];
    lo_byte |= static_cast<uint8_t>(g < 2 ? (q & 0x0F) : (q & 0x0F) << 4);
    qh[32 * h + l] |= static_cast<uint8_t>((q >> 4) << (2 * g));
  }
}

const char* QuantName(uint32_t t) {
  switch (t) {
    case kGgmlQ8_0: return "Q8_0";
    case kGgmlQ4_0: return "Q4_0";
    case kGgmlQ4_K: return "Q4_K";
    case kGgmlQ6_K: return "Q6_K";
    default: return "?";
  }
}

absl::Status CheckBlocks(uint32_t t, int64_t n, GgmlBlockLayout* l) {
  if (!GgmlQuantLayout(t, l)) {
    return absl::InvalidArgumentError(absl::StrCat("ggml type ", t, " is not a quantized type "
                                                   "handled here (Q8_0, Q4_0, Q4_K, Q6_K)"));
  }
  if (n < 0 || n % l->values != 0) {
    return absl::InvalidArgumentError(absl::StrCat(n, " values are not a whole number of ",
                                                   QuantName(t), " blocks of ", l->values));
  }
  return absl::OkStatus();
}

}  // namespace

float HalfBitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToHalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00;   // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                       // below 2^-14: subnormal half (or zero)
    const float v = std::fabs(f) * 16777216.0f;   // in units of 2^-24, exact
    return sign | static_cast<uint16_t>(std::lrintf(v));  // 1024 becomes the smallest normal
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax >> 13) & 0x3FF);
  const uint32_t rest = ax & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // to nearest, ties to even
  return sign | static_cast<uint16_t>(h);
}

bool GgmlQuantLayout(uint32_t t, GgmlBlockLayout* l) {
  switch (t) {
    case kGgmlQ8_0: *l = {kQK, kQ8_0Bytes}; return true;
    case kGgmlQ4_0: *l = {kQK, kQ4_0Bytes}; return true;
    case kGgmlQ4_K: *l = {kQKK, kQ4_KBytes}; return true;
    case kGgmlQ6_K: *l = {kQKK, kQ6_KBytes}; return true;
    default: return false;
  }
}

absl::Status DequantizeGgml(uint32_t t, const void* src, size_t nbytes, int64_t n, float* out) {
  GgmlBlockLayout l;
  RETURN_IF_ERROR(CheckBlocks(t, n, &l));
  const auto blocks = static_cast<uint64_t>(n / l.values);
  if (nbytes / l.bytes != blocks || nbytes % l.bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        QuantName(t), ": ", n, " values need ", blocks * l.bytes, " bytes, got ", nbytes));
  }
  const auto* p = static_cast<const uint8_t*>(src);
  for (uint64_t i = 0; i < blocks; ++i, p += l.bytes, out += l.values) {
    switch (t) {
      case kGgmlQ8_0: DequantQ8_0(p, out); break;
      case kGgmlQ4_0: DequantQ4_0(p, out); break;
      case kGgmlQ4_K: DequantQ4_K(p, out); break;
      case kGgmlQ6_K: DequantQ6_K(p, out); break;
    }
  }
  return absl::OkStatus();
}

absl::Status QuantizeGgml(uint32_t t, const float* x, int64_t n, std::vector<uint8_t>* out) {
  GgmlBlockLayout l;
  RETURN_IF_ERROR(CheckBlocks(t, n, &l));
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(absl::StrCat("cannot quantize non-finite value at ", i));
    }
  }
  const int64_t blocks = n / l.values;
  out->assign(static_cast<size_t>(blocks) * l.bytes, 0);
  uint8_t* p = out->data();
  for (int64_t i = 0; i < blocks; ++i, p += l.bytes, x += l.values) {
    switch (t) {
      case kGgmlQ8_0: QuantQ8_0(x, p); break;
      case kGgmlQ4_0: QuantQ4_0(x, p); break;
      case kGgmlQ4_K: QuantQ4_K(x, p); break;
      case kGgmlQ6_K: QuantQ6_K(x, p); break;
    }
  }
  return absl::OkStatus();
}

}  // namespace sparsex

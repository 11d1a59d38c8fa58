// bf16 on the host: the upper half of an fp32. Rounding to nearest, ties to even (NaN stays a
// quiet NaN); widening is exact. Used where KV travels or is kept as bf16 outside a GPU kernel
// (the cluster wire, fetched segments).
#pragma once

#include <cstdint>
#include <cstring>

namespace sparsex {

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace sparsex

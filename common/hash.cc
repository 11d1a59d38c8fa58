#include "common/hash.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstdio>

namespace sparsex {

std::string Hash128::Hex() const {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

std::optional<Hash128> Hash128::FromHex(std::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  uint64_t w[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return std::nullopt;
    w[i / 16] = (w[i / 16] << 4) | static_cast<uint64_t>(d);
  }
  return Hash128{w[0], w[1]};
}

uint64_t Hash64(const void* data, size_t n, uint64_t seed) {
  return XXH3_64bits_withSeed(data, n, seed);
}

Hash128 HashBytes128(const void* data, size_t n, uint64_t seed) {
  XXH128_hash_t h = XXH3_128bits_withSeed(data, n, seed);
  return {h.high64, h.low64};
}

Hasher::Hasher() : state_(XXH3_createState()) {
  XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_));
}
Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

Hasher& Hasher::Bytes(const void* data, size_t n) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, n);
  return *this;
}

Hasher& Hasher::U64(uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  return Bytes(b, 8);
}

Hasher& Hasher::Str(std::string_view s) {
  U64(s.size());
  return Bytes(s.data(), s.size());
}

Hasher& Hasher::I32s(std::span<const int32_t> v) {
  U64(v.size());
  for (int32_t x : v) {
    uint32_t u = static_cast<uint32_t>(x);
    unsigned char b[4] = {static_cast<unsigned char>(u), static_cast<unsigned char>(u >> 8),
                          static_cast<unsigned char>(u >> 16), static_cast<unsigned char>(u >> 24)};
    Bytes(b, 4);
  }
  return *this;
}

Hash128 Hasher::Finish() const {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return {h.high64, h.low64};
}

}  // namespace sparsex

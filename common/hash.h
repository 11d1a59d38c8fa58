// Deterministic 64/128-bit hashing (XXH3) used for model fingerprints, prefix-block hashes,
// segment fingerprints and block checksums. Values are identical in every process and on every
// machine: no random seeds, fixed little-endian serialisation of integers.
#pragma once

#include <cstdint>
#include <span>
#include <optional>
#include <string>
#include <string_view>

namespace sparsex {

struct Hash128 {
  uint64_t hi = 0, lo = 0;
  bool operator==(const Hash128&) const = default;
  std::string Hex() const;  // 32 lowercase hex digits
  // Parses Hex()'s output (either case); nullopt for anything else.
  static std::optional<Hash128> FromHex(std::string_view hex);
  template <typename H>
  friend H AbslHashValue(H h, const Hash128& v) {
    return H::combine(std::move(h), v.hi, v.lo);
  }
};

uint64_t Hash64(const void* data, size_t n, uint64_t seed = 0);
Hash128 HashBytes128(const void* data, size_t n, uint64_t seed = 0);

// Streaming 128-bit hasher; feed integers as little-endian fixed width.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  Hasher& Bytes(const void* data, size_t n);
  Hasher& Str(std::string_view s);  // length-prefixed
  Hasher& U64(uint64_t v);
  Hasher& I32s(std::span<const int32_t> v);  // length-prefixed
  Hash128 Finish() const;

 private:
  void* state_;
};

}  // namespace sparsex

#include "common/kv_block.h"

#include <cstring>
#include <limits>

namespace sparsex {
namespace {

constexpr size_t kHeaderChecksumOffset = 120;

void PutU16(uint8_t* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t GetU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void WriteHeader(const KvBlockHeader& h, uint8_t* out) {
  std::memset(out, 0, kKvBlockHeaderBytes);
  PutU32(out + 0, kKvBlockMagic);
  PutU16(out + 4, kKvBlockFormatVersion);
  out[6] = static_cast<uint8_t>(h.dtype);
  PutU32(out + 8, h.layout_version);
  PutU32(out + 12, h.layer_begin);
  PutU32(out + 16, h.layer_end);
  PutU32(out + 20, h.num_tokens);
  PutU32(out + 24, h.kv_dim);
  PutU64(out + 32, h.model_fp.hi);
  PutU64(out + 40, h.model_fp.lo);
  PutU64(out + 48, h.segment_fp.hi);
  PutU64(out + 56, h.segment_fp.lo);
  PutU64(out + 64, h.payload_bytes);
  PutU64(out + 72, h.payload_checksum);
  PutU64(out + kHeaderChecksumOffset, Hash64(out, kHeaderChecksumOffset));
}

}  // namespace

absl::Status SetKvBlockMac(std::span<uint8_t> block, std::span<const uint8_t> nonce,
                           std::span<const uint8_t> tag) {
  if (block.size() < kKvBlockHeaderBytes || nonce.size() != kKvBlockMacNonceBytes ||
      tag.size() != kKvBlockMacTagBytes) {
    return absl::InvalidArgumentError("kv block: bad MAC field sizes");
  }
  uint8_t* h = block.data();
  std::memcpy(h + kKvBlockMacOffset, nonce.data(), kKvBlockMacNonceBytes);
  std::memcpy(h + kKvBlockMacOffset + kKvBlockMacNonceBytes, tag.data(), kKvBlockMacTagBytes);
  h[kKvBlockMacOffset + kKvBlockMacNonceBytes + kKvBlockMacTagBytes] = 1;
  PutU64(h + kHeaderChecksumOffset, Hash64(h, kHeaderChecksumOffset));
  return absl::OkStatus();
}

size_t KvDtypeSize(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kF32: return 4;
    case KvDtype::kF16: return 2;
    case KvDtype::kBF16: return 2;
    case KvDtype::kF8E4M3: return 1;
  }
  return 0;
}

const char* KvDtypeName(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kF32: return "f32";
    case KvDtype::kF16: return "f16";
    case KvDtype::kBF16: return "bf16";
    case KvDtype::kF8E4M3: return "f8e4m3";
  }
  return "unknown";
}

absl::StatusOr<uint64_t> KvPayloadBytes(const KvBlockHeader& h) {
  const size_t es = KvDtypeSize(h.dtype);
  if (es == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv block: unknown dtype ", static_cast<int>(h.dtype)));
  }
  if (h.layer_end <= h.layer_begin) {
    return absl::InvalidArgumentError(absl::StrCat("kv block: empty layer range [",
                                                   h.layer_begin, ", ", h.layer_end, ")"));
  }
  if (h.num_tokens == 0 || h.kv_dim == 0) {
    return absl::InvalidArgumentError("kv block: num_tokens and kv_dim must be positive");
  }
  // Each factor < 2^32; check the product for overflow in 128 bits.
  unsigned __int128 n = static_cast<unsigned __int128>(h.layer_end - h.layer_begin) * 2u *
                        h.num_tokens * h.kv_dim * es;
  if (n > std::numeric_limits<uint64_t>::max() - kKvBlockHeaderBytes) {
    return absl::InvalidArgumentError("kv block: payload size overflows");
  }
  return static_cast<uint64_t>(n);
}

absl::StatusOr<uint64_t> KvBlockEncodedBytes(const KvBlockHeader& h) {
  ASSIGN_OR_RETURN(uint64_t p, KvPayloadBytes(h));
  return p + kKvBlockHeaderBytes;
}

absl::Status EncodeKvBlockInto(const KvBlockHeader& h, std::span<const uint8_t> payload,
                               std::span<uint8_t> out) {
  ASSIGN_OR_RETURN(uint64_t want, KvPayloadBytes(h));
  if (payload.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv block: payload is ", payload.size(), " bytes, shape implies ", want));
  }
  if (out.size() != want + kKvBlockHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv block: output is ", out.size(),
                                                   " bytes, need ", want + kKvBlockHeaderBytes));
  }
  KvBlockHeader full = h;
  full.payload_bytes = want;
  full.payload_checksum = Hash64(payload.data(), payload.size());
  uint8_t* dst = out.data() + kKvBlockHeaderBytes;
  if (payload.data() != dst && !payload.empty()) std::memmove(dst, payload.data(), want);
  WriteHeader(full, out.data());
  return absl::OkStatus();
}

absl::StatusOr<std::string> EncodeKvBlock(const KvBlockHeader& h,
                                          std::span<const uint8_t> payload) {
  ASSIGN_OR_RETURN(uint64_t total, KvBlockEncodedBytes(h));
  std::string out(total, '\0');
  RETURN_IF_ERROR(EncodeKvBlockInto(
      h, payload, {reinterpret_cast<uint8_t*>(out.data()), out.size()}));
  return out;
}

absl::StatusOr<KvBlockHeader> DecodeKvBlockHeader(std::span<const uint8_t> bytes) {
  if (bytes.size() < kKvBlockHeaderBytes) {
    return absl::DataLossError(absl::StrCat("kv block: ", bytes.size(),
                                            " bytes, shorter than the header"));
  }
  const uint8_t* p = bytes.data();
  if (GetU32(p) != kKvBlockMagic) return absl::DataLossError("kv block: bad magic");
  if (GetU16(p + 4) != kKvBlockFormatVersion) {
    return absl::DataLossError(
        absl::StrCat("kv block: unknown header format version ", GetU16(p + 4)));
  }
  if (GetU64(p + kHeaderChecksumOffset) != Hash64(p, kHeaderChecksumOffset)) {
    return absl::DataLossError("kv block: header checksum mismatch");
  }
  KvBlockHeader h;
  h.dtype = static_cast<KvDtype>(p[6]);
  h.layout_version = GetU32(p + 8);
  h.layer_begin = GetU32(p + 12);
  h.layer_end = GetU32(p + 16);
  h.num_tokens = GetU32(p + 20);
  h.kv_dim = GetU32(p + 24);
  h.model_fp = {GetU64(p + 32), GetU64(p + 40)};
  h.segment_fp = {GetU64(p + 48), GetU64(p + 56)};
  h.payload_bytes = GetU64(p + 64);
  h.payload_checksum = GetU64(p + 72);
  return h;
}

absl::StatusOr<KvBlockView> DecodeKvBlock(std::span<const uint8_t> bytes) {
  ASSIGN_OR_RETURN(KvBlockHeader h, DecodeKvBlockHeader(bytes));
  absl::StatusOr<uint64_t> want = KvPayloadBytes(h);
  if (!want.ok()) return absl::DataLossError(want.status().message());
  if (*want != h.payload_bytes) {
    return absl::DataLossError(absl::StrCat("kv block: payload_bytes ", h.payload_bytes,
                                            " disagrees with the shape (", *want, ")"));
  }
  if (bytes.size() != kKvBlockHeaderBytes + h.payload_bytes) {
    return absl::DataLossError(absl::StrCat("kv block: ", bytes.size(), " bytes, header says ",
                                            kKvBlockHeaderBytes + h.payload_bytes));
  }
  return KvBlockView{h, bytes.subspan(kKvBlockHeaderBytes)};
}

absl::StatusOr<KvBlockView> VerifyKvBlock(std::span<const uint8_t> bytes) {
  ASSIGN_OR_RETURN(KvBlockView v, DecodeKvBlock(bytes));
  if (Hash64(v.payload.data(), v.payload.size()) != v.header.payload_checksum) {
    return absl::DataLossError("kv block: payload checksum mismatch");
  }
  return v;
}

absl::Status CheckKvLayout(const KvBlockHeader& h, uint32_t expected) {
  if (h.layout_version != expected) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout_mismatch: kv block has layout version ", h.layout_version, ", expected ",
        expected));
  }
  return absl::OkStatus();
}

uint64_t KvBlockWireChecksum(std::span<const uint8_t> bytes) {
  return Hash64(bytes.data(), bytes.size());
}

}  // namespace sparsex

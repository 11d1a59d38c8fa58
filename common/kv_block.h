// Serialized KV block: the unit of KV that leaves a worker's GPU, sits in the cache cluster
// (host memory, RocksDB) and comes back. Shared by the engine and cache_server; no heavy deps.
//
// Wire format (all integers little-endian, fixed width, header is kKvBlockHeaderBytes long):
//
//   off  size  field
//     0     4  magic               kKvBlockMagic ("SXKV")
//     4     2  format_version      kKvBlockFormatVersion (this header's own layout)
//     6     1  dtype               KvDtype
//     7     1  reserved            0
//     8     4  layout_version      kKvLayoutVersion of the producer (meaning of the payload)
//    12     4  layer_begin         first layer held
//    16     4  layer_end           one past the last layer held (> layer_begin)
//    20     4  num_tokens          tokens of the segment (>= 1)
//    24     4  kv_dim              elements per token per layer of K (and of V):
//                                  num_kv_heads * head_dim
//    28     4  reserved            0
//    32    16  model_fp            Hash128 (hi, lo)
//    48    16  segment_fp          Hash128 (hi, lo)
//    64     8  payload_bytes       == (layer_end - layer_begin) * 2 * num_tokens * kv_dim
//                                     * DtypeSize(dtype)
//    72     8  payload_checksum    XXH3-64 (seed 0) of the payload bytes
//    80    12  mac_nonce           writer's random nonce (gpu_worker/service/block_mac.h); 0
//                                  when the block carries no MAC
//    92    16  mac_tag             AES-256-GMAC of bytes [0, 80) and the payload; 0 when none
//   108     1  mac_present         1 when mac_nonce / mac_tag are set, else 0
//   109    11  reserved            0
//   120     8  header_checksum     XXH3-64 (seed 0) of bytes [0, 120)
//   128     -  payload
//
// Payload layout (row-major): for each layer l in [layer_begin, layer_end): K[num_tokens][kv_dim]
// then V[num_tokens][kv_dim]. K is stored before RoPE (position independent).
//
//   KvBlockHeader h;
//   h.model_fp = model_fp; h.segment_fp = seg_fp; h.layer_begin = 0; h.layer_end = 1;
//   h.num_tokens = n; h.kv_dim = 1024; h.dtype = KvDtype::kBF16;
//   ASSIGN_OR_RETURN(std::string bytes, EncodeKvBlock(h, payload));
//   ...
//   ASSIGN_OR_RETURN(KvBlockView v, DecodeKvBlock(bytes));  // header + sizes checked
//   RETURN_IF_ERROR(VerifyKvBlock(bytes));                    // + payload checksum
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/fingerprint.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex {

inline constexpr uint32_t kKvBlockMagic = 0x564b5853;  // bytes "SXKV"
inline constexpr uint16_t kKvBlockFormatVersion = 1;
inline constexpr size_t kKvBlockHeaderBytes = 128;

enum class KvDtype : uint8_t {
  kF32 = 1,
  kF16 = 2,
  kBF16 = 3,
  kF8E4M3 = 4,
};

// Bytes per element; 0 for an unknown dtype.
size_t KvDtypeSize(KvDtype dtype);
const char* KvDtypeName(KvDtype dtype);

struct KvBlockHeader {
  uint32_t layout_version = kKvLayoutVersion;
  Hash128 model_fp;
  Hash128 segment_fp;
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
  uint32_t num_tokens = 0;
  uint32_t kv_dim = 0;
  KvDtype dtype = KvDtype::kBF16;
  // Filled by Encode; checked by Decode/Verify.
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;

  bool operator==(const KvBlockHeader&) const = default;
};

// Payload size implied by the shape fields, or INVALID_ARGUMENT (bad dtype, empty range,
// zero tokens/kv_dim, overflow).
absl::StatusOr<uint64_t> KvPayloadBytes(const KvBlockHeader& h);

// Encoded size of a block with this header's shape.
absl::StatusOr<uint64_t> KvBlockEncodedBytes(const KvBlockHeader& h);

// Serialises header + payload. payload.size() must equal KvPayloadBytes(h) (INVALID_ARGUMENT
// otherwise). payload_bytes and payload_checksum of `h` are ignored and computed.
absl::StatusOr<std::string> EncodeKvBlock(const KvBlockHeader& h,
                                          std::span<const uint8_t> payload);

// Same, into caller memory of exactly KvBlockEncodedBytes(h) bytes (e.g. registered memory).
// `payload` may already sit at out.data() + kKvBlockHeaderBytes (no copy is made then).
absl::Status EncodeKvBlockInto(const KvBlockHeader& h, std::span<const uint8_t> payload,
                               std::span<uint8_t> out);

// Parses the header only: DATA_LOSS on a short buffer, wrong magic, unknown format version or
// a header checksum mismatch; INVALID_ARGUMENT-free (any corruption is DATA_LOSS). Does not
// check the layout version (see CheckKvLayout) nor the payload.
absl::StatusOr<KvBlockHeader> DecodeKvBlockHeader(std::span<const uint8_t> bytes);

struct KvBlockView {
  KvBlockHeader header;
  std::span<const uint8_t> payload;
};

// Header + total size (bytes.size() == header + payload_bytes, shape consistent): DATA_LOSS
// otherwise. The payload checksum is not computed (see VerifyKvBlock).
absl::StatusOr<KvBlockView> DecodeKvBlock(std::span<const uint8_t> bytes);

// DecodeKvBlock + payload checksum (DATA_LOSS on mismatch).
absl::StatusOr<KvBlockView> VerifyKvBlock(std::span<const uint8_t> bytes);

// FAILED_PRECONDITION unless the block was produced with `expected` layout version.
absl::Status CheckKvLayout(const KvBlockHeader& h, uint32_t expected = kKvLayoutVersion);

// The header's MAC fields (offsets 80-109 above) and the header checksum after them: a MAC is
// computed over an encoded block and written into it afterwards (block_mac.h).
inline constexpr size_t kKvBlockMacOffset = 80;
inline constexpr size_t kKvBlockMacNonceBytes = 12;
inline constexpr size_t kKvBlockMacTagBytes = 16;
// Writes nonce, tag and the present flag into an encoded block's header and recomputes the
// header checksum. INVALID_ARGUMENT for a buffer shorter than a header or wrong field sizes.
absl::Status SetKvBlockMac(std::span<uint8_t> block, std::span<const uint8_t> nonce,
                           std::span<const uint8_t> tag);

// XXH3-64 of a whole encoded block: the checksum carried by a cache put's commit.
uint64_t KvBlockWireChecksum(std::span<const uint8_t> bytes);

// View of an encoded block held in a std::string.
inline std::span<const uint8_t> KvBlockBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace sparsex

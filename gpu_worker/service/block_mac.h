// Provenance of cache-cluster KV: every block a worker writes carries a MAC under the cluster's
// KV key (AES-256-GMAC through OpenSSL's AES-256-GCM with the block as additional data: a
// standard MAC that runs at several GB/s a core with AES-NI and carry-less multiply), and a
// worker uses a fetched block only when its MAC verifies. The cache servers never hold the key:
// whoever can write bytes into their arena or RocksDB (an outsider on the UCX data plane, a
// compromised cache server) cannot make a block a worker accepts.
//
//   ASSIGN_OR_RETURN(auto mac, BlockMac::FromFile("kv_mac.key"));   // 32 bytes, hex
//   RETURN_IF_ERROR(mac->Seal(block));    // after EncodeKvBlockInto: nonce + tag in the header
//   RETURN_IF_ERROR(mac->Verify(block));  // DATA_LOSS unless sealed under this key, unchanged
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"

namespace sparsex::service {

class BlockMac {
 public:
  // The key file holds 64 hex digits (openssl rand -hex 32), surrounding whitespace ignored.
  static absl::StatusOr<std::unique_ptr<BlockMac>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<BlockMac>> FromKey(std::span<const uint8_t> key32);

  // Seals an encoded block (common/kv_block.h) in place: a fresh random nonce, the tag over
  // header bytes [0, 80) and the payload, the header checksum recomputed.
  absl::Status Seal(std::span<uint8_t> block) const;
  // DATA_LOSS "unauthenticated" when the block has no MAC, another key's, or any byte of the
  // header's first 80 or of the payload changed since it was sealed.
  absl::Status Verify(std::span<const uint8_t> block) const;

 private:
  BlockMac() = default;
  absl::Status Tag(std::span<const uint8_t> block, const uint8_t* nonce, uint8_t* tag) const;
  uint8_t key_[32] = {};
};

}  // namespace sparsex::service

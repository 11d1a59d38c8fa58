#include "gpu_worker/service/block_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <cctype>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/kv_block.h"

namespace sparsex::service {
namespace {

struct CtxFree {
  void operator()(EVP_CIPHER_CTX* c) const { EVP_CIPHER_CTX_free(c); }
};

constexpr size_t kAuthedHeader = kKvBlockMacOffset;  // header bytes the tag covers
constexpr size_t kPresentOffset = kKvBlockMacOffset + kKvBlockMacNonceBytes + kKvBlockMacTagBytes;

}  // namespace

absl::StatusOr<std::unique_ptr<BlockMac>> BlockMac::FromKey(std::span<const uint8_t> key32) {
  if (key32.size() != 32) return absl::InvalidArgumentError("KV MAC key: 32 bytes needed");
  std::unique_ptr<BlockMac> m(new BlockMac());
  std::memcpy(m->key_, key32.data(), 32);
  return m;
}

absl::StatusOr<std::unique_ptr<BlockMac>> BlockMac::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("KV MAC key: cannot read ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string hex;
  for (char c : ss.str()) {
    if (!std::isspace(static_cast<unsigned char>(c))) hex += c;
  }
  if (hex.size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV MAC key ", path, ": 64 hex digits needed (openssl rand -hex 32), found ", hex.size(),
        " characters"));
  }
  uint8_t key[32];
  for (int i = 0; i < 32; ++i) {
    auto nib = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("KV MAC key: not hex");
    key[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  auto m = FromKey(key);
  OPENSSL_cleanse(key, sizeof key);
  return m;
}

absl::Status BlockMac::Tag(std::span<const uint8_t> block, const uint8_t* nonce,
                           uint8_t* tag) const {
  if (block.size() < kKvBlockHeaderBytes) return absl::DataLossError("kv block: short");
  std::unique_ptr<EVP_CIPHER_CTX, CtxFree> ctx(EVP_CIPHER_CTX_new());
  int len = 0;
  // GMAC: AES-256-GCM with no plaintext, the block as additional authenticated data.
  if (!ctx || EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, kKvBlockMacNonceBytes, nullptr) != 1 ||
      EVP_EncryptInit_ex(ctx.get(), nullptr, nullptr, key_, nonce) != 1 ||
      EVP_EncryptUpdate(ctx.get(), nullptr, &len, block.data(), kAuthedHeader) != 1) {
    return absl::InternalError("KV MAC: OpenSSL GCM setup failed");
  }
  // AAD in pieces of at most 1 GiB (an int length).
  const uint8_t* p = block.data() + kKvBlockHeaderBytes;
  size_t left = block.size() - kKvBlockHeaderBytes;
  while (left > 0) {
    const int n = static_cast<int>(std::min<size_t>(left, size_t{1} << 30));
    if (EVP_EncryptUpdate(ctx.get(), nullptr, &len, p, n) != 1) {
      return absl::InternalError("KV MAC: OpenSSL GCM update failed");
    }
    p += n;
    left -= n;
  }
  if (EVP_EncryptFinal_ex(ctx.get(), nullptr, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kKvBlockMacTagBytes, tag) != 1) {
    return absl::InternalError("KV MAC: OpenSSL GCM final failed");
  }
  return absl::OkStatus();
}

absl::Status BlockMac::Seal(std::span<uint8_t> block) const {
  uint8_t nonce[kKvBlockMacNonceBytes], tag[kKvBlockMacTagBytes];
  if (RAND_bytes(nonce, sizeof nonce) != 1) return absl::InternalError("KV MAC: no randomness");
  RETURN_IF_ERROR(Tag(block, nonce, tag));
  return SetKvBlockMac(block, nonce, tag);
}

absl::Status BlockMac::Verify(std::span<const uint8_t> block) const {
  if (block.size() < kKvBlockHeaderBytes || block[kPresentOffset] != 1) {
    return absl::DataLossError("unauthenticated KV block: no MAC");
  }
  uint8_t tag[kKvBlockMacTagBytes];
  RETURN_IF_ERROR(Tag(block, block.data() + kKvBlockMacOffset, tag));
  if (CRYPTO_memcmp(tag, block.data() + kKvBlockMacOffset + kKvBlockMacNonceBytes,
                    kKvBlockMacTagBytes) != 0) {
    return absl::DataLossError("unauthenticated KV block: MAC mismatch");
  }
  return absl::OkStatus();
}

}  // namespace sparsex::service

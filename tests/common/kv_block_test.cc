#include "common/kv_block.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace sparsex {
namespace {

KvBlockHeader SmallHeader() {
  KvBlockHeader h;
  h.model_fp = {0x1111, 0x2222};
  h.segment_fp = {0xabcdef, 0x123456};
  h.layer_begin = 2;
  h.layer_end = 4;
  h.num_tokens = 3;
  h.kv_dim = 8;
  h.dtype = KvDtype::kBF16;
  return h;
}

std::vector<uint8_t> Payload(size_t n, uint8_t seed = 7) {
  std::vector<uint8_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(seed + i * 31);
  return p;
}

TEST(KvBlockTest, PayloadBytesFollowsShape) {
  KvBlockHeader h = SmallHeader();
  EXPECT_EQ(*KvPayloadBytes(h), 2u * 2 * 3 * 8 * 2);
  EXPECT_EQ(*KvBlockEncodedBytes(h), kKvBlockHeaderBytes + 2u * 2 * 3 * 8 * 2);
  h.dtype = KvDtype::kF32;
  EXPECT_EQ(*KvPayloadBytes(h), 2u * 2 * 3 * 8 * 4);
  h.dtype = KvDtype::kF8E4M3;
  EXPECT_EQ(*KvPayloadBytes(h), 2u * 2 * 3 * 8);
}

TEST(KvBlockTest, RejectsBadShapes) {
  KvBlockHeader h = SmallHeader();
  h.layer_end = h.layer_begin;
  EXPECT_EQ(KvPayloadBytes(h).status().code(), absl::StatusCode::kInvalidArgument);
  h = SmallHeader();
  h.num_tokens = 0;
  EXPECT_EQ(KvPayloadBytes(h).status().code(), absl::StatusCode::kInvalidArgument);
  h = SmallHeader();
  h.dtype = static_cast<KvDtype>(99);
  EXPECT_EQ(KvPayloadBytes(h).status().code(), absl::StatusCode::kInvalidArgument);
  h = SmallHeader();
  h.layer_begin = 0;
  h.layer_end = 0xffffffffu;
  h.num_tokens = 0xffffffffu;
  h.kv_dim = 0xffffffffu;
  EXPECT_EQ(KvPayloadBytes(h).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvBlockTest, RoundTrip) {
  KvBlockHeader h = SmallHeader();
  auto payload = Payload(*KvPayloadBytes(h));
  auto enc = EncodeKvBlock(h, payload);
  ASSERT_TRUE(enc.ok()) << enc.status();
  ASSERT_EQ(enc->size(), *KvBlockEncodedBytes(h));
  auto v = VerifyKvBlock(KvBlockBytes(*enc));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->header.model_fp, h.model_fp);
  EXPECT_EQ(v->header.segment_fp, h.segment_fp);
  EXPECT_EQ(v->header.layer_begin, 2u);
  EXPECT_EQ(v->header.layer_end, 4u);
  EXPECT_EQ(v->header.num_tokens, 3u);
  EXPECT_EQ(v->header.kv_dim, 8u);
  EXPECT_EQ(v->header.dtype, KvDtype::kBF16);
  EXPECT_EQ(v->header.layout_version, kKvLayoutVersion);
  EXPECT_EQ(v->header.payload_bytes, payload.size());
  EXPECT_EQ(v->header.payload_checksum, Hash64(payload.data(), payload.size()));
  ASSERT_EQ(v->payload.size(), payload.size());
  EXPECT_EQ(std::memcmp(v->payload.data(), payload.data(), payload.size()), 0);
  EXPECT_TRUE(CheckKvLayout(v->header).ok());
}

TEST(KvBlockTest, EncodingIsDeterministicAndLittleEndian) {
  KvBlockHeader h = SmallHeader();
  auto payload = Payload(*KvPayloadBytes(h));
  auto a = *EncodeKvBlock(h, payload);
  auto b = *EncodeKvBlock(h, payload);
  EXPECT_EQ(a, b);
  // "SXKV" magic at offset 0, layer_begin at 12.
  EXPECT_EQ(a.substr(0, 4), "SXKV");
  EXPECT_EQ(static_cast<uint8_t>(a[12]), 2);
  EXPECT_EQ(static_cast<uint8_t>(a[13]), 0);
}

TEST(KvBlockTest, EncodeInPlace) {
  KvBlockHeader h = SmallHeader();
  const size_t pb = *KvPayloadBytes(h);
  std::vector<uint8_t> buf(kKvBlockHeaderBytes + pb);
  auto payload = Payload(pb, 3);
  std::memcpy(buf.data() + kKvBlockHeaderBytes, payload.data(), pb);
  ASSERT_TRUE(EncodeKvBlockInto(h, {buf.data() + kKvBlockHeaderBytes, pb}, buf).ok());
  auto v = VerifyKvBlock(buf);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(std::memcmp(v->payload.data(), payload.data(), pb), 0);
  // Wrong output size.
  std::vector<uint8_t> small(buf.size() - 1);
  EXPECT_EQ(EncodeKvBlockInto(h, payload, small).code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvBlockTest, PayloadSizeMismatchOnEncode) {
  KvBlockHeader h = SmallHeader();
  auto payload = Payload(*KvPayloadBytes(h) - 1);
  EXPECT_EQ(EncodeKvBlock(h, payload).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvBlockTest, DetectsPayloadCorruption) {
  KvBlockHeader h = SmallHeader();
  auto enc = *EncodeKvBlock(h, Payload(*KvPayloadBytes(h)));
  enc[kKvBlockHeaderBytes + 5] ^= 0x01;
  EXPECT_TRUE(DecodeKvBlock(KvBlockBytes(enc)).ok());  // shape still fine
  EXPECT_EQ(VerifyKvBlock(KvBlockBytes(enc)).status().code(), absl::StatusCode::kDataLoss);
}

TEST(KvBlockTest, DetectsHeaderCorruptionEverywhere) {
  KvBlockHeader h = SmallHeader();
  const auto good = *EncodeKvBlock(h, Payload(*KvPayloadBytes(h)));
  for (size_t i = 0; i < kKvBlockHeaderBytes; ++i) {
    std::string bad = good;
    bad[i] ^= 0x40;
    EXPECT_EQ(VerifyKvBlock(KvBlockBytes(bad)).status().code(), absl::StatusCode::kDataLoss)
        << "byte " << i;
  }
}

TEST(KvBlockTest, DetectsTruncationAndExtension) {
  KvBlockHeader h = SmallHeader();
  const auto good = *EncodeKvBlock(h, Payload(*KvPayloadBytes(h)));
  EXPECT_EQ(DecodeKvBlock(KvBlockBytes(good.substr(0, good.size() - 1))).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeKvBlock(KvBlockBytes(good + "x")).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeKvBlockHeader(KvBlockBytes(good.substr(0, 10))).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeKvBlock({}).status().code(), absl::StatusCode::kDataLoss);
}

TEST(KvBlockTest, LayoutMismatchIsFailedPrecondition) {
  KvBlockHeader h = SmallHeader();
  h.layout_version = kKvLayoutVersion + 1;
  auto enc = *EncodeKvBlock(h, Payload(*KvPayloadBytes(h)));
  auto v = VerifyKvBlock(KvBlockBytes(enc));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(CheckKvLayout(v->header).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(KvBlockTest, WireChecksumCoversEverything) {
  KvBlockHeader h = SmallHeader();
  auto enc = *EncodeKvBlock(h, Payload(*KvPayloadBytes(h)));
  const uint64_t c = KvBlockWireChecksum(KvBlockBytes(enc));
  enc.back() ^= 1;
  EXPECT_NE(c, KvBlockWireChecksum(KvBlockBytes(enc)));
}

}  // namespace
}  // namespace sparsex

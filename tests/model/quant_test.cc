// GGML block quantization (model/quant.h): hand-made blocks of Q8_0, Q4_0, Q4_K and Q6_K
// dequantize to values worked out by hand from the format's layout; quantize-then-dequantize
// round trips stay within each type's expected error; bad sizes are errors; a GGUF file
// converted to Q8_0 (QuantizeGgufFile) loads with weights close to the original's.
#include "model/quant.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "model/model.h"
#include "testing/models_dir.h"

namespace sparsex {
namespace {

using ::testing::HasSubstr;

std::vector<float> Dequant(uint32_t type, const std::vector<uint8_t>& blocks, int64_t n) {
  std::vector<float> y(static_cast<size_t>(n), -999.0f);
  absl::Status s = DequantizeGgml(type, blocks.data(), blocks.size(), n, y.data());
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

void PutHalf(std::vector<uint8_t>& b, size_t at, uint16_t h) { std::memcpy(&b[at], &h, 2); }

TEST(QuantTest, HalfConversion) {
  EXPECT_EQ(F32ToHalfBits(1.0f), 0x3C00);
  EXPECT_EQ(F32ToHalfBits(-2.0f), 0xC000);
  EXPECT_EQ(F32ToHalfBits(0.5f), 0x3800);
  EXPECT_EQ(F32ToHalfBits(65504.0f), 0x7BFF);
  EXPECT_EQ(F32ToHalfBits(65520.0f), 0x7C00);               // rounds up to infinity
  EXPECT_EQ(F32ToHalfBits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToHalfBits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: 0
  EXPECT_EQ(F32ToHalfBits(std::ldexp(3.0f, -25)), 0x0002);  // tie to even: 2
  EXPECT_EQ(F32ToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  EXPECT_EQ(F32ToHalfBits(1.0f + std::ldexp(3.0f, -11)), 0x3C02);
  // Every finite half survives half -> float -> half.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1F) == 0x1F) continue;
    ASSERT_EQ(F32ToHalfBits(HalfBitsToF32(static_cast<uint16_t>(h))), h) << h;
  }
  EXPECT_EQ(HalfBitsToF32(0x3555), 0.333251953125f);
  EXPECT_EQ(HalfBitsToF32(0x8001), -std::ldexp(1.0f, -24));
}

TEST(QuantTest, HandMadeQ8_0Block) {
  std::vector<uint8_t> b(34);
  PutHalf(b, 0, 0x3800);  // d = 0.5
  for (int i = 0; i < 32; ++i) b[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i * 8 - 128));
  const std::vector<float> y = Dequant(kGgmlQ8_0, b, 32);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 0.5f * static_cast<float>(i * 8 - 128)) << i;
  EXPECT_EQ(y[0], -64.0f);
  EXPECT_EQ(y[31], 60.0f);
}

TEST(QuantTest, HandMadeQ4_0Block) {
  std::vector<uint8_t> b(18);
  PutHalf(b, 0, 0x3400);  // d = 0.25
  for (int i = 0; i < 16; ++i) b[2 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  const std::vector<float> y = Dequant(kGgmlQ4_0, b, 32);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(y[i], 0.25f * static_cast<float>(i - 8)) << i;        // low nibbles: 0..15
    EXPECT_EQ(y[i + 16], 0.25f * static_cast<float>(7 - i)) << i;   // high nibbles: 15..0
  }
  EXPECT_EQ(y[0], -2.0f);
  EXPECT_EQ(y[16], 1.75f);
}

TEST(QuantTest, HandMadeQ4_KBlock) {
  // d = 1, dmin = 0.5; sub-block scales 1,2,3,4,17,33,50,63 and mins 0,5,10,15,20,40,60,63,
  // packed by hand: bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7;
  // bytes 4-7 mins 0-3 and the top 2 bits of mins 4-7; bytes 8-11 the low nibbles of scale
  // (low half) and min (high half) of sub-blocks 4-7.
  const int scale[8] = {1, 2, 3, 4, 17, 33, 50, 63};
  const int min[8] = {0, 5, 10, 15, 20, 40, 60, 63};
  const uint8_t packed[12] = {0x41, 0x82, 0xC3, 0xC4, 0x40, 0x85,
                              0xCA, 0xCF, 0x41, 0x81, 0xC2, 0xFF};
  std::vector<uint8_t> b(144);
  PutHalf(b, 0, 0x3C00);
  PutHalf(b, 2, 0x3800);
  std::memcpy(&b[4], packed, 12);
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 32; ++l)
      b[16 + 32 * p + l] = static_cast<uint8_t>((l % 16) | ((15 - l % 16) << 4));
  const std::vector<float> y = Dequant(kGgmlQ4_K, b, 256);
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 32; ++l) {
      const int q = j % 2 == 0 ? l % 16 : 15 - l % 16;  // even sub-blocks: low nibbles
      const float want = static_cast<float>(scale[j] * q) - 0.5f * static_cast<float>(min[j]);
      ASSERT_EQ(y[32 * j + l], want) << "sub-block " << j << " value " << l;
    }
  }
  EXPECT_EQ(y[32 * 7], 63.0f * 15 - 31.5f);
}

TEST(QuantTest, HandMadeQ6_KBlock) {
  // d = 0.5, scales[k] = k - 8. All 6-bit values 0 (x = d * scale * -32) except four values in
  // the first half set through ql[0], ql[32] and qh[0], and one in the second half.
  std::vector<uint8_t> b(210, 0);
  for (int k = 0; k < 16; ++k) b[192 + k] = static_cast<uint8_t>(static_cast<int8_t>(k - 8));
  PutHalf(b, 208, 0x3800);
  b[0] = 0x21;          // value 0: low nibble 1; value 64: high nibble 2
  b[128] = 0xE4;        // qh[0] = 0b11'10'01'00: top bits 0 (value 0), 1 (32), 2 (64), 3 (96)
  b[64 + 21] = 0x0F;    // second half, lane 21, group 0: low nibble 15
  b[128 + 32 + 21] = 0x03;  // its top bits 3: q = 63
  const std::vector<float> y = Dequant(kGgmlQ6_K, b, 256);
  for (int i = 0; i < 256; ++i) {
    float want = -16.0f * static_cast<float>(i / 16 - 8);
    if (i == 0) want = 0.5f * -8 * (1 - 32);    // 124
    if (i == 32) want = 0.5f * -6 * (16 - 32);  // 48
    if (i == 64) want = 0.5f * -4 * (34 - 32);  // -4
    if (i == 96) want = 0.5f * -2 * (48 - 32);  // -16
    if (i == 149) want = 0.5f * 1 * (63 - 32);  // 15.5
    ASSERT_EQ(y[i], want) << i;
  }
}

struct RoundTrip {
  uint32_t type;
  float max_rel_rms;  // RMS error over RMS of the data
};

class QuantRoundTripTest : public ::testing::TestWithParam<RoundTrip> {};

TEST_P(QuantRoundTripTest, QuantizeThenDequantizeIsClose) {
  const RoundTrip rt = GetParam();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);  // weight-like magnitudes
  const int64_t n = 256 * 64;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  for (int i = 0; i < 20; ++i) x[rng() % n] *= 8;  // outliers, as real weights have
  std::vector<uint8_t> blocks;
  ASSERT_TRUE(QuantizeGgml(rt.type, x.data(), n, &blocks).ok());
  GgmlBlockLayout l;
  ASSERT_TRUE(GgmlQuantLayout(rt.type, &l));
  EXPECT_EQ(blocks.size(), static_cast<size_t>(n / l.values) * l.bytes);
  const std::vector<float> y = Dequant(rt.type, blocks, n);
  double err = 0, ref = 0;
  for (int64_t i = 0; i < n; ++i) {
    err += (x[i] - y[i]) * (x[i] - y[i]);
    ref += x[i] * x[i];
  }
  const double rel = std::sqrt(err / ref);
  EXPECT_LT(rel, rt.max_rel_rms);
  std::printf("round trip type %u: relative RMS error %.4f\n", rt.type, rel);
  // Per block, no value is off by more than the block's range over its levels (a half step of
  // the coarsest sub-block step, with slack for the quantized scales).
  const int levels = rt.type == kGgmlQ8_0 ? 254 : rt.type == kGgmlQ6_K ? 63 : 15;
  for (int64_t b0 = 0; b0 < n; b0 += l.values) {
    float amax = 0;
    for (int64_t i = b0; i < b0 + l.values; ++i) amax = std::max(amax, std::fabs(x[i]));
    for (int64_t i = b0; i < b0 + l.values; ++i)
      ASSERT_LE(std::fabs(x[i] - y[i]), 2.0f * amax / levels * 1.1f) << i;
  }
  // A block of zeros stays zeros.
  std::vector<float> z(static_cast<size_t>(l.values), 0.0f);
  ASSERT_TRUE(QuantizeGgml(rt.type, z.data(), l.values, &blocks).ok());
  for (float v : Dequant(rt.type, blocks, l.values)) EXPECT_EQ(v, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Types, QuantRoundTripTest,
                         ::testing::Values(RoundTrip{kGgmlQ8_0, 0.008f},
                                           RoundTrip{kGgmlQ4_0, 0.12f},
                                           RoundTrip{kGgmlQ4_K, 0.10f},
                                           RoundTrip{kGgmlQ6_K, 0.03f}),
                         [](const auto& info) {
                           switch (info.param.type) {
                             case kGgmlQ8_0: return std::string("Q8_0");
                             case kGgmlQ4_0: return std::string("Q4_0");
                             case kGgmlQ4_K: return std::string("Q4_K");
                             default: return std::string("Q6_K");
                           }
                         });

TEST(QuantTest, BadSizesAreErrors) {
  std::vector<uint8_t> b(34 * 2);
  std::vector<float> y(64);
  EXPECT_TRUE(DequantizeGgml(kGgmlQ8_0, b.data(), b.size(), 64, y.data()).ok());
  // One byte short (a truncated block), one byte over, a partial block, an unknown type.
  absl::Status s = DequantizeGgml(kGgmlQ8_0, b.data(), b.size() - 1, 64, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("68 bytes"));
  EXPECT_FALSE(DequantizeGgml(kGgmlQ8_0, b.data(), b.size(), 32, y.data()).ok());
  s = DequantizeGgml(kGgmlQ8_0, b.data(), b.size(), 48, y.data());
  EXPECT_THAT(std::string(s.message()), HasSubstr("whole number"));
  EXPECT_FALSE(DequantizeGgml(kGgmlQ4_K, b.data(), b.size(), 64, y.data()).ok());
  EXPECT_FALSE(DequantizeGgml(3, b.data(), b.size(), 64, y.data()).ok());  // Q4_1
  EXPECT_FALSE(DequantizeGgml(kGgmlQ6_K, b.data(), 0, -256, y.data()).ok());
  std::vector<float> x(32, 1.0f);
  x[5] = std::nanf("");
  EXPECT_FALSE(QuantizeGgml(kGgmlQ8_0, x.data(), 32, &b).ok());
  EXPECT_FALSE(QuantizeGgml(kGgmlQ4_K, x.data(), 32, &b).ok());  // not a whole super-block
}

std::string StoriesPath() {
  return sparsex::testing::ModelsDir() + "/stories260K/stories260K.gguf";
}

std::vector<float> F32(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  t.ToF32(v.data());
  return v;
}

// The Q8_0 copy of stories260K loads; every quantized weight is within half a step of its
// block's scale of the original, norms and the 172-wide w_down (not whole blocks) are as they
// were; BF16 dequantization gives bf16 tensors.
TEST(QuantGgufTest, Stories260KConvertedToQ8_0Loads) {
  const std::string q8 = ::testing::TempDir() + "/stories260K-q8_0.gguf";
  ASSERT_TRUE(QuantizeGgufFile(StoriesPath(), q8, kGgmlQ8_0).ok())
      << "cannot convert the test model (set $SPARSEX_MODELS)";
  auto ref = LoadGguf(StoriesPath());
  auto q = LoadGguf(q8);
  ASSERT_TRUE(ref.ok() && q.ok()) << q.status();
  EXPECT_NE((*ref)->fingerprint(), (*q)->fingerprint());
  const ModelWeights& a = (*ref)->weights();
  const ModelWeights& b = (*q)->weights();
  auto close = [](const TensorView& x, const TensorView& y, bool quantized) {
    ASSERT_EQ(x.shape, y.shape) << x.name;
    EXPECT_EQ(y.dtype, DType::kF32) << y.name;
    const std::vector<float> fx = F32(x), fy = F32(y);
    float worst = 0;
    for (size_t b0 = 0; b0 < fx.size(); b0 += 32) {
      float amax = 0;
      for (size_t i = b0; i < b0 + 32 && i < fx.size(); ++i) amax = std::max(amax, std::fabs(fx[i]));
      for (size_t i = b0; i < b0 + 32 && i < fx.size(); ++i) {
        const float e = std::fabs(fx[i] - fy[i]);
        worst = std::max(worst, e);
        if (quantized) {
          ASSERT_LE(e, amax / 127 * 0.5f * 1.01f + 1e-7f) << x.name << " " << i;
        } else {
          ASSERT_EQ(e, 0.0f) << x.name << " " << i;
        }
      }
    }
    if (quantized) {
      EXPECT_GT(worst, 0.0f) << x.name << " was not quantized";
    }
  };
  close(a.tok_embeddings, b.tok_embeddings, true);
  close(a.final_norm, b.final_norm, false);
  for (size_t i = 0; i < a.layers.size(); ++i) {
    close(a.layers[i].attn_norm, b.layers[i].attn_norm, false);
    close(a.layers[i].wq, b.layers[i].wq, true);
    close(a.layers[i].wk, b.layers[i].wk, true);
    close(a.layers[i].wv, b.layers[i].wv, true);
    close(a.layers[i].wo, b.layers[i].wo, true);
    close(a.layers[i].w_gate, b.layers[i].w_gate, true);
    close(a.layers[i].w_up, b.layers[i].w_up, true);
    close(a.layers[i].w_down, b.layers[i].w_down, false);  // rows of 172: not whole blocks
  }
  LoadOptions bf16;
  bf16.dequantize_to = DType::kBF16;
  auto qb = LoadModel(q8, bf16);
  ASSERT_TRUE(qb.ok()) << qb.status();
  EXPECT_EQ((*qb)->weights().layers[0].wq.dtype, DType::kBF16);
  EXPECT_EQ((*qb)->weights().layers[0].w_down.dtype, DType::kF32);  // stored F32: as is
  const std::vector<float> wq32 = F32(b.layers[0].wq), wq16 = F32((*qb)->weights().layers[0].wq);
  for (size_t i = 0; i < wq32.size(); ++i)
    ASSERT_NEAR(wq16[i], wq32[i], std::fabs(wq32[i]) / 128) << i;
  LoadOptions f16;
  f16.dequantize_to = DType::kF16;
  auto qh = LoadModel(q8, f16);
  ASSERT_TRUE(qh.ok()) << qh.status();
  EXPECT_EQ((*qh)->weights().layers[0].wq.dtype, DType::kF16);
}

TEST(QuantGgufTest, CutQuantizedFileIsAnError) {
  const std::string q8 = ::testing::TempDir() + "/stories260K-q8_0-cut-src.gguf";
  ASSERT_TRUE(QuantizeGgufFile(StoriesPath(), q8, kGgmlQ8_0).ok());
  std::ifstream in(q8, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = ::testing::TempDir() + "/stories260K-q8_0-cut.gguf";
  for (size_t keep : {bytes.size() - 1, bytes.size() - 40, bytes.size() / 2}) {
    std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(keep));
    auto m = LoadGguf(cut);
    ASSERT_FALSE(m.ok()) << keep;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  }
  // Q4_K / Q6_K need rows of 256: stories260K's 64-wide rows stay unquantized, the file loads.
  const std::string q6 = ::testing::TempDir() + "/stories260K-q6_k.gguf";
  ASSERT_TRUE(QuantizeGgufFile(StoriesPath(), q6, kGgmlQ6_K).ok());
  EXPECT_TRUE(LoadGguf(q6).ok());
  EXPECT_EQ(QuantizeGgufFile(StoriesPath(), q6, 3).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sparsex

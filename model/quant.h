// GGML block quantization: the GGUF tensor types Q8_0, Q4_0, Q4_K and Q6_K, dequantized at load
// (model/gguf.cc) into the backend's dtype, and reference quantizers (round to nearest, no
// search) for tests and tools.
//
// Block layouts (ggml's, little-endian; "half" is IEEE fp16):
//   Q8_0  32 values, 34 bytes:  half d; int8 q[32]                      x = d * q
//   Q4_0  32 values, 18 bytes:  half d; u8 qs[16]                      x = d * (nibble - 8);
//         value j < 16 is the low nibble of qs[j], value j + 16 its high nibble
//   Q4_K 256 values, 144 bytes: half d, dmin; u8 scales[12]; u8 qs[128]
//         8 sub-blocks of 32 with 6-bit scale s and min m packed in scales[12];
//         x = d * s * nibble - dmin * m; each 32 bytes of qs hold two sub-blocks (low nibbles
//         the first, high nibbles the second)
//   Q6_K 256 values, 210 bytes: u8 ql[128]; u8 qh[64]; int8 scales[16]; half d
//         16 sub-blocks of 16 with int8 scale; x = d * scale * (q - 32), q a 6-bit value of
//         4 low bits (ql) and 2 high bits (qh)
//
//   std::vector<uint8_t> blocks;
//   RETURN_IF_ERROR(QuantizeGgml(kGgmlQ8_0, x.data(), n, &blocks));
//   RETURN_IF_ERROR(DequantizeGgml(kGgmlQ8_0, blocks.data(), blocks.size(), n, y.data()));
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/status.h"

namespace sparsex {

// GGUF tensor type ids.
inline constexpr uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ8_0 = 8,
                          kGgmlQ4_K = 12, kGgmlQ6_K = 14, kGgmlBF16 = 30;

struct GgmlBlockLayout {
  int64_t values = 0;  // values per block
  size_t bytes = 0;    // bytes per block
};
// The layout of a quantized type this code handles; false for any other type.
bool GgmlQuantLayout(uint32_t ggml_type, GgmlBlockLayout* layout);

// Dequantizes n values from nbytes of blocks at src into out (n floats). INVALID_ARGUMENT when
// the type is not one of the four, n is not a whole number of blocks, or nbytes is not exactly
// the blocks' size; never reads outside [src, src + nbytes).
absl::Status DequantizeGgml(uint32_t ggml_type, const void* src, size_t nbytes, int64_t n,
                            float* out);

// Quantizes n values (a whole number of blocks) into *out (resized), round to nearest.
absl::Status QuantizeGgml(uint32_t ggml_type, const float* x, int64_t n,
                          std::vector<uint8_t>* out);

// IEEE fp16 <-> fp32 (round to nearest even; exact for every half).
float HalfBitsToF32(uint16_t h);
uint16_t F32ToHalfBits(float f);

}  // namespace sparsex

// Quantized weight formats and the value of each element: the one definition the loader, the
// converter, the reference backend, the fast kernels and the tests share.
//
// FP8 block (GLM-5-FP8, DeepSeek-V3/V3.2): data F8_E4M3 [rows, cols], scales F32
//   [ceil(rows / 128), ceil(cols / 128)] (edge blocks partial):
//     w[r, c] = fp8(q[r, c]) * scale[r / 128, c / 128]                      (one float32 multiply)
// Int group (compressed-tensors `pack-quantized`, symmetric, what llm-compressor writes): q in
//   [-2^(b-1), 2^(b-1) - 1] stored as q + 2^(b-1), 32 / b values per little-endian int32 (element
//   c of a row in bits b * (c % (32 / b)) of int32 c / (32 / b); rows padded to whole int32s), so
//   in memory: Q4 two per byte, element 2i in the low nibble of byte i; Q8 one per byte. Scales
//   [rows, cols / group] in BF16, F16 or F32:
//     w[r, c] = round_to(scale dtype, float(q) * float(scale[r, c / group]))
//   which is compressed-tensors' own dequantization (x_q.to(scale.dtype) * scale): the product is
//   exact in float32 for BF16 scales and int4/int8 q, then rounded to the scale's dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/core/dtype.h"

namespace glm5::quant {

constexpr int64_t kFp8Block = 128;  // FP8 scale blocks: 128 x 128
constexpr float kFp8Max = 448.0f;   // largest finite E4M3 (fn) value

inline bool is_quantized(DType t) { return t == DType::F8_E4M3 || t == DType::Q4 || t == DType::Q8; }
inline int bits(DType t) { return t == DType::Q4 ? 4 : 8; }

// Bytes of one stored row of `ld` elements (Q4: ld is even, two elements per byte).
inline size_t row_bytes(DType t, int64_t ld) {
  return t == DType::Q4 ? size_t(ld + 1) / 2 : size_t(ld) * dtype_size(t);
}

// IEEE round to nearest even into F16 and back (finite inputs; overflow gives inf).
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal f16
    // value = a_float; f16 subnormal step 2^-24: round(value * 2^24) with RNE
    float v;
    uint32_t t = a;
    std::memcpy(&v, &t, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t r = a + 0x0fffu + ((a >> 13) & 1u);  // RNE on the 13 dropped mantissa bits
  return uint16_t(sign | ((r - 0x38000000u) >> 13));
}

// The value a float32 takes after a round trip through `t` (BF16, F16; F32 unchanged).
inline float round_to(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}

// An element of a scale array of dtype t, widened exactly.
inline float scale_at(DType t, const void* s, int64_t i) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(s)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(s)[i]);
    default: {
      float v;
      std::memcpy(&v, static_cast<const char*>(s) + 4 * i, 4);
      return v;
    }
  }
}

// q of element c of a stored int row (Q4 or Q8), in [-2^(b-1), 2^(b-1) - 1].
inline int int_at(DType t, const uint8_t* row, int64_t c) {
  if (t == DType::Q8) return int(row[c]) - 128;
  const uint8_t b = row[c / 2];
  return int((c & 1) ? (b >> 4) : (b & 0xf)) - 8;
}

// Int4 in nibble128 order (how WeightLayout::kQuantQuad of ops.h holds int4 rows, so that the fast
// CPU backend's decode kernel takes 16 nibbles per shift and table lookup): each 128-column block of
// a row is 64 bytes in which little-endian 32-bit word l (0..15) holds element 16 t + l in bits
// 4 t .. 4 t + 3 (t = 0..7). Same stored values (q + 8), same bytes per row.
constexpr int64_t kNibbleBlock = 128;
// Byte and bit shift of element c of a nibble128 row.
inline size_t nibble128_byte(int64_t c) {
  const int64_t e = c % kNibbleBlock;
  return size_t(c / kNibbleBlock * (kNibbleBlock / 2) + 4 * (e % 16) + (e / 16) / 2);
}
inline int nibble128_shift(int64_t c) { return 4 * ((c % kNibbleBlock / 16) & 1); }
// One 128-column block (64 bytes) from pack-quantized order into nibble128: word by word, each
// gathering its 8 nibbles (columns l, 16 + l, ..., 112 + l of the block).
inline void repack_nibble128_block(const uint8_t* src, uint8_t* dst) {
  for (int l = 0; l < 16; ++l) {
    uint32_t word = 0;
    for (int t = 0; t < 8; ++t) word |= uint32_t(int_at(DType::Q4, src, 16 * t + l) + 8) << (4 * t);
    std::memcpy(dst + 4 * l, &word, 4);  // little-endian, as the kernels load it
  }
}

// Quantized rows in quads (WeightLayout::kQuantQuad of ops.h): rows in groups of 4, each group
// stored as rb / 64 chunks of 4 rows x 64 bytes (rb: bytes per row, a multiple of 64), so that a
// decode tile of 4 rows reads one sequential stream (from 4 separate rows the hardware prefetchers
// keep up at only ~0.4 of the read bandwidth); int4 rows besides in nibble128 order.
constexpr int64_t kQuadChunk = 64;
// Offset of byte b of row r.
inline size_t quad_byte(int64_t r, int64_t b, size_t rb) {
  return size_t(r / 4) * 4 * rb + size_t(b / kQuadChunk) * 4 * kQuadChunk + size_t(r % 4) * kQuadChunk +
         size_t(b % kQuadChunk);
}
// rows x rb bytes of dtype t (Q4 / Q8 / F8_E4M3, row-major) into quads in dst ((rows + 3) / 4 * 4 * rb
// bytes; the padding rows zero).
inline void repack_quant_quad(DType t, const uint8_t* src, uint8_t* dst, int64_t rows, size_t rb) {
  const int64_t padded = (rows + 3) / 4 * 4;  // (rb % 64 == 0: the caller's check)
  for (int64_t r = 0; r < padded; ++r)
    for (size_t b = 0; b < rb; b += kQuadChunk) {
      uint8_t* out = dst + quad_byte(r, int64_t(b), rb);
      if (r >= rows)
        std::memset(out, 0, kQuadChunk);
      else if (t == DType::Q4)
        repack_nibble128_block(src + size_t(r) * rb + b, out);
      else
        std::memcpy(out, src + size_t(r) * rb + b, kQuadChunk);
    }
}

// Float32 -> E4M3 (fn), round to nearest even, saturating at +-448 (the converter's encoding).
// Normal results round the float's mantissa to 3 bits in integer arithmetic (the carry moves into
// the exponent by itself); below 2^-6 the result is a subnormal m / 8 * 2^-6 = m * 2^-9.
inline uint8_t f32_to_fp8_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;                   // NaN
  if (a >= 0x43e00000u) return uint8_t(sign | 0x7e);  // >= 448 (and inf): saturate
  if (a < 0x3c800000u) {                              // < 2^-6: subnormal or zero
    float v;
    std::memcpy(&v, &a, 4);
    return uint8_t(sign | int(std::nearbyint(v * 512.0f)));  // 0..8 (8: the smallest normal)
  }
  a += 0x7ffffu + ((a >> 20) & 1u);                        // round to nearest even on the 20 dropped bits
  const uint32_t e = (a >> 23) - 120, m = (a >> 20) & 7u;  // E4M3 exponent field, mantissa
  if (e > 15 || (e == 15 && m == 7)) return uint8_t(sign | 0x7e);
  return uint8_t(sign | (e << 3) | m);
}

}  // namespace glm5::quant

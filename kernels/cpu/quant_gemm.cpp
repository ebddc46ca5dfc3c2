// The fast CPU gemm for quantized weights (F8_E4M3 block-scaled, pack-quantized int4 / int8;
// element values in core/quant.h). Each work item dequantizes a block of W rows into a float32
// panel that stays in L2 (exactly the values weight_at() gives) and runs the float32 register
// tile of cpu/dot_tile.h over it, so an output element is the same dot_tile recipe over the same
// float32 weights whatever m, the block or the thread count: quantized results are bitwise those
// of the checkpoint dequantized to F32, and batch-invariant. Dequantization is the only new
// inner loop; it has an AVX-512 version and a portable one, chosen at run time from cpuid. Both
// read row-major weights and the quads of rows CpuBackend holds them in (kQuantQuad, ops.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "kernels/cpu/dot_tile.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/panel_block.h"

#if defined(__x86_64__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace glm5::kernels::cpu::fast {

namespace {

// Float32 panel bytes per work item (the W block, dequantized): kept in L2 while x streams past.
constexpr int64_t kPanelBytes = 192 * 1024;

// ---- portable dequantization: row r into out[0, cols) ----------------------------------------

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_e4m3_to_f32(uint8_t(i));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// (Element codes through quant_code, which knows both layouts: the portable path is for checking
// and for CPUs without AVX-512, not for speed.)
void dequant_row_portable(const Weight& w, int64_t r, float* out) {
  const int64_t srow = (r / w.scale_block_rows) * w.scale_ld;
  for (int64_t c0 = 0; c0 < w.cols; c0 += w.group) {
    const float s = quant::scale_at(w.scale_dtype, w.scale, srow + c0 / w.group);
    const int64_t c1 = std::min(w.cols, c0 + w.group);
    if (w.dtype == DType::F8_E4M3) {
      const float* t = fp8_table().v;
      for (int64_t c = c0; c < c1; ++c) out[c] = t[quant_code(w, r, c)] * s;
    } else if (w.dtype == DType::Q4) {  // the group's 16 values, by stored nibble q + 8
      float table[16];
      for (int u = 0; u < 16; ++u) table[u] = quant::round_to(w.scale_dtype, float(u - 8) * s);
      for (int64_t c = c0; c < c1; ++c) out[c] = table[quant_code(w, r, c)];
    } else {
      for (int64_t c = c0; c < c1; ++c) out[c] = quant::round_to(w.scale_dtype, float(quant_code(w, r, c) - 128) * s);
    }
  }
}

// ---- AVX-512 dequantization ---------------------------------------------------------------------

#if defined(__x86_64__)
#define GLM5_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))

GLM5_AVX512 inline __m512 round_to_avx512(DType t, __m512 v) {
  if (t == DType::BF16) {  // round to nearest even on the 16 dropped bits (finite values)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }
  if (t == DType::F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return v;
}

// 16 E4M3 bytes -> float32 times 2^-120, exactly: the code's 7 magnitude bits shifted into place
// (exponent field e, mantissa m) are the float 2^(e - 127) (1 + m / 8), or m 2^-129 for e = 0 (a
// float32 denormal), i.e. the E4M3 value times 2^-120 in both cases; so one multiply by
// scale * 2^120 gives fp8 * scale with the one rounding of weight_at. NaN codes give NaN.
constexpr float kTwo120 = 1.329227995784916e+36f;  // 2^120
GLM5_AVX512 inline __m512 fp8x16_biased(const uint8_t* p) {
  __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i mag = _mm512_and_si512(_mm512_slli_epi32(x, 20), _mm512_set1_epi32(0x07f00000));
  __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(x, 7), 31);
  __m512 v = _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7f));
  return _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(__builtin_nanf("")));
}

// fp8 * s for 16 codes: s * 2^120 as one factor unless that overflows (s >= 2^8), then two steps
// (the first exact).
struct Fp8Scale {
  __m512 f;
  bool two_steps;
  GLM5_AVX512 explicit Fp8Scale(float s) {
    const float pre = s * kTwo120;
    two_steps = !std::isfinite(pre) && std::isfinite(s);
    f = _mm512_set1_ps(two_steps ? s : pre);
  }
  GLM5_AVX512 __m512 apply(__m512 biased) const {
    if (two_steps) biased = _mm512_mul_ps(biased, _mm512_set1_ps(kTwo120));
    return _mm512_mul_ps(biased, f);
  }
};

GLM5_AVX512 inline __m512 q8x16(const uint8_t* p) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(128)));
}

// v rounded to BF16 (8 significant bits, nearest even) in three operations, Veltkamp's split:
// c = v (2^16 + 1), hi = c - (c - v). For v = q s with q an int8 or int4 and s a BF16 scale, hi
// equals round_to_avx512(BF16, v) (five operations) for every q and every BF16 mantissa, ties
// included (the tests run all of them), as long as c neither overflows nor leaves the normal range:
// scales s with split_safe(s). Other groups take the bit trick. Each of the three operations must
// round on its own: this file is compiled with -ffp-contract=off (kernels/CMakeLists.txt; GCC
// treats these intrinsics as plain vector arithmetic, which it would otherwise fuse into FMAs).
constexpr float kSplitBf16 = 65537.0f;  // 2^16 + 1
inline bool split_safe(float s) {
  const float a = std::fabs(s);
  return a >= 0x1p-100f && a <= 0x1p100f;
}
GLM5_AVX512 inline __m512 bf16_round_split(__m512 v) {
  const __m512 c = _mm512_mul_ps(v, _mm512_set1_ps(kSplitBf16));
  return _mm512_sub_ps(c, _mm512_sub_ps(c, v));
}

// How int8 values with BF16 scales become floats in the fused tiles, all three the same floats:
// kPairs (AVX512-BF16 + VBMI builds: vpermb and vcvtne2ps2bf16 for 32 values), kSplit (one FMA and
// Veltkamp's split per 16), kBits (a multiply and the bit-trick rounding per 16). Which is fastest
// depends on the CPU class: the pairs were measured faster on Zen 4, and an int8 decode with BF16
// scales ran at a quarter of its bandwidth bound on Zen 5 while F32 scales reached 90 %. So each
// process times the three on a block in cache the first time such a gemm runs (q8_sequence(),
// ~2 ms), unless GLM5_CPU_Q8_BF16 = pairs | split | bits names one (tests run every one).
enum class Q8Sequence { kPairs, kSplit, kBits };
Q8Sequence q8_sequence();

// Int4: for the 16 elements at byte p (8 bytes, element 2i in the low nibble of byte i), dword l
// of the result holds element l's nibble in its bits 0-3 (higher bits are not cleared: vpermps,
// which reads these as table indices, looks at bits 0-3 only). The 8 bytes are broadcast to every
// qword; with AVX512-VBMI (a build for such a CPU) one multishift takes bits 4l.. of the qword into
// the low byte of dword l; otherwise vpshufb copies byte l / 2 there (within each 128-bit lane)
// and a shift by 4 on odd l brings the high nibble down.
GLM5_AVX512 inline __m512i q4x16_nibbles(const uint8_t* p) {
  uint64_t b;
  std::memcpy(&b, p, 8);
  const __m512i bytes = _mm512_set1_epi64(int64_t(b));
#if defined(__AVX512VBMI__)
  const __m512i at = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
  return _mm512_multishift_epi64_epi8(at, bytes);
#else
  alignas(64) static constexpr int8_t kSpread[64] = {0, -1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1, -1,
                                                     2, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 3, -1, -1, -1,
                                                     4, -1, -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, 5, -1, -1, -1,
                                                     6, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1, 7, -1, -1, -1};
  const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  return _mm512_srlv_epi32(_mm512_shuffle_epi8(bytes, _mm512_load_si512(kSpread)), shift);
#endif
}

// Per group state and one chunk of 16 dequantized values, for weight dtype DT and scale dtype SD.
// at<true> only for groups whose scale passes fast_scale (split_safe, and for Q8 positive; the
// fused tiles take it when every group of a block of groups does): the shorter sequences, with the
// same floats. Q8's (u - 128) s is one FMA u s + (-128 s), exact (a product of at most 8 x 24 bits
// rounded once, as float(q) * s is; q = 0 gives +0, as 0 * s does for s > 0 only), and the BF16
// rounding is Veltkamp's split.
template <DType DT, DType SD>
struct Chunk {
  __m512 t;           // Q4: the group's 16 values by stored nibble; Q8: the scale
  __m512 bias;        // Q8: -128 * scale
  __m512 bias_magic;  // Q8: -(2^23 + 128) * scale (at32)
  Fp8Scale fs{1.0f};
  static constexpr int64_t kHalve = DT == DType::Q4 ? 2 : 1;  // code bytes per column: 1 / kHalve
  // Whether a group with scale s may take at<true>.
  static bool fast_scale(float s) { return DT == DType::F8_E4M3 || (split_safe(s) && (DT == DType::Q4 || s > 0)); }
  // fast: whether the fast sequences may run (fast_scale(s); the fused tiles pass the AND over a
  // whole block of groups, which may be false for a scale that alone would pass).
  GLM5_AVX512 void group(float s, bool fast) {
    if constexpr (DT == DType::Q4) {
      const __m512 v =
          _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_ps(s));
      t = SD == DType::BF16 && fast ? bf16_round_split(v) : round_to_avx512(SD, v);
    } else if constexpr (DT == DType::F8_E4M3) {
      fs = Fp8Scale(s);
    } else {
      t = _mm512_set1_ps(s);
      bias = _mm512_set1_ps(-128.0f * s);
      if constexpr (SD == DType::BF16) bias_magic = _mm512_set1_ps(-8388736.0f * s);
    }
  }
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  // Q8 with BF16 scales in a fast group (a build for a CPU with AVX512-BF16 and VBMI): the 32
  // values whose codes start at p, columns 0-15 into lo and 16-31 into hi, rounded to BF16 two
  // vectors at a time by one vcvtne2ps2bf16 (round to nearest even, as round_to: the fast groups'
  // values are normal or zero) instead of Veltkamp's three operations per vector, the same floats.
  // vpermb puts the code of column l / 2 (l even) or 16 + l / 2 (l odd) in dword l of b, and
  // those of 8 + l / 2 and 24 + l / 2 in a, so that dword l of the packed pairs (words 0-15 from
  // b, 16-31 from a) holds columns l and 16 + l: lo is it shifted up, hi its high half.
  // The codes are loaded into bytes 0-31 of a register whose byte 32 is 0 and byte 33 is 0x4b, so
  // that vpermb makes each dword (code u, 0, 0, 0x4b): the float 2^23 + u, with no conversion.
  // Then (2^23 + u) s - (2^23 + 128) s is one FMA and exact: the product is exact inside it, the
  // constant has 17 x 8 significant bits (< 2^24), and the result (u - 128) s is at most 8 x 8.
  // (Zen 4, 2 threads, in L2: 25.6 -> 27.2 GB/s of int8 weights; a two-source vpermt2b instead
  // of the masked load was 5 % slower than the conversion it saves.)
  static constexpr bool kPairs = DT == DType::Q8 && SD == DType::BF16;
  GLM5_AVX512 void at32(const uint8_t* p, __m512& lo, __m512& hi) const {
#define GLM5_DW(c) c, 32, 32, 33
    alignas(64) static constexpr int8_t kB[64] = {
        GLM5_DW(0), GLM5_DW(16), GLM5_DW(1), GLM5_DW(17), GLM5_DW(2), GLM5_DW(18), GLM5_DW(3), GLM5_DW(19),
        GLM5_DW(4), GLM5_DW(20), GLM5_DW(5), GLM5_DW(21), GLM5_DW(6), GLM5_DW(22), GLM5_DW(7), GLM5_DW(23)};
    alignas(64) static constexpr int8_t kA[64] = {
        GLM5_DW(8),  GLM5_DW(24), GLM5_DW(9),  GLM5_DW(25), GLM5_DW(10), GLM5_DW(26), GLM5_DW(11), GLM5_DW(27),
        GLM5_DW(12), GLM5_DW(28), GLM5_DW(13), GLM5_DW(29), GLM5_DW(14), GLM5_DW(30), GLM5_DW(15), GLM5_DW(31)};
#undef GLM5_DW
    const __m512i consts = _mm512_set_epi64(0, 0, 0, 0x4b00, 0, 0, 0, 0);  // byte 32 = 0, byte 33 = 0x4b
    const __m512i raw = _mm512_mask_loadu_epi8(consts, 0xFFFFFFFFull, p);
    const __m512 b =
        _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_permutexvar_epi8(_mm512_load_si512(kB), raw)), t, bias_magic);
    const __m512 a =
        _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_permutexvar_epi8(_mm512_load_si512(kA), raw)), t, bias_magic);
    const __m512i z = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(a, b));  // words 0-15 from b, 16-31 from a
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(z, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(z, _mm512_set1_epi32(int(0xffff0000u))));
  }
#else
  static constexpr bool kPairs = false;
  GLM5_AVX512 void at32(const uint8_t*, __m512&, __m512&) const {}
#endif
  // The 16 values whose codes start at p (Q4 row-major: 8 bytes; Q8, FP8: 16).
  template <bool kFast>
  GLM5_AVX512 __m512 at(const uint8_t* p) const {
    if constexpr (DT == DType::Q4) {
      return _mm512_permutexvar_ps(q4x16_nibbles(p), t);
    } else if constexpr (DT == DType::Q8) {
      if constexpr (!kFast) return round_to_avx512(SD, _mm512_mul_ps(q8x16(p), t));
      const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), t, bias);
      return SD == DType::BF16 ? bf16_round_split(v) : round_to_avx512(SD, v);
    } else {
      return fs.apply(fp8x16_biased(p));
    }
  }
};

// Byte b of a stored row: row-major (base = the row), or in a quad of rows (kQuantQuad: base = the
// quad's first byte + 64 x the row's place in it; chunks of 4 rows x 64 bytes).
template <bool kQuad>
struct RowBytes {
  const uint8_t* base;
  const uint8_t* operator()(int64_t b) const {
    if constexpr (kQuad) return base + quant::quad_byte(0, b, 0);  // (row 0's offsets: rb unused)
    return base + b;
  }
};
template <bool kQuad>
RowBytes<kQuad> row_bytes_of(const Weight& w, int64_t r) {
  const size_t rb = quant::row_bytes(w.dtype, w.ld);
  const auto* d = static_cast<const uint8_t*>(w.data);
  if constexpr (kQuad) return {d + quant::quad_byte(r, 0, rb)};
  return {d + size_t(r) * rb};
}

// Int4 in nibble128 order: chunk t (0..7) of the 128-column block whose 64 bytes are d is the
// table at the nibbles in bits 4t.. of each dword (vpermps reads bits 0-3 only).
GLM5_AVX512 inline __m512 q4_nibble128_chunk(__m512i d, int t, __m512 table) {
  return _mm512_permutexvar_ps(t ? _mm512_srli_epi32(d, unsigned(4 * t)) : d, table);
}

// Row r of w dequantized into out[0, w.cols). Groups are whole multiples of 16 columns here
// (checked by the caller); a ragged last chunk of a row (cols % 16) takes weight_at. kQuad:
// kQuantQuad (Q4 then in nibble128 order, groups and cols whole 128-column blocks).
template <DType DT, DType SD, bool kQuad = false>
GLM5_AVX512 void dequant_row_t(const Weight& w, int64_t r, float* out) {
  const RowBytes<kQuad> row = row_bytes_of<kQuad>(w, r);
  const int64_t srow = (r / w.scale_block_rows) * w.scale_ld;
  const int64_t full = w.cols / 16 * 16;
  for (int64_t c0 = 0, gi = 0; c0 < full; c0 += w.group, ++gi) {
    Chunk<DT, SD> ch;
    const float s = quant::scale_at(SD, w.scale, srow + gi);
    const bool fast = ch.fast_scale(s);
    ch.group(s, fast);
    const int64_t c1 = std::min(full, c0 + w.group);
    constexpr int64_t kHalve = Chunk<DT, SD>::kHalve;
    if constexpr (DT == DType::Q4 && kQuad) {
      for (int64_t c = c0; c < c1; c += quant::kNibbleBlock) {
        const __m512i d = _mm512_loadu_si512(row(c / 2));
        for (int t = 0; t < 8; ++t) _mm512_storeu_ps(out + c + 16 * t, q4_nibble128_chunk(d, t, ch.t));
      }
    } else if (fast) {
      for (int64_t c = c0; c < c1; c += 16) _mm512_storeu_ps(out + c, ch.template at<true>(row(c / kHalve)));
    } else {
      for (int64_t c = c0; c < c1; c += 16) _mm512_storeu_ps(out + c, ch.template at<false>(row(c / kHalve)));
    }
  }
  for (int64_t c = full; c < w.cols; ++c) out[c] = weight_at(w, r, c);
}

// f.template operator()<DT, SD>() for w's weight dtype DT (Q4, Q8, else F8_E4M3) and scale dtype SD
// (BF16, F16, else F32): how each kernel picks its instance for a weight.
template <class F>
auto for_format(const Weight& w, F f) {
  const auto scale = [&]<DType DT>() {
    if (w.scale_dtype == DType::BF16) return f.template operator()<DT, DType::BF16>();
    if (w.scale_dtype == DType::F16) return f.template operator()<DT, DType::F16>();
    return f.template operator()<DT, DType::F32>();
  };
  if (w.dtype == DType::Q4) return scale.template operator()<DType::Q4>();
  if (w.dtype == DType::Q8) return scale.template operator()<DType::Q8>();
  return scale.template operator()<DType::F8_E4M3>();
}

using DequantRowFn = void (*)(const Weight&, int64_t, float*);

DequantRowFn dequant_row_avx512(const Weight& w) {
  const bool quad = w.layout == WeightLayout::kQuantQuad;
  return for_format(w, [quad]<DType DT, DType SD>() -> DequantRowFn {
    return quad ? dequant_row_t<DT, SD, true> : dequant_row_t<DT, SD, false>;
  });
}
#endif

#if defined(__AVX512F__)
// ---- AVX-512 small-m gemm: W rows dequantized in registers, no panel ----------------------------
// For m <= 4 (decode) a panel costs as much as the dot products: here each 16-column chunk of up to
// four W rows is dequantized into registers and multiplied straight into the accumulators. The
// recipe is dot_tile's exactly (lane l sums x[16q + l] * w[16q + l] by FMA in q order, then the
// simd::reduce tree), over the same float weights, so the bytes equal the panel path's.

// The next tile's bytes of code bytes [b0, b1) of each row, prefetched while this tile runs (its
// rows are short, a few KiB: too short for the hardware prefetcher to ramp up). Row-major: the
// next NR rows, rb bytes apart; quads: one stretch, 4 rows x 64 bytes per chunk. Only where
// tile_prefetches (cpu/dot_tile.h).
template <int MR, int NR, bool kQuad>
GLM5_AVX512 __attribute__((always_inline)) inline void prefetch_next(const uint8_t* next, size_t rb, int64_t b0,
                                                                     int64_t b1) {
  constexpr int64_t C = quant::kQuadChunk;
  if (!tile_prefetches<MR>()) return;
  if constexpr (kQuad) {
    for (int64_t b = (b0 + C - 1) / C * 4 * C; b < (b1 + C - 1) / C * 4 * C; b += 64)  // (chunks from b0's next)
      _mm_prefetch(reinterpret_cast<const char*>(next + b), _MM_HINT_T0);
  } else {
    for (int64_t b = (b0 + 63) / 64 * 64; b < b1; b += 64)
      for (int c = 0; c < NR; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * rb + b), _MM_HINT_T0);
  }
}

// Columns [k0, k1) of one group of the tile's NR rows (their Chunk states ch) into acc. `pairs`:
// Q8's pairs sequence may run (q8_sequence()).
template <int MR, int NR, bool kFast, bool kQuad, DType DT, DType SD>
GLM5_AVX512 __attribute__((always_inline)) inline void fused_group(const Chunk<DT, SD>* ch, const RowBytes<kQuad>* rows,
                                                                   const uint8_t* next, size_t rb, const float* x,
                                                                   int64_t ldx, int64_t k0, int64_t k1,
                                                                   __m512 (&acc)[MR][4], bool pairs, bool round) {
  constexpr int64_t kHalve = Chunk<DT, SD>::kHalve;
  prefetch_next<MR, NR, kQuad>(next, rb, k0 / kHalve, k1 / kHalve);
  if constexpr (kFast && Chunk<DT, SD>::kPairs && MR <= 2) {  // (more rows of x would not fit the registers)
    if (pairs && (k1 - k0) % 32 == 0) {  // (k0 a multiple of 32 too: 32 code bytes never straddle a quad chunk)
      for (int64_t k = k0; k < k1; k += 32) {
        __m512 x0[MR], x1[MR];
        for (int r = 0; r < MR; ++r)
          x0[r] = _mm512_loadu_ps(x + r * ldx + k), x1[r] = _mm512_loadu_ps(x + r * ldx + k + 16);
        for (int c = 0; c < NR; ++c) {
          __m512 lo, hi;
          ch[c].at32(rows[c](k), lo, hi);
          for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(x1[r], hi, _mm512_fmadd_ps(x0[r], lo, acc[r][c]));
        }
      }
      return;
    }
  }
  for (int64_t k = k0; k < k1; k += 16) {
    __m512 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      __m512 wv = ch[c].template at<kFast>(rows[c](k / kHalve));
      if (round) wv = round_to_avx512(DType::BF16, wv);  // (precision fast: values not bf16 already)
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
}

// fused_group for Q4 in quads (nibble128 order): per 128-column block one 64-byte load per row,
// then per 16 columns one shift, one table lookup and the FMA (the row-major order takes a
// broadcast and a byte shuffle for the nibbles of each 16 columns: ~30 % more time per weight on
// Zen 4). The columns, lanes and FMA order are those of fused_group.
template <int MR, int NR, DType SD>
GLM5_AVX512 __attribute__((always_inline)) inline void fused_group_nib(const Chunk<DType::Q4, SD>* ch,
                                                                       const RowBytes<true>* rows, const uint8_t* next,
                                                                       size_t rb, const float* x, int64_t ldx,
                                                                       int64_t k0, int64_t k1, __m512 (&acc)[MR][4]) {
  prefetch_next<MR, NR, true>(next, rb, k0 / 2, k1 / 2);
  for (int64_t k = k0; k < k1; k += quant::kNibbleBlock) {
    __m512i d[NR];
    for (int c = 0; c < NR; ++c) d[c] = _mm512_loadu_si512(rows[c](k / 2));
    for (int t = 0; t < 8; ++t) {
      __m512 xv[MR];
      for (int r = 0; r < MR; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k + 16 * t);
      for (int c = 0; c < NR; ++c) {
        const __m512 wv = q4_nibble128_chunk(d[c], t, ch[c].t);
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
      }
    }
  }
}

// The scales of groups [gb, gb + ng) of the tile's rows (scale offsets srow) as float32 into sc, and
// whether every one of them allows Chunk's fast sequences: done once per block of groups rather
// than once per group and row (an int4 group is only 64 bytes of a row). BF16 16 at a time.
constexpr int64_t kScaleBlock = 32;
template <DType DT, DType SD, int NR>
GLM5_AVX512 bool block_scales(const void* scale, const int64_t* srow, int64_t gb, int ng,
                              float (&sc)[NR][kScaleBlock]) {
  if constexpr (SD == DType::BF16 && DT != DType::F8_E4M3) {
    __mmask16 ok = 0xffff;
    for (int c = 0; c < NR; ++c)
      for (int i = 0; i < ng; i += 16) {
        const __mmask16 lanes = __mmask16((1u << std::min(16, ng - i)) - 1);
        const __m256i b = _mm256_maskz_loadu_epi16(lanes, static_cast<const uint16_t*>(scale) + srow[c] + gb + i);
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        _mm512_store_ps(sc[c] + i, v);
        const __m512 a = _mm512_abs_ps(v);
        __mmask16 good = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p100f), _CMP_LE_OQ);
        if constexpr (DT == DType::Q8) good &= _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
        ok &= __mmask16(good | ~lanes);
      }
    return ok == 0xffff;
  } else {
    bool ok = true;
    for (int c = 0; c < NR; ++c)
      for (int i = 0; i < ng; ++i) {
        sc[c][i] = quant::scale_at(SD, scale, srow[c] + gb + i);
        ok = ok && Chunk<DT, SD>::fast_scale(sc[c][i]);
      }
    return ok;
  }
}

// y[r, j] (+)= x[r, :] . W[j, :] for r < MR, j in [j0, j0 + NR), NR <= 4; k % 16 == 0, group % 16 == 0
// (kQuad: kQuantQuad, j0 % 4 == 0; int4 then has k and group multiples of 128).
template <int MR, int NR, DType DT, DType SD, bool kQuad>
GLM5_AVX512 void fused_tile(const float* x, int64_t ldx, const Weight& w, int64_t j0, float* y, int64_t ldy,
                            bool accumulate, bool round) {
  const size_t rb = quant::row_bytes(DT, w.ld);
  RowBytes<kQuad> rows[NR];
  int64_t srow[NR];
  for (int c = 0; c < NR; ++c) {
    rows[c] = row_bytes_of<kQuad>(w, j0 + c);
    srow[c] = ((j0 + c) / w.scale_block_rows) * w.scale_ld;
  }
  const uint8_t* next = static_cast<const uint8_t*>(w.data) + size_t(j0 + 4) * rb;  // the following tile
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  alignas(64) float sc[NR][kScaleBlock];
  const int64_t groups = (w.cols + w.group - 1) / w.group;
  // Int8 with BF16 scales: the sequence this CPU runs fastest (the same floats either way).
  const Q8Sequence seq = DT == DType::Q8 && SD == DType::BF16 ? q8_sequence() : Q8Sequence::kPairs;
  for (int64_t gb = 0; gb < groups; gb += kScaleBlock) {
    const int ng = int(std::min(kScaleBlock, groups - gb));
    const bool fast = block_scales<DT, SD, NR>(w.scale, srow, gb, ng, sc) && seq != Q8Sequence::kBits;
    for (int gi = 0; gi < ng; ++gi) {
      Chunk<DT, SD> ch[NR];
      for (int c = 0; c < NR; ++c) {
        ch[c].group(sc[c][gi], fast);
        if constexpr (DT == DType::Q4)  // (the group's 16 values: rounded once here)
          if (round) ch[c].t = round_to_avx512(DType::BF16, ch[c].t);
      }
      const int64_t g0 = (gb + gi) * w.group, g1 = std::min(w.cols, g0 + w.group);  // FP8's last block may be partial
      if constexpr (DT == DType::Q4 && kQuad)
        fused_group_nib<MR, NR>(ch, rows, next, rb, x, ldx, g0, g1, acc);
      else if (fast)
        fused_group<MR, NR, true, kQuad>(ch, rows, next, rb, x, ldx, g0, g1, acc, seq == Q8Sequence::kPairs,
                                         round && DT != DType::Q4);
      else
        fused_group<MR, NR, false, kQuad>(ch, rows, next, rb, x, ldx, g0, g1, acc, false, round && DT != DType::Q4);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      float* o = y + r * ldy + j0 + c;
      const float v = simd::reduce(acc[r][c]);
      *o = accumulate ? *o + v : v;
    }
}

template <int MR, DType DT, DType SD, bool kQuad>
GLM5_AVX512 void fused_tile_nr(const GemmParams& p, int64_t j, int nr, bool round) {
  switch (nr) {
    case 4: fused_tile<MR, 4, DT, SD, kQuad>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate, round); break;
    case 3: fused_tile<MR, 3, DT, SD, kQuad>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate, round); break;
    case 2: fused_tile<MR, 2, DT, SD, kQuad>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate, round); break;
    default: fused_tile<MR, 1, DT, SD, kQuad>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate, round); break;
  }
}

// round: precision fast for a format whose values are not bf16 already (QuantSplit::round).
template <DType DT, DType SD, bool kQuad = false>
GLM5_AVX512 void fused_rows(const GemmParams& p, int64_t j0, int64_t j1, bool round) {
  for (int64_t j = j0; j < j1; j += 4) {
    const int nr = int(std::min<int64_t>(4, j1 - j));
    switch (p.m) {
      case 1: fused_tile_nr<1, DT, SD, kQuad>(p, j, nr, round); break;
      case 2: fused_tile_nr<2, DT, SD, kQuad>(p, j, nr, round); break;
      case 3: fused_tile_nr<3, DT, SD, kQuad>(p, j, nr, round); break;
      default: fused_tile_nr<4, DT, SD, kQuad>(p, j, nr, round); break;
    }
  }
}

using FusedFn = void (*)(const GemmParams&, int64_t, int64_t, bool);

FusedFn fused_fn(const Weight& w) {
  const bool quad = w.layout == WeightLayout::kQuantQuad;
  return for_format(w, [quad]<DType DT, DType SD>() -> FusedFn {
    return quad ? fused_rows<DT, SD, true> : fused_rows<DT, SD, false>;
  });
}

std::atomic<int> g_q8_sequence{-1};  // a Q8Sequence once decided
thread_local int t_q8_timing = -1;   // the candidate the deciding thread is timing

Q8Sequence q8_sequence() {
  if (t_q8_timing >= 0) return Q8Sequence(t_q8_timing);
  const int v = g_q8_sequence.load(std::memory_order_relaxed);
  return v < 0 ? Q8Sequence::kPairs : Q8Sequence(v);
}

// Seconds of the fused decode tile over 64 rows x 4096 int8 values with BF16 scales (256 KiB of
// codes, in L2: the sequences' own cost, not the memory's) in sequence `q`: best of 5.
double time_q8_sequence(Q8Sequence q, const GemmParams& p) {
  t_q8_timing = int(q);  // (this thread only: the choice is published once made)
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 4; ++rep) fused_rows<DType::Q8, DType::BF16>(p, 0, p.n, false);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Decides q8_sequence() once, on the thread that plans the first such gemm (before its items run).
void decide_q8_sequence() {
  if (g_q8_sequence.load(std::memory_order_acquire) >= 0) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_q8_sequence.load(std::memory_order_relaxed) >= 0) return;
  const char* e = std::getenv("GLM5_CPU_Q8_BF16");
  const std::string v = e ? e : "";
  const bool pairs_built = Chunk<DType::Q8, DType::BF16>::kPairs;
  if (v == "pairs" || v == "split" || v == "bits") {
    if (v == "pairs" && !pairs_built)
      std::fprintf(stderr, "glm5: GLM5_CPU_Q8_BF16=pairs needs a build for AVX512-BF16 + VBMI: split instead\n");
    g_q8_sequence.store(int(v == "bits"                    ? Q8Sequence::kBits
                            : v == "split" || !pairs_built ? Q8Sequence::kSplit
                                                           : Q8Sequence::kPairs));
    return;
  }
  if (!v.empty() && v != "auto")
    std::fprintf(stderr, "glm5: GLM5_CPU_Q8_BF16=%s ignored (expected pairs, split, bits or auto)\n", v.c_str());
  const int64_t n = 64, k = 4096, group = 128;
  std::vector<uint8_t> codes(size_t(n * k));
  std::vector<uint16_t> scales(size_t(n * (k / group)));
  std::vector<float> x(size_t(k), 0.5f), y(static_cast<size_t>(n), 0.0f);
  std::mt19937 rng(1);
  for (uint8_t& c : codes) c = uint8_t(rng());
  for (uint16_t& sc : scales) sc = f32_to_bf16(0.01f * float(1 + rng() % 16));
  GemmParams p;
  p.x = x.data(), p.ldx = k, p.y = y.data(), p.ldy = n, p.m = 1, p.n = n, p.k = k;
  p.w = Weight{codes.data(), DType::Q8, n, k, k, scales.data(), DType::BF16, k / group, group, 1};
  Q8Sequence best = Q8Sequence::kSplit;
  double best_s = time_q8_sequence(Q8Sequence::kSplit, p);
  for (Q8Sequence q : {Q8Sequence::kPairs, Q8Sequence::kBits}) {
    if (q == Q8Sequence::kPairs && !pairs_built) continue;
    const double t = time_q8_sequence(q, p);
    if (t < best_s) best = q, best_s = t;
  }
  t_q8_timing = -1;
  g_q8_sequence.store(int(best), std::memory_order_release);
}
#endif

bool cpu_has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// Which dequantization path runs: the best the CPU has, unless GLM5_CPU_KERNELS=portable or a
// test forces one.
std::atomic<int> g_forced{-1};  // -1 auto, 0 portable, 1 avx512

bool use_avx512() {
  static const bool has = cpu_has_avx512();
  static const bool env_portable = [] {
    const char* e = std::getenv("GLM5_CPU_KERNELS");
    const std::string v = e ? e : "";
    if (!v.empty() && v != "portable" && v != "auto")
      std::fprintf(stderr, "glm5: GLM5_CPU_KERNELS=%s ignored (expected portable or auto)\n", v.c_str());
    return v == "portable";
  }();
  const int f = g_forced.load(std::memory_order_relaxed);
  if (f >= 0) return f == 1 && has;
  return has && !env_portable;
}

}  // namespace

std::string q8_bf16_sequence() {
#if defined(__AVX512F__)
  decide_q8_sequence();
  switch (q8_sequence()) {
    case Q8Sequence::kPairs: return "pairs";
    case Q8Sequence::kSplit: return "split";
    case Q8Sequence::kBits: return "bits";
  }
#endif
  return "none";
}

std::vector<std::string> quant_paths() {
  std::vector<std::string> p{"portable"};
  if (cpu_has_avx512()) p.push_back("avx512");
  return p;
}

void set_quant_path(const std::string& path) {
  CHECK(path == "auto" || path == "portable" || path == "avx512", "set_quant_path: unknown path '", path, "'");
  CHECK(path != "avx512" || cpu_has_avx512(), "set_quant_path: this CPU has no AVX-512");
  g_forced.store(path == "auto" ? -1 : path == "avx512" ? 1 : 0);
}

std::string quant_path() { return use_avx512() ? "avx512" : "portable"; }

void dequantize_rows(const Weight& w, int64_t r0, int64_t n, float* out, int64_t ldo) {
#if defined(__x86_64__)
  if (use_avx512() && w.group % 16 == 0) {
    const DequantRowFn row = dequant_row_avx512(w);
    for (int64_t i = 0; i < n; ++i) row(w, r0 + i, out + i * ldo);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dequant_row_portable(w, r0 + i, out + i * ldo);
}

// y = x W^T for a quantized W [n, k] cut into work items of W rows (cpu/gemm.cpp runs them):
// on AVX-512 builds, decode-sized calls dequantize in registers (fused_tile, 16 rows per item).
// Only where the register tile itself is the AVX-512 one (a build for AVX-512): its FMA is fused
// and the portable tile's (a * b + c) need not be, so mixing the two would make a row's bits
// depend on m. Otherwise each item dequantizes a block of rows once into a float32 panel.
QuantSplit quant_split(const GemmParams& p, bool round) {
  QuantSplit s;
  s.round = round;
#if defined(__AVX512F__)
  if (p.m <= 4 && use_avx512() && p.k % 16 == 0 && p.w.group % 16 == 0 && p.w.cols == p.k) {
    if (p.w.dtype == DType::Q8 && p.w.scale_dtype == DType::BF16) decide_q8_sequence();
    s.fused = true;
    s.rows_per_item = 16;
    s.items = (p.n + s.rows_per_item - 1) / s.rows_per_item;
    return s;
  }
#endif
  int64_t nb = kPanelBytes / (4 * std::max<int64_t>(p.k, 1));
  // (prefill runs panel_block over the panel, whose accumulators take 64 bytes per output: at most
  // kPanelCols W rows keep them in L2)
  s.rows_per_item = std::clamp<int64_t>(nb / kTileCols * kTileCols, kTileCols, p.m >= kPanelMinRows ? kPanelCols : 256);
  s.items = (p.n + s.rows_per_item - 1) / s.rows_per_item;
  return s;
}

void quant_item(const GemmParams& p, const QuantSplit& s, int64_t item) {
  const int64_t j0 = item * s.rows_per_item, j1 = std::min(p.n, j0 + s.rows_per_item);
#if defined(__AVX512F__)
  if (s.fused) {
    fused_fn(p.w)(p, j0, j1, s.round);
    return;
  }
#endif
  // One panel per thread, kept between calls: a fresh 192 KiB buffer per item would be mapped
  // and faulted in anew every time (decode makes hundreds of these calls per token).
  thread_local std::vector<float> panel;
  if (panel.size() < size_t(s.rows_per_item * p.k)) panel.resize(size_t(s.rows_per_item * p.k));
  dequantize_rows(p.w, j0, j1 - j0, panel.data(), p.k);
  if (s.round)
    for (size_t i = 0; i < size_t((j1 - j0) * p.k); i += simd::kLanes) {
      const int n = int(std::min<size_t>(simd::kLanes, size_t((j1 - j0) * p.k) - i));
      simd::store_n(panel.data() + i, simd::round_bf16(simd::load_n(panel.data() + i, n)), n);
    }
  if (p.m < kPanelMinRows || p.k == 0) {
    dot_block<LoadF32>(p.x, p.ldx, panel.data(), p.k, p.m, j1 - j0, p.k, p.y + j0, p.ldy, p.accumulate);
    return;
  }
  for (int64_t i0 = 0; i0 < p.m; i0 += kPanelRows)  // prefill: the cache-blocked kernel over the panel
    panel_block<LoadF32>(p.x + i0 * p.ldx, p.ldx, panel.data(), p.k, std::min(kPanelRows, p.m - i0), j1 - j0, p.k,
                         p.y + i0 * p.ldy + j0, p.ldy, p.accumulate);
}

// y = x W with a quantized W [k, n] (not on a hot path: the model dequantizes what it
// transposes at load): the whole matrix dequantized, then the float32 gemm.
void gemm_quantized_tn(const GemmParams& p, Precision precision) {
  std::vector<float> full(size_t(p.w.rows * p.w.cols));
  dequantize_rows(p.w, 0, p.w.rows, full.data(), p.w.cols);
  GemmParams q = p;
  q.w = Weight{full.data(), DType::F32, p.w.rows, p.w.cols, p.w.cols};
  gemm(q, precision);  // (kFast: the F32 values rounded as they are read)
}

}  // namespace glm5::kernels::cpu::fast

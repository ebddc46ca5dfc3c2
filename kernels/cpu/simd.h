// A 16-lane float vector for the fast CPU kernels: AVX-512 intrinsics when the compiler targets
// AVX-512, GCC vector extensions otherwise (same 16-lane algorithm, so the same reduction order).
// Every fast kernel builds its dot products from `fma` chains over 16-element chunks followed by
// `reduce`; that is what fixes the reduction order of an output element whatever tile computes it.
// Weight loaders widen BF16/F16/F32 to float exactly (bit-exact conversions, no rounding).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/core/dtype.h"

#if defined(__AVX512F__)
// GCC 12 reports its own AVX-512 headers' "undefined vector" idiom as uninitialized use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace glm5::kernels::simd {

constexpr int kLanes = 16;

#if defined(__AVX512F__)

using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf splat(float v) { return _mm512_set1_ps(v); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
// The first n (0..16) elements, zeros in the other lanes; reads nothing past p + n.
inline vf load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1u), p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store_n(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1u), v); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
// Keeps v in a register: stops the compiler from re-reading a reused operand from memory in
// every FMA (which makes register tiles load-bound).
inline vf pin(vf v) {
  asm("" : "+v"(v));
  return v;
}
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
// Fixed pairwise tree: lanes (0..7)+(8..15), then halves again, down to one value.
inline float reduce(vf v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
  return _mm_cvtss_f32(d);
}
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
// reduce() of a 4 x 4 tile of vectors at once, the same tree for each: y[r * ldy + c] (+)=
// reduce(v[r][c]) for r < mr, c < nr (v's other entries take part in the shuffles but never reach
// y: initialise them). Four levels of one add per pair of vectors, with shuffles that line up the
// halves each level adds: 45 operations for 16 sums instead of 8 each, which matter where k is
// short (an expert's down projection: 16 FMAs per sum at k = 256). After level 1, vector j holds
// the 8 sums of the pair (v_s, v_t) it took; the pairs are chosen so that after level 4 lane
// 4 r + c holds v[r][c]'s sum.
inline void reduce_store_4x4(const vf (&v)[4][4], int mr, int nr, float* y, int64_t ldy, bool accumulate) {
  // level 1: [a.lo8 + a.hi8 | b.lo8 + b.hi8]; src(s) = v[s % 4][s / 4] pairs s = 2j, 2j + 1
  const auto l1 = [](vf a, vf b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  };
  // level 2: per 8-group, quarter 0 + quarter 1
  const auto l2 = [](vf a, vf b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  };
  // level 3: per 128-bit lane, elements (0, 1) + (2, 3); level 4: elements 0 + 1
  const auto l3 = [](vf a, vf b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
  };
  const auto l4 = [](vf a, vf b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xdd));
  };
  const auto src = [&](int s) { return v[s % 4][s / 4]; };
  vf w[8], z[4];
  for (int j = 0; j < 8; ++j) w[j] = l1(src(2 * j), src(2 * j + 1));
  for (int j = 0; j < 4; ++j) z[j] = l2(w[2 * j], w[2 * j + 1]);
  const vf u = l4(l3(z[0], z[1]), l3(z[2], z[3]));
  const __m128 row[4] = {_mm512_castps512_ps128(u), _mm512_extractf32x4_ps(u, 1), _mm512_extractf32x4_ps(u, 2),
                         _mm512_extractf32x4_ps(u, 3)};
  for (int r = 0; r < mr; ++r) {
    float* o = y + r * ldy;
#if defined(__AVX512VL__)
    const __mmask8 cols = __mmask8((1u << nr) - 1u);
    _mm_mask_storeu_ps(o, cols, accumulate ? _mm_add_ps(_mm_maskz_loadu_ps(cols, o), row[r]) : row[r]);
#else
    alignas(16) float t[4];
    _mm_store_ps(t, row[r]);
    for (int c = 0; c < nr; ++c) o[c] = accumulate ? o[c] + t[c] : t[c];
#endif
  }
}
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }  // exact in any order
// e^x, about 1 ulp (Cephes expf polynomial on x - n ln2, then x 2^n by scalef, which also
// gives the denormals and zero below -87). For softmax inputs (<= 0); x < -104 gives 0.
inline vf exp(vf x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}
inline vf widen_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf widen_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Each lane rounded to bf16 (nearest even) and widened back: f32_to_bf16's arithmetic (a NaN stays
// a quiet NaN).
inline vf round_bf16(vf v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i q = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_and_si512(q, _mm512_set1_epi32(int(0xffff0000u))));
}

// r[0..16): the rows of a 16 x 16 float block, replaced by its transpose: four rounds of block
// swaps (8 x 8, 4 x 4, 2 x 2, 1 x 1 sub-blocks across the diagonal), two permutes per row pair.
inline void transpose16(__m512 (&r)[16]) {
#pragma GCC unroll 4
  for (int s = 8; s >= 1; s /= 2) {
    alignas(64) int32_t lo[16], hi[16];
    for (int c = 0; c < 16; ++c) {
      lo[c] = (c & s) ? 16 + c - s : c;  // row i keeps its own columns, takes row i + s's low ones
      hi[c] = (c & s) ? 16 + c : c + s;  // row i + s takes row i's high columns, keeps its own
    }
    const __m512i il = _mm512_load_si512(lo), ih = _mm512_load_si512(hi);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      if (!(i & s)) {
        const __m512 a = r[i], b = r[i + s];
        r[i] = _mm512_permutex2var_ps(a, il, b);
        r[i + s] = _mm512_permutex2var_ps(a, ih, b);
      }
  }
}

#else  // portable fallback with the same lane structure

// 64-byte vectors are passed by value in these helpers and in the kernels built on them: GCC
// notes that the ABI differs from AVX-512 builds, which does not matter for functions that
// never cross a library boundary. (Left off for the rest of the translation unit.)
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
inline vf zero() { return vf{}; }
inline vf splat(float v) { return vf{} + v; }
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load_n(const float* p, int n) {
  vf v{};
  std::memcpy(&v, p, size_t(n) * 4);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline void store_n(float* p, vf v, int n) { std::memcpy(p, &v, size_t(n) * 4); }
inline vf fma(vf a, vf b, vf c) { return a * b + c; }
inline vf pin(vf v) { return v; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf add(vf a, vf b) { return a + b; }
inline float reduce(vf v) {
  float t[16];
  std::memcpy(t, &v, sizeof t);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}
inline void reduce_store_4x4(const vf (&v)[4][4], int mr, int nr, float* y, int64_t ldy, bool accumulate) {
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nr; ++c) {
      const float s = reduce(v[r][c]);
      y[r * ldy + c] = accumulate ? y[r * ldy + c] + s : s;
    }
}
inline vf sub(vf a, vf b) { return a - b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf max(vf a, vf b) {
  for (int i = 0; i < 16; ++i) a[i] = a[i] > b[i] ? a[i] : b[i];
  return a;
}
inline float reduce_max(vf v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline vf exp(vf x) {
  for (int i = 0; i < 16; ++i) x[i] = std::exp(x[i]);
  return x;
}
inline vf widen_bf16(const uint16_t* p) {
  vu u;
  for (int i = 0; i < 16; ++i) u[i] = uint32_t(p[i]) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline vf widen_f16(const uint16_t* p) {
  vf v;
  for (int i = 0; i < 16; ++i) v[i] = f16_to_f32(p[i]);
  return v;
}
inline vf round_bf16(vf v) {
  for (int i = 0; i < 16; ++i) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
  return v;
}

#endif

}  // namespace glm5::kernels::simd

// AVX512-BF16 helpers shared by the kernels of cpu/bf16_gemm.cpp and cpu/bf16_attention.cpp. Each
// function carries a target attribute (the build may be for any x86-64): call them only from code
// that bf16::available() guards.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define GLM5_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace glm5::kernels::cpu::bf16 {

// The high halves of 16 float32 rounded to bf16 (f32_to_bf16's bit trick, NaN kept quiet), in place.
GLM5_BF16 inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
}

// 32 values of a row as 16 pairs: f32_to_bf16 of each (the bit trick, NaN kept quiet), the high
// halves of the two vectors' dwords gathered in column order.
// The vpermt2w index that gathers the high 16-bit halves of two vectors' 32 dwords, in order.
GLM5_BF16 inline __m512i high_halves_index() {
  alignas(64) static const uint16_t odd_words[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  return _mm512_load_si512(odd_words);
}

GLM5_BF16 inline __m512i pairs32(const float* x, int n) {
  __m512i h[2];
  for (int e = 0; e < 2; ++e) {
    const int c = std::clamp(n - 16 * e, 0, 16);
    h[e] = bf16_bits(_mm512_maskz_loadu_ps(__mmask16((1u << c) - 1u), x + 16 * e));
  }
  return _mm512_permutex2var_epi16(h[0], high_halves_index(), h[1]);
}

}  // namespace glm5::kernels::cpu::bf16

#endif

// The AVX512-BF16 gemm of cpu/bf16_gemm.h. Its functions carry a target attribute (the build may be
// for any x86-64); nothing here runs vdpbf16ps unless available() said so.
#include "kernels/cpu/bf16_gemm.h"

#include <algorithm>
#include <array>
#include <utility>

#include "kernels/core/check.h"

#include "kernels/cpu/bf16_simd.h"

namespace glm5::kernels::cpu::bf16 {

bool available() {
#if defined(__x86_64__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return has;
#else
  return false;
#endif
}

#if defined(__x86_64__)
namespace {
GLM5_BF16 void pack_row_avx512(const float* x, int64_t k, uint32_t* o) {
  for (int64_t c = 0; c < k; c += 32) {
    const int n = int(std::min<int64_t>(32, k - c));
    const __m512i v = pairs32(x + c, n);
    _mm512_mask_storeu_epi32(o + c / 2, __mmask16((1u << ((n + 1) / 2)) - 1u), v);
  }
}
}  // namespace
#endif

void pack_pairs(const float* x, int64_t ldx, int64_t m, int64_t k, PackedPairs& out) {
  out.m = m;
  out.pairs = (k + 1) / 2;
  // Grown, never shrunk (decode packs hundreds of small x per token into the same buffer).
  if (out.data.size() < size_t(m * out.pairs)) out.data.resize(size_t(m * out.pairs));
    // (on all threads for a prefill's x; inside another parallel region, nested regions run serially)
#pragma omp parallel for schedule(static) if (m * k >= (int64_t(1) << 18))
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * ldx;
    uint32_t* o = out.data.data() + i * out.pairs;
#if defined(__x86_64__)
    if (available()) {
      pack_row_avx512(xr, k, o);
      continue;
    }
#endif
    for (int64_t p = 0; p < k / 2; ++p)
      o[p] = uint32_t(f32_to_bf16(xr[2 * p])) | uint32_t(f32_to_bf16(xr[2 * p + 1])) << 16;
    if (k % 2) o[k / 2] = f32_to_bf16(xr[k - 1]);
  }
}

#if defined(__x86_64__)
namespace {

// Tile: MR x rows by NV groups of 16 W rows (16 NV columns of y), pairs [p0, p1). The MR x NV
// accumulators start at zero (first) or from `acc` (a float32 stored and loaded back is the same
// value, so cutting k into panels changes no bit); they go back to `acc`, or (last) to y.
// MR = 4, NV = 4: 16 accumulators, 4 W vectors and a broadcast in the 32 registers; per pair 4
// vector loads feed 16 vdpbf16ps.
constexpr int kMR = 4, kNV = 4;
// Pairs per panel for calls with more than one tile of x rows: the block's W panel (64 rows x
// 256 pairs, 64 KiB) stays in L2 while the x tiles pass over it.
constexpr int64_t kPanelPairs = 256;
// x rows per block: their accumulators (64 rows x 64 columns x 64 bytes) stay in L2 between panels.
constexpr int64_t kRowBlock = 64;

template <int MR, int NV>
GLM5_BF16 void tile(const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t gstride, int64_t p0, int64_t p1,
                    float* acc, bool first, bool last, float* y, int64_t ldy, int ncols, bool accumulate) {
  __m512 a[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) a[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r * NV + v) * 16);
  const uint16_t* wp = w + p0 * 32;
  for (int64_t p = p0; p < p1; ++p, wp += 32) {
    __m512i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(wp + v * gstride);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_set1_epi32(int(x[r * ldx + p]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], (__m512bh)xb, (__m512bh)wv[v]);
    }
  }
  if (!last) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r * NV + v) * 16, a[r][v]);
    return;
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int c = std::clamp(ncols - 16 * v, 0, 16);
      if (c == 0) continue;
      const __mmask16 m = __mmask16((1u << c) - 1u);
      float* o = y + r * ldy + 16 * v;
      const __m512 res = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), a[r][v]) : a[r][v];
      _mm512_mask_storeu_ps(o, m, res);
    }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*, bool, bool,
                        float*, int64_t, int, bool);

template <int MR, int... NV>
constexpr std::array<TileFn, kNV> tile_row(std::integer_sequence<int, NV...>) {
  return {tile<MR, NV + 1>...};
}

TileFn tile_fn(int mr, int nv) {
  static const std::array<std::array<TileFn, kNV>, kMR> table = {
      tile_row<1>(std::make_integer_sequence<int, kNV>{}), tile_row<2>(std::make_integer_sequence<int, kNV>{}),
      tile_row<3>(std::make_integer_sequence<int, kNV>{}), tile_row<4>(std::make_integer_sequence<int, kNV>{})};
  return table[size_t(mr - 1)][size_t(nv - 1)];
}

}  // namespace
#endif

void gemm_rows(const PackedPairs& x, const uint16_t* w, int64_t ldw, int64_t nb, float* y, int64_t ldy,
               bool accumulate) {
  if (nb <= 0 || x.m <= 0) return;
  CHECK(ldw >= 2 * x.pairs, "bf16::gemm_rows: a kPair16 weight with ld ", ldw, " for ", x.pairs, " k pairs");
#if defined(__x86_64__)
  CHECK(available(), "bf16::gemm_rows: this CPU has no AVX512-BF16");
  const int64_t P = x.pairs, gstride = 16 * ldw;
  const int64_t panel = x.m <= kMR ? std::max<int64_t>(P, 1) : kPanelPairs;  // decode: all of k at once
  thread_local std::vector<float> acc_buf;
  for (int64_t ib = 0; ib < x.m; ib += kRowBlock) {
    const int64_t mb = std::min(kRowBlock, x.m - ib), tiles = (mb + kMR - 1) / kMR;
    if (P > panel && acc_buf.size() < size_t(tiles * kMR * kNV * 16)) acc_buf.resize(size_t(tiles * kMR * kNV * 16));
    for (int64_t j0 = 0; j0 < nb; j0 += 16 * kNV) {
      const int ncols = int(std::min<int64_t>(16 * kNV, nb - j0)), nv = (ncols + 15) / 16;
      int64_t p0 = 0;
      do {
        const int64_t p1 = std::min(P, p0 + panel);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t i0 = ib + t * kMR;
          const int mr = int(std::min<int64_t>(kMR, x.m - i0));
          float* acc = P > panel ? acc_buf.data() + t * kMR * kNV * 16 : nullptr;
          tile_fn(mr, nv)(x.row(i0), P, w + j0 * ldw, gstride, p0, p1, acc, p0 == 0, p1 == P, y + i0 * ldy + j0, ldy,
                          ncols, accumulate);
        }
        p0 = p1;
      } while (p0 < P);
    }
  }
#else
  GLM5_FAIL("bf16::gemm_rows: AVX512-BF16 needs x86-64");
#endif
}

#if defined(__x86_64__)
namespace {

// The exact kernel's head loop (cpu/attention.cpp indexer_heads) on pairs: MR heads x 4 vectors of
// 16 keys, then each head's weighted relu added in order.
template <int MR>
GLM5_BF16 void indexer_heads(const uint32_t* q, int64_t pairs, const float* w, const uint32_t* kp, __m512 (&sc)[4]) {
  __m512 acc[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i kv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) kv[v] = _mm512_loadu_si512(kp + p * kIndexerBlock + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i qb = _mm512_set1_epi32(int(q[r * pairs + p]));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)qb, (__m512bh)kv[v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m512 wr = _mm512_set1_ps(w[r]);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) sc[v] = _mm512_fmadd_ps(wr, _mm512_max_ps(acc[r][v], _mm512_setzero_ps()), sc[v]);
  }
}

}  // namespace
#endif

void indexer_block(const uint32_t* q, int64_t heads, int64_t pairs, const float* w, const uint32_t* kp, float* out) {
#if defined(__x86_64__)
  CHECK(available(), "bf16::indexer_block: this CPU has no AVX512-BF16");
  [&]() GLM5_BF16 {
    __m512 sc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t h = 0;
    for (; h + 4 <= heads; h += 4) indexer_heads<4>(q + h * pairs, pairs, w + h, kp, sc);
    switch (heads - h) {
      case 1: indexer_heads<1>(q + h * pairs, pairs, w + h, kp, sc); break;
      case 2: indexer_heads<2>(q + h * pairs, pairs, w + h, kp, sc); break;
      case 3: indexer_heads<3>(q + h * pairs, pairs, w + h, kp, sc); break;
      default: break;
    }
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, sc[v]);
  }();
#else
  GLM5_FAIL("bf16::indexer_block: AVX512-BF16 needs x86-64");
#endif
}

void pack_key_block(const float* kt, int64_t D, uint32_t* kp) {
#if defined(__x86_64__)
  CHECK(available(), "bf16::pack_key_block: this CPU has no AVX512-BF16");
  [&]() GLM5_BF16 {
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
    for (int64_t p = 0; p < D / 2; ++p)
      for (int64_t v = 0; v < kIndexerBlock; v += 16) {
        const __m512i lo = bf16_bits(_mm512_loadu_ps(kt + 2 * p * kIndexerBlock + v));
        const __m512i hi = bf16_bits(_mm512_loadu_ps(kt + (2 * p + 1) * kIndexerBlock + v));
        _mm512_storeu_si512(kp + p * kIndexerBlock + v,
                            _mm512_or_si512(_mm512_srli_epi32(lo, 16), _mm512_and_si512(hi, high)));
      }
  }();
#else
  (void)kt, (void)D, (void)kp;
  GLM5_FAIL("bf16::pack_key_block: needs x86-64");
#endif
}

void pack_key_block(const uint16_t* kt16, int64_t D, uint32_t* kp) {
  for (int64_t p = 0; p < D / 2; ++p)
    for (int64_t j = 0; j < kIndexerBlock; ++j)
      kp[p * kIndexerBlock + j] =
          uint32_t(kt16[2 * p * kIndexerBlock + j]) | uint32_t(kt16[(2 * p + 1) * kIndexerBlock + j]) << 16;
}

}  // namespace glm5::kernels::cpu::bf16

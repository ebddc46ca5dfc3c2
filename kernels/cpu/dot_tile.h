// The register tile behind the fast CPU gemm and attention scores: y[r, c] = a[r, :] . b[c, :]
// for r < MR, c < NR, with b rows in BF16/F16/F32. Every output element is computed the same way
// whatever MR and NR are: 16 lane accumulators, lane l sums a[16q + l] * b[16q + l] over
// q = 0, 1, ... by FMA (the last chunk zero-padded), then the fixed simd::reduce tree. That per-element
// recipe is what makes results independent of batch size and tiling.
#pragma once

#include <cstdint>
#include <array>
#include <cstring>
#include <utility>

#include "cpu/simd.h"

namespace glm5::kernels::cpu {

// Register tile shape: kTileRows rows of a by kTileCols rows of b.
constexpr int kTileRows = 4, kTileCols = 4;

// Loaders: 16 consecutive row elements widened to float (`part` reads only n of them).
struct LoadF32 {
  using T = float;
  static simd::vf full(const T* p) { return simd::load(p); }
  static simd::vf part(const T* p, int n) { return simd::load_n(p, n); }
};
struct LoadBF16 {
  using T = uint16_t;
  static simd::vf full(const T* p) { return simd::widen_bf16(p); }
  static simd::vf part(const T* p, int n) {
    uint16_t t[16] = {};
    std::memcpy(t, p, size_t(n) * 2);
    return simd::widen_bf16(t);
  }
};
struct LoadF16 {
  using T = uint16_t;
  static simd::vf full(const T* p) { return simd::widen_f16(p); }
  static simd::vf part(const T* p, int n) {
    uint16_t t[16] = {};
    std::memcpy(t, p, size_t(n) * 2);
    return simd::widen_f16(t);
  }
};

// y[r * ldy + c] = (accumulate ? y : 0) + a[r * lda + :k] . b[c * ldb + :k], in pieces:
// the same recipe split over k: chunk range [k0, k1) of the dot products, with the 16-lane
// accumulators kept in `state_lanes` (MR * NR * 16 floats, 64-byte aligned) between calls. k0 must be a multiple of 16 and
// only the last call (k1 == k) may have a partial chunk; `first` zeroes the state, `last` reduces
// it into y. Storing fp32 lanes and loading them back is exact, so any split gives the bits of
// a single dot_tile call.
//
// Packed = true reads b from a panel instead of rows: the 16-element chunk q of column c is at
// b + (q * kTileCols + c) * 16, the tail chunk zero-padded (so it loads the same values that
// L::part gives; ldb is unused). L must then be LoadF32.
template <int MR, int NR, class L, bool Packed = false>
inline void dot_tile_part(const float* a, int64_t lda, const typename L::T* b, int64_t ldb,
                          int64_t k0, int64_t k1, float* state_lanes, bool first, bool last,
                          float* y, int64_t ldy, bool accumulate) {
  simd::vf* state = reinterpret_cast<simd::vf*>(state_lanes);  // 64-byte aligned
  simd::vf acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) acc[r][c] = first ? simd::zero() : state[r * NR + c];
  int64_t kk = k0;
  for (; kk + simd::kLanes <= k1; kk += simd::kLanes) {
    simd::vf av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = simd::pin(simd::load(a + r * lda + kk));
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      simd::vf bv = Packed ? simd::pin(L::full(b + (kk / simd::kLanes * kTileCols + c) * simd::kLanes))
                           : simd::pin(L::full(b + c * ldb + kk));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][c] = simd::fma(av[r], bv, acc[r][c]);
    }
  }
  if (kk < k1) {
    const int n = int(k1 - kk);
    simd::vf av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = simd::load_n(a + r * lda + kk, n);
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      simd::vf bv = Packed ? L::full(b + (kk / simd::kLanes * kTileCols + c) * simd::kLanes)
                           : L::part(b + c * ldb + kk, n);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][c] = simd::fma(av[r], bv, acc[r][c]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) state[r * NR + c] = acc[r][c];
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      float v = simd::reduce(acc[r][c]);
      float* o = y + r * ldy + c;
      *o = accumulate ? *o + v : v;
    }
}

// The whole dot product in one call.
template <int MR, int NR, class L>
inline void dot_tile(const float* a, int64_t lda, const typename L::T* b, int64_t ldb, int64_t k,
                     float* y, int64_t ldy, bool accumulate) {
  dot_tile_part<MR, NR, L>(a, lda, b, ldb, 0, k, nullptr, true, true, y, ldy, accumulate);
}

// Tiles for runtime mr in [1, kTileRows], nr in [1, kTileCols].

template <class L>
using DotTilePartFn = void (*)(const float*, int64_t, const typename L::T*, int64_t, int64_t,
                               int64_t, float*, bool, bool, float*, int64_t, bool);

namespace detail {
template <class L, bool Packed, int MR, int... NR>
constexpr void fill_row(DotTilePartFn<L>* row, std::integer_sequence<int, NR...>) {
  ((row[NR] = dot_tile_part<MR, NR + 1, L, Packed>), ...);
}
template <class L, bool Packed, int... MR>
constexpr auto make_tile_table(std::integer_sequence<int, MR...>) {
  std::array<std::array<DotTilePartFn<L>, kTileCols>, kTileRows> t{};
  (fill_row<L, Packed, MR + 1>(t[MR].data(), std::make_integer_sequence<int, kTileCols>{}), ...);
  return t;
}
}  // namespace detail

template <class L, bool Packed = false>
inline DotTilePartFn<L> dot_tile_part_fn(int mr, int nr) {
  static const auto table =
      detail::make_tile_table<L, Packed>(std::make_integer_sequence<int, kTileRows>{});
  return table[mr - 1][nr - 1];
}

// y[i, j] (+)= a[i, :] . b[j, :] for i < m, j < n: tiles of kTileRows x kTileCols, single thread.
template <class L>
inline void dot_block(const float* a, int64_t lda, const typename L::T* b, int64_t ldb, int64_t m,
                      int64_t n, int64_t k, float* y, int64_t ldy, bool accumulate) {
  for (int64_t i = 0; i < m; i += kTileRows) {
    int mr = int(m - i < kTileRows ? m - i : kTileRows);
    for (int64_t j = 0; j < n; j += kTileCols) {
      int nr = int(n - j < kTileCols ? n - j : kTileCols);
      dot_tile_part_fn<L>(mr, nr)(a + i * lda, lda, b + j * ldb, ldb, 0, k, nullptr, true, true,
                                  y + i * ldy + j, ldy, accumulate);
    }
  }
}

}  // namespace glm5::kernels::cpu

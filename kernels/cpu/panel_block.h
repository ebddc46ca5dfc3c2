// The prefill-sized block of the fast CPU gemm: y[i, j] (+)= x[i, :] . W[j, :] for a block of
// kPanelRows x rows by kPanelCols W rows, by the dot_tile recipe (cpu/dot_tile.h) but blocked for
// the caches: k runs in panels of kPanelK, and per panel the block's W rows are widened once into
// float32 sub-panels of kSubCols rows that stay in L1 with a tile's x rows, while the block's x rows
// stay in L2. A tile's 16-lane accumulators are kept between panels in a buffer (an exact round
// trip), so every lane still sums its products in k order and the final reduce is the same: each
// element is bitwise what dot_tile gives it, whatever m (decode keeps using dot_tile directly).
// Without this, every 4 x 4 tile read its x and W rows over the whole k (96 KiB + 48 KiB at hidden
// 6144) from L2, and two loads per FMA from L2 capped the gemm at ~40 % of the FMA peak.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/dot_tile.h"

namespace glm5::kernels::cpu {

// (A sub-panel is 16 KiB: with a tile's 4 KiB of x rows it fits a 32 KiB L1. At 32 W rows it
// filled the L1 alone: one panel_block at k = 2048 from L2, 1 thread, Zen 4: 97 -> 99 GFLOP/s.)
constexpr int64_t kPanelRows = 64, kPanelCols = 128, kPanelK = 256, kSubCols = 16;
static_assert(kSubCols % kTileCols == 0 && kSubCols % 4 == 0, "sub-panels are whole tiles and whole quads");
// Rows from which the gemms use panel_block (below it, dot_tile over whole rows: decode).
constexpr int64_t kPanelMinRows = 32;

namespace detail {

// One MR x NR tile over the panel's chunks: `full` 16-wide chunks, then (last panel only) a tail of
// `tail` elements zero-padded as dot_tile pads it. acc: MR x NR vectors of 16 floats, read unless
// `first`; written back unless `last`, when the sums are reduced into y instead.
template <int MR, int NR>
void panel_tile(const float* x, int64_t ldx, const float* wp, int64_t full, int tail, float* acc, bool first, bool last,
                float* y, int64_t ldy, bool accumulate) {
  simd::vf a[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) a[r][c] = first ? simd::zero() : simd::load(acc + (r * NR + c) * simd::kLanes);
  for (int64_t q = 0; q < full; ++q) {
    simd::vf av[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) av[r] = simd::pin(simd::load(x + r * ldx + 16 * q));
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) {
      const simd::vf bv = simd::pin(simd::load(wp + c * kPanelK + 16 * q));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) a[r][c] = simd::fma(av[r], bv, a[r][c]);
    }
  }
  if (tail > 0) {
    simd::vf av[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) av[r] = simd::load_n(x + r * ldx + 16 * full, tail);
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) {
      const simd::vf bv = simd::load(wp + c * kPanelK + 16 * full);  // zero past the tail
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) a[r][c] = simd::fma(av[r], bv, a[r][c]);
    }
  }
  if (!last) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) simd::store(acc + (r * NR + c) * simd::kLanes, a[r][c]);
    return;
  }
  simd::vf v[4][4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) v[r][c] = r < MR && c < NR ? a[r][c] : simd::zero();
  simd::reduce_store_4x4(v, MR, NR, y, ldy, accumulate);
}

using PanelTileFn = void (*)(const float*, int64_t, const float*, int64_t, int, float*, bool, bool, float*, int64_t,
                             bool);

template <int MR, int... NR>
constexpr std::array<PanelTileFn, kTileCols> panel_row(std::integer_sequence<int, NR...>) {
  return {panel_tile<MR, NR + 1>...};
}

inline PanelTileFn panel_tile_fn(int mr, int nr) {
  static const std::array<std::array<PanelTileFn, kTileCols>, kTileRows> table = {
      panel_row<1>(std::make_integer_sequence<int, kTileCols>{}),
      panel_row<2>(std::make_integer_sequence<int, kTileCols>{}),
      panel_row<3>(std::make_integer_sequence<int, kTileCols>{}),
      panel_row<4>(std::make_integer_sequence<int, kTileCols>{})};
  return table[size_t(mr - 1)][size_t(nr - 1)];
}

// Part `part` of `parts` of the W bytes of sub-panel rows [s0, s0 + sn), columns [kp, kp + kc),
// prefetched into L1 (BF16 / F16: 8 KiB) or L2 (F32: 16 KiB would crowd the L1 out). A BF16
// sub-panel is 4 separate runs of 2 KiB (quads) or 16 of 512 bytes (rows), too short for the
// hardware prefetcher: without this the widening waited for each from memory while no FMA ran
// (speed-a's expert gemms at m = 64, W from memory, 2 threads: gate + up 162 -> 175 GFLOP/s, down
// 153 -> 161; into L2 instead of L1 gained half as much). Prefetches never fault, so the padding
// rows of a last quad are harmless. (always_inline: GCC finds a function that only prefetches
// free of side effects and drops calls to it.)
template <class L, bool Quad>
__attribute__((always_inline)) inline void prefetch_subpanel(const typename L::T* w, int64_t ldw, int64_t s0,
                                                             int64_t sn, int64_t kp, int64_t kc, int64_t part,
                                                             int64_t parts) {
  constexpr int64_t es = sizeof(typename L::T);
  const int64_t runs = Quad ? (sn + 3) / 4 : sn, run_bytes = es * kc * (Quad ? 4 : 1);
  const int64_t lines = (run_bytes + 63) / 64 + 1;  // (+1: a run need not start on a line)
  const int64_t total = runs * lines, b = total * part / parts, e = total * (part + 1) / parts;
  for (int64_t i = b; i < e; ++i) {
    const int64_t run = i / lines, line = i % lines;
    const int64_t r = s0 + (Quad ? 4 * run : run);  // (a quad's 4 rows are one run from its first)
    const uintptr_t at = reinterpret_cast<uintptr_t>(w) + uintptr_t(es * (r * ldw + (Quad ? 4 * kp : kp)) + 64 * line);
    __builtin_prefetch(reinterpret_cast<const void*>(at), 0, es == 4 ? 2 : 3);
  }
}

}  // namespace detail

// y[i, j] (+)= x[i, :k] . w[j, :k] for i < m, j < n (rows of L::T, row j at w + j * ldw; Quad: w
// interleaved, WeightLayout::kQuad16, from a multiple of 4 rows); sized for m <= kPanelRows and
// n <= kPanelCols (the accumulators take m x n x 64 bytes).
template <class L, bool Quad = false>
void panel_block(const float* x, int64_t ldx, const typename L::T* w, int64_t ldw, int64_t m, int64_t n, int64_t k,
                 float* y, int64_t ldy, bool accumulate) {
  static_assert(kTileRows == 4 && kTileCols == 4, "panel_tile_fn's table is written for 4 x 4 tiles");
  struct alignas(64) Lanes {
    float v[simd::kLanes];
  };
  thread_local std::vector<Lanes> acc_buf, wp_buf;  // accumulators [m][n], a sub-panel [kSubCols][kPanelK]
  const int64_t ti = (m + kTileRows - 1) / kTileRows, tj = (n + kTileCols - 1) / kTileCols;
  acc_buf.resize(size_t(ti * tj * kTileRows * kTileCols));
  wp_buf.resize(size_t(kSubCols * kPanelK / simd::kLanes));
  float* wp = wp_buf.data()->v;
  for (int64_t kp = 0; kp < k; kp += kPanelK) {
    const int64_t kc = std::min(kPanelK, k - kp);
    const bool first = kp == 0, last = kp + kc == k;
    const int64_t full = kc / simd::kLanes;
    const int tail = int(kc % simd::kLanes);
    for (int64_t s0 = 0; s0 < n; s0 += kSubCols) {
      const int64_t sn = std::min(kSubCols, n - s0);
      // W rows [s0, s0 + sn), columns [kp, kp + kc) widened (exact), zero-padded to whole chunks.
      for (int64_t j = 0; j < sn; ++j) {
        const int64_t r = s0 + j;
        const typename L::T* src = w + (r - r % 4) * ldw + chunk_at<Quad>(int(r % 4), kp, ldw);
        float* dst = wp + j * kPanelK;
        for (int64_t q = 0; q < full; ++q) simd::store(dst + 16 * q, L::full(src + chunk_at<Quad>(0, 16 * q, ldw)));
        if (tail) simd::store(dst + 16 * full, L::part(src + chunk_at<Quad>(0, 16 * full, ldw), tail));
      }
      // The next sub-panel's W (this panel's next rows, else the next panel's first) is fetched
      // while this one's tiles run, a share per tile (a few lines: bursts of prefetches stall).
      int64_t next_kp = kp, next_s0 = s0 + kSubCols;
      if (next_s0 >= n) next_kp = kp + kPanelK, next_s0 = 0;
      const bool more = next_kp < k;
      const int64_t next_sn = std::min(kSubCols, n - next_s0), next_kc = std::min(kPanelK, k - next_kp);
      const int64_t sub_tiles = (sn + kTileCols - 1) / kTileCols;
      for (int64_t i = 0; i < m; i += kTileRows) {
        const int mr = int(std::min<int64_t>(kTileRows, m - i));
        for (int64_t j = s0; j < s0 + sn; j += kTileCols) {
          const int nr = int(std::min<int64_t>(kTileCols, s0 + sn - j));
          if (more)
            detail::prefetch_subpanel<L, Quad>(w, ldw, next_s0, next_sn, next_kp, next_kc,
                                               i / kTileRows * sub_tiles + (j - s0) / kTileCols, ti * sub_tiles);
          float* acc = acc_buf.data()[((i / kTileRows) * tj + j / kTileCols) * kTileRows * kTileCols].v;
          detail::panel_tile_fn(mr, nr)(x + i * ldx + kp, ldx, wp + (j - s0) * kPanelK, full, tail, acc, first, last,
                                        y + i * ldy + j, ldy, accumulate);
        }
      }
    }
  }
}

}  // namespace glm5::kernels::cpu

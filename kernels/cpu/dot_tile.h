// The register tile behind the fast CPU gemm and the indexer scores: y[r, c] = a[r, :] . b[c, :]
// for r < MR, c < NR, with b rows in BF16/F16/F32 widened on the fly. Every output element is
// computed the same way whatever MR and NR are: 16 lane accumulators, lane l sums
// a[16q + l] * b[16q + l] over q = 0, 1, ... by FMA (the last chunk zero-padded), then the fixed
// simd::reduce tree. That per-element recipe is what makes results independent of batch size.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kernels/cpu/simd.h"

namespace glm5::kernels::cpu {

// Register tile shape: up to kTileRows rows of a by kTileCols rows of b (16 accumulators).
constexpr int kTileRows = 4, kTileCols = 4;
// Bytes ahead of the tile's b rows that it prefetches into L2. Row-major b: the next tile, and at
// least kPrefetchMinBytes (short rows: a tile of k = 256 is 2 KiB, too close to cover the memory
// latency). Interleaved b (WeightLayout::kQuad16, one stream): kPrefetchQuadBytes (16 KiB did at
// least as well as 8 and 32 KiB).
constexpr size_t kPrefetchMinBytes = 8192, kPrefetchQuadBytes = 16384;
// Bytes ahead that it prefetches again, into L1: by then the line is in L2 (or on its way), and the
// load finds it in L1 instead of waiting on an L2 hit (decode ~3% closer to the read bandwidth,
// BENCHMARKS.md).
constexpr size_t kPrefetchNearBytes = 2048;

// Whether tiles of one row of a (decode at batch 1, or the last row of an odd batch) prefetch b as
// above (tiles of more rows always do; so do tiles of short rows as stored, below). Decided once
// from cpuid: not on AMD, where the hardware prefetcher alone streams BF16
// weights at batch 1 from memory at 1.00-1.06 of the read probe and these prefetches cut that to
// 0.72-0.77 (Zen 4, 2 threads; with 8 rows they are needed: 0.41 without, 0.73 with); yes
// elsewhere (Intel Xeon, where they were measured to help). The quantized kernels' next-tile
// prefetch (cpu/quant_gemm.cpp) follows it too (int8 from memory on Zen 4: 0.74-0.76 of the probe
// without, 0.72-0.74 with; F32 scales 0.91-0.94 against 0.85). GLM5_CPU_PREFETCH=0 / 1 overrides;
// set_single_row_prefetch switches it for benchmarks. Results are the same bits either way.
// Short rows as stored (not interleaved, at most kShortRowBytes: the per-head absorption gemms' 64
// rows of 512 bytes) prefetch on every CPU: a tile's rows are then a few lines each, which the
// hardware prefetcher does not pick up in time (W_UV from memory on Zen 4: 28-31 -> 15-19 us per
// layer of speed-a).
constexpr size_t kShortRowBytes = 1024;
namespace detail {
extern std::atomic<int> g_single_row_prefetch;  // -1 until decided (cpu/gemm.cpp)
bool decide_single_row_prefetch();
}  // namespace detail
inline bool single_row_prefetch() {
  const int v = detail::g_single_row_prefetch.load(std::memory_order_relaxed);
  return v < 0 ? detail::decide_single_row_prefetch() : v == 1;
}
inline void set_single_row_prefetch(bool on) { detail::g_single_row_prefetch.store(on ? 1 : 0); }
// Whether a tile of MR rows of a prefetches its weights in software (the rule above).
template <int MR>
inline bool tile_prefetches() {
  return MR > 1 || single_row_prefetch();
}

// Where row c's chunk of 16 elements from column kk (a multiple of 16) starts, relative to the
// first row of a tile: row-major b (Quad = false), row stride ldb; or interleaved (Quad = true,
// WeightLayout::kQuad16 with the tile's first row a multiple of 4): chunks of 4 rows x 16.
template <bool Quad>
constexpr int64_t chunk_at(int c, int64_t kk, int64_t ldb) {
  return Quad ? 4 * kk + 16 * c : c * ldb + kk;
}

// Loaders: 16 consecutive row elements widened to float (`part` reads only n of them and
// zero-fills the rest).
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

// The loaders of Precision::kFast for F16 / F32 weights: the widened values rounded to bf16.
template <class L>
struct LoadRounded {
  using T = typename L::T;
  static simd::vf full(const T* p) { return simd::round_bf16(L::full(p)); }
  static simd::vf part(const T* p, int n) { return simd::round_bf16(L::part(p, n)); }
};

// y[r * ldy + c] = (accumulate ? y[r * ldy + c] : 0) + a[r * lda + :k] . b row c (chunk_at<Quad>)
template <int MR, int NR, class L, bool Quad = false>
void dot_tile(const float* a, int64_t lda, const typename L::T* b, int64_t ldb, int64_t k, float* y, int64_t ldy,
              bool accumulate) {
  simd::vf acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) acc[r][c] = simd::zero();
  int64_t kk = 0;
  const size_t ahead = Quad ? kPrefetchQuadBytes : std::max<size_t>(sizeof(*b) * size_t(NR * ldb), kPrefetchMinBytes);
  const uintptr_t base = reinterpret_cast<uintptr_t>(b);
  const bool prefetch = (!Quad && sizeof(*b) * size_t(ldb) <= kShortRowBytes) || tile_prefetches<MR>();
  for (; kk + simd::kLanes <= k; kk += simd::kLanes) {
    // Ask for the b rows `ahead` bytes on (each 64-byte line once, into L2): with few rows of a
    // (decode) the tile is short and b comes from memory, which otherwise waits for the FMAs
    // instead of overlapping them (decode GEMMs 10-25% faster at m = 4-16; one tile ahead into L2
    // beat two tiles into L1 by ~5% of the read bandwidth at m = 1); then again nearer, into L1.
    // A prefetch past the end of b is harmless: it never faults (the address is formed as an
    // integer).
    if (!prefetch) {
      // (the hardware prefetcher alone)
    } else if constexpr (Quad) {  // this step reads NR x 16 elements in one run
      const uintptr_t at = base + sizeof(*b) * size_t(4 * kk);
#pragma GCC unroll 8
      for (size_t o = 0; o < sizeof(*b) * 16 * NR; o += 64) {
        __builtin_prefetch(reinterpret_cast<const void*>(at + o + ahead), 0, 2);
        __builtin_prefetch(reinterpret_cast<const void*>(at + o + kPrefetchNearBytes), 0, 3);
      }
    } else if ((kk * int64_t(sizeof(*b))) % 64 == 0) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c)
        __builtin_prefetch(reinterpret_cast<const void*>(base + sizeof(*b) * size_t(c * ldb + kk) + ahead), 0, 2);
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c)
        __builtin_prefetch(reinterpret_cast<const void*>(base + sizeof(*b) * size_t(c * ldb + kk) + kPrefetchNearBytes),
                           0, 3);
    }
    simd::vf av[MR];
    // pin: keep each loaded operand in a register instead of letting the compiler fold it
    // into every FMA as a memory operand (which makes the tile load-bound).
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = simd::pin(simd::load(a + r * lda + kk));
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      simd::vf bv = simd::pin(L::full(b + chunk_at<Quad>(c, kk, ldb)));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][c] = simd::fma(av[r], bv, acc[r][c]);
    }
  }
  if (kk < k) {
    const int n = int(k - kk);
    simd::vf av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = simd::load_n(a + r * lda + kk, n);
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      simd::vf bv = L::part(b + chunk_at<Quad>(c, kk, ldb), n);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][c] = simd::fma(av[r], bv, acc[r][c]);
    }
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

template <class L>
using DotTileFn = void (*)(const float*, int64_t, const typename L::T*, int64_t, int64_t, float*, int64_t, bool);

namespace detail {
template <class L, bool Quad, int MR, int... NR>
constexpr void fill_row(DotTileFn<L>* row, std::integer_sequence<int, NR...>) {
  ((row[NR] = dot_tile<MR, NR + 1, L, Quad>), ...);
}
template <class L, bool Quad, int... MR>
constexpr auto make_tile_table(std::integer_sequence<int, MR...>) {
  std::array<std::array<DotTileFn<L>, kTileCols>, kTileRows> t{};
  (fill_row<L, Quad, MR + 1>(t[MR].data(), std::make_integer_sequence<int, kTileCols>{}), ...);
  return t;
}
}  // namespace detail

// The tile for runtime mr in [1, kTileRows], nr in [1, kTileCols].
template <class L, bool Quad = false>
DotTileFn<L> dot_tile_fn(int mr, int nr) {
  static const auto table = detail::make_tile_table<L, Quad>(std::make_integer_sequence<int, kTileRows>{});
  return table[mr - 1][nr - 1];
}

// y[i, j] (+)= a[i, :] . b[j, :] for i < m, j < n: all rows of a against a block of b rows
// (the b block stays in cache while a streams past it), single thread. Row j of b starts at
// b + j * ldb (Quad: the block starts at a multiple of 4 rows, and tiles of 4 rows keep it so).
template <class L, bool Quad = false>
void dot_block(const float* a, int64_t lda, const typename L::T* b, int64_t ldb, int64_t m, int64_t n, int64_t k,
               float* y, int64_t ldy, bool accumulate) {
  static_assert(!Quad || kTileCols == 4, "interleaved rows come in groups of 4: tiles must not straddle them");
  for (int64_t i = 0; i < m; i += kTileRows) {
    const int mr = int(m - i < kTileRows ? m - i : kTileRows);
    for (int64_t j = 0; j < n; j += kTileCols) {
      const int nr = int(n - j < kTileCols ? n - j : kTileCols);
      dot_tile_fn<L, Quad>(mr, nr)(a + i * lda, lda, b + j * ldb, ldb, k, y + i * ldy + j, ldy, accumulate);
    }
  }
}

}  // namespace glm5::kernels::cpu

// The fast CPU gemm: fp32 activations x BF16/F16/F32 weights -> fp32, OpenMP over output columns.
// Batch-invariant by construction: y[i, j] is always the dot_tile recipe (cpu/dot_tile.h) over
// x row i and W row j, whatever m, the tile shape or the path (streamed or buffered) is.
// Not here: library GEMMs (they change the reduction order with the shape), weight prepacking.
#include <algorithm>
#include <vector>

#include "cpu/dot_tile.h"
#include "cpu/fast_ops.h"

namespace glm5::kernels::cpu::fast {

namespace {

// Up to this many rows, W is streamed and widened on the fly (decode is bandwidth-bound: W is
// read once). Above it, each thread widens a block of W rows into an fp32 buffer once and runs
// every x row against it.
constexpr int64_t kStreamMaxRows = 4;
// Columns per parallel work item in the streamed path.
constexpr int64_t kStreamCols = 32;
// Bytes of fp32 W block per thread in the buffered path (fits in a 1 MiB L2 with x rows).
#ifndef KB_BYTES
#define KB_BYTES (384 * 1024)
#endif
#ifndef KC
#define KC 512
#endif
constexpr int64_t kBufferBytes = KB_BYTES;
// k chunk of the buffered path (a multiple of 16).
constexpr int64_t kKChunk = KC;

// y = x W^T, W [n, k] rows of L::T.
template <class L>
void gemm_nt(const GemmParams& p) {
  using T = typename L::T;
  const T* w = static_cast<const T*>(p.w.data);
  const int64_t m = p.m, n = p.n, k = p.k, ldw = p.w.ld;
  if (m <= kStreamMaxRows) {
    const int64_t blocks = (n + kStreamCols - 1) / kStreamCols;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t j0 = b * kStreamCols, nj = std::min(kStreamCols, n - j0);
      dot_block<L>(p.x, p.ldx, w + j0 * ldw, ldw, m, nj, k, p.y + j0, p.ldy, p.accumulate);
    }
    return;
  }
  // Block of W rows per work item: as many as fit kBufferBytes, a multiple of the tile width.
  int64_t nb = std::max<int64_t>(kBufferBytes / (4 * std::max<int64_t>(k, 1)), kTileCols);
  nb = std::min(nb / kTileCols * kTileCols, (n + kTileCols - 1) / kTileCols * kTileCols);
  const int64_t blocks = (n + nb - 1) / nb;
#pragma omp parallel if (m * n * k >= (1 << 18))
  {
    static thread_local std::vector<float> buf;
    struct alignas(64) Lanes { float v[simd::kLanes]; };
    static thread_local std::vector<Lanes> state;
    state.resize(size_t(nb * kTileRows));
    if constexpr (!std::is_same_v<L, LoadF32>) buf.resize(size_t(nb * k));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t j0 = b * nb, nj = std::min(nb, n - j0);
      const float* wb;
      int64_t ldb;
      if constexpr (std::is_same_v<L, LoadF32>) {
        wb = w + j0 * ldw;
        ldb = ldw;
      } else {  // widen rows j0..j0+nj once; exact, so the result equals the streamed path's
        for (int64_t j = 0; j < nj; ++j) {
          const T* src = w + (j0 + j) * ldw;
          float* dst = buf.data() + j * k;
          int64_t kk = 0;
          for (; kk + simd::kLanes <= k; kk += simd::kLanes) simd::store(dst + kk, L::full(src + kk));
          if (kk < k) simd::store_n(dst + kk, L::part(src + kk, int(k - kk)), int(k - kk));
        }
        wb = buf.data();
        ldb = k;
      }
      // Rows of x in groups of 4, k in chunks of kKChunk: the 4 x rows of a chunk stay in L1
      // while the block's W rows stream from L2; lane accumulators wait in `state`.
      float* st = state.data()->v;
      for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
        int mr = int(std::min<int64_t>(kTileRows, m - i0));
        for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += kKChunk) {
          int64_t k1 = std::min(k, k0 + kKChunk);
          bool first = k0 == 0, last = k1 == k;
          for (int64_t j = 0; j < nj; j += kTileCols) {
            int nr = int(std::min<int64_t>(kTileCols, nj - j));
            dot_tile_part_fn<LoadF32>(mr, nr)(p.x + i0 * p.ldx, p.ldx, wb + j * ldb, ldb, k0, k1,
                                              st + j * kTileRows * simd::kLanes, first, last,
                                              p.y + i0 * p.ldy + j0 + j, p.ldy, p.accumulate);
          }
          if (last) break;
        }
      }
    }
  }
}

// y[r, j0 + 16v + l] for r < MR, v < NV: sequential FMA over k of x[r, k] * W[k, j], W [k, n].
// `last` = valid columns of the last vector (1..16).
template <int MR, int NV, class L>
void tile_tn(const float* x, int64_t ldx, const typename L::T* w, int64_t ldw, int64_t k, float* y,
             int64_t ldy, int last, bool accumulate) {
  simd::vf acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = simd::zero();
  for (int64_t kk = 0; kk < k; ++kk) {
    const typename L::T* row = w + kk * ldw;
    simd::vf wv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      wv[v] = (v == NV - 1 && last < simd::kLanes) ? L::part(row + 16 * v, last) : L::full(row + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      simd::vf xb = simd::splat(x[r * ldx + kk]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = simd::fma(xb, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      int cnt = v == NV - 1 ? last : simd::kLanes;
      float* o = y + r * ldy + 16 * v;
      simd::vf res = acc[r][v];
      if (accumulate) res = simd::add(simd::load_n(o, cnt), res);
      simd::store_n(o, res, cnt);
    }
}

template <class L>
using TileTnFn = void (*)(const float*, int64_t, const typename L::T*, int64_t, int64_t, float*,
                          int64_t, int, bool);

template <class L>
TileTnFn<L> tile_tn_fn(int mr, int nv) {
  static const TileTnFn<L> table[4][4] = {
      {tile_tn<1, 1, L>, tile_tn<1, 2, L>, tile_tn<1, 3, L>, tile_tn<1, 4, L>},
      {tile_tn<2, 1, L>, tile_tn<2, 2, L>, tile_tn<2, 3, L>, tile_tn<2, 4, L>},
      {tile_tn<3, 1, L>, tile_tn<3, 2, L>, tile_tn<3, 3, L>, tile_tn<3, 4, L>},
      {tile_tn<4, 1, L>, tile_tn<4, 2, L>, tile_tn<4, 3, L>, tile_tn<4, 4, L>},
  };
  return table[mr - 1][nv - 1];
}

// y = x W, W [k, n]: work items are (4 rows, 64 columns); each y element is a plain sequential
// sum over k, so tiles never change its value.
template <class L>
void gemm_tn(const GemmParams& p) {
  using T = typename L::T;
  const T* w = static_cast<const T*>(p.w.data);
  const int64_t rb = (p.m + 3) / 4, cb = (p.n + 63) / 64;
#pragma omp parallel for collapse(2) schedule(static) if (p.m * p.n * p.k >= (1 << 16))
  for (int64_t ib = 0; ib < rb; ++ib)
    for (int64_t jb = 0; jb < cb; ++jb) {
      int64_t i0 = ib * 4, j0 = jb * 64;
      int mr = int(std::min<int64_t>(4, p.m - i0));
      int64_t nc = std::min<int64_t>(64, p.n - j0);
      int nv = int((nc + 15) / 16), last = int(nc - 16 * (nv - 1));
      tile_tn_fn<L>(mr, nv)(p.x + i0 * p.ldx, p.ldx, w + j0, p.w.ld, p.k, p.y + i0 * p.ldy + j0,
                            p.ldy, last, p.accumulate);
    }
}

template <class L>
void gemm_typed(const GemmParams& p) {
  if (p.trans_w) gemm_tn<L>(p);
  else gemm_nt<L>(p);
}

}  // namespace

void gemm(const GemmParams& p) {
  if (p.m == 0 || p.n == 0) return;
  switch (p.w.dtype) {
    case DType::BF16: gemm_typed<LoadBF16>(p); break;
    case DType::F16: gemm_typed<LoadF16>(p); break;
    case DType::F32: gemm_typed<LoadF32>(p); break;
    default: GLM5_FAIL("gemm: weight dtype ", dtype_name(p.w.dtype), " is not supported");
  }
}

}  // namespace glm5::kernels::cpu::fast

// The fast CPU gemm: fp32 activations x BF16/F16/F32 weights -> fp32, OpenMP over blocks of
// output columns. Batch-invariant by construction: y[i, j] is always the dot_tile recipe
// (cpu/dot_tile.h) over x row i and W row j, whatever m, the tile shape or the thread count.
// Not here: library GEMMs (they change the reduction order with the shape), weight prepacking.
#include <omp.h>

#include <algorithm>

#include "cpu/dot_tile.h"
#include "cpu/fast_ops.h"

namespace glm5::kernels::cpu::fast {

namespace {

// Bytes of W per work item: a block of W rows that stays in L2 while every row of x runs
// against it, so W is read from memory once per call (decode, m = 1, is bandwidth-bound).
// Measured on Zen 4 (1 MiB L2): 256 KiB beats 128 KiB and 512 KiB; splitting k to keep x rows
// in L1 was slower.
constexpr int64_t kBlockBytes = 256 * 1024;
// Multiply-adds below which a call stays on one thread: an OpenMP fork/join costs a few
// microseconds, as much as ~2^18 multiply-adds of streamed weights (decode calls are often small).
constexpr int64_t kParallelMacs = int64_t(1) << 18;

// y = x W^T, W [n, k] rows of L::T, widened on the fly (exact, so no dtype changes a bit).
// Work items are column blocks; when there are too few of them to keep the threads busy (small
// n, large m) the rows are split too, at the price of reading W once per row block.
template <class L>
void gemm_nt(const GemmParams& p) {
  using T = typename L::T;
  const T* w = static_cast<const T*>(p.w.data);
  int64_t nb = kBlockBytes / int64_t(sizeof(T) * std::max<int64_t>(p.k, 1));
  nb = std::clamp<int64_t>(nb / kTileCols * kTileCols, kTileCols, 256);
  const int64_t col_blocks = (p.n + nb - 1) / nb;
  const int64_t threads = omp_get_max_threads();
  int64_t mb = p.m;  // rows per work item
  if (col_blocks < 2 * threads && p.m >= 64) {
    const int64_t want = std::min<int64_t>((2 * threads + col_blocks - 1) / col_blocks, p.m / 32);
    mb = ((p.m + want - 1) / want + kTileRows - 1) / kTileRows * kTileRows;
  }
  const int64_t row_blocks = (p.m + mb - 1) / mb;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (p.m * p.n * p.k >= kParallelMacs)
  for (int64_t rb = 0; rb < row_blocks; ++rb)
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t i0 = rb * mb, j0 = cb * nb;
      dot_block<L>(p.x + i0 * p.ldx, p.ldx, w + j0 * p.w.ld, p.w.ld, std::min(mb, p.m - i0),
                   std::min(nb, p.n - j0), p.k, p.y + i0 * p.ldy + j0, p.ldy, p.accumulate);
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
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (p.m * p.n * p.k >= 2 * kParallelMacs)
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
    case DType::F8_E4M3: case DType::Q4: case DType::Q8: gemm_quantized(p); break;
    default: GLM5_FAIL("gemm: weight dtype ", dtype_name(p.w.dtype), " is not supported");
  }
}

}  // namespace glm5::kernels::cpu::fast

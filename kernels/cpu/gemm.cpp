// The fast CPU gemm: fp32 activations x BF16/F16/F32 (or quantized) weights -> fp32. Every gemm
// is cut into work items (blocks of output: W rows x x rows) and the items of all gemms of one
// call (gemm_batch: independent gemms, e.g. an expert's gate and up, or the per-head absorption
// gemms) run in one OpenMP region: decode makes hundreds of small gemms per token, and one region
// per gemm left the second thread waiting at a join for each of them.
// Batch-invariant by construction: y[i, j] is always the dot_tile recipe (cpu/dot_tile.h) over
// x row i and W row j, whatever m, the tile shape, the batch of gemms or the thread count; on the
// AMX path (row-major or kTile16 BF16 weights, gemm_path() "amx") always the tile recipe of
// cpu/amx_gemm.h instead. W is row-major or interleaved: in groups of 4 rows (WeightLayout::kQuad16,
// how the fast backend holds the model's plain-dtype matrices on the fp32 path: a decode tile then
// reads one stream) or of 16 rows as AMX tiles (kTile16, BF16 on the AMX path); the layout changes
// where a tile reads its chunks, never the recipe, so all give the same bits.
// Not here: library GEMMs (they change the reduction order with the shape).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/amx_gemm.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/dot_tile.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/panel_block.h"

namespace glm5::kernels::cpu {

// See single_row_prefetch (cpu/dot_tile.h): GLM5_CPU_PREFETCH=0 / 1, else off on AMD (interleaved
// and long rows). Decided at the first use (not at static initialisation, so that no order between
// files matters).
bool detail::decide_single_row_prefetch() {
  const std::string e = std::getenv("GLM5_CPU_PREFETCH") ? std::getenv("GLM5_CPU_PREFETCH") : "";
  bool on = true;
  if (e == "0" || e == "1") {
    on = e == "1";
  } else {
    if (!e.empty()) std::fprintf(stderr, "glm5: GLM5_CPU_PREFETCH=%s ignored (expected 0 or 1)\n", e.c_str());
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    on = !__builtin_cpu_is("amd");
#endif
  }
  int expected = -1;
  g_single_row_prefetch.compare_exchange_strong(expected, on ? 1 : 0);
  return g_single_row_prefetch.load(std::memory_order_relaxed) == 1;
}

std::atomic<int> detail::g_single_row_prefetch{-1};

namespace fast {

namespace {

// Bytes of W per work item: a block of W rows that stays in L2 while every row of x runs
// against it, so W is read from memory once per call (decode, m = 1, is bandwidth-bound).
// Measured on Zen 4 (1 MiB L2): 256 KiB beats 128 KiB and 512 KiB; splitting k to keep x rows
// in L1 was slower.
constexpr int64_t kBlockBytes = 256 * 1024;
// Multiply-adds below which a call stays on one thread: an OpenMP fork/join costs a few
// microseconds, as much as ~2^18 multiply-adds of streamed weights (decode calls are often small).
constexpr int64_t kParallelMacs = int64_t(1) << 18;

// y = x W^T, W [n, k] rows of L::T, widened on the fly (exact, so no dtype changes a bit), for
// decode-sized m (below kPanelMinRows): work items are blocks of W rows against all rows of x.
struct NtSplit {
  int64_t nb = 0, col_blocks = 0;
};

NtSplit nt_split(const GemmParams& p, size_t elem_bytes) {
  NtSplit s;
  const int64_t nb = kBlockBytes / int64_t(elem_bytes * size_t(std::max<int64_t>(p.k, 1)));
  s.nb = std::clamp<int64_t>(nb / kTileCols * kTileCols, kTileCols, 256);
  s.col_blocks = (p.n + s.nb - 1) / s.nb;
  return s;
}

// (Items start at multiples of 4 W rows: a kQuad16 W stays aligned to its groups of 4.)
template <class L, bool Quad>
void nt_item(const GemmParams& p, const NtSplit& s, int64_t item) {
  using T = typename L::T;
  const T* w = static_cast<const T*>(p.w.data);
  const int64_t j0 = item * s.nb;
  dot_block<L, Quad>(p.x, p.ldx, w + j0 * p.w.ld, p.w.ld, p.m, std::min(s.nb, p.n - j0), p.k, p.y + j0, p.ldy,
                     p.accumulate);
}

// y[r, j0 + 16v + l] for r < MR, v < NV: sequential FMA over k of x[r, k] * W[k, j], W [k, n].
// `last` = valid columns of the last vector (1..16).
template <int MR, int NV, class L>
void tile_tn(const float* x, int64_t ldx, const typename L::T* w, int64_t ldw, int64_t k, float* y, int64_t ldy,
             int last, bool accumulate) {
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// tile_tn for BF16 W on AVX-512, 32 columns per step: one 64-byte load gives the even columns
// (each bf16 shifted into the high half of its 32-bit lane) and the odd ones (masked in place),
// two instructions for 32 widened values instead of four, and every y element is still the
// same sequential FMA chain over k (only which lane holds which column differs). The two halves
// are interleaved back into column order at the store. NP pairs of vectors (32 columns each);
// `cols` = valid columns of the last pair (1..32).
template <int MR, int NP>
void tile_tn_bf16(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k, float* y, int64_t ldy,
                  int cols, bool accumulate) {
  __m512 even[MR][NP], odd[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NP; ++v) even[r][v] = odd[r][v] = _mm512_setzero_ps();
  const __mmask32 tail = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t kk = 0; kk < k; ++kk) {
    const uint16_t* row = w + kk * ldw;
    __m512 we[NP], wo[NP];
#pragma GCC unroll 8
    for (int v = 0; v < NP; ++v) {
      const __m512i raw = v == NP - 1 ? _mm512_maskz_loadu_epi16(tail, row + 32 * v) : _mm512_loadu_si512(row + 32 * v);
      we[v] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      wo[v] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);
#pragma GCC unroll 8
      for (int v = 0; v < NP; ++v) {
        even[r][v] = _mm512_fmadd_ps(xb, we[v], even[r][v]);
        odd[r][v] = _mm512_fmadd_ps(xb, wo[v], odd[r][v]);
      }
    }
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NP; ++v) {
      const int n = v == NP - 1 ? cols : 32;
      float* o = y + r * ldy + 32 * v;
      __m512 res[2] = {_mm512_permutex2var_ps(even[r][v], lo_idx, odd[r][v]),
                       _mm512_permutex2var_ps(even[r][v], hi_idx, odd[r][v])};
      for (int hlf = 0; hlf < 2; ++hlf) {
        const int c = std::clamp(n - 16 * hlf, 0, 16);
        if (c == 0) continue;
        const __mmask16 m = __mmask16((1u << c) - 1u);
        if (accumulate) res[hlf] = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o + 16 * hlf), res[hlf]);
        _mm512_mask_storeu_ps(o + 16 * hlf, m, res[hlf]);
      }
    }
}

using TileTnBf16Fn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, int, bool);

// MR rows x NP pairs: 4 rows up to 2 pairs (64 columns, as tile_tn), 1 row up to 8 (256 columns).
TileTnBf16Fn tile_tn_bf16_fn(int mr, int np) {
  static const TileTnBf16Fn rows4[4][2] = {
      {tile_tn_bf16<1, 1>, tile_tn_bf16<1, 2>},
      {tile_tn_bf16<2, 1>, tile_tn_bf16<2, 2>},
      {tile_tn_bf16<3, 1>, tile_tn_bf16<3, 2>},
      {tile_tn_bf16<4, 1>, tile_tn_bf16<4, 2>},
  };
  static const TileTnBf16Fn row1[8] = {tile_tn_bf16<1, 1>, tile_tn_bf16<1, 2>, tile_tn_bf16<1, 3>, tile_tn_bf16<1, 4>,
                                       tile_tn_bf16<1, 5>, tile_tn_bf16<1, 6>, tile_tn_bf16<1, 7>, tile_tn_bf16<1, 8>};
  return np > 2 ? row1[np - 1] : rows4[mr - 1][np - 1];
}
#endif

template <class L>
using TileTnFn = void (*)(const float*, int64_t, const typename L::T*, int64_t, int64_t, float*, int64_t, int, bool);

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

// y = x W, W [k, n]: work items are (4 rows, 64 columns), or (4 rows, 256 columns) for BF16 W on
// AVX-512: an item then reads whole rows of a W of up to 256 columns (the per-head absorption
// gemms: one contiguous run per item at decode), and with more rows it is 4 tiles of 64 columns
// (prefill's absorption, 16 heads x 256 rows, k = 64, 2 threads: items of one tile took about as
// long as handing them out: 0.85 -> 0.65 ms, old and new in one run). Each y element is a plain
// sequential sum over k, so tiles never change its value.
constexpr int64_t kTnRows = 4, kTnCols = 64, kTnRowCols = 256;

int64_t tn_cols(const GemmParams& p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (p.w.dtype == DType::BF16) return kTnRowCols;
#endif
  return kTnCols;
}

template <class L>
void tn_item(const GemmParams& p, int64_t item) {
  using T = typename L::T;
  const T* w = static_cast<const T*>(p.w.data);
  const int64_t cols = tn_cols(p), cb = (p.n + cols - 1) / cols;
  const int64_t i0 = item / cb * kTnRows, j0 = item % cb * cols;
  const int mr = int(std::min<int64_t>(kTnRows, p.m - i0));
  const int64_t nc = std::min<int64_t>(cols, p.n - j0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<L, LoadBF16>) {
    // one row: the whole item at once (up to 8 pairs); more: tiles of up to 2 pairs
    const int64_t step = mr == 1 ? nc : 2 * 32;
    for (int64_t j = j0; j < j0 + nc; j += step) {
      const int64_t c = std::min(step, j0 + nc - j);
      const int np = int((c + 31) / 32);
      tile_tn_bf16_fn(mr, np)(p.x + i0 * p.ldx, p.ldx, w + j, p.w.ld, p.k, p.y + i0 * p.ldy + j, p.ldy,
                              int(c - 32 * (np - 1)), p.accumulate);
    }
  } else
#endif
  {
    const int nv = int((nc + 15) / 16), last = int(nc - 16 * (nv - 1));
    tile_tn_fn<L>(mr, nv)(p.x + i0 * p.ldx, p.ldx, w + j0, p.w.ld, p.k, p.y + i0 * p.ldy + j0, p.ldy, last,
                          p.accumulate);
  }
}

// From kPanelMinRows rows, y = x W^T (plain dtypes) runs in cache-blocked panels
// (cpu/panel_block.h): items of kPanelRows x rows by kPanelCols W rows.
template <class L, bool Quad>
void panel_item(const GemmParams& p, int64_t item) {
  using T = typename L::T;
  const int64_t cb = (p.n + kPanelCols - 1) / kPanelCols;
  const int64_t i0 = item / cb * kPanelRows, j0 = item % cb * kPanelCols;
  panel_block<L, Quad>(p.x + i0 * p.ldx, p.ldx, static_cast<const T*>(p.w.data) + j0 * p.w.ld, p.w.ld,
                       std::min(kPanelRows, p.m - i0), std::min(kPanelCols, p.n - j0), p.k, p.y + i0 * p.ldy + j0,
                       p.ldy, p.accumulate);
}

// The BF16 path (gemm_path()): 0 fp32 (the dot_tile recipe), 1 amx, 2 amx-emulated; -1 not chosen.
std::atomic<int> g_gemm_path{-1};
constexpr const char* kGemmPathNames[] = {"fp32", "amx", "amx-emulated"};

int path_index(const std::string& name, const char* what) {
  for (int i = 0; i < 3; ++i)
    if (name == kGemmPathNames[i]) {
      std::string why;
      CHECK(i != 1 || amx::available(&why), what, "=amx: this machine cannot run AMX: ", why);
      return i;
    }
  CHECK(name == "auto", what, "=", name, ": expected auto, fp32, amx or amx-emulated");
  return amx::available() ? 1 : 0;
}

// A path chosen once: the environment variable `env` if set, else "auto" (the best this machine
// has), by `index` (which names env in its errors); set_* calls store into `slot` directly.
int path_once(std::atomic<int>& slot, const char* env, int (*index)(const std::string&, const char*)) {
  const int v = slot.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  const char* e = std::getenv(env);
  int expected = -1;
  slot.compare_exchange_strong(expected, index(e && *e ? e : "auto", env));
  return slot.load(std::memory_order_relaxed);
}

int gemm_path_now() { return path_once(g_gemm_path, "GLM5_CPU_GEMM", path_index); }

// The fast precision's path (fast_gemm_path()): 0 portable, 1 avx512bf16, 2 amx, 3 amx-emulated; -1
// not chosen.
std::atomic<int> g_fast_path{-1};
constexpr const char* kFastPathNames[] = {"portable", "avx512bf16", "amx", "amx-emulated"};
constexpr int kFastPortable = 0, kFastBf16 = 1, kFastAmx = 2, kFastAmxEmulated = 3;

int fast_path_index(const std::string& name, const char* what) {
  for (int i = 0; i < 4; ++i)
    if (name == kFastPathNames[i]) {
      std::string why;
      CHECK(i != kFastAmx || amx::available(&why), what, "=amx: this machine cannot run AMX: ", why);
      CHECK(i != kFastBf16 || bf16::available(), what, "=avx512bf16: this CPU has no AVX512-BF16");
      return i;
    }
  CHECK(name == "auto", what, "=", name, ": expected auto, portable, avx512bf16, amx or amx-emulated");
  return amx::available() ? kFastAmx : bf16::available() ? kFastBf16 : kFastPortable;
}

int fast_path_now() { return path_once(g_fast_path, "GLM5_CPU_FAST_GEMM", fast_path_index); }

// Whether a BF16 gemm (y = x W^T, weight layout l) runs on AMX tiles in this precision.
bool runs_on_amx(const GemmParams& g, Precision precision) {
  if (g.w.dtype != DType::BF16 || g.trans_w || g.k == 0) return false;
  if (g.w.layout == WeightLayout::kTile16) return true;
  if (g.w.layout != WeightLayout::kRowMajor) return false;
  return precision == Precision::kFast ? fast_path_now() >= kFastAmx : gemm_path_now() != 0;
}

// kPair16 (AVX512-BF16) items: decode-sized x, ~kBlockBytes of W in multiples of 64 rows (one
// tile's 4 groups); larger x, 128 rows per pass over x.
int64_t pair_rows_per_item(int64_t m, int64_t k) {
  if (m > 16) return 128;
  const int64_t nb = kBlockBytes / (2 * std::max<int64_t>(k, 1));
  return std::clamp<int64_t>(nb / 64 * 64, 64, 256);
}

// BF16 y = x W^T on AMX tiles: items of W rows against all of x (packed once per batch). Decode-
// sized x (<= 5 rows: one B tile): ~kBlockBytes of W in multiples of 48 rows (the kernel's three W blocks);
// larger x: 128 rows, so that each pass over the packed x (6 bytes per element, from L3) feeds
// 128 W rows (~0.02 bytes per flop) while the W block stays in L2.
int64_t amx_rows_per_item(int64_t m, int64_t k) {
  if (m > amx::kRowsPerBlock) return 128;
  const int64_t nb = kBlockBytes / (2 * std::max<int64_t>(k, 1));
  return std::clamp<int64_t>(nb / 48 * 48, 48, 240);
}

// An AMX job's x as tile terms. A small x is packed by the first thread that runs an item reading
// it (state 0 -> 1 -> 2; others wait for 2), so that the small x of a batch (decode's per-head
// absorption inputs) are packed on all threads inside the batch's one parallel region instead of
// one after another before it (see pack_amx_inputs for which x are packed this way). A batch's x
// must not alias any of its y: a lazily packed x is read while other gemms of the batch write.
struct Pack {
  amx::PackedX x;
  const GemmParams* src = nullptr;  // what to pack
  int terms = amx::kTerms;          // 1 in Precision::kFast
  std::atomic<int> state{2};        // 0: to pack, 1: being packed, 2: ready

  const amx::PackedX& ready() {
    int s = state.load(std::memory_order_acquire);
    if (s == 2) return x;
    if (s == 0 && state.compare_exchange_strong(s, 1, std::memory_order_acquire)) {
      amx::pack_x(src->x, src->ldx, src->m, src->k, x, terms);
      state.store(2, std::memory_order_release);
      return x;
    }
    while (state.load(std::memory_order_acquire) != 2) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    return x;
  }
};

// One gemm of a batch: how it is cut into items and what an item costs (bytes of W read plus
// a share for the multiply-adds), for splitting a batch over threads by cost. In Precision::kFast
// `p` is the batch's copy of the caller's params, whose x round_inputs replaces by its bf16 values
// where the kernel reads floats (portable, quantized, transposed), and `round_w` rounds F16 / F32 /
// dequantized weights as they are read.
struct Job {
  const GemmParams* p = nullptr;
  const GemmParams* src = nullptr;  // the caller's params (its x)
  enum Kind { kNt, kPanel, kTn, kQuant, kAmx, kPair } kind = kNt;
  bool fast = false, round_w = false;
  NtSplit nt;
  QuantSplit quant;
  Pack* px = nullptr;                  // kAmx: x as tile terms (set by pack_amx_inputs)
  bf16::PackedPairs* pairs = nullptr;  // kPair: x as bf16 pairs (set by round_inputs)
  int64_t amx_rows = 0, pair_rows = 0;
  bool amx_emulated = false;
  int64_t items = 0;
  double item_cost = 0;

  Job(const GemmParams& g, const GemmParams& caller, Precision precision)
      : p(&g), src(&caller), fast(precision == Precision::kFast) {
    const double wbytes = quant::is_quantized(g.w.dtype) ? 1.0 : double(dtype_size(g.w.dtype));
    round_w = fast && (g.w.dtype == DType::F16 || g.w.dtype == DType::F32 ||
                       (quant::is_quantized(g.w.dtype) && !quant_values_are_bf16(g.w)));
    CHECK(g.w.layout != WeightLayout::kPair16 || (fast && fast_path_now() == kFastBf16),
          "gemm: a kPair16 (AVX512-BF16 pairs) weight in ", precision_name(precision), " precision on fast path ",
          kFastPathNames[fast_path_now()],
          ": weights are laid out for the precision and path chosen when they were loaded");
    if (g.trans_w) {
      kind = kTn;
      const int64_t cols = tn_cols(g);
      items = (g.m + kTnRows - 1) / kTnRows * ((g.n + cols - 1) / cols);
      item_cost = double(std::min(cols, g.n) * g.k) * (wbytes + double(std::min(g.m, kTnRows)));
    } else if (quant::is_quantized(g.w.dtype)) {
      kind = kQuant;
      quant = quant_split(g, round_w);
      items = quant.items;
      item_cost = double(quant.rows_per_item * g.k) * (wbytes + double(g.m));
    } else if (g.w.layout == WeightLayout::kPair16 && g.k > 0) {
      kind = kPair;
      pair_rows = pair_rows_per_item(g.m, g.k);
      items = (g.n + pair_rows - 1) / pair_rows;
      item_cost = double(pair_rows * g.k) * (wbytes + 0.5 * double(g.m));
    } else if (runs_on_amx(g, precision)) {
      const bool amx_path = fast ? fast_path_now() >= kFastAmx : gemm_path_now() != 0;
      CHECK(amx_path, "gemm: a kTile16 (AMX tile) weight on the ",
            fast ? std::string("fast path ") + kFastPathNames[fast_path_now()] + " (GLM5_CPU_FAST_GEMM)"
                 : std::string("fp32 gemm path (GLM5_CPU_GEMM=fp32)"),
            ": weights are laid out for the path chosen when they were loaded");
      kind = kAmx;
      amx_emulated = fast ? fast_path_now() == kFastAmxEmulated : gemm_path_now() == 2;
      amx_rows = amx_rows_per_item(g.m, g.k);
      items = (g.n + amx_rows - 1) / amx_rows;
      item_cost = double(amx_rows * g.k) * (wbytes + double(g.m) / (fast ? 3 : 1));
    } else if (g.m >= kPanelMinRows && g.k > 0) {  // (k = 0: dot_tile writes the zeros)
      kind = kPanel;
      items = (g.m + kPanelRows - 1) / kPanelRows * ((g.n + kPanelCols - 1) / kPanelCols);
      item_cost = double(kPanelCols * g.k) * (wbytes + double(std::min(g.m, kPanelRows)));
    } else {
      nt = nt_split(g, dtype_size(g.w.dtype));
      items = nt.col_blocks;
      item_cost = double(nt.nb * g.k) * (wbytes + double(g.m));
    }
  }

  // Whether the kernel reads x as floats (then, in kFast, round_inputs gives it the rounded copy).
  bool reads_float_x() const { return kind != kAmx && kind != kPair; }

  void run(int64_t item) const {
    switch (kind) {
      case kQuant: quant_item(*p, quant, item); return;
      case kAmx: {
        const int64_t j0 = item * amx_rows;
        amx::gemm_rows(px->ready(), static_cast<const uint16_t*>(p->w.data) + j0 * p->w.ld, p->w.ld,
                       p->w.layout == WeightLayout::kTile16, std::min(amx_rows, p->n - j0), p->y + j0, p->ldy,
                       p->accumulate, amx_emulated);
        return;
      }
      case kPair: {
        const int64_t j0 = item * pair_rows;
        bf16::gemm_rows(*pairs, static_cast<const uint16_t*>(p->w.data) + j0 * p->w.ld, p->w.ld,
                        std::min(pair_rows, p->n - j0), p->y + j0, p->ldy, p->accumulate);
        return;
      }
      case kTn: return typed([&]<class L>() { tn_item<L>(*p, item); });
      case kPanel:
        if (quad()) return typed([&]<class L>() { panel_item<L, true>(*p, item); });
        return typed([&]<class L>() { panel_item<L, false>(*p, item); });
      case kNt:
        if (quad()) return typed([&]<class L>() { nt_item<L, true>(*p, nt, item); });
        return typed([&]<class L>() { nt_item<L, false>(*p, nt, item); });
    }
  }

 private:
  bool quad() const { return p->w.layout == WeightLayout::kQuad16; }
  template <class F>
  void typed(F f) const {
    switch (p->w.dtype) {
      case DType::BF16: f.template operator()<LoadBF16>(); break;
      case DType::F16:
        if (round_w)
          f.template operator()<LoadRounded<LoadF16>>();
        else
          f.template operator()<LoadF16>();
        break;
      default:
        if (round_w)
          f.template operator()<LoadRounded<LoadF32>>();
        else
          f.template operator()<LoadF32>();
        break;
    }
  }
};

// Rows per gemm up to which a batch is split into contiguous, equal-cost ranges of items, one per
// thread (decode: each thread then streams its own run of W, which the hardware prefetcher follows
// best); a thread that finishes early takes items from the back of another's range, so a thread
// slowed down by its memory traffic or the OS does not hold the others at the join. Larger calls
// take items dynamically (their items are compute-bound).
constexpr int64_t kStaticRows = 16;

// A thread's remaining items [lo, hi) as one atomic word: the owner takes from the front, others
// from the back, each by compare-and-swap.
class ItemRange {
 public:
  void set(uint32_t lo, uint32_t hi) { v_.store(pack(lo, hi), std::memory_order_relaxed); }
  bool take_front(uint32_t& item) { return take(item, true); }
  bool take_back(uint32_t& item) { return take(item, false); }

 private:
  static uint64_t pack(uint32_t lo, uint32_t hi) { return uint64_t(lo) << 32 | hi; }
  bool take(uint32_t& item, bool front) {
    uint64_t v = v_.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t lo = uint32_t(v >> 32), hi = uint32_t(v);
      if (lo >= hi) return false;
      const uint64_t next = front ? pack(lo + 1, hi) : pack(lo, hi - 1);
      if (v_.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        item = front ? lo : hi - 1;
        return true;
      }
    }
  }
  alignas(64) std::atomic<uint64_t> v_{0};
};

// What run_jobs and gemm_batch need per call, kept by the calling thread between calls (decode
// makes hundreds of gemm calls per token: none allocates once the buffers have grown).
struct Scratch {
  std::vector<Job> jobs;
  std::vector<int64_t> first;  // first global item of each job, and the total
  std::vector<double> mid;     // cost midpoint of every item, in item order
  std::unique_ptr<ItemRange[]> ranges;
  int n_ranges = 0;
  std::vector<std::unique_ptr<Pack>> packed;              // the AMX jobs' x (pack_amx_inputs)
  std::vector<Pack*> pack_first;                          // those packed before the items run
  std::vector<GemmParams> params;                         // the batch's params (kFast: x replaced)
  std::vector<std::vector<float>> rounded;                // kFast: x as bf16 values (round_inputs)
  std::vector<std::unique_ptr<bf16::PackedPairs>> pairs;  // kFast: x as bf16 pairs
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The AMX jobs' x as tile terms, each distinct x once (decode: every expert's gate and up share
// one), into buffers this thread keeps between calls (no allocation in the decode loop; what stays
// allocated is the high-water mark, 1.5x the float32 activations of the largest batch). A large x
// is packed here, its rows split over the threads inside pack_x. A small one with at most
// kStaticRows rows is packed where it is first read (Pack::ready): those batches give each thread
// its own run of jobs, so each packs its own x. Other small x (prefill's experts, whose items go
// to threads one by one, so that a neighbour would wait for the pack) are packed here first, one
// per thread.
void pack_amx_inputs(std::vector<Job>& jobs) {
  Scratch& sc = scratch();
  std::vector<std::unique_ptr<Pack>>& pool = sc.packed;
  std::vector<Pack*>& first = sc.pack_first;
  first.clear();
  size_t used = 0;
  int64_t elems = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (jobs[j].kind != Job::kAmx) continue;
    const GemmParams& g = *jobs[j].p;
    for (size_t i = 0; i < j && !jobs[j].px; ++i) {
      const GemmParams& h = *jobs[i].p;
      if (jobs[i].kind == Job::kAmx && h.x == g.x && h.ldx == g.ldx && h.m == g.m && h.k == g.k &&
          jobs[i].fast == jobs[j].fast)
        jobs[j].px = jobs[i].px;
    }
    if (jobs[j].px) continue;
    if (used == pool.size()) pool.push_back(std::make_unique<Pack>());
    Pack& pk = *pool[used++];
    jobs[j].px = &pk;
    pk.src = &g;
    pk.terms = jobs[j].fast ? 1 : amx::kTerms;
    pk.state.store(0, std::memory_order_relaxed);  // (published to the threads by a region's start)
    if (g.m * g.k >= amx::kPackParallelElems) {
      pk.ready();
    } else if (g.m > kStaticRows) {
      first.push_back(&pk);
      elems += g.m * g.k;
    }
  }
  const int64_t n = int64_t(first.size());
  if (n > 1 && elems >= (int64_t(1) << 16)) {  // (a branch: a region whose if is false costs ~0.5 us)
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t u = 0; u < n; ++u) first[size_t(u)]->ready();
  } else {
    for (int64_t u = 0; u < n; ++u) first[size_t(u)]->ready();
  }
}

// Precision::kFast: each distinct x of the batch once as bf16 values (the jobs whose kernels read
// floats then read the copy, row stride k) or as bf16 pairs (kPair16 jobs), in buffers this thread
// keeps between calls.
void round_inputs(std::vector<GemmParams>& params, std::vector<Job>& jobs) {
  Scratch& sc = scratch();
  size_t floats = 0, pairs = 0;
  // First the buffers and who shares them, then the work: each distinct x on one thread, the x of
  // a batch (decode's per-head absorption inputs, prefill's experts) spread over the threads.
  struct Work {
    const GemmParams* x;
    float* out;
    bf16::PackedPairs* pairs;
  };
  std::vector<Work> work;
  int64_t elems = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    Job& job = jobs[j];
    if (!job.fast || job.kind == Job::kAmx || job.p->k == 0) continue;
    const GemmParams& s = *job.src;
    GemmParams& g = params[size_t(job.p - params.data())];
    bool shared = false;
    for (size_t i = 0; i < j && !shared; ++i) {
      const GemmParams& h = *jobs[i].src;
      if (!jobs[i].fast || jobs[i].kind == Job::kAmx || h.x != s.x || h.ldx != s.ldx || h.m != s.m || h.k != s.k ||
          jobs[i].reads_float_x() != job.reads_float_x())
        continue;
      shared = true;
      if (job.kind == Job::kPair)
        job.pairs = jobs[i].pairs;
      else
        g.x = jobs[i].p->x, g.ldx = jobs[i].p->ldx;
    }
    if (shared) continue;
    if (job.kind == Job::kPair) {
      if (pairs == sc.pairs.size()) sc.pairs.push_back(std::make_unique<bf16::PackedPairs>());
      job.pairs = sc.pairs[pairs++].get();
      work.push_back({&s, nullptr, job.pairs});
    } else {
      if (floats == sc.rounded.size()) sc.rounded.emplace_back();
      std::vector<float>& buf = sc.rounded[floats++];
      if (buf.size() < size_t(s.m * s.k)) buf.resize(size_t(s.m * s.k));
      g.x = buf.data(), g.ldx = s.k;
      work.push_back({&s, buf.data(), nullptr});
    }
    elems += s.m * s.k;
  }
  const auto one = [&](const Work& w, bool may_fork) {
    if (w.pairs)
      bf16::pack_pairs(w.x->x, w.x->ldx, w.x->m, w.x->k, *w.pairs);
    else
      round_bf16_rows(w.x->x, w.x->ldx, w.x->m, w.x->k, w.out, may_fork);
  };
  const int64_t n = int64_t(work.size());
  if (n > 1 && elems >= (int64_t(1) << 16)) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) one(work[size_t(i)], false);
  } else {
    for (const Work& w : work) one(w, true);
  }
}

void run_jobs(const std::vector<Job>& jobs) {
  Scratch& sc = scratch();
  int64_t total = 0, macs = 0, max_m = 0;
  std::vector<int64_t>& first = sc.first;
  first.assign(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    total += jobs[j].items;
    first[j + 1] = total;
    macs += jobs[j].p->m * jobs[j].p->n * jobs[j].p->k;
    max_m = std::max(max_m, jobs[j].p->m);
  }
  if (total == 0) return;
  const auto run = [&](int64_t g) {
    const size_t j = size_t(std::upper_bound(first.begin(), first.end(), g) - first.begin() - 1);
    jobs[j].run(g - first[j]);
  };
  // Each thread that ran AMX items releases its tiles when its items are done (gemm_rows leaves
  // them configured from one item to the next).
  const bool tiles = std::any_of(jobs.begin(), jobs.end(), [](const Job& j) { return j.kind == Job::kAmx; });
  const int threads = omp_get_max_threads();
  if (macs < kParallelMacs || total == 1 || threads == 1) {
    for (int64_t g = 0; g < total; ++g) run(g);
    if (tiles) amx::release_tiles();
    return;
  }
  if (max_m > kStaticRows) {
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t g = 0; g < total; ++g) run(g);
      if (tiles) amx::release_tiles();
    }
    return;
  }
  // Equal-cost contiguous ranges: thread t starts at the first item whose cost midpoint is at or
  // past t / threads of the total cost. Set before the region, so that items of a thread the
  // runtime does not start are taken by the others.
  std::vector<double>& mid = sc.mid;
  mid.clear();
  double cost = 0;
  for (const Job& j : jobs)
    for (int64_t i = 0; i < j.items; ++i, cost += j.item_cost) mid.push_back(cost + 0.5 * j.item_cost);
  if (sc.n_ranges < threads) {
    sc.ranges = std::make_unique<ItemRange[]>(size_t(threads));
    sc.n_ranges = threads;
  }
  ItemRange* ranges = sc.ranges.get();
  uint32_t begin = 0;
  for (int t = 0; t < threads; ++t) {
    uint32_t end = begin;
    while (end < uint32_t(total) && (t == threads - 1 || mid[end] < cost * (t + 1) / threads)) ++end;
    ranges[t].set(begin, end);
    begin = end;
  }
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num();
    uint32_t g;
    while (ranges[id].take_front(g)) run(g);
    for (int o = 1; o < threads; ++o)
      while (ranges[(id + o) % threads].take_back(g)) run(g);
    if (tiles) amx::release_tiles();
  }
}

bool quantized_tn(const GemmParams& p) {  // dequantized whole first, then its own gemm call
  return p.trans_w && quant::is_quantized(p.w.dtype);
}

}  // namespace

void gemm_batch(std::span<const GemmParams> ps, Precision precision) {
  Scratch& sc = scratch();
  std::vector<Job>& jobs = sc.jobs;
  std::vector<GemmParams>& params = sc.params;
  jobs.clear();
  params.clear();
  for (const GemmParams& p : ps) {
    if (p.m == 0 || p.n == 0 || quantized_tn(p)) continue;
    switch (p.w.dtype) {
      case DType::BF16:
      case DType::F16:
      case DType::F32:
      case DType::F8_E4M3:
      case DType::Q4:
      case DType::Q8: break;
      default: GLM5_FAIL("gemm: weight dtype ", dtype_name(p.w.dtype), " is not supported");
    }
    params.push_back(p);
  }
  size_t next = 0;  // (params is complete: the jobs keep pointers into it)
  for (const GemmParams& p : ps)
    if (!(p.m == 0 || p.n == 0 || quantized_tn(p))) jobs.emplace_back(params[next++], p, precision);
  if (precision == Precision::kFast) round_inputs(params, jobs);
  pack_amx_inputs(jobs);
  run_jobs(jobs);
  // After the batch: gemm_quantized_tn calls gemm, which reuses this thread's scratch.
  for (const GemmParams& p : ps)
    if (p.m != 0 && p.n != 0 && quantized_tn(p)) gemm_quantized_tn(p, precision);
}

void gemm(const GemmParams& p, Precision precision) { gemm_batch({&p, 1}, precision); }

std::vector<std::string> gemm_paths() {
  std::vector<std::string> v = {"fp32"};
  if (amx::available()) v.push_back("amx");
  v.push_back("amx-emulated");
  return v;
}

void round_bf16_rows(const float* x, int64_t ldx, int64_t m, int64_t k, float* out, bool may_fork) {
  const auto rows = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* xr = x + i * ldx;
      float* o = out + i * k;
      int64_t c = 0;
      for (; c + simd::kLanes <= k; c += simd::kLanes) simd::store(o + c, simd::round_bf16(simd::load(xr + c)));
      if (c < k) simd::store_n(o + c, simd::round_bf16(simd::load_n(xr + c, int(k - c))), int(k - c));
    }
  };
  if (!may_fork || m * k < (int64_t(1) << 18) || m < 2) return rows(0, m);
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    rows(m * id / nt, m * (id + 1) / nt);
  }
}

std::string gemm_path() { return kGemmPathNames[gemm_path_now()]; }

void set_gemm_path(const std::string& path) { g_gemm_path.store(path_index(path, "set_gemm_path")); }

std::vector<std::string> fast_gemm_paths() {
  std::vector<std::string> v = {"portable"};
  if (bf16::available()) v.push_back("avx512bf16");
  if (amx::available()) v.push_back("amx");
  v.push_back("amx-emulated");
  return v;
}

std::string fast_gemm_path() { return kFastPathNames[fast_path_now()]; }

void set_fast_gemm_path(const std::string& path) { g_fast_path.store(fast_path_index(path, "set_fast_gemm_path")); }

bool fast_bf16_dots() { return bf16::available() && fast_path_now() != kFastPortable; }

WeightLayout fast_bf16_layout() {
  const int f = fast_path_now();
  return f == kFastBf16 ? WeightLayout::kPair16 : f >= kFastAmx ? WeightLayout::kTile16 : WeightLayout::kQuad16;
}

}  // namespace fast
}  // namespace glm5::kernels::cpu

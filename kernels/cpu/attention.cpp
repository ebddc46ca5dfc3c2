// Fast CPU attention-side ops: MLA prefill (MHA mode), MLA decode (absorbed MQA mode), DSA indexer
// scores, and top-k. OpenMP over (head, query rows) or (query row, heads) blocks (a single decode
// row: its keys for the scores, its heads for the softmax, its columns for the values), and over
// key blocks for the indexer. Every row is computed by one per-row recipe (16-lane dot products, a
// vectorised softmax over the row's allowed keys in ascending order, sequential FMA of values)
// whatever other rows share the call, so results are batch-invariant.
// Not here: online (flash) softmax, which would tie a row's rounding to its key blocking.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/simd.h"

namespace glm5::kernels::cpu::fast {

void softmax_row(float* w, int64_t n) {
  if (n == 0) return;
  // Max: full chunks in lanes, the tail in scalar (max is exact in any order).
  simd::vf vmax = simd::splat(kNegInf);
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) vmax = simd::max(vmax, simd::load(w + i));
  float mx = simd::reduce_max(vmax);
  for (int64_t j = i; j < n; ++j) mx = std::max(mx, w[j]);
  const simd::vf vmx = simd::splat(mx);
  simd::vf vsum = simd::zero();
  for (i = 0; i + simd::kLanes <= n; i += simd::kLanes) {
    simd::vf e = simd::exp(simd::sub(simd::load(w + i), vmx));
    simd::store(w + i, e);
    vsum = simd::add(vsum, e);
  }
  if (i < n) {
    const int tail = int(n - i);
    simd::store_n(w + i, simd::exp(simd::sub(simd::load_n(w + i, tail), vmx)), tail);
    vsum = simd::add(vsum, simd::load_n(w + i, tail));
  }
  const simd::vf vtot = simd::splat(simd::reduce(vsum));
  for (i = 0; i + simd::kLanes <= n; i += simd::kLanes) simd::store(w + i, simd::div(simd::load(w + i), vtot));
  if (i < n) simd::store_n(w + i, simd::div(simd::load_n(w + i, int(n - i)), vtot), int(n - i));
}

namespace {

// One part of the dot2 recipe: the chunks of a[r][0:d] . b[c][0:d] into acc[r][c], the tail
// chunk zero-padded.
template <int MR, int NR>
inline void dot_part(simd::vf (&acc)[MR][NR], const float* const* a, const float* const* b, int64_t d) {
  int64_t i = 0;
  for (; i + simd::kLanes <= d; i += simd::kLanes) {
    simd::vf av[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) av[r] = simd::pin(simd::load(a[r] + i));
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) {
      simd::vf bv = simd::pin(simd::load(b[c] + i));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][c] = simd::fma(av[r], bv, acc[r][c]);
    }
  }
  if (i < d) {
    const int n = int(d - i);
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) {
      simd::vf bv = simd::load_n(b[c] + i, n);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][c] = simd::fma(simd::load_n(a[r] + i, n), bv, acc[r][c]);
    }
  }
}

// out[r * ldo + c] = scale * ([a1[r] | a2[r]] . [b1[c] | b2[c]]) for r < MR, c < NR: one
// 16-lane FMA chain per pair over part 1 then part 2, then simd::reduce. Every score of every
// attention op is this recipe, whatever the tile, so rows never depend on their neighbours.
template <int MR, int NR>
inline void dot2_tile(const float* const* a1, const float* const* a2, const float* const* b1, const float* const* b2,
                      int64_t d1, int64_t d2, float scale, float* out, int64_t ldo) {
  simd::vf acc[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) acc[r][c] = simd::zero();
  dot_part<MR, NR>(acc, a1, b1, d1);
  if (d2 > 0) dot_part<MR, NR>(acc, a2, b2, d2);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) out[r * ldo + c] = scale * simd::reduce(acc[r][c]);
}

template <int MR>
inline void dot2_tile_n(int nr, const float* const* a1, const float* const* a2, const float* const* b1,
                        const float* const* b2, int64_t d1, int64_t d2, float scale, float* out, int64_t ldo) {
  switch (nr) {
    case 1: dot2_tile<MR, 1>(a1, a2, b1, b2, d1, d2, scale, out, ldo); break;
    case 2: dot2_tile<MR, 2>(a1, a2, b1, b2, d1, d2, scale, out, ldo); break;
    case 3: dot2_tile<MR, 3>(a1, a2, b1, b2, d1, d2, scale, out, ldo); break;
    default: dot2_tile<MR, 4>(a1, a2, b1, b2, d1, d2, scale, out, ldo); break;
  }
}

// Where the keys and values of one attention problem live: key t is [k1(t) | k2(t)], value t is
// v(t)[0:dv]; every query row of a task shares them.
struct KeyValues {
  const float* k1;
  int64_t k1_stride, d1;
  const float* k2;
  int64_t k2_stride, d2;
  const float* v;
  int64_t v_stride, dv;
  float scale;
  KeyPages pages = {};   // row of key t (paged caches); every row of a task reads one sequence
  int64_t page_row = 0;  // the query row whose table `pages` uses
  int64_t at(int32_t t) const { return pages.row(page_row, t); }
};

// One query row: its two query parts, its allowed keys (ascending) and its output [dv].
struct QueryRow {
  const float* q1;
  const float* q2;
  const int32_t* keys;
  int64_t n_keys;
  float* out;
};

// Keys per block (at most, per row): a block's keys stay in cache while every row of the task
// uses them.
constexpr int64_t kKeyBlock = 32;
// How far ahead in a row's key list the score pass prefetches.
constexpr int64_t kPrefetchKeys = 8;
// Output columns per value tile (4 vectors).
constexpr int64_t kValueCols = 64;

// out[r][d0 + j] += sum_{i < n} w[r][i] * v(keys[i])[d0 + j] for r < MR, j < 16 * (NV - 1) + last:
// one sequential FMA chain over the keys per output element, whatever the tile.
template <int MR, int NV>
void value_tile(const KeyValues& kv, const int32_t* keys, int64_t n, const float* const* w, float* const* out,
                int64_t d0, int last) {
  simd::vf acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = simd::load_n(out[r] + d0 + 16 * v, v == NV - 1 ? last : simd::kLanes);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = kv.v + kv.at(keys[i]) * kv.v_stride + d0;
    simd::vf vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      vv[v] =
          simd::pin(v == NV - 1 && last < simd::kLanes ? simd::load_n(row + 16 * v, last) : simd::load(row + 16 * v));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      simd::vf wr = simd::splat(w[r][i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = simd::fma(wr, vv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) simd::store_n(out[r] + d0 + 16 * v, acc[r][v], v == NV - 1 ? last : simd::kLanes);
}

template <int MR>
void value_tile_n(int nv, const KeyValues& kv, const int32_t* keys, int64_t n, const float* const* w, float* const* out,
                  int64_t d0, int last) {
  switch (nv) {
    case 1: value_tile<MR, 1>(kv, keys, n, w, out, d0, last); break;
    case 2: value_tile<MR, 2>(kv, keys, n, w, out, d0, last); break;
    case 3: value_tile<MR, 3>(kv, keys, n, w, out, d0, last); break;
    default: value_tile<MR, 4>(kv, keys, n, w, out, d0, last); break;
  }
}

// Splits the rows of a task into key blocks: each block ends where the row that reaches furthest
// soonest has its kKeyBlock-th next key, so no row has more than kKeyBlock keys in a block (dense
// causal rows: positions [0, 32), [32, 64), ...; a sparse selection over a long context: 32
// selected keys per block, not the one or two that a block of 32 positions would hold; near the
// diagonal of causal rows, short blocks up to where each next row's keys end). Row r's
// keys in the block are keys[lo[r]:hi[r]] (cursor cur[r] advances), and runs of 4 rows that see
// exactly the same keys there (all heads of a decode row, causal prefill rows off the diagonal)
// are grouped so that each key load serves 4 rows. Neither the blocks nor the grouping change how
// a value is computed, only which tile computes it.
struct KeyBlock {
  std::vector<int64_t> cur, lo, hi, group_start;
  std::vector<int> group_size;

  explicit KeyBlock(int64_t n_rows) : cur(size_t(n_rows), 0), lo(size_t(n_rows)), hi(size_t(n_rows)) {}

  // The next block; false when every row's keys are done.
  bool next(const QueryRow* rows, int64_t n_rows) {
    int64_t end = -1;  // one past the block's last position
    for (int64_t r = 0; r < n_rows; ++r)
      if (cur[r] < rows[r].n_keys) {
        const int64_t last = rows[r].keys[std::min(cur[r] + kKeyBlock, rows[r].n_keys) - 1];
        end = end < 0 ? last + 1 : std::min(end, last + 1);
      }
    if (end < 0) return false;
    for (int64_t r = 0; r < n_rows; ++r) {
      int64_t i = cur[r];
      lo[r] = i;
      while (i < rows[r].n_keys && rows[r].keys[i] < end) ++i;
      hi[r] = cur[r] = i;
    }
    group_start.clear();
    group_size.clear();
    for (int64_t r = 0; r < n_rows;) {
      int g = 1;
      if (r + 4 <= n_rows) {
        g = 4;
        for (int64_t j = 1; j < 4; ++j)
          if (rows[r + j].keys + lo[r + j] != rows[r].keys + lo[r] || hi[r + j] - lo[r + j] != hi[r] - lo[r]) g = 1;
      }
      if (hi[r] > lo[r]) {
        group_start.push_back(r);
        group_size.push_back(g);
      }
      r += g;
    }
    return true;
  }
};

// The cache lines of keys[i0, i1) (both parts), for the score pass of one decode row: a sparse
// selection reads keys scattered over the whole cache, each a few hundred bytes, and the
// prefetchers do not see them coming (speed-a, top-256 of 16k, caches from memory: 0.045-0.083 ->
// 0.042-0.066 ms). Not in attend() (prefill's rows, and decode's in a batch or on one thread):
// prefill's keys are in cache, and there it cost 8.1-8.6 -> 8.6-9.7 ms for 256 rows; decode
// batches were not measured with it. (always_inline here and below: GCC finds a function that
// only prefetches free of side effects and drops every call to it.)
__attribute__((always_inline)) inline void prefetch_keys(const KeyValues& kv, const int32_t* keys, int64_t i0,
                                                         int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t at = kv.at(keys[i]);
    const char* a = reinterpret_cast<const char*>(kv.k1 + at * kv.k1_stride);
    for (int64_t o = 0; o < kv.d1 * 4; o += 64) __builtin_prefetch(a + o, 0, 2);
    const char* b = reinterpret_cast<const char*>(kv.k2 + at * kv.k2_stride);
    for (int64_t o = 0; o < kv.d2 * 4; o += 64) __builtin_prefetch(b + o, 0, 2);
  }
}

// Attention for the rows of one task, in three passes over the rows' allowed keys: scores,
// softmax weights, weighted values. Keys are visited in blocks (KeyBlock: at most kKeyBlock of a
// row's keys) so a block is read from memory once for all rows; each row's arithmetic is
// unaffected by that. Every row's key list is strictly ascending (AllowedKeys, or positions).
void attend(const KeyValues& kv, const QueryRow* rows, int64_t n_rows, std::vector<float>& scratch) {
  int64_t max_keys = 0;
  for (int64_t r = 0; r < n_rows; ++r) max_keys = std::max(max_keys, rows[r].n_keys);
  scratch.resize(size_t(n_rows * max_keys));
  // Scores: row r, key i at scratch[r * max_keys + i].
  KeyBlock blk(n_rows);
  while (blk.next(rows, n_rows)) {
    for (size_t g = 0; g < blk.group_start.size(); ++g) {
      const int64_t r = blk.group_start[g];
      const int mr = blk.group_size[g];
      const float* a1[4];
      const float* a2[4];
      for (int j = 0; j < mr; ++j) a1[j] = rows[r + j].q1, a2[j] = rows[r + j].q2;
      const int32_t* keys = rows[r].keys;
      for (int64_t i = blk.lo[r]; i < blk.hi[r]; i += 4) {
        const int nr = int(std::min<int64_t>(4, blk.hi[r] - i));
        const float* b1[4];
        const float* b2[4];
        for (int c = 0; c < nr; ++c) {
          const int64_t at = kv.at(keys[i + c]);
          b1[c] = kv.k1 + at * kv.k1_stride;
          b2[c] = kv.k2 + at * kv.k2_stride;
        }
        float* out = scratch.data() + r * max_keys + i;
        if (mr == 4)
          dot2_tile_n<4>(nr, a1, a2, b1, b2, kv.d1, kv.d2, kv.scale, out, max_keys);
        else
          dot2_tile_n<1>(nr, a1, a2, b1, b2, kv.d1, kv.d2, kv.scale, out, max_keys);
      }
    }
  }
  // Softmax weights, in place. A row without keys gets zeros.
  for (int64_t r = 0; r < n_rows; ++r) {
    std::fill(rows[r].out, rows[r].out + kv.dv, 0.0f);
    softmax_row(scratch.data() + r * max_keys, rows[r].n_keys);
  }
  // Weighted values, column chunk outside the rows so a chunk of the block's values stays in L1.
  KeyBlock vblk(n_rows);
  while (vblk.next(rows, n_rows)) {
    for (int64_t d0 = 0; d0 < kv.dv; d0 += kValueCols) {
      const int64_t cols = std::min(kValueCols, kv.dv - d0);
      const int nv = int((cols + 15) / 16), last = int(cols - 16 * (nv - 1));
      for (size_t g = 0; g < vblk.group_start.size(); ++g) {
        const int64_t r = vblk.group_start[g], i = vblk.lo[r], n = vblk.hi[r] - i;
        const int mr = vblk.group_size[g];
        const float* w[4];
        float* out[4];
        for (int j = 0; j < mr; ++j) {
          w[j] = scratch.data() + (r + j) * max_keys + i;
          out[j] = rows[r + j].out;
        }
        if (mr == 4)
          value_tile_n<4>(nv, kv, rows[r].keys + i, n, w, out, d0, last);
        else
          value_tile_n<1>(nv, kv, rows[r].keys + i, n, w, out, d0, last);
      }
    }
  }
}

// One decode row (all heads share its keys) on all threads, in three phases with the same
// arithmetic as attend: scores of every head, each thread over its own run of the keys (so each
// key row comes from memory into one core, not into every core: the gather of scattered latents
// waits on memory, not on the FMAs); softmax, each thread over its heads; weighted values, each
// thread over its own columns of every head (one sequential FMA chain over all keys per output
// element, as attend's value tiles; the keys that other threads scored it reads from their cores).
void attend_one_row(const KeyValues& kv, const float* q, int64_t n_heads, const int32_t* keys, int64_t n_keys,
                    float* out, int64_t ld_out, std::vector<float>& scores) {
  scores.resize(size_t(n_heads * std::max<int64_t>(n_keys, 1)));
  float* sc = scores.data();
#pragma omp parallel
  {
    const int th = omp_get_thread_num(), nth = omp_get_num_threads();
    // Scores: keys [k0, k1) (whole tiles of 4), blocks of kKeyBlock keys, every head of each block.
    const int64_t tiles = (n_keys + 3) / 4;
    const int64_t k0 = std::min(n_keys, tiles * th / nth * 4), k1 = std::min(n_keys, tiles * (th + 1) / nth * 4);
    for (int64_t b0 = k0; b0 < k1; b0 += kKeyBlock) {
      const int64_t b1 = std::min(k1, b0 + kKeyBlock);
      for (int64_t h = 0; h < n_heads; h += 4) {
        const int mr = int(std::min<int64_t>(4, n_heads - h));
        const float* a1[4];
        const float* a2[4] = {};
        for (int j = 0; j < mr; ++j) a1[j] = q + (h + j) * kv.d1;  // (q [n_heads, d1]: one part)
        for (int64_t i = b0; i < b1; i += 4) {
          const int nr = int(std::min<int64_t>(4, b1 - i));
          if (h == 0) prefetch_keys(kv, keys, std::min(i + kPrefetchKeys, k1), std::min(i + kPrefetchKeys + nr, k1));
          const float* b1p[4];
          const float* b2p[4] = {};
          for (int c = 0; c < nr; ++c) b1p[c] = kv.k1 + kv.at(keys[i + c]) * kv.k1_stride;
          float* o = sc + h * n_keys + i;
          if (mr == 4)
            dot2_tile_n<4>(nr, a1, a2, b1p, b2p, kv.d1, 0, kv.scale, o, n_keys);
          else
            for (int j = 0; j < mr; ++j)
              dot2_tile_n<1>(nr, a1 + j, a2, b1p, b2p, kv.d1, 0, kv.scale, o + j * n_keys, n_keys);
        }
      }
    }
#pragma omp barrier
    for (int64_t h = n_heads * th / nth; h < n_heads * (th + 1) / nth; ++h) softmax_row(sc + h * n_keys, n_keys);
#pragma omp barrier
    // Values: chunks of kValueCols columns dealt to the threads in runs.
    const int64_t chunks = (kv.dv + kValueCols - 1) / kValueCols;
    for (int64_t c = chunks * th / nth; c < chunks * (th + 1) / nth; ++c) {
      const int64_t d0 = c * kValueCols, cols = std::min(kValueCols, kv.dv - d0);
      const int nv = int((cols + 15) / 16), last = int(cols - 16 * (nv - 1));
      for (int64_t h = 0; h < n_heads; h += 4) {
        const int mr = int(std::min<int64_t>(4, n_heads - h));
        const float* w[4];
        float* o[4];
        for (int j = 0; j < mr; ++j) {
          w[j] = sc + (h + j) * n_keys;
          o[j] = out + (h + j) * ld_out;
          std::fill(o[j] + d0, o[j] + d0 + cols, 0.0f);
        }
        if (mr == 4)
          value_tile_n<4>(nv, kv, keys, n_keys, w, o, d0, last);
        else
          for (int j = 0; j < mr; ++j) value_tile_n<1>(nv, kv, keys, n_keys, w + j, o + j, d0, last);
      }
    }
  }
}

// Query rows per prefill task (one head) and heads per decode task (one query row).
constexpr int64_t kPrefillRows = 8;
constexpr int64_t kDecodeHeads = 8;

// Key keys[i] of decode row s from a bf16 latent cache, widened (exactly) into row i of `wide`
// ([n_keys, dk]) and renumbered i in `local`: the f32 recipe then runs on the widened rows.
void widen_key(const MlaDecodeParams& p, int64_t s, const int32_t* keys, int64_t i, int64_t dk, float* wide,
               int32_t* local) {
  const uint16_t* src = static_cast<const uint16_t*>(static_cast<const void*>(p.cache)) + p.pages.row(s, keys[i]) * dk;
  float* dst = wide + i * dk;
  int64_t d = 0;
  for (; d + simd::kLanes <= dk; d += simd::kLanes) simd::store(dst + d, simd::widen_bf16(src + d));
  for (; d < dk; ++d) dst[d] = bf16_to_f32(src[d]);
  local[i] = int32_t(i);
}

}  // namespace

void mla_prefill(const MlaPrefillParams& p) {
  if (p.s == 0) return;
  AllowedKeys allowed(p.s, p.t, p.q_pos, p.topk, p.topk_len, "mla_prefill");
  const int64_t dq = p.qk_nope_head_dim + p.qk_rope_head_dim;
  const int64_t dkv = p.qk_nope_head_dim + p.v_head_dim;
  const int64_t row_blocks = (p.s + kPrefillRows - 1) / kPrefillRows;
#pragma omp parallel if (p.s * p.t * p.n_heads * (dq + p.v_head_dim) >= kParallelMacs)
  {
    std::vector<float> scratch;
    QueryRow rows[kPrefillRows];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t h = 0; h < p.n_heads; ++h)
      for (int64_t b = 0; b < row_blocks; ++b) {
        KeyValues kv{p.kv + h * dkv,
                     p.n_heads * dkv,
                     p.qk_nope_head_dim,
                     p.k_pe,
                     p.ld_k_pe,
                     p.qk_rope_head_dim,
                     p.kv + h * dkv + p.qk_nope_head_dim,
                     p.n_heads * dkv,
                     p.v_head_dim,
                     p.scale};
        int64_t s0 = b * kPrefillRows, n = std::min(kPrefillRows, p.s - s0);
        for (int64_t r = 0; r < n; ++r) {
          int64_t s = s0 + r;
          const float* q = p.q + (s * p.n_heads + h) * dq;
          rows[r] = QueryRow{q, q + p.qk_nope_head_dim, allowed.ptr[s], allowed.len[s],
                             p.out + (s * p.n_heads + h) * p.v_head_dim};
        }
        attend(kv, rows, n, scratch);
      }
  }
}

void mla_decode(const MlaDecodeParams& p) {
  if (p.s == 0) return;
  AllowedKeys allowed(p.s, p.t, p.q_pos, p.topk, p.topk_len, "mla_decode");
  const int64_t dk = p.kv_lora_rank + p.qk_rope_head_dim;
  const bool bf16 = p.pages.dtype == DType::BF16;
  const bool parallel = p.s * p.t * p.n_heads * (dk + p.kv_lora_rank) >= kParallelMacs;
  // Row s's keys and values in the latent cache ([c_kv | k_pe] per key; values are c_kv).
  const auto latents = [&](int64_t s) {
    return KeyValues{p.cache, dk, dk, p.cache, 0, 0, p.cache, dk, p.kv_lora_rank, p.scale, p.pages, s};
  };
  // The same for keys widened from a bf16 cache into rows 0..n_keys-1 of `wide` (widen_key).
  const auto widened_latents = [&](const float* wide) {
    return KeyValues{wide, dk, dk, wide, 0, 0, wide, dk, p.kv_lora_rank, p.scale};
  };
  if (p.s == 1 && parallel && omp_get_max_threads() > 1) {
    thread_local std::vector<float> scores, widened;  // n_heads x n_keys; n_keys x dk (bf16 caches)
    thread_local std::vector<int32_t> local;          // (kept: the model's n_keys <= index_topk)
    KeyValues kv = latents(0);
    const int32_t* keys = allowed.ptr[0];
    const int64_t n_keys = allowed.len[0];
    if (bf16) {  // the row's keys widened once, each thread its share, then the f32 recipe as below
      widened.resize(size_t(n_keys * dk));
      local.resize(size_t(n_keys));
      float* wide = widened.data();  // (inside the region, `widened` would name each thread's own)
      int32_t* renumbered = local.data();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n_keys; ++i) widen_key(p, 0, keys, i, dk, wide, renumbered);
      kv = widened_latents(wide);
      keys = renumbered;
    }
    attend_one_row(kv, p.q_lat, p.n_heads, keys, n_keys, p.out_lat, p.kv_lora_rank, scores);
    return;
  }
  const int64_t head_blocks = (p.n_heads + kDecodeHeads - 1) / kDecodeHeads;
#pragma omp parallel if (parallel)
  {
    std::vector<float> scratch, widened;
    std::vector<int32_t> local;
    QueryRow rows[kDecodeHeads];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < p.s; ++s)
      for (int64_t b = 0; b < head_blocks; ++b) {
        KeyValues kv = latents(s);
        const int32_t* keys = allowed.ptr[s];
        const int64_t n_keys = allowed.len[s];
        if (bf16) {
          // A bf16 cache: the row's keys widened (exactly) into f32 rows 0..n_keys-1, then the
          // f32 recipe (the keys renumbered 0..n_keys-1: blocks and tiles are the same).
          widened.resize(size_t(n_keys * dk));
          local.resize(size_t(n_keys));
          for (int64_t i = 0; i < n_keys; ++i) widen_key(p, s, keys, i, dk, widened.data(), local.data());
          kv = widened_latents(widened.data());
          keys = local.data();
        }
        int64_t h0 = b * kDecodeHeads, n = std::min(kDecodeHeads, p.n_heads - h0);
        for (int64_t r = 0; r < n; ++r) {
          int64_t h = h0 + r;
          rows[r] = QueryRow{p.q_lat + (s * p.n_heads + h) * dk, nullptr, keys, n_keys,
                             p.out_lat + (s * p.n_heads + h) * p.kv_lora_rank};
        }
        attend(kv, rows, n, scratch);
      }
  }
}

namespace {

// Keys per indexer work item (4 vectors).
constexpr int64_t kIndexerKeys = 64;

// sc[v] (16 keys each) += sum_{r < MR} w[r] * relu(q[r, :] . kt[:, 16v : 16v + 16]) with
// kt the key block transposed ([D][kIndexerKeys]): each dot is a sequential FMA chain over d,
// vectorised across keys, and heads are added in ascending order.
template <int MR>
inline void indexer_heads(const float* q, int64_t D, const float* w, const float* kt, simd::vf (&sc)[4]) {
  simd::vf acc[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = simd::zero();
  for (int64_t d = 0; d < D; ++d) {
    simd::vf kv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) kv[v] = simd::pin(simd::load(kt + d * kIndexerKeys + 16 * v));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      simd::vf qb = simd::splat(q[r * D + d]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = simd::fma(qb, kv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    simd::vf wr = simd::splat(w[r]);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) sc[v] = simd::fma(wr, simd::max(acc[r][v], simd::zero()), sc[v]);
  }
}

// Transposes keys [t0, t0 + nt) of query row s (nt <= kIndexerKeys) into kt [D][kIndexerKeys],
// zero-padded. Exact data movement (bf16 keys widened exactly), so how is free: on AVX-512 builds
// 16 x 16 blocks in registers (one row over 16k keys: 0.37 -> 0.22 ms with them, bench_kernels).
void transpose_keys(const IndexerScoresParams& p, int64_t s, int64_t t0, int64_t nt, float* kt) {
  const int64_t D = p.head_dim;
  const bool bf16 = p.pages.dtype == DType::BF16;
  if (p.pages.tiled) {  // tiles of another size than kIndexerKeys (not the runtime's layout)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < kIndexerKeys; ++j)
        kt[d * kIndexerKeys + j] = j < nt ? cache_at(p.pages.dtype, p.k, p.pages.at(s, t0 + j, d, D)) : 0.0f;
    return;
  }
  int64_t at[kIndexerKeys];
  for (int64_t j = 0; j < kIndexerKeys; ++j) at[j] = j < nt ? p.pages.row(s, t0 + j) * D : -1;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const uint16_t* kb = static_cast<const uint16_t*>(static_cast<const void*>(p.k));
    for (int64_t g = 0; g < kIndexerKeys; g += 16)
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t a = at[g + i];
          r[i] = a < 0 ? _mm512_setzero_ps() : bf16 ? simd::widen_bf16(kb + a + d0) : _mm512_loadu_ps(p.k + a + d0);
        }
        simd::transpose16(r);
        for (int x = 0; x < 16; ++x) _mm512_store_ps(kt + (d0 + x) * kIndexerKeys + g, r[x]);
      }
    return;
  }
#endif
  for (int64_t j = 0; j < kIndexerKeys; ++j) {
    if (at[j] < 0) {
      for (int64_t d = 0; d < D; ++d) kt[d * kIndexerKeys + j] = 0.0f;
    } else if (bf16) {  // widened exactly
      const uint16_t* k = static_cast<const uint16_t*>(static_cast<const void*>(p.k)) + at[j];
      for (int64_t d = 0; d < D; ++d) kt[d * kIndexerKeys + j] = bf16_to_f32(k[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) kt[d * kIndexerKeys + j] = p.k[at[j] + d];
    }
  }
}

// Whether key block [t0, t0 + kIndexerKeys) is one tile of the cache, already [D][kIndexerKeys].
bool block_is_tile(const IndexerScoresParams& p) { return p.pages.tiled && p.pages.block_size == kIndexerKeys; }

// The transposed key block [D][kIndexerKeys] for row s at [t0, t0 + nt): the cache's own tile
// when it holds f32 tiles (lanes past the row's keys are whatever the tile holds; their scores
// are dropped), widened into kt for bf16 tiles, else transposed into kt.
const float* key_block(const IndexerScoresParams& p, int64_t s, int64_t t0, int64_t nt, float* kt) {
  if (!block_is_tile(p)) {
    transpose_keys(p, s, t0, nt, kt);
    return kt;
  }
  const int64_t base = p.pages.at(s, t0, 0, p.head_dim), n = p.head_dim * kIndexerKeys;
  if (p.pages.dtype != DType::BF16) return p.k + base;
  const uint16_t* kb = static_cast<const uint16_t*>(static_cast<const void*>(p.k)) + base;
  for (int64_t i = 0; i < n; i += simd::kLanes) simd::store(kt + i, simd::widen_bf16(kb + i));
  return kt;
}

// The cache lines of keys [t0, t0 + nt) of a shared table (a decode row's next block).
__attribute__((always_inline)) inline void prefetch_key_block(const IndexerScoresParams& p, int64_t t0, int64_t nt) {
  const int64_t bytes = p.head_dim * (p.pages.dtype == DType::BF16 ? 2 : 4);
  const char* base = static_cast<const char*>(static_cast<const void*>(p.k));
  for (int64_t j = 0; j < nt; ++j) {
    const char* a = base + p.pages.row(0, t0 + j) * bytes;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(a + o, 0, 2);
  }
}

// How many of keys [t0, t0 + nt) query row s sees (those at positions <= q_pos[s]).
int64_t keys_seen(const IndexerScoresParams& p, int64_t s, int64_t t0, int64_t nt) {
  return std::clamp<int64_t>(int64_t(p.q_pos[s]) + 1 - t0, 0, nt);
}

// Scores of query row s against the transposed key block kt at [t0, t0 + nt).
void score_block(const IndexerScoresParams& p, int64_t s, int64_t t0, int64_t nt, const float* kt) {
  const int64_t H = p.n_heads, D = p.head_dim;
  float* out = p.scores + s * p.ld_scores + t0;
  const int64_t nv = keys_seen(p, s, t0, nt);
  if (nv > 0) {
    simd::vf sc[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
    const float* q = p.q + s * H * D;
    const float* w = p.weights + s * H;
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) indexer_heads<4>(q + h * D, D, w + h, kt, sc);
    switch (H - h) {
      case 1: indexer_heads<1>(q + h * D, D, w + h, kt, sc); break;
      case 2: indexer_heads<2>(q + h * D, D, w + h, kt, sc); break;
      case 3: indexer_heads<3>(q + h * D, D, w + h, kt, sc); break;
      default: break;
    }
    alignas(64) float tmp[kIndexerKeys];
    for (int v = 0; v < 4; ++v) simd::store(tmp + 16 * v, sc[v]);
    std::copy(tmp, tmp + nv, out);
  }
  std::fill(out + nv, out + nt, kNegInf);
}

// Scores of query row s against a block packed as bf16 pairs (bf16_dots: cpu/bf16_gemm.h
// indexer_block), q as pairs [S][H][D / 2].
void score_block_dp(const IndexerScoresParams& p, int64_t s, int64_t t0, int64_t nt, const uint32_t* kp,
                    const uint32_t* qp) {
  const int64_t H = p.n_heads, pairs = p.head_dim / 2;
  float* out = p.scores + s * p.ld_scores + t0;
  const int64_t nv = keys_seen(p, s, t0, nt);
  if (nv > 0) {
    alignas(64) float tmp[kIndexerKeys];
    bf16::indexer_block(qp + s * H * pairs, H, pairs, p.weights + s * H, kp, tmp);
    std::copy(tmp, tmp + nv, out);
  }
  std::fill(out + nv, out + nt, kNegInf);
}

static_assert(kIndexerKeys == bf16::kIndexerBlock, "one key block for both recipes");

}  // namespace

// Work items are blocks of kIndexerKeys keys: the block, read in place when the cache holds it as
// one tile (the runtime's layout on this backend: 16k keys of 8 x 64 from memory, 2 threads,
// 0.42-0.50 -> 0.25-0.32 ms), else transposed once into L1, is scored against every query row
// that can see it (scores[s, t] for t > q_pos[s] are -inf). With one table per row (decode rows
// of different sequences), a work item is (row, key block), dealt to the threads in runs of 4
// consecutive items, and only the row's own keys are used. Either way a score is the same sequence
// of FMAs. With bf16_dots (precision fast, AVX512-BF16, even head_dim) each block is packed as
// bf16 pairs after it is transposed, the queries once before, and the scores are vdpbf16ps chains
// (bf16::indexer_block's recipe).
void indexer_scores(const IndexerScoresParams& p, bool bf16_dots) {
  if (p.s == 0) return;
  const int64_t D = p.head_dim;
  bf16_dots = bf16_dots && D % 2 == 0 && bf16::available();
  thread_local std::vector<uint32_t> q_pairs;  // [S][H][D / 2] (bf16_dots)
  if (bf16_dots) {
    q_pairs.resize(size_t(p.s * p.n_heads * (D / 2)));
    for (int64_t i = 0; i < p.s * p.n_heads; ++i)
      for (int64_t c = 0; c < D / 2; ++c)
        q_pairs[size_t(i * (D / 2) + c)] =
            uint32_t(f32_to_bf16(p.q[i * D + 2 * c])) | uint32_t(f32_to_bf16(p.q[i * D + 2 * c + 1])) << 16;
  }
  const uint32_t* qp = q_pairs.data();
  const int64_t blocks = (p.t + kIndexerKeys - 1) / kIndexerKeys;
  // A single row's own table is the shared one: it takes the decode path below, whose contiguous
  // run per thread the hardware prefetcher streams (as (row, block) items, dynamically interleaved
  // between the threads, a 16k-token decode row's scan ran at 0.23 instead of 0.14 ms per layer).
  const bool per_row = p.s > 1 && p.pages.block_table && p.pages.ld_table > 0;
#pragma omp parallel if (p.s * p.t * p.n_heads * D >= kParallelMacs)
  {
    struct alignas(64) Lanes {
      float v[simd::kLanes];
    };
    std::vector<Lanes> kt_buf(size_t(D * kIndexerKeys / simd::kLanes));
    float* kt = kt_buf.data()->v;
    std::vector<uint32_t> kp(bf16_dots ? size_t(D / 2 * kIndexerKeys) : 0);
    // One block against rows [s0, s1): the exact recipe, or packed as pairs first.
    const auto score = [&](int64_t s0, int64_t s1, int64_t t0, int64_t nt, const float* kb) {
      if (bf16_dots) {
        bf16::pack_key_block(kb, D, kp.data());
        for (int64_t s = s0; s < s1; ++s) score_block_dp(p, s, t0, nt, kp.data(), qp);
      } else {
        for (int64_t s = s0; s < s1; ++s) score_block(p, s, t0, nt, kb);
      }
    };
    if (per_row) {
#pragma omp for collapse(2) schedule(dynamic, 4)
      for (int64_t s = 0; s < p.s; ++s)
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t t0 = b * kIndexerKeys, nt = std::min(kIndexerKeys, p.t - t0);
          const int64_t seen = keys_seen(p, s, t0, nt);
          if (seen == 0)
            score_block(p, s, t0, nt, kt);  // (all -inf)
          else
            score(s, s + 1, t0, nt, key_block(p, s, t0, seen, kt));
        }
    } else if (p.s == 1) {
      // One row (decode): blocks of equal cost, so each thread takes one contiguous run. Keys by
      // rows: it prefetches its next block's keys while it transposes and scores this one (16k
      // keys of 8 x 64 from memory, 2 threads: 0.47 / 0.51 -> 0.45 / 0.46 ms in one run). Tiles
      // are contiguous 16 KiB runs, which the hardware prefetcher follows (a software prefetch of
      // the next tile gave nothing).
      // Keys past q_pos[0] are never read (a row's own table need not cover them).
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t0 = b * kIndexerKeys, nt = std::min(kIndexerKeys, p.t - t0);
        const int64_t seen = keys_seen(p, 0, t0, nt);
        const int64_t next = keys_seen(p, 0, t0 + nt, std::min(kIndexerKeys, p.t - t0 - nt));
        if (!p.pages.tiled && next > 0) prefetch_key_block(p, t0 + nt, next);
        if (seen == 0)
          score_block(p, 0, t0, nt, kt);  // (all -inf)
        else
          score(0, 1, t0, nt, key_block(p, 0, t0, seen, kt));
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t0 = b * kIndexerKeys, nt = std::min(kIndexerKeys, p.t - t0);
        score(0, p.s, t0, nt, key_block(p, 0, t0, nt, kt));
      }
    }
  }
}

namespace {

// A finite value's bits as an unsigned integer in the order of the values (-0 as +0, which
// compares equal to it): a larger value has a larger key.
inline uint32_t value_key(float x) {
  x = x == 0.0f ? 0.0f : x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The value whose value_key is u.
inline float key_value(uint32_t u) {
  u = (u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// How many of u[0, n) are >= c.
inline size_t count_at_least(const uint32_t* u, size_t n, uint32_t c) {
  size_t i = 0, cnt = 0;
#if defined(__AVX512F__)
  const __m512i vc = _mm512_set1_epi32(int32_t(c));
  for (; i + 16 <= n; i += 16)
    cnt += size_t(__builtin_popcount(_mm512_cmpge_epu32_mask(_mm512_loadu_si512(u + i), vc)));
#endif
  for (; i < n; ++i) cnt += u[i] >= c;
  return cnt;
}

// The k-th largest of u[0, n) (1 <= k <= n), bit by bit from the top: the largest c with at least
// k entries >= c is that entry. 32 counting passes without a data-dependent branch: selecting
// with nth_element (a mispredicted branch per comparison) cost a 16k-token decode row ~2x more on
// new scores than on the same scores again, so a warm benchmark hid half of its cost.
inline uint32_t kth_largest(const uint32_t* u, size_t n, size_t k) {
  uint32_t t = 0;
  for (int b = 31; b >= 0; --b) {
    const uint32_t c = t | (uint32_t(1) << b);
    if (count_at_least(u, n, c) >= k) t = c;
  }
  return t;
}

// Keeps the best k of idx[base:] (ascending indices of finite entries of v), ascending: the k-th
// largest value key T, then one pass that keeps the entries above T and, of those equal to T, the
// first (lowest-index) ones until there are k: larger value first, then lower index, a strict order.
void keep_best(const float* v, std::vector<int32_t>& idx, size_t base, int64_t k) {
  const size_t n = idx.size() - base;
  if (n <= size_t(k)) return;
  if (k == 0) {
    idx.resize(base);
    return;
  }
  thread_local std::vector<uint32_t> keys;
  keys.resize(n);
  for (size_t i = 0; i < n; ++i) keys[i] = value_key(v[idx[base + i]]);
  const uint32_t kth = kth_largest(keys.data(), n, size_t(k));
  // (kth + 1 does not wrap: a finite value's key is at most 0xFF7FFFFF)
  size_t ties = size_t(k) - count_at_least(keys.data(), n, kth + 1);  // >= 1 of the entries equal to kth
  size_t o = base;
  for (size_t i = 0; i < n; ++i) {
    const bool keep = keys[i] > kth || (keys[i] == kth && ties > 0);
    ties -= keys[i] == kth && ties > 0;
    idx[o] = idx[base + i];
    o += keep;
  }
  idx.resize(o);
}

// Appends the indices c in [c0, c1) with thr <= v[c] < +inf (thr finite: so no NaN), ascending.
// AVX-512: 16 compares per step and the hits' indices compressed into one store into a buffer,
// advanced by their count, then appended to out (no branch on whether a step has a hit: with a
// threshold that 1 in 16 values reach, a third of the steps have none, at random).
void append_at_least(const float* v, int64_t c0, int64_t c1, float thr, std::vector<int32_t>& out) {
  int64_t c = c0;
#if defined(__AVX512F__)
  thread_local std::vector<int32_t> hits;
  if (hits.size() < size_t(c1 - c0) + 16) hits.resize(size_t(c1 - c0) + 16);
  int32_t* h = hits.data();
  const __m512 t = _mm512_set1_ps(thr), inf = _mm512_set1_ps(-kNegInf);
  __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int32_t(c0)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (; c + 16 <= c1; c += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
    const __m512 x = _mm512_loadu_ps(v + c);
    const __mmask16 m = _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x, inf, _CMP_LT_OQ);
    _mm512_storeu_si512(h, _mm512_maskz_compress_epi32(m, idx));
    h += __builtin_popcount(m);
  }
  out.insert(out.end(), hits.data(), h);
#endif
  for (; c < c1; ++c)
    if (v[c] >= thr && v[c] < -kNegInf) out.push_back(int32_t(c));
}

// best_k for a long row, k <= (c1 - c0) / 8: a threshold from every 16th value (the k/8-th best of
// them, so that ~2k entries reach it), then only the entries at or above it (all of the best k are,
// when at least k reach it) go through the selection. False, with out untouched, when fewer than
// k reach it (then the plain path). Selecting among all 16k indices of a decode row through their
// values took ~80-140 us, mostly mispredicted branches.
bool best_k_sampled(const float* v, int64_t c0, int64_t c1, int64_t k, std::vector<int32_t>& out) {
  thread_local std::vector<uint32_t> sample;
  sample.clear();
  for (int64_t c = c0; c < c1; c += 16)
    if (std::isfinite(v[c])) sample.push_back(value_key(v[c]));
  const size_t r = size_t(std::max<int64_t>(k / 8, 1));
  if (sample.size() < 4 * r) return false;
  const float thr = key_value(kth_largest(sample.data(), sample.size(), r));
  const size_t base = out.size();
  append_at_least(v, c0, c1, thr, out);
  if (out.size() - base < size_t(k)) {
    out.resize(base);
    return false;
  }
  keep_best(v, out, base, k);
  return true;
}

// The indices of the min(k, #finite) best finite entries of v[c0, c1) (larger value first, then
// lower index: a strict order, so the best k are one set), appended to out in ascending order.
void best_k(const float* v, int64_t c0, int64_t c1, int64_t k, std::vector<int32_t>& out) {
  if (k > 0 && c1 - c0 >= 8 * k && best_k_sampled(v, c0, c1, k, out)) return;
  const size_t base = out.size();
  for (int64_t c = c0; c < c1; ++c)
    if (std::isfinite(v[c])) out.push_back(int32_t(c));
  keep_best(v, out, base, k);
}

// The row length from which one row's selection (decode: one row over the whole context) runs on
// all threads, each over one contiguous run of the columns (for a decode row, about the run of
// scores its own indexer scan wrote).
constexpr int64_t kTopkChunkedCols = 8192;

}  // namespace

// Same selection as the reference (largest finite values, ties to the lower index, ascending,
// padded with -1), the k-th best value found by counting (kth_largest) instead of a sort. Parallel
// over rows; a long row (decode after a long context) over one run of its columns per thread:
// each run's best k, then the best k of their union, which holds the row's best k (the order is
// strict), so the result is the same.
void topk(const TopkParams& p) {
  if (p.k == 0) return;
  const bool chunked = p.rows < omp_get_max_threads() && p.cols >= kTopkChunkedCols;
  for (int64_t r = 0; chunked && r < p.rows; ++r) {
    const float* v = p.scores + r * p.ld;
    const int64_t chunks = omp_get_max_threads();
    // Kept by the calling thread (no allocation per decode step); `part` names its instance in
    // the parallel region too (a thread_local named there would be each thread's own).
    thread_local std::vector<std::vector<int32_t>> parts;
    thread_local std::vector<int32_t> all;
    std::vector<std::vector<int32_t>>& part = parts;
    part.resize(size_t(chunks));
#pragma omp parallel for schedule(static, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      part[size_t(c)].clear();
      best_k(v, c * p.cols / chunks, (c + 1) * p.cols / chunks, p.k, part[size_t(c)]);
    }
    all.clear();  // the chunks' best, ascending (the chunks are in column order)
    for (const auto& q : part) all.insert(all.end(), q.begin(), q.end());
    keep_best(v, all, 0, p.k);
    int32_t* out = p.indices + r * p.k;
    for (int64_t j = 0; j < p.k; ++j) out[j] = size_t(j) < all.size() ? all[size_t(j)] : -1;
  }
  if (chunked) return;
#pragma omp parallel if (p.rows * p.cols >= (1 << 15))
  {
    thread_local std::vector<int32_t> idx;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* v = p.scores + r * p.ld;
      idx.clear();
      best_k(v, 0, p.cols, p.k, idx);
      int32_t* out = p.indices + r * p.k;
      for (int64_t j = 0; j < p.k; ++j) out[j] = size_t(j) < idx.size() ? idx[size_t(j)] : -1;
    }
  }
}

}  // namespace glm5::kernels::cpu::fast

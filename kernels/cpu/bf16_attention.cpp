// The AVX512-BF16 MLA attention of cpu/bf16_attention.h. A task packs its keys once (bf16 pairs:
// key rows for the scores, pairs of consecutive keys for the values) and runs every query row that
// shares them: in prefill, a block of query rows of one head over the causal prefix of positions
// (or one row over its own selection); in decode, heads of one token over its keys. Each row's
// arithmetic is the recipe whatever tile computes it: a score is its own lane chain and tree, a
// value element its own chain over the row's pairs, so rows never depend on their neighbours.
#include "kernels/cpu/bf16_attention.h"

#include <omp.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/core/check.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/bf16_simd.h"

// GCC 12 reports its own AVX-512 headers' "undefined vector" idiom (the casts and masked loads
// below) as uninitialized use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace glm5::kernels::cpu::bf16 {

#if defined(__x86_64__)
namespace {

using fast::AllowedKeys;

constexpr int64_t kVec = 16;  // dwords (bf16 pairs) per vector
// Dwords of a part of d values: its pairs, padded to whole vectors.
int64_t part_words(int64_t d) { return ((d + 1) / 2 + kVec - 1) / kVec * kVec; }

// Query rows of one head per prefill task: the task packs its keys once for all of them.
constexpr int64_t kPrefillRows = 16;
// Heads per decode task while there are fewer than two rows per thread (one row's heads split over
// the threads, each packing the row's keys); with more rows, all heads of a row in one task.
constexpr int64_t kDecodeHeads = 8;

// Where key t's two parts and its value start (float32 or bf16 elements).
struct KeyRow {
  const void* k1;
  const void* k2;
  const void* v;
};

// One task's keys L[0..n), packed: k[i * kw ...] key L[i] (part 1's pairs, then part 2's, each
// padded with zeros to whole vectors); v[j * vw + d] the value pair (v(L[2j])[d], v(L[2j+1])[d]),
// zeros past dv and, for odd n, in the last pair's second half.
struct Packed {
  int64_t n = 0, kw = 0, vw = 0;
  std::vector<uint32_t> k, v;
};

// Whether 16 float32 are bf16 values already (low halves zero): then f32_to_bf16 is their high
// halves, and the packers skip the rounding (the caches of precision fast hold such values).
GLM5_BF16 inline bool exact_bf16(__m512i u) { return _mm512_test_epi32_mask(u, _mm512_set1_epi32(0xffff)) == 0; }

// x[0..n) as pairs into out[0..words), zeros after (words a multiple of kVec).
GLM5_BF16 void pack_part(const float* x, int64_t n, uint32_t* out, int64_t words) {
  const __m512i odd = high_halves_index();
  for (int64_t c = 0; c < words; c += kVec) {
    const int m = int(std::clamp<int64_t>(n - 2 * c, 0, 32));
    if (m == 32) {
      const __m512i a = _mm512_loadu_si512(x + 2 * c), b = _mm512_loadu_si512(x + 2 * c + 16);
      if (exact_bf16(_mm512_or_si512(a, b))) {
        _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(a, odd, b));
        continue;
      }
    }
    _mm512_storeu_si512(out + c, m > 0 ? pairs32(x + 2 * c, m) : _mm512_setzero_si512());
  }
}
GLM5_BF16 void pack_part(const uint16_t* x, int64_t n, uint32_t* out, int64_t words) {
  for (int64_t c = 0; c < words; c += kVec) {
    const int m = int(std::clamp<int64_t>(n - 2 * c, 0, 32));
    const __mmask32 mask = m == 32 ? __mmask32(~0u) : __mmask32((1u << m) - 1u);
    _mm512_storeu_si512(out + c, _mm512_maskz_loadu_epi16(mask, x + 2 * c));
  }
}

// m (<= 16) values as bf16 in the low halves of 16 dwords, zeros after.
GLM5_BF16 __m512i low_halves(const float* x, int m) {
  const __m512i u = _mm512_maskz_loadu_epi32(__mmask16((1u << m) - 1u), x);
  return _mm512_srli_epi32(exact_bf16(u) ? u : bf16_bits(_mm512_castsi512_ps(u)), 16);
}
GLM5_BF16 __m512i low_halves(const uint16_t* x, int m) {
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(__mmask16((1u << m) - 1u), x));
}

// The value pair (a, b) of dv values each (b null: zeros) into out[0..vw).
template <class T>
GLM5_BF16 void pack_value_pair(const T* a, const T* b, int64_t dv, uint32_t* out, int64_t vw) {
  for (int64_t c = 0; c < vw; c += kVec) {
    const int m = int(std::clamp<int64_t>(dv - c, 0, kVec));
    if constexpr (std::is_same_v<T, float>) {
      if (m == kVec && b) {  // (bf16 values already: the high halves as they are)
        const __m512i u = _mm512_loadu_si512(a + c), w = _mm512_loadu_si512(b + c);
        if (exact_bf16(_mm512_or_si512(u, w))) {
          _mm512_storeu_si512(out + c, _mm512_or_si512(_mm512_srli_epi32(u, 16), w));
          continue;
        }
      }
    }
    __m512i w = low_halves(a + c, m);
    if (b) w = _mm512_or_si512(w, _mm512_slli_epi32(low_halves(b + c, m), 16));
    _mm512_storeu_si512(out + c, w);
  }
}

// Sizes pk for keys L[0..n) (grown, never shrunk: a thread packs one task after another).
void size_keys(Packed& pk, int64_t n, int64_t d1, int64_t d2, int64_t dv) {
  pk.n = n, pk.kw = part_words(d1) + part_words(d2), pk.vw = (dv + kVec - 1) / kVec * kVec;
  if (pk.k.size() < size_t(n * pk.kw)) pk.k.resize(size_t(n * pk.kw));
  if (pk.v.size() < size_t((n + 1) / 2 * pk.vw)) pk.v.resize(size_t((n + 1) / 2 * pk.vw));
}

// Packs keys L[i0..i1) of pk's list (i0 even; elements of type T; row(t) says where key t is).
template <class T, class RowOf>
GLM5_BF16 void pack_keys(Packed& pk, const int32_t* keys, int64_t i0, int64_t i1, int64_t d1, int64_t d2, int64_t dv,
                         RowOf row) {
  const int64_t w1 = part_words(d1);
  for (int64_t i = i0; i < i1; ++i) {
    const KeyRow r = row(keys[i]);
    pack_part(static_cast<const T*>(r.k1), d1, pk.k.data() + i * pk.kw, w1);
    pack_part(static_cast<const T*>(r.k2), d2, pk.k.data() + i * pk.kw + w1, pk.kw - w1);
    if (i % 2 == 0)
      pack_value_pair(static_cast<const T*>(r.v), i + 1 < pk.n ? static_cast<const T*>(row(keys[i + 1]).v) : nullptr,
                      dv, pk.v.data() + i / 2 * pk.vw, pk.vw);
  }
}

// One query (parts at x and x + d1) into out[0..kw).
GLM5_BF16 void pack_query(const float* x, int64_t d1, int64_t d2, int64_t kw, uint32_t* out) {
  const int64_t w1 = part_words(d1);
  pack_part(x, d1, out, w1);
  pack_part(x + d1, d2, out + w1, kw - w1);
}
// Query rows i = 0..rows-1 (at x + i * ld) into out [rows][kw].
void pack_queries(const float* x, int64_t ld, int64_t rows, int64_t d1, int64_t d2, int64_t kw,
                  std::vector<uint32_t>& out) {
  if (out.size() < size_t(rows * kw)) out.resize(size_t(rows * kw));
  uint32_t* o = out.data();
#pragma omp parallel for schedule(static) if (rows * kw >= (int64_t(1) << 16))
  for (int64_t i = 0; i < rows; ++i) pack_query(x + i * ld, d1, d2, kw, o + i * kw);
}

// Lane 4 r + c of the result: the sum of v[r][c]'s lanes by simd::reduce's tree (lanes l + l + 8,
// then + 4, + 2, + 1): the shuffles of simd.h reduce_store_4x4, copied because this code is built
// for its own target (the test holds both to the tree).
GLM5_BF16 inline __attribute__((always_inline)) __m512 reduce_4x4(const __m512 (&v)[4][4]) {
  const auto l1 = [](__m512 a, __m512 b) GLM5_BF16 {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  };
  const auto l2 = [](__m512 a, __m512 b) GLM5_BF16 {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  };
  const auto l3 = [](__m512 a, __m512 b)
                      GLM5_BF16 { return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee)); };
  const auto l4 = [](__m512 a, __m512 b)
                      GLM5_BF16 { return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xdd)); };
  __m512 w[8], z[4];
  for (int j = 0; j < 8; ++j) w[j] = l1(v[(2 * j) % 4][(2 * j) / 4], v[(2 * j + 1) % 4][(2 * j + 1) / 4]);
  for (int j = 0; j < 4; ++j) z[j] = l2(w[2 * j], w[2 * j + 1]);
  return l4(l3(z[0], z[1]), l3(z[2], z[3]));
}

// Scores of MR query rows (packed, q[r]) against keys [i, i + nr) of K (nr <= 4) into out[r][i..]:
// 16 lane chains per row and key, then one reduce_4x4.
template <int MR>
GLM5_BF16 void score_tile(const uint32_t* const* q, const Packed& K, int64_t i, int nr, float scale,
                          float* const* out) {
  const uint32_t* kr[4];
  for (int c = 0; c < 4; ++c) kr[c] = K.k.data() + (i + std::min(c, nr - 1)) * K.kw;
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t w = 0; w < K.kw; w += kVec) {
    __m512i kv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_si512(kr[c] + w);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i qv = _mm512_loadu_si512(q[r] + w);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)qv, (__m512bh)kv[c]);
    }
  }
  const __m512 u = _mm512_mul_ps(reduce_4x4(acc), _mm512_set1_ps(scale));  // (scale * sum, as kExact)
  const __mmask8 cols = __mmask8((1u << nr) - 1u);
  _mm_mask_storeu_ps(out[0] + i, cols, _mm512_castps512_ps128(u));
  if constexpr (MR > 1) _mm_mask_storeu_ps(out[1] + i, cols, _mm512_extractf32x4_ps(u, 1));
  if constexpr (MR > 2) _mm_mask_storeu_ps(out[2] + i, cols, _mm512_extractf32x4_ps(u, 2));
  if constexpr (MR > 3) _mm_mask_storeu_ps(out[3] + i, cols, _mm512_extractf32x4_ps(u, 3));
}

// out[r][d0 + 16 v + e] for r < MR, v < NV (e < last in the last vector) continue their chains
// over the value pairs [j0, j1) with the rows' weight pairs wp[r][j]. kMaskSecond: the pairs'
// second halves are zeroed (the last pair of an odd number of keys).
template <int MR, int NV, bool kMaskSecond>
GLM5_BF16 void value_span(const uint32_t* const* wp, const Packed& V, int64_t j0, int64_t j1, float* const* out,
                          int64_t d0, int last) {
  const __mmask16 lm = __mmask16((1u << last) - 1u);
  __m512 acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = v == NV - 1 ? _mm512_maskz_loadu_ps(lm, out[r] + d0 + 16 * v) : _mm512_loadu_ps(out[r] + d0 + 16 * v);
  const __m512i first_half = _mm512_set1_epi32(0xffff);
  for (int64_t j = j0; j < j1; ++j) {
    const uint32_t* vr = V.v.data() + j * V.vw + d0;
    __m512i vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      vv[v] = _mm512_loadu_si512(vr + 16 * v);
      if constexpr (kMaskSecond) vv[v] = _mm512_and_si512(vv[v], first_half);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i wb = _mm512_set1_epi32(int(wp[r][j]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)wb, (__m512bh)vv[v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (v == NV - 1)
        _mm512_mask_storeu_ps(out[r] + d0 + 16 * v, lm, acc[r][v]);
      else
        _mm512_storeu_ps(out[r] + d0 + 16 * v, acc[r][v]);
    }
}

template <int MR, bool kMaskSecond>
GLM5_BF16 void value_span_n(int nv, const uint32_t* const* wp, const Packed& V, int64_t j0, int64_t j1,
                            float* const* out, int64_t d0, int last) {
  switch (nv) {
    case 1: value_span<MR, 1, kMaskSecond>(wp, V, j0, j1, out, d0, last); break;
    case 2: value_span<MR, 2, kMaskSecond>(wp, V, j0, j1, out, d0, last); break;
    case 3: value_span<MR, 3, kMaskSecond>(wp, V, j0, j1, out, d0, last); break;
    default: value_span<MR, 4, kMaskSecond>(wp, V, j0, j1, out, d0, last); break;
  }
}

// One query row: its packed query, how many of the task's keys it sees (a prefix), its output.
struct Row {
  const uint32_t* q;
  int64_t n;
  float* out;
};

struct Scratch {
  std::vector<float> scores;      // [rows][max n]
  std::vector<uint32_t> weights;  // [rows][ww]: the softmax weights as bf16 pairs
};

// Each thread's buffers, kept between calls (a decode step calls once per layer: fresh buffers of
// a few hundred KiB each time cost page faults that showed in decode's tokens per second), and
// released after a call that grew them past kKeepBytes (in the model, a task sees at most
// index_topk keys: a few MiB at GLM-5's sizes).
thread_local Packed t_keys;
thread_local Scratch t_scratch;
thread_local std::vector<uint32_t> t_queries;  // [rows * heads][kw]
constexpr size_t kKeepBytes = size_t(64) << 20;

template <class T>
void release_if_large(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > kKeepBytes) std::vector<T>().swap(v);
}
// The bytes a call's largest task may hold in these buffers: nk keys of kw dwords and their value
// pairs (vw each), the scores and weights of up to `rows` rows, and the call's packed queries.
size_t task_bytes(int64_t nk, int64_t kw, int64_t vw, int64_t rows, int64_t queries) {
  return size_t(4 * (nk * (kw + vw) + 2 * rows * (nk + 16) + queries * kw));
}
// The calling thread's buffers, and each worker's (one parallel region: every thread its own).
void release_large_buffers() {
  const auto release = [] {
    release_if_large(t_keys.k), release_if_large(t_keys.v), release_if_large(t_queries);
    release_if_large(t_scratch.scores), release_if_large(t_scratch.weights);
  };
  release();
#pragma omp parallel
  release();
}

// Scores: 4 keys at a time against every tile of 4 rows (so the 4 keys come into L1 once for all
// rows; a row's keys up to the longest in its tile: a score never depends on its tile).
GLM5_BF16 void score_all(const Packed& K, const Row* rows, int64_t nrows, int64_t ld, float scale, float* scores) {
  int64_t nmax = 0;
  for (int64_t r = 0; r < nrows; ++r) nmax = std::max(nmax, rows[r].n);
  for (int64_t i = 0; i < nmax; i += 4)
    for (int64_t r0 = 0; r0 < nrows; r0 += 4) {
      const int mr = int(std::min<int64_t>(4, nrows - r0));
      const uint32_t* q[4];
      float* o[4];
      int64_t nk = 0;
      for (int j = 0; j < 4; ++j) {
        const int64_t r = r0 + std::min(j, mr - 1);
        q[j] = rows[r].q, o[j] = scores + r * ld, nk = std::max(nk, rows[r].n);
      }
      if (mr == 4) {
        if (i < nk) score_tile<4>(q, K, i, int(std::min<int64_t>(4, nk - i)), scale, o);
      } else {
        for (int j = 0; j < mr; ++j)
          if (i < rows[r0 + j].n)
            score_tile<1>(q + j, K, i, int(std::min<int64_t>(4, rows[r0 + j].n - i)), scale, o + j);
      }
    }
}

// Values, 64 columns at a time: the pairs every row of a tile of 4 has in full together, then each
// row's own remaining pairs and, for an odd count, its last key alone.
GLM5_BF16 void values_all(const Packed& V, const Row* rows, int64_t nrows, int64_t dv, const uint32_t* weights,
                          int64_t ww) {
  for (int64_t r = 0; r < nrows; ++r) std::fill(rows[r].out, rows[r].out + dv, 0.0f);
  for (int64_t d0 = 0; d0 < dv; d0 += 64) {
    const int64_t cols = std::min<int64_t>(64, dv - d0);
    const int nv = int((cols + 15) / 16), last = int(cols - 16 * (nv - 1));
    for (int64_t r0 = 0; r0 < nrows; r0 += 4) {
      const int mr = int(std::min<int64_t>(4, nrows - r0));
      const uint32_t* wp[4];
      float* o[4];
      int64_t common = std::numeric_limits<int64_t>::max();
      for (int j = 0; j < mr; ++j) {
        wp[j] = weights + (r0 + j) * ww, o[j] = rows[r0 + j].out;
        common = std::min(common, rows[r0 + j].n / 2);
      }
      if (mr == 4)
        value_span_n<4, false>(nv, wp, V, 0, common, o, d0, last);
      else
        common = 0;
      for (int j = 0; j < mr; ++j) {
        const int64_t full = rows[r0 + j].n / 2;
        if (full > common) value_span_n<1, false>(nv, wp + j, V, common, full, o + j, d0, last);
        if (rows[r0 + j].n % 2) value_span_n<1, true>(nv, wp + j, V, full, full + 1, o + j, d0, last);
      }
    }
  }
}

// The recipe for rows that see prefixes of the task's packed keys.
GLM5_BF16 void attend_rows(const Packed& K, const Row* rows, int64_t nrows, int64_t dv, float scale, Scratch& s) {
  int64_t nmax = 1;
  for (int64_t r = 0; r < nrows; ++r) nmax = std::max(nmax, rows[r].n);
  const int64_t ww = part_words(nmax);
  if (s.scores.size() < size_t(nrows * nmax)) s.scores.resize(size_t(nrows * nmax));
  if (s.weights.size() < size_t(nrows * ww)) s.weights.resize(size_t(nrows * ww));
  score_all(K, rows, nrows, nmax, scale, s.scores.data());
  for (int64_t r = 0; r < nrows; ++r) {
    float* w = s.scores.data() + r * nmax;
    fast::softmax_row(w, rows[r].n);
    pack_part(w, rows[r].n, s.weights.data() + r * ww, ww);
  }
  values_all(K, rows, nrows, dv, s.weights.data(), ww);
}

// Where prefill's key t of head h is: its nope part and value in kv_b_proj's expansion, its rope
// part in k_pe (shared by the heads).
KeyRow prefill_key(const MlaPrefillParams& p, int64_t h, int32_t t) {
  const int64_t DKV = p.qk_nope_head_dim + p.v_head_dim;
  const float* k = p.kv + (t * p.n_heads + h) * DKV;
  return KeyRow{k, p.qk_rope_head_dim > 0 ? p.k_pe + t * p.ld_k_pe : nullptr, k + p.qk_nope_head_dim};
}

// Keys per packing item of prefill_dense (even).
constexpr int64_t kPackKeys = 64;

// Dense causal rows (each sees a prefix of positions 0, 1, ...): one head at a time, its keys
// packed once by all threads, then its blocks of query rows.
void prefill_dense(const MlaPrefillParams& p, const AllowedKeys& allowed, const uint32_t* qp, int64_t kw) {
  const int64_t N = p.qk_nope_head_dim, P = p.qk_rope_head_dim, V = p.v_head_dim, H = p.n_heads;
  const int64_t nk = *std::max_element(allowed.len.begin(), allowed.len.end());
  Packed& K = t_keys;  // the calling thread's, shared: the threads pack disjoint keys of it
  size_keys(K, nk, N, P, V);
  const int64_t blocks = (p.s + kPrefillRows - 1) / kPrefillRows, items = (nk + kPackKeys - 1) / kPackKeys;
#pragma omp parallel if (p.s * p.t * H * (N + P + V) >= fast::kParallelMacs)
  {
    Scratch& scratch = t_scratch;
    Row rows[kPrefillRows];
    for (int64_t h = 0; h < H; ++h) {
      const auto row_of = [&](int32_t t) { return prefill_key(p, h, t); };
#pragma omp for schedule(static)
      for (int64_t c = 0; c < items; ++c)
        pack_keys<float>(K, allowed.ptr[0], c * kPackKeys, std::min(nk, (c + 1) * kPackKeys), N, P, V, row_of);
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t s0 = b * kPrefillRows, n = std::min(kPrefillRows, p.s - s0);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t s = s0 + r;
          rows[r] = Row{qp + (s * H + h) * kw, allowed.len[size_t(s)], p.out + (s * H + h) * V};
        }
        attend_rows(K, rows, n, V, p.scale, scratch);
      }
    }
  }
}

// Rows with their own selections: a task per (head, row), packing the row's keys.
void prefill_selected(const MlaPrefillParams& p, const AllowedKeys& allowed, const uint32_t* qp, int64_t kw) {
  const int64_t N = p.qk_nope_head_dim, P = p.qk_rope_head_dim, V = p.v_head_dim, H = p.n_heads;
#pragma omp parallel if (p.s * p.topk_len * H * (N + P + V) >= fast::kParallelMacs)
  {
    Packed& K = t_keys;
    Scratch& scratch = t_scratch;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < p.s; ++s) {
        const int64_t n = allowed.len[size_t(s)];
        size_keys(K, n, N, P, V);
        pack_keys<float>(K, allowed.ptr[size_t(s)], 0, n, N, P, V, [&](int32_t t) { return prefill_key(p, h, t); });
        const Row row{qp + (s * H + h) * kw, n, p.out + (s * H + h) * V};
        attend_rows(K, &row, 1, V, p.scale, scratch);
      }
  }
}

void prefill(const MlaPrefillParams& p) {
  const AllowedKeys allowed(p.s, p.t, p.q_pos, p.topk, p.topk_len, "mla_prefill");
  const int64_t N = p.qk_nope_head_dim, P = p.qk_rope_head_dim;
  const int64_t kw = part_words(N) + part_words(P);
  pack_queries(p.q, N + P, p.s * p.n_heads, N, P, kw, t_queries);
  if (p.topk)
    prefill_selected(p, allowed, t_queries.data(), kw);
  else
    prefill_dense(p, allowed, t_queries.data(), kw);
  const int64_t nk = *std::max_element(allowed.len.begin(), allowed.len.end());
  if (task_bytes(nk, kw, p.v_head_dim + kVec, std::max(kPrefillRows, p.n_heads), p.s * p.n_heads) > kKeepBytes)
    release_large_buffers();
}

// Packs row s's keys from the latent cache into K (float32 or bf16 cache).
void pack_latents(const MlaDecodeParams& p, int64_t s, const int32_t* keys, int64_t n, Packed& K) {
  const int64_t R = p.kv_lora_rank, LAT = R + p.qk_rope_head_dim;
  size_keys(K, n, R, p.qk_rope_head_dim, R);
  if (p.pages.dtype == DType::BF16)
    pack_keys<uint16_t>(K, keys, 0, n, R, p.qk_rope_head_dim, R, [&](int32_t t) {
      const uint16_t* k = static_cast<const uint16_t*>(static_cast<const void*>(p.cache)) + p.pages.row(s, t) * LAT;
      return KeyRow{k, k + R, k};
    });
  else
    pack_keys<float>(K, keys, 0, n, R, p.qk_rope_head_dim, R, [&](int32_t t) {
      const float* k = p.cache + p.pages.row(s, t) * LAT;
      return KeyRow{k, k + R, k};
    });
}

void decode(const MlaDecodeParams& p) {
  CHECK(!p.pages.tiled, "mla_decode: a tiled latent cache");
  const AllowedKeys allowed(p.s, p.t, p.q_pos, p.topk, p.topk_len, "mla_decode");
  const int64_t R = p.kv_lora_rank, P = p.qk_rope_head_dim, LAT = R + P, H = p.n_heads;
  const int64_t kw = part_words(R) + part_words(P);
  pack_queries(p.q_lat, LAT, p.s * H, R, P, kw, t_queries);
  const uint32_t* qp = t_queries.data();  // (inside the region, t_queries names each thread's own)
  const int64_t per_task = p.s >= 2 * omp_get_max_threads() ? H : std::min(H, kDecodeHeads);
  const int64_t blocks = (H + per_task - 1) / per_task;
#pragma omp parallel if (p.s * p.t * H * (LAT + R) >= fast::kParallelMacs)
  {
    Packed& K = t_keys;
    Scratch& scratch = t_scratch;
    std::vector<Row> rows(static_cast<size_t>(per_task));
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < p.s; ++s)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n_keys = allowed.len[size_t(s)], h0 = b * per_task, n = std::min(per_task, H - h0);
        pack_latents(p, s, allowed.ptr[size_t(s)], n_keys, K);
        for (int64_t r = 0; r < n; ++r)
          rows[size_t(r)] = Row{qp + (s * H + h0 + r) * kw, n_keys, p.out_lat + (s * H + h0 + r) * R};
        attend_rows(K, rows.data(), n, R, p.scale, scratch);
      }
  }
  const int64_t nk = *std::max_element(allowed.len.begin(), allowed.len.end());
  if (task_bytes(nk, kw, R + kVec, H, p.s * H) > kKeepBytes) release_large_buffers();
}

}  // namespace
#endif

void mla_prefill(const MlaPrefillParams& p) {
#if defined(__x86_64__)
  CHECK(available(), "bf16::mla_prefill: this CPU has no AVX512-BF16");
  if (p.s > 0) prefill(p);
#else
  (void)p;
  GLM5_FAIL("bf16::mla_prefill: AVX512-BF16 needs x86-64");
#endif
}

void mla_decode(const MlaDecodeParams& p) {
#if defined(__x86_64__)
  CHECK(available(), "bf16::mla_decode: this CPU has no AVX512-BF16");
  if (p.s > 0) decode(p);
#else
  (void)p;
  GLM5_FAIL("bf16::mla_decode: AVX512-BF16 needs x86-64");
#endif
}

std::vector<float> mla_decode_scores(const MlaDecodeParams& p) {
  std::vector<float> out;
#if defined(__x86_64__)
  CHECK(available(), "bf16::mla_decode_scores: this CPU has no AVX512-BF16");
  const AllowedKeys allowed(p.s, p.t, p.q_pos, p.topk, p.topk_len, "mla_decode");
  const int64_t H = p.n_heads, kw = part_words(p.kv_lora_rank) + part_words(p.qk_rope_head_dim);
  std::vector<uint32_t> qp;
  pack_queries(p.q_lat, p.kv_lora_rank + p.qk_rope_head_dim, p.s * H, p.kv_lora_rank, p.qk_rope_head_dim, kw, qp);
  Packed K;
  for (int64_t s = 0; s < p.s; ++s) {
    const int64_t n = allowed.len[size_t(s)];
    pack_latents(p, s, allowed.ptr[size_t(s)], n, K);
    std::vector<Row> rows;
    for (int64_t h = 0; h < H; ++h) rows.push_back(Row{qp.data() + (s * H + h) * kw, n, nullptr});
    std::vector<float> scores(size_t(H * std::max<int64_t>(n, 1)));
    score_all(K, rows.data(), H, std::max<int64_t>(n, 1), p.scale, scores.data());
    for (int64_t h = 0; h < H; ++h)
      out.insert(out.end(), scores.begin() + h * std::max<int64_t>(n, 1),
                 scores.begin() + h * std::max<int64_t>(n, 1) + n);
  }
#else
  (void)p;
  GLM5_FAIL("bf16::mla_decode_scores: AVX512-BF16 needs x86-64");
#endif
  return out;
}

}  // namespace glm5::kernels::cpu::bf16

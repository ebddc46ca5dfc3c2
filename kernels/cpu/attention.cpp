// Fast CPU attention-side ops: MLA prefill (MHA mode), MLA decode (absorbed MQA mode), DSA indexer
// scores, and top-k. OpenMP over (query row, head) blocks; every row is computed by the same
// per-row recipe (16-lane dot products, softmax over the row's allowed keys in ascending order,
// sequential FMA of values) whatever other rows share the call, so results are batch-invariant.
// Not here: online (flash) softmax, which would tie a row's rounding to its key blocking.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/dot_tile.h"
#include "cpu/fast_ops.h"
#include "cpu/reference.h"

namespace glm5::kernels::cpu::fast {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// scale * ([a1 | a2] . [b1 | b2]) with one 16-lane FMA chain over both parts (each part
// zero-padded to a multiple of 16), then simd::reduce.
inline float dot2(const float* a1, const float* b1, int64_t d1, const float* a2, const float* b2,
                  int64_t d2) {
  simd::vf acc = simd::zero();
  int64_t i = 0;
  for (; i + simd::kLanes <= d1; i += simd::kLanes)
    acc = simd::fma(simd::load(a1 + i), simd::load(b1 + i), acc);
  if (i < d1) acc = simd::fma(simd::load_n(a1 + i, int(d1 - i)), simd::load_n(b1 + i, int(d1 - i)), acc);
  for (i = 0; i + simd::kLanes <= d2; i += simd::kLanes)
    acc = simd::fma(simd::load(a2 + i), simd::load(b2 + i), acc);
  if (i < d2) acc = simd::fma(simd::load_n(a2 + i, int(d2 - i)), simd::load_n(b2 + i, int(d2 - i)), acc);
  return simd::reduce(acc);
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
};

// One query row: its two query parts, its allowed keys (ascending) and its output [dv].
struct QueryRow {
  const float* q1;
  const float* q2;
  const int32_t* keys;
  int64_t n_keys;
  float* out;
};

// Keys per block: a block's keys stay in cache while every row of the task uses them.
constexpr int64_t kKeyBlock = 32;
// Output columns accumulated in registers at a time (8 vectors).
constexpr int64_t kOutCols = 128;

// out[0:dv] += sum_{i < n} w[i] * v(keys[i])[0:dv], one sequential FMA chain per element.
void accumulate_values(const KeyValues& kv, const int32_t* keys, const float* w, int64_t n,
                       float* out) {
  int64_t d0 = 0;
  for (; d0 + kOutCols <= kv.dv; d0 += kOutCols) {
    simd::vf acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = simd::load(out + d0 + 16 * j);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = kv.v + keys[i] * kv.v_stride + d0;
      simd::vf wi = simd::splat(w[i]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = simd::fma(wi, simd::load(v + 16 * j), acc[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) simd::store(out + d0 + 16 * j, acc[j]);
  }
  for (; d0 < kv.dv; d0 += simd::kLanes) {  // remaining columns, one vector at a time
    int cnt = int(std::min<int64_t>(simd::kLanes, kv.dv - d0));
    simd::vf acc = simd::load_n(out + d0, cnt);
    for (int64_t i = 0; i < n; ++i)
      acc = simd::fma(simd::splat(w[i]), simd::load_n(kv.v + keys[i] * kv.v_stride + d0, cnt), acc);
    simd::store_n(out + d0, acc, cnt);
  }
}

// Attention for the rows of one task. Keys are visited in blocks of kKeyBlock positions so a
// block is read from memory once for all rows; each row's arithmetic is unaffected by that.
void attend(const KeyValues& kv, const QueryRow* rows, int64_t n_rows, std::vector<float>& scratch) {
  int64_t max_keys = 0, end = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    max_keys = std::max(max_keys, rows[r].n_keys);
    if (rows[r].n_keys) end = std::max<int64_t>(end, rows[r].keys[rows[r].n_keys - 1] + 1);
  }
  scratch.resize(size_t(n_rows * max_keys));
  std::vector<int64_t> cur(size_t(n_rows), 0);
  // Scores.
  for (int64_t t0 = 0; t0 < end; t0 += kKeyBlock) {
    for (int64_t r = 0; r < n_rows; ++r) {
      const QueryRow& q = rows[r];
      float* score = scratch.data() + r * max_keys;
      int64_t& i = cur[size_t(r)];
      for (; i < q.n_keys && q.keys[i] < t0 + kKeyBlock; ++i) {
        int64_t t = q.keys[i];
        score[i] = kv.scale * dot2(q.q1, kv.k1 + t * kv.k1_stride, kv.d1, q.q2,
                                   kv.k2 + t * kv.k2_stride, kv.d2);
      }
    }
  }
  // Softmax weights, in place: w = exp(s - max) / sum.
  for (int64_t r = 0; r < n_rows; ++r) {
    float* w = scratch.data() + r * max_keys;
    const int64_t n = rows[r].n_keys;
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, w[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      w[i] = std::exp(w[i] - mx);
      sum += w[i];
    }
    for (int64_t i = 0; i < n; ++i) w[i] = w[i] / sum;
    std::fill(rows[r].out, rows[r].out + kv.dv, 0.0f);
    cur[size_t(r)] = 0;
  }
  // Weighted values.
  for (int64_t t0 = 0; t0 < end; t0 += kKeyBlock) {
    for (int64_t r = 0; r < n_rows; ++r) {
      const QueryRow& q = rows[r];
      int64_t& i = cur[size_t(r)];
      int64_t j = i;
      while (j < q.n_keys && q.keys[j] < t0 + kKeyBlock) ++j;
      accumulate_values(kv, q.keys + i, scratch.data() + r * max_keys + i, j - i, q.out);
      i = j;
    }
  }
}

// The allowed keys of every query row (ops.h): dense causal rows use a prefix of 0, 1, 2, ...;
// indexer-selected rows get their own sorted, de-duplicated list.
struct AllowedKeys {
  std::vector<int32_t> iota;
  std::vector<std::vector<int32_t>> lists;
  std::vector<const int32_t*> ptr;
  std::vector<int64_t> len;

  AllowedKeys(int64_t s, int64_t t, const int32_t* q_pos, const int32_t* topk, int64_t topk_len,
              const char* op) {
    ptr.resize(size_t(s));
    len.resize(size_t(s));
    if (!topk) {
      iota.resize(size_t(t));
      std::iota(iota.begin(), iota.end(), 0);
      for (int64_t r = 0; r < s; ++r) {
        ptr[r] = iota.data();
        len[r] = std::clamp<int64_t>(int64_t(q_pos[r]) + 1, 0, t);
      }
      return;
    }
    for (int64_t i = 0; i < s * topk_len; ++i)
      CHECK(topk[i] >= -1 && topk[i] < t, op, ": topk entry ", topk[i], " (row ", i / topk_len,
            ", column ", i % topk_len, ") outside [-1, ", t, ")");
    lists.resize(size_t(s));
#pragma omp parallel for schedule(static) if (s * topk_len >= 4096)
    for (int64_t r = 0; r < s; ++r) {
      std::vector<int32_t>& l = lists[size_t(r)];
      const int32_t* sel = topk + r * topk_len;
      for (int64_t j = 0; j < topk_len; ++j)
        if (sel[j] >= 0 && sel[j] <= q_pos[r]) l.push_back(sel[j]);
      std::sort(l.begin(), l.end());
      l.erase(std::unique(l.begin(), l.end()), l.end());
      ptr[r] = l.data();
      len[r] = int64_t(l.size());
    }
  }
};

// Query rows per prefill task (one head) and heads per decode task (one query row).
constexpr int64_t kPrefillRows = 8;
constexpr int64_t kDecodeHeads = 8;

}  // namespace

void mla_prefill(const MlaPrefillParams& p) {
  if (p.s == 0) return;
  AllowedKeys allowed(p.s, p.t, p.q_pos, p.topk, p.topk_len, "mla_prefill");
  const int64_t dq = p.qk_nope_head_dim + p.qk_rope_head_dim;
  const int64_t dkv = p.qk_nope_head_dim + p.v_head_dim;
  const int64_t row_blocks = (p.s + kPrefillRows - 1) / kPrefillRows;
#pragma omp parallel
  {
    std::vector<float> scratch;
    QueryRow rows[kPrefillRows];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t h = 0; h < p.n_heads; ++h)
      for (int64_t b = 0; b < row_blocks; ++b) {
        KeyValues kv{p.kv + h * dkv, p.n_heads * dkv, p.qk_nope_head_dim,
                     p.k_pe, p.ld_k_pe, p.qk_rope_head_dim,
                     p.kv + h * dkv + p.qk_nope_head_dim, p.n_heads * dkv, p.v_head_dim, p.scale};
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
  const int64_t head_blocks = (p.n_heads + kDecodeHeads - 1) / kDecodeHeads;
  const KeyValues kv{p.cache, dk, dk, p.cache, 0, 0, p.cache, dk, p.kv_lora_rank, p.scale};
#pragma omp parallel
  {
    std::vector<float> scratch;
    QueryRow rows[kDecodeHeads];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < p.s; ++s)
      for (int64_t b = 0; b < head_blocks; ++b) {
        int64_t h0 = b * kDecodeHeads, n = std::min(kDecodeHeads, p.n_heads - h0);
        for (int64_t r = 0; r < n; ++r) {
          int64_t h = h0 + r;
          rows[r] = QueryRow{p.q_lat + (s * p.n_heads + h) * dk, nullptr, allowed.ptr[s],
                             allowed.len[s], p.out_lat + (s * p.n_heads + h) * p.kv_lora_rank};
        }
        attend(kv, rows, n, scratch);
      }
  }
}

// Per query row s: dots[h, t] = q[s, h] . k[t] by dot tiles over a block of keys, then
// scores[s, t] = sum_h weights[s, h] * relu(dots[h, t]) in head order.
void indexer_scores(const IndexerScoresParams& p) {
  constexpr int64_t kBlock = 64;
  const int64_t H = p.n_heads, D = p.head_dim;
#pragma omp parallel
  {
    std::vector<float> dots(size_t(H * kBlock));
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < p.s; ++s) {
      float* out = p.scores + s * p.ld_scores;
      const int64_t valid = std::clamp<int64_t>(int64_t(p.q_pos[s]) + 1, 0, p.t);
      const float* q = p.q + s * H * D;
      const float* w = p.weights + s * H;
      for (int64_t t0 = 0; t0 < valid; t0 += kBlock) {
        int64_t nt = std::min(kBlock, valid - t0);
        dot_block<LoadF32>(q, D, p.k + t0 * D, D, H, nt, D, dots.data(), kBlock, false);
        for (int64_t j = 0; j < nt; ++j) {
          float acc = 0.0f;
          for (int64_t h = 0; h < H; ++h) acc += w[h] * std::max(dots[h * kBlock + j], 0.0f);
          out[t0 + j] = acc;
        }
      }
      for (int64_t t = valid; t < p.t; ++t) out[t] = kNegInf;
    }
  }
}

// Same selection as the reference (largest finite values, ties to the lower index, ascending,
// padded with -1), with nth_element instead of a full sort. Parallel over rows.
void topk(const TopkParams& p) {
#pragma omp parallel if (p.rows * p.cols >= (1 << 15))
  {
    std::vector<int32_t> idx;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* v = p.scores + r * p.ld;
      idx.clear();
      for (int64_t c = 0; c < p.cols; ++c)
        if (std::isfinite(v[c])) idx.push_back(int32_t(c));
      size_t keep = std::min<size_t>(idx.size(), size_t(p.k));
      auto before = [v](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
      if (keep < idx.size()) std::nth_element(idx.begin(), idx.begin() + keep, idx.end(), before);
      std::sort(idx.begin(), idx.begin() + keep);
      int32_t* out = p.indices + r * p.k;
      for (int64_t j = 0; j < p.k; ++j) out[j] = size_t(j) < keep ? idx[size_t(j)] : -1;
    }
  }
}

}  // namespace glm5::kernels::cpu::fast

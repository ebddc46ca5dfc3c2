// The cases every backend is checked on, as data: op_cases() lists one call per entry (odd sizes,
// every weight dtype, strides, accumulate, masked rows, top-k wider than the row, ...) to be
// compared with the reference backend; row_cases() lists the batch-invariance probes.
// Backend tests (CPU here, CUDA later) loop over these lists with their own backend.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tests/kernels/op_check.h"

namespace glm5::kernels::test {

namespace cases {

constexpr float kInf = std::numeric_limits<float>::infinity();

inline std::string dtype_str(DType t) { return std::string(dtype_name(t)); }

// gemm: x [m, ldx], W in `dtype` ([n, ld] or [k, ld] when trans), y [m, ldy] (+)= x W^T.
inline OpCase gemm_case(int64_t m, int64_t n, int64_t k, DType dtype, bool trans, bool accumulate, int64_t pad = 0,
                        uint64_t seed = 1) {
  const int64_t ldx = k + pad, ldy = n + 2 * pad;
  const int64_t rows = trans ? k : n, cols = trans ? n : k, ldw = cols + pad;
  auto x = random_floats(size_t(m * ldx), seed);
  auto w = weight_bytes(random_floats(size_t(rows * ldw), seed + 1), dtype);
  auto y0 = random_floats(size_t(m * ldy), seed + 2);
  std::string name = "gemm_m" + std::to_string(m) + "_n" + std::to_string(n) + "_k" + std::to_string(k) + "_" +
                     dtype_str(dtype) + (trans ? "_trans" : "") + (accumulate ? "_acc" : "") + (pad ? "_pad" : "");
  return {name, [=](Buffers& b) {
            GemmParams p;
            p.x = b.in(x);
            p.ldx = ldx;
            p.w = Weight{b.in_bytes(w), dtype, rows, cols, ldw};
            p.trans_w = trans;
            p.y = accumulate ? b.out("y", y0) : b.out("y", size_t(m * ldy));
            p.ldy = ldy;
            p.m = m, p.n = n, p.k = k;
            p.accumulate = accumulate;
            b.backend().gemm(p);
          }};
}

inline OpCase rms_norm_case(int64_t m, int64_t d, bool in_place, uint64_t seed) {
  auto x = random_floats(size_t(m * (d + 3)), seed, -3.0f, 3.0f);
  auto w = random_floats(size_t(d), seed + 1, 0.5f, 1.5f);
  return {"rms_norm_m" + std::to_string(m) + "_d" + std::to_string(d) + (in_place ? "_inplace" : ""), [=](Buffers& b) {
            RmsNormParams p;
            p.weight = b.in(w);
            p.m = m, p.d = d, p.eps = 1e-5f;
            if (in_place) {
              float* xy = b.out("xy", x);
              p.x = xy, p.y = xy, p.ldx = p.ldy = d + 3;
            } else {
              p.x = b.in(x), p.ldx = d + 3;
              p.y = b.out("y", size_t(m * d)), p.ldy = d;
            }
            b.backend().rms_norm(p);
          }};
}

inline OpCase layer_norm_case(int64_t m, int64_t d, bool in_place, uint64_t seed) {
  auto x = random_floats(size_t(m * d), seed, -2.0f, 4.0f);
  auto w = random_floats(size_t(d), seed + 1, 0.5f, 1.5f);
  auto bias = random_floats(size_t(d), seed + 2);
  return {"layer_norm_m" + std::to_string(m) + "_d" + std::to_string(d) + (in_place ? "_inplace" : ""),
          [=](Buffers& b) {
            LayerNormParams p;
            p.weight = b.in(w), p.bias = b.in(bias);
            p.m = m, p.d = d, p.eps = 1e-6f;
            if (in_place) {
              float* xy = b.out("xy", x);
              p.x = xy, p.y = xy, p.ldx = p.ldy = d;
            } else {
              p.x = b.in(x), p.ldx = d;
              p.y = b.out("y", size_t(m * d)), p.ldy = d;
            }
            b.backend().layer_norm(p);
          }};
}

// rope on x [m, token_stride]: n_heads heads of head_stride, slice at offset.
inline OpCase rope_case(int64_t m, int64_t n_heads, int64_t rope_dim, bool interleaved, float mscale, uint64_t seed) {
  const int64_t offset = 5, head_stride = offset + rope_dim + 3, token_stride = n_heads * head_stride + 2;
  auto x = random_floats(size_t(m * token_stride), seed);
  auto pos = random_ints(size_t(m), seed + 1, 0, 5000);
  std::vector<float> inv_freq(size_t(rope_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * float(i) / float(rope_dim));
  return {"rope_m" + std::to_string(m) + "_h" + std::to_string(n_heads) + "_d" + std::to_string(rope_dim) +
              (interleaved ? "_interleaved" : "_half"),
          [=](Buffers& b) {
            RopeParams p;
            p.x = b.out("x", x);
            p.m = m, p.n_heads = n_heads, p.token_stride = token_stride, p.head_stride = head_stride;
            p.offset = offset, p.rope_dim = rope_dim;
            p.positions = b.in(pos);
            p.inv_freq = b.in(inv_freq);
            p.mscale = mscale;
            p.interleaved = interleaved;
            b.backend().rope(p);
          }};
}

// How a case's cache is addressed: contiguous, paged with one block table for every query row, or
// paged with a table per row (each row's blocks elsewhere in the pool, in shuffled order).
enum class Paging { None, Shared, PerRow };

inline std::string paging_str(Paging g) {
  return g == Paging::None ? "" : g == Paging::Shared ? "_paged" : "_paged_rows";
}

// A paged copy of a contiguous cache [t, row] for s query rows: the pool (blocks of `bs` rows
// plus spare blocks that hold garbage) and the block tables, such that every row reads exactly
// the contiguous cache. Returns the pool; `tables` / `ld` get the tables and their stride.
// `tiled`: each block stored transposed, [row][bs] (KeyPages::tiled).
inline std::vector<float> paged_pool(const std::vector<float>& cache, int64_t t, int64_t row, int64_t s, Paging g,
                                     int64_t bs, uint64_t seed, std::vector<int32_t>& tables, int64_t& ld,
                                     bool tiled = false) {
  const int64_t nb = std::max<int64_t>(1, (t + bs - 1) / bs), n_tables = g == Paging::PerRow ? s : 1;
  const int64_t pool_blocks = nb * n_tables + 3;
  std::vector<float> pool = random_floats(size_t(pool_blocks * bs * row), seed, -50.0f, 50.0f);
  std::vector<int32_t> order(static_cast<size_t>(pool_blocks));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int32_t(i);
  auto shuffle = random_ints(order.size(), seed + 1, 0, 1 << 30);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[size_t(shuffle[i - 1]) % i]);
  ld = g == Paging::PerRow ? nb : 0;
  tables.assign(size_t(nb * n_tables), 0);
  for (int64_t r = 0; r < n_tables; ++r)
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t blk = order[size_t(r * nb + j)];
      tables[size_t(r * nb + j)] = blk;
      for (int64_t i = 0; i < bs && j * bs + i < t; ++i)
        for (int64_t d = 0; d < row; ++d) {
          const int64_t at = int64_t(blk) * bs * row + (tiled ? d * bs + i : i * row + d);
          pool[size_t(at)] = cache[size_t((j * bs + i) * row + d)];
        }
    }
  return pool;
}

// Values made bf16-representable (a bf16 KV cache holds exactly these), and their bf16 bits
// packed two per float slot (so a Buffers input can carry them).
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}
inline std::vector<float> pack_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  std::vector<float> out((h.size() + 1) / 2, 0.0f);
  std::memcpy(out.data(), h.data(), h.size() * 2);
  return out;
}

// tile: 0 for keys by rows, else KeyPages::tiled with blocks of `tile` keys (64: the fast cpu
// backend's own tiles, read in place; others go through its gather path).
inline OpCase indexer_case(int64_t s, int64_t t, int64_t heads, int64_t dim, uint64_t seed, Paging g = Paging::None,
                           bool bf16 = false, int64_t tile = 0) {
  auto q = random_floats(size_t(s * heads * dim), seed);
  auto w = random_floats(size_t(s * heads), seed + 1, -0.3f, 0.5f);
  auto k = random_floats(size_t(t * dim), seed + 2);
  auto q_pos = random_ints(size_t(s), seed + 3, -1, int32_t(t) + 2);
  q_pos[0] = int32_t(t) - 1;  // one row that sees every key
  if (g == Paging::PerRow)    // per-row tables cover only the row's own positions
    for (auto& x : q_pos) x = std::min(x, int32_t(t) - 1);
  const int64_t ld = t + 3, bs = tile > 0 ? tile : 4;
  std::vector<int32_t> tables;
  int64_t ld_table = 0;
  if (bf16) k = round_bf16(k);
  if (g != Paging::None) k = paged_pool(k, t, dim, s, g, bs, seed + 5, tables, ld_table, tile > 0);
  const bool packed = bf16 && g != Paging::None;  // a bf16 pool (the contiguous twin stays f32)
  if (packed) k = pack_bf16(k);
  return {"indexer_scores_s" + std::to_string(s) + "_t" + std::to_string(t) + "_h" + std::to_string(heads) + "_d" +
              std::to_string(dim) + paging_str(g) + (bf16 ? "_bf16" : "") +
              (tile > 0 ? "_tiles" + std::to_string(tile) : ""),
          [=](Buffers& b) {
            IndexerScoresParams p;
            p.q = b.in(q), p.weights = b.in(w), p.k = b.in(k), p.q_pos = b.in(q_pos);
            p.scores = b.out("scores", size_t(s * ld));
            p.s = s, p.t = t, p.n_heads = heads, p.head_dim = dim, p.ld_scores = ld;
            if (g != Paging::None)
              p.pages = KeyPages{b.in(tables), ld_table, bs, packed ? DType::BF16 : DType::F32, tile > 0};
            b.backend().indexer_scores(p);
          }};
}

// Scores with ties (values on a coarse grid), -inf, +inf and NaN entries.
inline OpCase topk_case(int64_t rows, int64_t cols, int64_t k, uint64_t seed) {
  auto v = random_floats(size_t(rows * (cols + 1)), seed);
  auto pick = random_ints(v.size(), seed + 1, 0, 19);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = std::round(v[i] * 8.0f) / 8.0f;  // many ties
    if (pick[i] == 0) v[i] = -kInf;
    if (pick[i] == 1 && i % 7 == 0) v[i] = kInf;
    if (pick[i] == 2 && i % 5 == 0) v[i] = std::numeric_limits<float>::quiet_NaN();
  }
  if (rows > 1)  // the last row: nothing finite (a single row keeps its values: long decode rows)
    for (int64_t c = 0; c < cols; ++c) v[size_t((rows - 1) * (cols + 1) + c)] = -kInf;
  return {"topk_r" + std::to_string(rows) + "_c" + std::to_string(cols) + "_k" + std::to_string(k), [=](Buffers& b) {
            TopkParams p;
            p.scores = b.in(v);
            p.rows = rows, p.cols = cols, p.ld = cols + 1, p.k = k;
            p.indices = b.out_i32("indices", size_t(rows * k));
            b.backend().topk(p);
          }};
}

// topk rows for attention: entries in [-1, t), with duplicates, -1 padding and keys beyond q_pos.
inline std::vector<int32_t> attention_topk(int64_t s, int64_t t, int64_t len, uint64_t seed) {
  auto v = random_ints(size_t(s * len), seed, -1, int32_t(t) - 1);
  for (int64_t j = 0; j < len; ++j) v[size_t(j)] = -1;  // row 0: nothing selected -> zeros
  return v;
}

inline OpCase mla_prefill_case(int64_t s, int64_t t, int64_t heads, int64_t nope, int64_t rope, int64_t vdim,
                               int64_t topk_len, uint64_t seed, float scale = 0.0f) {
  const int64_t dq = nope + rope, dkv = nope + vdim, ld_k_pe = rope + 4;
  auto q = random_floats(size_t(s * heads * dq), seed);
  auto kv = random_floats(size_t(t * heads * dkv), seed + 1);
  auto k_pe = random_floats(size_t(t * ld_k_pe), seed + 2);
  auto q_pos = random_ints(size_t(s), seed + 3, 0, int32_t(t) - 1);
  if (s > 1) q_pos[1] = -1;  // a fully masked row
  auto topk = topk_len ? attention_topk(s, t, topk_len, seed + 4) : std::vector<int32_t>{};
  if (scale == 0.0f) scale = 1.0f / std::sqrt(float(dq));
  return {"mla_prefill_s" + std::to_string(s) + "_t" + std::to_string(t) + "_h" + std::to_string(heads) + "_" +
              std::to_string(nope) + "_" + std::to_string(rope) + "_" + std::to_string(vdim) + "_topk" +
              std::to_string(topk_len) + "_scale" + std::to_string(int(scale * 1000)),
          [=](Buffers& b) {
            MlaPrefillParams p;
            p.q = b.in(q), p.kv = b.in(kv), p.k_pe = b.in(k_pe), p.ld_k_pe = ld_k_pe;
            p.q_pos = b.in(q_pos);
            if (topk_len) p.topk = b.in(topk), p.topk_len = topk_len;
            p.out = b.out("out", size_t(s * heads * vdim));
            p.s = s, p.t = t, p.n_heads = heads, p.qk_nope_head_dim = nope;
            p.qk_rope_head_dim = rope, p.v_head_dim = vdim, p.scale = scale;
            b.backend().mla_prefill(p);
          }};
}

inline OpCase mla_decode_case(int64_t s, int64_t t, int64_t heads, int64_t rank, int64_t rope, int64_t topk_len,
                              uint64_t seed, float scale = 0.3f, Paging g = Paging::None, bool bf16 = false) {
  const int64_t dk = rank + rope, bs = 4;
  auto q = random_floats(size_t(s * heads * dk), seed, -0.5f, 0.5f);
  auto cache = random_floats(size_t(t * dk), seed + 1);
  std::vector<int32_t> tables;
  int64_t ld_table = 0;
  if (bf16) cache = round_bf16(cache);
  if (g != Paging::None) cache = paged_pool(cache, t, dk, s, g, bs, seed + 5, tables, ld_table);
  const bool packed = bf16 && g != Paging::None;
  if (packed) cache = pack_bf16(cache);
  auto q_pos = random_ints(size_t(s), seed + 3, 0, int32_t(t) - 1);
  q_pos[0] = int32_t(t) - 1;
  if (s > 1) q_pos[1] = -1;
  auto topk = topk_len ? attention_topk(s, t, topk_len, seed + 4) : std::vector<int32_t>{};
  if (topk_len && s == 1) topk[0] = 0;  // keep the single row from being empty
  return {"mla_decode_s" + std::to_string(s) + "_t" + std::to_string(t) + "_h" + std::to_string(heads) + "_" +
              std::to_string(rank) + "_" + std::to_string(rope) + "_topk" + std::to_string(topk_len) + "_scale" +
              std::to_string(int(scale * 1000)) + paging_str(g) + (bf16 ? "_bf16" : ""),
          [=](Buffers& b) {
            MlaDecodeParams p;
            p.q_lat = b.in(q), p.cache = b.in(cache), p.q_pos = b.in(q_pos);
            if (topk_len) p.topk = b.in(topk), p.topk_len = topk_len;
            p.out_lat = b.out("out_lat", size_t(s * heads * rank));
            p.s = s, p.t = t, p.n_heads = heads, p.kv_lora_rank = rank, p.qk_rope_head_dim = rope;
            p.scale = scale;
            if (g != Paging::None) p.pages = KeyPages{b.in(tables), ld_table, bs, packed ? DType::BF16 : DType::F32};
            b.backend().mla_decode(p);
          }};
}

inline OpCase router_case(int64_t m, int64_t experts, int64_t top_k, int64_t n_group, int64_t topk_group,
                          bool with_bias, bool norm, uint64_t seed) {
  auto logits = random_floats(size_t(m * experts), seed, -4.0f, 4.0f);
  auto bias = random_floats(size_t(experts), seed + 1, -0.2f, 0.2f);
  return {"router_m" + std::to_string(m) + "_e" + std::to_string(experts) + "_k" + std::to_string(top_k) + "_g" +
              std::to_string(n_group) + "_" + std::to_string(topk_group) + (with_bias ? "_bias" : "") +
              (norm ? "_norm" : ""),
          [=](Buffers& b) {
            RouterParams p;
            p.logits = b.in(logits);
            if (with_bias) p.bias = b.in(bias);
            p.m = m, p.n_experts = experts, p.top_k = top_k, p.n_group = n_group;
            p.topk_group = topk_group, p.norm_topk_prob = norm, p.routed_scaling_factor = 2.5f;
            p.expert_weights = b.out("expert_weights", size_t(m * top_k));
            p.expert_ids = b.out_i32("expert_ids", size_t(m * top_k));
            b.backend().router(p);
          }};
}

inline OpCase swiglu_case(int64_t m, int64_t n, uint64_t seed) {
  auto g = random_floats(size_t(m * (n + 1)), seed, -6.0f, 6.0f);
  auto u = random_floats(size_t(m * (n + 1)), seed + 1, -2.0f, 2.0f);
  return {"swiglu_m" + std::to_string(m) + "_n" + std::to_string(n), [=](Buffers& b) {
            SwigluParams p;
            p.gate = b.in(g), p.up = b.in(u), p.ld_in = n + 1;
            p.out = b.out("out", size_t(m * (n + 2))), p.ld_out = n + 2;
            p.m = m, p.n = n;
            b.backend().swiglu(p);
          }};
}

inline OpCase embedding_case(int64_t m, int64_t vocab, int64_t hidden, DType dtype, uint64_t seed) {
  auto table = weight_bytes(random_floats(size_t(vocab * (hidden + 1)), seed), dtype);
  auto ids = random_ints(size_t(m), seed + 1, 0, int32_t(vocab) - 1);
  return {"embedding_m" + std::to_string(m) + "_" + dtype_str(dtype), [=](Buffers& b) {
            EmbeddingParams p;
            p.table = Weight{b.in_bytes(table), dtype, vocab, hidden, hidden + 1};
            p.ids = b.in(ids), p.m = m;
            p.out = b.out("out", size_t(m * hidden));
            b.backend().embedding(p);
          }};
}

inline OpCase gather_rows_case(int64_t n, int64_t src_rows, int64_t d, uint64_t seed) {
  auto src = random_floats(size_t(src_rows * d), seed);
  auto rows = random_ints(size_t(n), seed + 1, 0, int32_t(src_rows) - 1);
  return {"gather_rows_n" + std::to_string(n) + "_d" + std::to_string(d), [=](Buffers& b) {
            GatherRowsParams p;
            p.src = b.in(src), p.rows = b.in(rows), p.n = n, p.d = d;
            p.dst = b.out("dst", size_t(n * d));
            b.backend().gather_rows(p);
          }};
}

inline OpCase moe_combine_case(int64_t m, int64_t top_k, int64_t d, bool accumulate, uint64_t seed) {
  const int64_t slots_n = m * top_k + 3;
  auto expert_out = random_floats(size_t(slots_n * d), seed);
  auto slots = random_ints(size_t(m * top_k), seed + 1, -1, int32_t(slots_n) - 1);
  auto w = random_floats(size_t(m * top_k), seed + 2, 0.0f, 1.0f);
  auto out0 = random_floats(size_t(m * d), seed + 3);
  return {"moe_combine_m" + std::to_string(m) + "_k" + std::to_string(top_k) + "_d" + std::to_string(d) +
              (accumulate ? "_acc" : ""),
          [=](Buffers& b) {
            MoeCombineParams p;
            p.expert_out = b.in(expert_out), p.slots = b.in(slots), p.weights = b.in(w);
            p.out = accumulate ? b.out("out", out0) : b.out("out", size_t(m * d));
            p.m = m, p.top_k = top_k, p.d = d, p.accumulate = accumulate;
            b.backend().moe_combine(p);
          }};
}

inline OpCase add_case(int64_t n, uint64_t seed) {
  auto x = random_floats(size_t(n), seed), y = random_floats(size_t(n), seed + 1);
  return {"add_n" + std::to_string(n), [=](Buffers& b) {
            AddParams p;
            p.x = b.in(x), p.y = b.out("y", y), p.n = n;
            b.backend().add(p);
          }};
}

inline OpCase copy_2d_case(int64_t rows, int64_t cols, uint64_t seed) {
  auto src = random_floats(size_t(rows * (cols + 5)), seed);
  return {"copy_2d_r" + std::to_string(rows) + "_c" + std::to_string(cols), [=](Buffers& b) {
            Copy2dParams p;
            p.src = b.in(src), p.ld_src = cols + 5;
            p.dst = b.out("dst", size_t(rows * (cols + 2))), p.ld_dst = cols + 2;
            p.rows = rows, p.cols = cols;
            b.backend().copy_2d(p);
          }};
}

// F32 -> BF16 (rounding) -> F32 (exact) through a bf16 buffer: a bf16 KV cache's write and read.
inline OpCase copy_2d_bf16_case(int64_t rows, int64_t cols, uint64_t seed) {
  auto src = random_floats(size_t(rows * (cols + 5)), seed, -300.0f, 300.0f);
  return {"copy_2d_bf16_r" + std::to_string(rows) + "_c" + std::to_string(cols), [=](Buffers& b) {
            const int64_t ld_mid = cols + 3;
            void* mid = const_cast<float*>(b.in(std::vector<float>(size_t(rows * ld_mid + 1) / 2 + 1, 0.0f)));
            b.backend().copy_2d({b.in(src), cols + 5, mid, ld_mid, rows, cols, DType::F32, DType::BF16});
            float* dst = b.out("dst", size_t(rows * (cols + 2)));
            b.backend().copy_2d({mid, ld_mid, dst, cols + 2, rows, cols, DType::BF16, DType::F32});
          }};
}

// The KV cache write of a step: n rows to their positions in a paged pool (per-row block tables
// of 4-position blocks, rows of a few sequences), F32 or BF16 pool; the pool is the output (a
// bf16 pool read back through copy_2d).
inline OpCase paged_write_case(int64_t n, int64_t width, bool bf16, uint64_t seed, bool tiled = false) {
  const int64_t bs = 4, seqs = 3, per_seq = (n + seqs - 1) / seqs, nb = (per_seq + bs - 1) / bs + 1;
  auto src = random_floats(size_t(n * (width + 1)), seed, -200.0f, 200.0f);
  std::vector<int32_t> pos(static_cast<size_t>(n)), tables(size_t(n * nb));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q = i % seqs;  // row i belongs to sequence q at position i / seqs + 1
    pos[size_t(i)] = int32_t(i / seqs + 1);
    for (int64_t j = 0; j < nb; ++j) tables[size_t(i * nb + j)] = int32_t(q + seqs * (nb - 1 - j));  // interleaved
  }
  const int64_t pool_rows = seqs * nb * bs;
  auto pool0 = random_floats(size_t(pool_rows * width), seed + 1);
  return {"paged_write_n" + std::to_string(n) + "_w" + std::to_string(width) + (bf16 ? "_bf16" : "") +
              (tiled ? "_tiled" : ""),
          [=](Buffers& b) {
            PagedWriteParams p;
            p.src = b.in(src), p.ld_src = width + 1, p.pos = b.in(pos), p.n = n, p.width = width;
            p.pages = KeyPages{b.in(tables), nb, bs, bf16 ? DType::BF16 : DType::F32, tiled};
            if (!bf16) {
              p.pool = b.out("pool", pool0);
              b.backend().paged_write(p);
              return;
            }
            void* pool = const_cast<float*>(b.in(pack_bf16(pool0)));
            p.pool = pool;
            b.backend().paged_write(p);
            float* out = b.out("pool", size_t(pool_rows * width));
            b.backend().copy_2d({pool, width, out, width, pool_rows, width, DType::BF16, DType::F32});
          }};
}

}  // namespace cases

// Every op at several sizes, to be compared with the reference backend.
// Pairs of (contiguous, paged) cases over the same logical cache: their outputs must be bitwise
// equal on any backend (paging changes where a key is read, never how it is used).
inline std::vector<std::pair<OpCase, OpCase>> paging_pairs() {
  using namespace cases;
  std::vector<std::pair<OpCase, OpCase>> v;
  for (Paging g : {Paging::Shared, Paging::PerRow}) {
    // (The per-row variant clamps q_pos to t - 1, which changes nothing: a row sees at most t keys.)
    v.push_back({indexer_case(9, 70, 8, 128, 902, Paging::None), indexer_case(9, 70, 8, 128, 902, g)});
    // Other head shapes: 16 heads of 64 (150 keys), 32 heads of 128 (GLM-5's indexer).
    v.push_back({indexer_case(9, 150, 16, 64, 907, Paging::None), indexer_case(9, 150, 16, 64, 907, g)});
    v.push_back({indexer_case(9, 70, 32, 128, 908, Paging::None), indexer_case(9, 70, 32, 128, 908, g)});
    v.push_back({mla_decode_case(4, 70, 9, 512, 64, 50, 903, 0.3f, Paging::None),
                 mla_decode_case(4, 70, 9, 512, 64, 50, 903, 0.3f, g)});
    v.push_back({mla_decode_case(3, 90, 5, 40, 8, 0, 904, 0.3f, Paging::None),
                 mla_decode_case(3, 90, 5, 40, 8, 0, 904, 0.3f, g)});
    // A bf16 pool against f32 rows holding the same (bf16-representable) values.
    v.push_back({indexer_case(9, 70, 8, 128, 905, Paging::None, true), indexer_case(9, 70, 8, 128, 905, g, true)});
    v.push_back({mla_decode_case(4, 70, 9, 512, 64, 50, 906, 0.3f, Paging::None, true),
                 mla_decode_case(4, 70, 9, 512, 64, 50, 906, 0.3f, g, true)});
    // Indexer keys in tiles, f32 and bf16, one row and several (decode and prefill): of 64 (the
    // runtime's blocks on the fast cpu backend, read in place; 150 keys end in a partial tile),
    // speed-a's 8 x 64, GLM-5's 32 x 128 and 6 heads; then tiles of 4 and 128 (its gather path).
    struct Shape {
      int64_t t, heads, dim, tile;
    };
    for (bool bf16 : {false, true})
      for (int64_t rows : {1, 9})
        for (Shape h : {Shape{150, 8, 64, 64}, Shape{150, 32, 128, 64}, Shape{150, 6, 64, 64}, Shape{70, 32, 128, 4},
                        Shape{300, 8, 64, 128}})
          v.push_back({indexer_case(rows, h.t, h.heads, h.dim, 909, Paging::None, bf16),
                       indexer_case(rows, h.t, h.heads, h.dim, 909, g, bf16, h.tile)});
  }
  return v;
}

inline std::vector<OpCase> op_cases() {
  using namespace cases;
  std::vector<OpCase> v;
  uint64_t seed = 100;
  for (DType dt : {DType::BF16, DType::F16, DType::F32})
    for (int64_t m : {1, 3, 17, 64})
      for (bool trans : {false, true}) {
        v.push_back(gemm_case(m, 37, 83, dt, trans, m == 3, 0, seed++));
        v.push_back(gemm_case(m, 129, 300, dt, trans, m == 17, m == 64 ? 3 : 0, seed++));
      }
  v.push_back(gemm_case(9, 70, 1100, DType::BF16, false, false, 1, seed++));  // k chunks + tail
  v.push_back(gemm_case(5, 200, 2048, DType::BF16, false, true, 0, seed++));
  v.push_back(gemm_case(2, 1030, 64, DType::BF16, false, false, 0, seed++));  // many column blocks
  v.push_back(gemm_case(6, 70, 0, DType::BF16, false, true, 0, seed++));      // k = 0
  v.push_back(gemm_case(6, 70, 0, DType::F32, false, false, 0, seed++));
  v.push_back(gemm_case(0, 70, 20, DType::BF16, false, false, 0, seed++));   // m = 0
  v.push_back(gemm_case(5, 517, 192, DType::BF16, true, false, 2, seed++));  // q absorption shape
  for (int64_t m : {1, 5})
    for (int64_t d : {7, 100, 6144}) {
      v.push_back(rms_norm_case(m, d, false, seed++));
      v.push_back(layer_norm_case(m, d, false, seed++));
    }
  v.push_back(rms_norm_case(40, 1000, true, seed++));  // large enough to run threaded
  v.push_back(layer_norm_case(3, 128, true, seed++));
  for (bool inter : {true, false}) {
    v.push_back(rope_case(1, 1, 6, inter, 1.0f, seed++));
    v.push_back(rope_case(7, 3, 64, inter, 1.3f, seed++));
    v.push_back(rope_case(300, 4, 64, inter, 1.0f, seed++));
  }
  v.push_back(indexer_case(1, 1, 3, 20, seed++));
  v.push_back(indexer_case(5, 37, 3, 20, seed++));
  v.push_back(indexer_case(9, 70, 8, 128, seed++));
  v.push_back(indexer_case(2, 130, 32, 128, seed++));
  for (Paging g : {Paging::Shared, Paging::PerRow}) {
    v.push_back(indexer_case(5, 37, 3, 20, 901, g));
    v.push_back(indexer_case(9, 70, 8, 128, 902, g));
    v.push_back(mla_decode_case(4, 70, 9, 512, 64, 50, 903, 0.3f, g));
    v.push_back(mla_decode_case(3, 90, 5, 40, 8, 0, 904, 0.3f, g));
  }
  for (int64_t k : {1, 10, 150}) v.push_back(topk_case(6, 100, k, seed++));
  v.push_back(topk_case(3, 2100, 2048, seed++));
  for (int64_t topk_len : {0, 1}) {  // one token alone
    v.push_back(mla_prefill_case(1, 1, 1, 8, 4, 8, topk_len, seed++));
    v.push_back(mla_decode_case(1, 1, 2, 16, 4, topk_len, seed++));
  }
  for (int64_t topk_len : {0, 5, 50}) {  // 50 > t for some cases: top-k wider than the context
    v.push_back(mla_prefill_case(9, 40, 3, 24, 8, 20, topk_len, seed++));
    v.push_back(mla_prefill_case(5, 70, 2, 192, 64, 256, topk_len, seed++));
    v.push_back(mla_decode_case(1, 90, 5, 40, 8, topk_len, seed++));
    v.push_back(mla_decode_case(4, 70, 9, 512, 64, topk_len, seed++));
  }
  // Sharp softmax: score gaps of hundreds, so most weights underflow to 0.
  v.push_back(mla_prefill_case(9, 40, 3, 24, 8, 20, 0, seed++, 40.0f));
  v.push_back(mla_decode_case(3, 90, 5, 40, 8, 0, seed++, 60.0f));
  v.push_back(router_case(7, 16, 4, 4, 2, true, true, seed++));
  v.push_back(router_case(5, 32, 8, 1, 1, true, true, seed++));
  v.push_back(router_case(3, 64, 6, 8, 3, false, false, seed++));
  v.push_back(router_case(600, 256, 8, 8, 4, true, true, seed++));  // threaded
  for (int64_t m : {1, 13}) v.push_back(swiglu_case(m, 77, seed++));
  v.push_back(swiglu_case(100, 2000, seed++));
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) v.push_back(embedding_case(6, 50, 37, dt, seed++));
  v.push_back(gather_rows_case(9, 5, 33, seed++));
  v.push_back(gather_rows_case(300, 40, 300, seed++));
  for (bool acc : {false, true}) {
    v.push_back(moe_combine_case(1, 8, 33, acc, seed++));
    v.push_back(moe_combine_case(70, 4, 500, acc, seed++));
  }
  v.push_back(add_case(1, seed++));
  v.push_back(add_case(100000, seed++));
  v.push_back(copy_2d_case(3, 17, seed++));
  v.push_back(copy_2d_case(200, 300, seed++));
  v.push_back(copy_2d_bf16_case(3, 17, seed++));
  v.push_back(copy_2d_bf16_case(64, 576, seed++));
  for (bool bf16 : {false, true}) {
    v.push_back(paged_write_case(1, 576, bf16, seed++));
    v.push_back(paged_write_case(37, 128, bf16, seed++));
    v.push_back(paged_write_case(37, 128, bf16, seed++, true));
  }
  for (Paging g : {Paging::Shared, Paging::PerRow}) {
    v.push_back(indexer_case(9, 70, 8, 128, 905, g, true));
    v.push_back(mla_decode_case(4, 70, 9, 512, 64, 50, 906, 0.3f, g, true));
  }
  // trans_w BF16 column tails: one row's 256-column items (then 25 or 16 columns), 4-row items of 64
  // (then 24; 48 = 32 + 16), with accumulate and padded strides
  v.push_back(gemm_case(1, 281, 40, DType::BF16, true, true, 3, 907));
  v.push_back(gemm_case(1, 272, 33, DType::BF16, true, false, 0, 908));
  v.push_back(gemm_case(3, 88, 50, DType::BF16, true, true, 1, 909));
  v.push_back(gemm_case(2, 48, 20, DType::BF16, true, false, 0, 910));
  return v;
}

// Batch-invariance probes: gemm (streamed and buffered paths, all dtypes, trans) and the
// attention ops, plus the row-wise ops that have their own fast code.
inline std::vector<RowCase> row_cases() {
  using namespace cases;
  std::vector<RowCase> v;
  auto gemm_probe = [](DType dtype, bool trans, int64_t n, int64_t k) {
    const int64_t wr = trans ? k : n, wc = trans ? n : k;
    auto w = weight_bytes(random_floats(size_t(wr * wc), 7), dtype);
    auto xp = random_floats(size_t(k), 8);
    return RowCase{
        "gemm_" + dtype_str(dtype) + (trans ? "_trans" : "") + "_n" + std::to_string(n) + "_k" + std::to_string(k),
        [=](Buffers& b, int64_t rows, int64_t probe) {
          auto x = random_floats(size_t(rows * k), 1000 + uint64_t(rows));
          std::copy(xp.begin(), xp.end(), x.begin() + probe * k);
          GemmParams p;
          p.x = b.in(x), p.ldx = k;
          p.w = Weight{b.in_bytes(w), dtype, wr, wc, wc};
          p.trans_w = trans;
          p.y = b.out("y", size_t(rows * n)), p.ldy = n;
          p.m = rows, p.n = n, p.k = k;
          b.backend().gemm(p);
          return std::pair<size_t, size_t>(size_t(probe * n), size_t(n));
        }};
  };
  v.push_back(gemm_probe(DType::BF16, false, 77, 1100));
  v.push_back(gemm_probe(DType::BF16, false, 300, 2048));
  v.push_back(gemm_probe(DType::F16, false, 45, 333));
  v.push_back(gemm_probe(DType::F32, false, 45, 333));
  v.push_back(gemm_probe(DType::BF16, true, 130, 192));
  v.push_back(gemm_probe(DType::BF16, true, 300, 64));  // one row: a 256-column item, then 44
  v.push_back(gemm_probe(DType::F32, true, 45, 33));

  // Attention: keys fixed, query rows vary; the probe row has fixed q, q_pos and topk.
  const int64_t T = 75;
  auto keys_topk = [T](int64_t rows, int64_t probe, int64_t len, const std::vector<int32_t>& probe_sel) {
    auto sel = random_ints(size_t(rows * len), 2000 + uint64_t(rows), -1, int32_t(T) - 1);
    std::copy(probe_sel.begin(), probe_sel.end(), sel.begin() + probe * len);
    return sel;
  };
  auto qpos_rows = [T](int64_t rows, int64_t probe, int32_t probe_pos) {
    auto qp = random_ints(size_t(rows), 3000 + uint64_t(rows), -1, int32_t(T) - 1);
    qp[size_t(probe)] = probe_pos;
    return qp;
  };
  for (int64_t len : {0, 40}) {
    const int64_t H = 3, nope = 40, rope = 16, vd = 36, dq = nope + rope, dkv = nope + vd;
    auto kv = random_floats(size_t(T * H * dkv), 11);
    auto k_pe = random_floats(size_t(T * rope), 12);
    auto qp = random_floats(size_t(H * dq), 13);
    auto sel = random_ints(size_t(len), 14, -1, int32_t(T) - 1);
    v.push_back(RowCase{"mla_prefill_topk" + std::to_string(len), [=](Buffers& b, int64_t rows, int64_t probe) {
                          auto q = random_floats(size_t(rows * H * dq), 4000 + uint64_t(rows));
                          std::copy(qp.begin(), qp.end(), q.begin() + probe * H * dq);
                          auto q_pos = qpos_rows(rows, probe, 60);
                          auto topk = keys_topk(rows, probe, len, sel);
                          MlaPrefillParams p;
                          p.q = b.in(q), p.kv = b.in(kv), p.k_pe = b.in(k_pe), p.ld_k_pe = rope;
                          p.q_pos = b.in(q_pos);
                          if (len) p.topk = b.in(topk), p.topk_len = len;
                          p.out = b.out("out", size_t(rows * H * vd));
                          p.s = rows, p.t = T, p.n_heads = H, p.qk_nope_head_dim = nope;
                          p.qk_rope_head_dim = rope, p.v_head_dim = vd, p.scale = 0.125f;
                          b.backend().mla_prefill(p);
                          return std::pair<size_t, size_t>(size_t(probe * H * vd), size_t(H * vd));
                        }});
  }
  for (int64_t len : {0, 40}) {
    const int64_t H = 10, rank = 136, rope = 16, dk = rank + rope;
    auto cache = random_floats(size_t(T * dk), 21);
    auto qp = random_floats(size_t(H * dk), 22, -0.5f, 0.5f);
    auto sel = random_ints(size_t(len), 24, -1, int32_t(T) - 1);
    v.push_back(RowCase{"mla_decode_topk" + std::to_string(len), [=](Buffers& b, int64_t rows, int64_t probe) {
                          auto q = random_floats(size_t(rows * H * dk), 5000 + uint64_t(rows));
                          std::copy(qp.begin(), qp.end(), q.begin() + probe * H * dk);
                          auto q_pos = qpos_rows(rows, probe, int32_t(T) - 1);
                          auto topk = keys_topk(rows, probe, len, sel);
                          MlaDecodeParams p;
                          p.q_lat = b.in(q), p.cache = b.in(cache), p.q_pos = b.in(q_pos);
                          if (len) p.topk = b.in(topk), p.topk_len = len;
                          p.out_lat = b.out("out_lat", size_t(rows * H * rank));
                          p.s = rows, p.t = T, p.n_heads = H, p.kv_lora_rank = rank;
                          p.qk_rope_head_dim = rope, p.scale = 0.2f;
                          b.backend().mla_decode(p);
                          return std::pair<size_t, size_t>(size_t(probe * H * rank), size_t(H * rank));
                        }});
  }
  {
    const int64_t H = 6, D = 72;
    auto k = random_floats(size_t(T * D), 31);
    auto qp = random_floats(size_t(H * D), 32);
    auto wp = random_floats(size_t(H), 33);
    v.push_back(RowCase{"indexer_scores", [=](Buffers& b, int64_t rows, int64_t probe) {
                          auto q = random_floats(size_t(rows * H * D), 6000 + uint64_t(rows));
                          auto w = random_floats(size_t(rows * H), 7000 + uint64_t(rows));
                          std::copy(qp.begin(), qp.end(), q.begin() + probe * H * D);
                          std::copy(wp.begin(), wp.end(), w.begin() + probe * H);
                          auto q_pos = qpos_rows(rows, probe, 50);
                          IndexerScoresParams p;
                          p.q = b.in(q), p.weights = b.in(w), p.k = b.in(k), p.q_pos = b.in(q_pos);
                          p.scores = b.out("scores", size_t(rows * T));
                          p.s = rows, p.t = T, p.n_heads = H, p.head_dim = D, p.ld_scores = T;
                          b.backend().indexer_scores(p);
                          return std::pair<size_t, size_t>(size_t(probe * T), size_t(T));
                        }});
  }
  {
    const int64_t d = 1000;
    auto xp = random_floats(size_t(d), 41, -3.0f, 3.0f);
    auto w = random_floats(size_t(d), 42);
    v.push_back(RowCase{"rms_norm", [=](Buffers& b, int64_t rows, int64_t probe) {
                          auto x = random_floats(size_t(rows * d), 8000 + uint64_t(rows));
                          std::copy(xp.begin(), xp.end(), x.begin() + probe * d);
                          RmsNormParams p;
                          p.x = b.in(x), p.ldx = d, p.weight = b.in(w);
                          p.y = b.out("y", size_t(rows * d)), p.ldy = d;
                          p.m = rows, p.d = d;
                          b.backend().rms_norm(p);
                          return std::pair<size_t, size_t>(size_t(probe * d), size_t(d));
                        }});
  }
  {
    const int64_t top_k = 4, d = 700, n_slots = 300;
    auto expert_out = random_floats(size_t(n_slots * d), 51);
    auto sp = std::vector<int32_t>{17, -1, 3, 250};
    auto wp = random_floats(size_t(top_k), 52, 0.0f, 1.0f);
    v.push_back(RowCase{"moe_combine", [=](Buffers& b, int64_t rows, int64_t probe) {
                          auto slots =
                              random_ints(size_t(rows * top_k), 9000 + uint64_t(rows), -1, int32_t(n_slots) - 1);
                          auto w = random_floats(size_t(rows * top_k), 9500 + uint64_t(rows));
                          std::copy(sp.begin(), sp.end(), slots.begin() + probe * top_k);
                          std::copy(wp.begin(), wp.end(), w.begin() + probe * top_k);
                          MoeCombineParams p;
                          p.expert_out = b.in(expert_out), p.slots = b.in(slots), p.weights = b.in(w);
                          p.out = b.out("out", size_t(rows * d));
                          p.m = rows, p.top_k = top_k, p.d = d;
                          b.backend().moe_combine(p);
                          return std::pair<size_t, size_t>(size_t(probe * d), size_t(d));
                        }});
  }
  return v;
}

}  // namespace glm5::kernels::test

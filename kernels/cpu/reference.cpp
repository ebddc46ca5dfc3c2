// The reference backend: every op of ops.h as a plain single-threaded float32 loop, written to be
// read against the comments in ops.h. It is the spec other backends are compared with, so it
// favours the obvious formula over speed (weights are widened element by element, softmax is
// three passes, top-k is a full sort). Also the parameter checks shared by the CPU backends.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace glm5::kernels::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool weight_dtype_ok(DType t) {
  return t == DType::BF16 || t == DType::F16 || t == DType::F32 || quant::is_quantized(t);
}

void check_weight_dtype(const char* op, const Weight& w) {
  CHECK(weight_dtype_ok(w.dtype), op, ": weight dtype ", dtype_name(w.dtype),
        " is not supported by the CPU backends (expected BF16, F16, F32, F8_E4M3 or pack-quantized int4/int8)");
  if (!quant::is_quantized(w.dtype)) return;
  CHECK(w.scale && w.group > 0 && w.scale_block_rows > 0 && w.scale_ld >= (w.cols + w.group - 1) / w.group, op, ": ",
        dtype_name(w.dtype), " weight [", w.rows, ", ", w.cols, "] without valid scales (group ", w.group,
        ", scale_ld ", w.scale_ld, ")");
  CHECK(w.dtype != DType::Q4 || w.ld % 2 == 0, op, ": int4 weight ld ", w.ld, " is odd");
}

// NaN sorts below everything, so comparisons stay a strict weak order on any input.
float order_key(float v) { return std::isnan(v) ? kNegInf : v; }

// Larger value first, ties to the lower index: the selection order of topk and router.
struct ByValueDesc {
  const float* v;
  bool operator()(int32_t a, int32_t b) const {
    float ka = order_key(v[a]), kb = order_key(v[b]);
    return ka > kb || (ka == kb && a < b);
  }
};

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Softmax over `score` followed by out[0:dv] = sum_t w[t] * value(t), t in list order.
// An empty list gives zeros.
template <class ValueAt>
void softmax_weighted_sum(const std::vector<float>& score, const std::vector<int32_t>& keys, ValueAt value, int64_t dv,
                          float* out) {
  for (int64_t d = 0; d < dv; ++d) out[d] = 0.0f;
  if (keys.empty()) return;
  float mx = kNegInf;
  for (float s : score) mx = std::max(mx, s);
  std::vector<float> w(score.size());
  float sum = 0.0f;
  for (size_t i = 0; i < score.size(); ++i) {
    w[i] = std::exp(score[i] - mx);
    sum += w[i];
  }
  for (size_t i = 0; i < score.size(); ++i) w[i] = w[i] / sum;
  for (size_t i = 0; i < keys.size(); ++i) {
    const float* v = value(keys[i]);
    for (int64_t d = 0; d < dv; ++d) out[d] += w[i] * v[d];
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parameter checks.

void validate(const GemmParams& p) {
  CHECK(p.m >= 0 && p.n >= 0 && p.k >= 0, "gemm: negative size m = ", p.m, ", n = ", p.n, ", k = ", p.k);
  check_weight_dtype("gemm", p.w);
  int64_t want_rows = p.trans_w ? p.k : p.n, want_cols = p.trans_w ? p.n : p.k;
  CHECK(p.w.rows == want_rows && p.w.cols == want_cols, "gemm: weight is [", p.w.rows, ", ", p.w.cols,
        "] but m = ", p.m, ", n = ", p.n, ", k = ", p.k, ", trans_w = ", p.trans_w, " need [", want_rows, ", ",
        want_cols, "]");
  CHECK(p.w.ld >= p.w.cols, "gemm: weight ld ", p.w.ld, " < cols ", p.w.cols);
  if (p.w.layout == WeightLayout::kQuad16)
    CHECK(!p.trans_w && !quant::is_quantized(p.w.dtype) && p.w.ld % 16 == 0, "gemm: an interleaved (kQuad16) ",
          dtype_name(p.w.dtype), " weight with ld ", p.w.ld, " and trans_w = ", p.trans_w,
          ": the layout holds only BF16/F16/F32 rows used as y = x W^T, ld a multiple of 16");
  if (p.w.layout == WeightLayout::kTile16)
    CHECK(!p.trans_w && p.w.dtype == DType::BF16 && p.w.ld % 32 == 0, "gemm: an interleaved (kTile16) ",
          dtype_name(p.w.dtype), " weight with ld ", p.w.ld, " and trans_w = ", p.trans_w,
          ": the layout holds only BF16 rows used as y = x W^T, ld a multiple of 32");
  if (p.w.layout == WeightLayout::kPair16)
    CHECK(!p.trans_w && p.w.dtype == DType::BF16 && p.w.ld % 2 == 0, "gemm: an interleaved (kPair16) ",
          dtype_name(p.w.dtype), " weight with ld ", p.w.ld, " and trans_w = ", p.trans_w,
          ": the layout holds only BF16 rows used as y = x W^T, ld even");
  if (p.w.layout == WeightLayout::kQuantQuad)
    CHECK(!p.trans_w && quant_quad_fits(p.w.dtype, p.w.cols, p.w.ld, p.w.group),
          "gemm: a quad-interleaved (kQuantQuad) ", dtype_name(p.w.dtype), " weight [", p.w.rows, ", ", p.w.cols,
          "] with ld ", p.w.ld, ", group ", p.w.group, " and trans_w = ", p.trans_w,
          ": the layout holds only quantized rows used as y = x W^T, cols = ld a multiple of 64 (int4: ld and "
          "group multiples of 128)");
  CHECK(p.ldx >= p.k, "gemm: ldx ", p.ldx, " < k ", p.k);
  CHECK(p.ldy >= p.n, "gemm: ldy ", p.ldy, " < n ", p.n);
  if (p.m > 0 && p.n > 0) {
    CHECK(p.y, "gemm: y is null");
    CHECK(p.k == 0 || (p.x && p.w.data), "gemm: x or weight data is null");
  }
}

void validate(const RmsNormParams& p) {
  CHECK(p.m >= 0 && p.d > 0, "rms_norm: need m >= 0 and d > 0, found m = ", p.m, ", d = ", p.d);
  CHECK(p.ldx >= p.d && p.ldy >= p.d, "rms_norm: ldx ", p.ldx, " / ldy ", p.ldy, " < d ", p.d);
  CHECK(p.m == 0 || (p.x && p.y && p.weight), "rms_norm: null pointer");
}

void validate(const LayerNormParams& p) {
  CHECK(p.m >= 0 && p.d > 0, "layer_norm: need m >= 0 and d > 0, found m = ", p.m, ", d = ", p.d);
  CHECK(p.ldx >= p.d && p.ldy >= p.d, "layer_norm: ldx ", p.ldx, " / ldy ", p.ldy, " < d ", p.d);
  CHECK(p.m == 0 || (p.x && p.y && p.weight && p.bias), "layer_norm: null pointer");
}

void validate(const RopeParams& p) {
  CHECK(p.rope_dim > 0 && p.rope_dim % 2 == 0, "rope: rope_dim must be even and > 0, found ", p.rope_dim);
  CHECK(p.m >= 0 && p.n_heads >= 0 && p.offset >= 0, "rope: negative m = ", p.m, ", n_heads = ", p.n_heads,
        " or offset = ", p.offset);
  CHECK(p.m == 0 || p.n_heads == 0 || (p.x && p.positions && p.inv_freq), "rope: null pointer");
}

void validate(const IndexerScoresParams& p) {
  CHECK(p.s >= 0 && p.t >= 0 && p.n_heads > 0 && p.head_dim > 0,
        "indexer_scores: need s, t >= 0 and n_heads, head_dim > 0, found s = ", p.s, ", t = ", p.t,
        ", n_heads = ", p.n_heads, ", head_dim = ", p.head_dim);
  CHECK(p.ld_scores >= p.t, "indexer_scores: ld_scores ", p.ld_scores, " < t ", p.t);
  CHECK(p.s == 0 || (p.q && p.weights && p.q_pos && p.scores && (p.t == 0 || p.k)), "indexer_scores: null pointer");
  CHECK(!p.pages.tiled || p.pages.block_size > 0, "indexer_scores: tiled keys need block_size > 0");
}

void validate(const TopkParams& p) {
  CHECK(p.rows >= 0 && p.cols >= 0 && p.k >= 0, "topk: negative rows = ", p.rows, ", cols = ", p.cols, " or k = ", p.k);
  CHECK(p.ld >= p.cols, "topk: ld ", p.ld, " < cols ", p.cols);
  CHECK(p.rows == 0 || p.k == 0 || (p.indices && (p.cols == 0 || p.scores)), "topk: null pointer");
}

void validate(const MlaPrefillParams& p) {
  CHECK(p.s >= 0 && p.t >= 0 && p.n_heads > 0 && p.qk_nope_head_dim >= 0 && p.qk_rope_head_dim >= 0 && p.v_head_dim > 0,
        "mla_prefill: bad sizes s = ", p.s, ", t = ", p.t, ", n_heads = ", p.n_heads,
        ", qk_nope_head_dim = ", p.qk_nope_head_dim, ", qk_rope_head_dim = ", p.qk_rope_head_dim,
        ", v_head_dim = ", p.v_head_dim);
  CHECK(p.qk_rope_head_dim == 0 || p.ld_k_pe >= p.qk_rope_head_dim, "mla_prefill: ld_k_pe ", p.ld_k_pe,
        " < qk_rope_head_dim ", p.qk_rope_head_dim);
  CHECK(!p.topk || p.topk_len >= 0, "mla_prefill: topk_len ", p.topk_len, " < 0");
  CHECK(p.s == 0 || (p.q && p.q_pos && p.out), "mla_prefill: null pointer");
  CHECK(p.s == 0 || p.t == 0 || (p.kv && (p.qk_rope_head_dim == 0 || p.k_pe)), "mla_prefill: null kv or k_pe");
}

void validate(const MlaDecodeParams& p) {
  CHECK(p.s >= 0 && p.t >= 0 && p.n_heads > 0 && p.kv_lora_rank > 0 && p.qk_rope_head_dim >= 0,
        "mla_decode: bad sizes s = ", p.s, ", t = ", p.t, ", n_heads = ", p.n_heads,
        ", kv_lora_rank = ", p.kv_lora_rank, ", qk_rope_head_dim = ", p.qk_rope_head_dim);
  CHECK(!p.topk || p.topk_len >= 0, "mla_decode: topk_len ", p.topk_len, " < 0");
  CHECK(p.s == 0 || (p.q_lat && p.q_pos && p.out_lat), "mla_decode: null pointer");
  CHECK(p.s == 0 || p.t == 0 || p.cache, "mla_decode: null cache");
  CHECK(!p.pages.tiled, "mla_decode: the latent cache is stored by rows, found tiled pages");
}

void validate(const RouterParams& p) {
  CHECK(p.m >= 0 && p.n_experts > 0, "router: need m >= 0 and n_experts > 0, found m = ", p.m,
        ", n_experts = ", p.n_experts);
  CHECK(p.n_group >= 1 && p.n_experts % p.n_group == 0, "router: n_experts ", p.n_experts,
        " is not divisible by n_group ", p.n_group);
  CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group, "router: topk_group ", p.topk_group,
        " not in [1, n_group = ", p.n_group, "]");
  int64_t selectable = p.n_group > 1 ? p.topk_group * (p.n_experts / p.n_group) : p.n_experts;
  CHECK(p.top_k >= 1 && p.top_k <= selectable, "router: top_k ", p.top_k, " not in [1, ", selectable,
        "] (experts in the kept groups)");
  CHECK(p.m == 0 || (p.logits && p.expert_ids && p.expert_weights), "router: null pointer");
}

void validate(const SwigluParams& p) {
  CHECK(p.m >= 0 && p.n >= 0, "swiglu: negative m = ", p.m, " or n = ", p.n);
  CHECK(p.ld_in >= p.n && p.ld_out >= p.n, "swiglu: ld_in ", p.ld_in, " / ld_out ", p.ld_out, " < n ", p.n);
  CHECK(p.m == 0 || p.n == 0 || (p.gate && p.up && p.out), "swiglu: null pointer");
}

void validate(const EmbeddingParams& p) {
  check_weight_dtype("embedding", p.table);
  CHECK(p.m >= 0, "embedding: negative m = ", p.m);
  CHECK(p.table.ld >= p.table.cols, "embedding: table ld ", p.table.ld, " < cols ", p.table.cols);
  CHECK(p.m == 0 || (p.ids && p.out && p.table.data), "embedding: null pointer");
  for (int64_t i = 0; p.ids && i < p.m; ++i)
    CHECK(p.ids[i] >= 0 && p.ids[i] < p.table.rows, "embedding: token id ", p.ids[i], " (row ", i,
          ") outside the table's [0, ", p.table.rows, ")");
}

void validate(const GatherRowsParams& p) {
  CHECK(p.n >= 0 && p.d >= 0, "gather_rows: negative n = ", p.n, " or d = ", p.d);
  CHECK(p.n == 0 || p.d == 0 || (p.src && p.rows && p.dst), "gather_rows: null pointer");
  for (int64_t i = 0; p.rows && i < p.n; ++i)
    CHECK(p.rows[i] >= 0, "gather_rows: source row ", p.rows[i], " (entry ", i, ") < 0");
}

void validate(const MoeCombineParams& p) {
  CHECK(p.m >= 0 && p.top_k >= 0 && p.d >= 0, "moe_combine: negative m = ", p.m, ", top_k = ", p.top_k,
        " or d = ", p.d);
  CHECK(p.m == 0 || p.d == 0 || (p.out && (p.top_k == 0 || (p.slots && p.weights))), "moe_combine: null pointer");
  if (!p.slots) return;
  for (int64_t i = 0; i < p.m * p.top_k; ++i)
    CHECK(p.slots[i] >= -1, "moe_combine: slot ", p.slots[i], " (row ", i / p.top_k, ", j ", i % p.top_k, ") < -1");
  CHECK(p.m * p.top_k == 0 || p.d == 0 || p.expert_out, "moe_combine: expert_out is null");
}

void validate(const Copy2dParams& p) {
  CHECK(p.rows >= 0 && p.cols >= 0, "copy_2d: negative rows = ", p.rows, " or cols = ", p.cols);
  CHECK(p.ld_src >= p.cols && p.ld_dst >= p.cols, "copy_2d: ld_src ", p.ld_src, " / ld_dst ", p.ld_dst, " < cols ",
        p.cols);
  CHECK(p.rows == 0 || p.cols == 0 || (p.src && p.dst), "copy_2d: null pointer");
  for (DType t : {p.src_dtype, p.dst_dtype})
    CHECK(t == DType::F32 || t == DType::BF16, "copy_2d: elements must be F32 or BF16, found ", dtype_name(t));
}

void validate(const PagedWriteParams& p) {
  CHECK(p.n >= 0 && p.width >= 0 && p.ld_src >= p.width, "paged_write: bad sizes n = ", p.n, ", width = ", p.width,
        ", ld_src = ", p.ld_src);
  CHECK(p.n == 0 || p.width == 0 || (p.src && p.pos && p.pool && p.pages.block_table && p.pages.block_size > 0),
        "paged_write: null pointer or no block table");
  CHECK(p.pages.dtype == DType::F32 || p.pages.dtype == DType::BF16,
        "paged_write: pool elements must be F32 or BF16, found ", dtype_name(p.pages.dtype));
}

void validate(const AddParams& p) {
  CHECK(p.n >= 0, "add: negative n = ", p.n);
  CHECK(p.n == 0 || (p.x && p.y), "add: null pointer");
}

void allowed_keys(int64_t t_count, int32_t q_pos, const int32_t* topk, int64_t topk_len, std::vector<int32_t>& out) {
  out.clear();
  int64_t last = std::min<int64_t>(q_pos, t_count - 1);  // causal: t <= q_pos
  if (!topk) {
    for (int64_t t = 0; t <= last; ++t) out.push_back(int32_t(t));
    return;
  }
  std::vector<char> keep(size_t(std::max<int64_t>(t_count, 0)), 0);
  for (int64_t j = 0; j < topk_len; ++j) {
    int32_t t = topk[j];
    if (t == -1) continue;
    CHECK(t >= 0 && t < t_count, "mla: topk entry ", t, " (column ", j, ") outside [-1, ", t_count, ")");
    if (t <= last) keep[size_t(t)] = 1;
  }
  for (int64_t t = 0; t < t_count; ++t)
    if (keep[size_t(t)]) out.push_back(int32_t(t));
}

// ---------------------------------------------------------------------------------------------
// Reference ops.

namespace ref {

void gemm(const GemmParams& p, Precision precision) {
  const bool fast = precision == Precision::kFast;
  for (int64_t i = 0; i < p.m; ++i) {
    const float* x = p.x + i * p.ldx;
    for (int64_t j = 0; j < p.n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < p.k; ++kk) {
        float w = p.trans_w ? weight_at(p.w, kk, j) : weight_at(p.w, j, kk);
        acc += fast ? bf16_round(x[kk]) * bf16_round(w) : x[kk] * w;
      }
      float& y = p.y[i * p.ldy + j];
      y = p.accumulate ? y + acc : acc;
    }
  }
}

void rms_norm(const RmsNormParams& p) {
  for (int64_t i = 0; i < p.m; ++i) {
    const float* x = p.x + i * p.ldx;
    float* y = p.y + i * p.ldy;
    float ss = 0.0f;
    for (int64_t j = 0; j < p.d; ++j) ss += x[j] * x[j];
    float r = 1.0f / std::sqrt(ss / float(p.d) + p.eps);
    for (int64_t j = 0; j < p.d; ++j) y[j] = p.weight[j] * (x[j] * r);
  }
}

void layer_norm(const LayerNormParams& p) {
  for (int64_t i = 0; i < p.m; ++i) {
    const float* x = p.x + i * p.ldx;
    float* y = p.y + i * p.ldy;
    float sum = 0.0f;
    for (int64_t j = 0; j < p.d; ++j) sum += x[j];
    float mean = sum / float(p.d);
    float var = 0.0f;
    for (int64_t j = 0; j < p.d; ++j) var += (x[j] - mean) * (x[j] - mean);
    float r = 1.0f / std::sqrt(var / float(p.d) + p.eps);
    for (int64_t j = 0; j < p.d; ++j) y[j] = (x[j] - mean) * r * p.weight[j] + p.bias[j];
  }
}

void rope(const RopeParams& p) {
  const int64_t half = p.rope_dim / 2;
  for (int64_t tok = 0; tok < p.m; ++tok) {
    for (int64_t i = 0; i < half; ++i) {
      float angle = float(p.positions[tok]) * p.inv_freq[i];
      float c = std::cos(angle) * p.mscale, s = std::sin(angle) * p.mscale;
      for (int64_t h = 0; h < p.n_heads; ++h) {
        float* x = p.x + tok * p.token_stride + h * p.head_stride + p.offset;
        int64_t a = p.interleaved ? 2 * i : i, b = p.interleaved ? 2 * i + 1 : i + half;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
      }
    }
  }
}

void indexer_scores(const IndexerScoresParams& p) {
  std::vector<float> key(static_cast<size_t>(p.head_dim));
  for (int64_t s = 0; s < p.s; ++s) {
    float* out = p.scores + s * p.ld_scores;
    for (int64_t t = 0; t < p.t; ++t) {
      if (t > p.q_pos[s]) {
        out[t] = kNegInf;
        continue;
      }
      float acc = 0.0f;
      for (int64_t h = 0; h < p.n_heads; ++h) {
        const float* q = p.q + (s * p.n_heads + h) * p.head_dim;
        for (int64_t d = 0; d < p.head_dim; ++d)
          key[size_t(d)] = cache_at(p.pages.dtype, p.k, p.pages.at(s, t, d, p.head_dim));
        float dot = 0.0f;  // the same loop for f32 and bf16 caches
        for (int64_t d = 0; d < p.head_dim; ++d) dot += q[d] * key[size_t(d)];
        acc += p.weights[s * p.n_heads + h] * std::max(dot, 0.0f);
      }
      out[t] = acc;
    }
  }
}

void topk(const TopkParams& p) {
  std::vector<int32_t> idx;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* v = p.scores + r * p.ld;
    idx.clear();
    for (int64_t c = 0; c < p.cols; ++c)
      if (std::isfinite(v[c])) idx.push_back(int32_t(c));
    std::sort(idx.begin(), idx.end(), ByValueDesc{v});
    size_t keep = std::min<size_t>(idx.size(), size_t(p.k));
    std::sort(idx.begin(), idx.begin() + keep);
    int32_t* out = p.indices + r * p.k;
    for (int64_t j = 0; j < p.k; ++j) out[j] = size_t(j) < keep ? idx[size_t(j)] : -1;
  }
}

void mla_prefill(const MlaPrefillParams& p) {
  const int64_t dq = p.qk_nope_head_dim + p.qk_rope_head_dim;
  const int64_t dkv = p.qk_nope_head_dim + p.v_head_dim;
  std::vector<int32_t> keys;
  std::vector<float> score;
  for (int64_t s = 0; s < p.s; ++s) {
    allowed_keys(p.t, p.q_pos[s], p.topk ? p.topk + s * p.topk_len : nullptr, p.topk_len, keys);
    for (int64_t h = 0; h < p.n_heads; ++h) {
      const float* q = p.q + (s * p.n_heads + h) * dq;
      score.assign(keys.size(), 0.0f);
      for (size_t i = 0; i < keys.size(); ++i) {
        const float* kn = p.kv + (keys[i] * p.n_heads + h) * dkv;
        const float* kp = p.k_pe + keys[i] * p.ld_k_pe;
        float nope = 0.0f, pe = 0.0f;
        for (int64_t d = 0; d < p.qk_nope_head_dim; ++d) nope += q[d] * kn[d];
        for (int64_t d = 0; d < p.qk_rope_head_dim; ++d) pe += q[p.qk_nope_head_dim + d] * kp[d];
        score[i] = p.scale * (nope + pe);
      }
      auto value = [&](int32_t t) { return p.kv + (t * p.n_heads + h) * dkv + p.qk_nope_head_dim; };
      softmax_weighted_sum(score, keys, value, p.v_head_dim, p.out + (s * p.n_heads + h) * p.v_head_dim);
    }
  }
}

void mla_decode(const MlaDecodeParams& p) {
  const int64_t dk = p.kv_lora_rank + p.qk_rope_head_dim;
  std::vector<float> key(static_cast<size_t>(dk));
  std::vector<int32_t> keys;
  std::vector<float> score;
  for (int64_t s = 0; s < p.s; ++s) {
    allowed_keys(p.t, p.q_pos[s], p.topk ? p.topk + s * p.topk_len : nullptr, p.topk_len, keys);
    for (int64_t h = 0; h < p.n_heads; ++h) {
      const float* q = p.q_lat + (s * p.n_heads + h) * dk;
      score.assign(keys.size(), 0.0f);
      for (size_t i = 0; i < keys.size(); ++i) {
        const int64_t c = p.pages.row(s, keys[i]) * dk;
        for (int64_t d = 0; d < dk; ++d) key[size_t(d)] = cache_at(p.pages.dtype, p.cache, c + d);
        float dot = 0.0f;  // the same loop for f32 and bf16 caches
        for (int64_t d = 0; d < dk; ++d) dot += q[d] * key[size_t(d)];
        score[i] = p.scale * dot;
      }
      // Values widened once per key (exact for BF16), then the usual weighted sum.
      std::vector<float> rows(keys.size() * size_t(p.kv_lora_rank));
      for (size_t i = 0; i < keys.size(); ++i)
        for (int64_t d = 0; d < p.kv_lora_rank; ++d)
          rows[i * size_t(p.kv_lora_rank) + size_t(d)] =
              cache_at(p.pages.dtype, p.cache, p.pages.row(s, keys[i]) * dk + d);
      std::vector<int32_t> local(keys.size());
      for (size_t i = 0; i < local.size(); ++i) local[i] = int32_t(i);
      auto value = [&](int32_t i) { return rows.data() + size_t(i) * size_t(p.kv_lora_rank); };
      softmax_weighted_sum(score, local, value, p.kv_lora_rank, p.out_lat + (s * p.n_heads + h) * p.kv_lora_rank);
    }
  }
}

void router(const RouterParams& p) {
  const int64_t ne = p.n_experts, group_size = ne / p.n_group;
  std::vector<float> sc(static_cast<size_t>(ne)), b(sc), gscore(static_cast<size_t>(p.n_group));
  std::vector<int32_t> order(static_cast<size_t>(ne)), groups(static_cast<size_t>(p.n_group));
  std::vector<int32_t> members(static_cast<size_t>(group_size));
  for (int64_t i = 0; i < p.m; ++i) {
    const float* logits = p.logits + i * ne;
    for (int64_t e = 0; e < ne; ++e) {
      sc[e] = sigmoid(logits[e]);
      b[e] = sc[e] + (p.bias ? p.bias[e] : 0.0f);
    }
    if (p.n_group > 1) {
      // Group score: sum of the group's two largest biased scores (one when a group has one).
      for (int64_t g = 0; g < p.n_group; ++g) {
        std::iota(members.begin(), members.end(), int32_t(g * group_size));
        std::sort(members.begin(), members.end(), ByValueDesc{b.data()});
        gscore[g] = b[members[0]] + (group_size > 1 ? b[members[1]] : 0.0f);
      }
      std::iota(groups.begin(), groups.end(), 0);
      std::sort(groups.begin(), groups.end(), ByValueDesc{gscore.data()});
      for (int64_t r = p.topk_group; r < p.n_group; ++r)
        for (int64_t e = 0; e < group_size; ++e) b[groups[r] * group_size + e] = kNegInf;
    }
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), ByValueDesc{b.data()});
    std::sort(order.begin(), order.begin() + p.top_k);
    int32_t* ids = p.expert_ids + i * p.top_k;
    float* w = p.expert_weights + i * p.top_k;
    float sum = 0.0f;
    for (int64_t j = 0; j < p.top_k; ++j) {
      ids[j] = order[j];
      w[j] = sc[order[j]];
      sum += w[j];
    }
    for (int64_t j = 0; j < p.top_k; ++j) {
      if (p.norm_topk_prob) w[j] = w[j] / (sum + 1e-20f);
      w[j] = w[j] * p.routed_scaling_factor;
    }
  }
}

void swiglu(const SwigluParams& p) {
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      float g = p.gate[i * p.ld_in + j], u = p.up[i * p.ld_in + j];
      p.out[i * p.ld_out + j] = g / (1.0f + std::exp(-g)) * u;
    }
}

void embedding(const EmbeddingParams& p) {
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.table.cols; ++j) p.out[i * p.table.cols + j] = weight_at(p.table, p.ids[i], j);
}

void gather_rows(const GatherRowsParams& p) {
  for (int64_t i = 0; i < p.n; ++i)
    for (int64_t j = 0; j < p.d; ++j) p.dst[i * p.d + j] = p.src[p.rows[i] * p.d + j];
}

void moe_combine(const MoeCombineParams& p) {
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t c = 0; c < p.d; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < p.top_k; ++j) {
        int32_t slot = p.slots[i * p.top_k + j];
        if (slot < 0) continue;
        acc += p.weights[i * p.top_k + j] * p.expert_out[slot * p.d + c];
      }
      float& o = p.out[i * p.d + c];
      o = p.accumulate ? o + acc : acc;
    }
}

void add(const AddParams& p) {
  for (int64_t i = 0; i < p.n; ++i) p.y[i] += p.x[i];
}

void copy_2d(const Copy2dParams& p) {
  for (int64_t i = 0; i < p.rows; ++i)
    for (int64_t j = 0; j < p.cols; ++j) {
      const float v = cache_at(p.src_dtype, p.src, i * p.ld_src + j);
      if (p.dst_dtype == DType::BF16)
        static_cast<uint16_t*>(p.dst)[i * p.ld_dst + j] = f32_to_bf16(v);
      else
        static_cast<float*>(p.dst)[i * p.ld_dst + j] = v;
    }
}

void paged_write(const PagedWriteParams& p) {
  for (int64_t i = 0; i < p.n; ++i) {
    for (int64_t j = 0; j < p.width; ++j) {
      const float v = p.src[i * p.ld_src + j];
      const int64_t e = p.pages.at(i, p.pos[i], j, p.width);
      if (p.pages.dtype == DType::BF16)
        static_cast<uint16_t*>(p.pool)[e] = f32_to_bf16(v);
      else
        static_cast<float*>(p.pool)[e] = v;
    }
  }
}

}  // namespace ref

// ---------------------------------------------------------------------------------------------

// A bf16-rounded copy of rows [0, m) of `width` floats (row stride ld), row stride width.
static std::vector<float> rounded(const float* x, int64_t ld, int64_t m, int64_t width) {
  std::vector<float> out(size_t(m * width));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < width; ++j) out[size_t(i * width + j)] = bf16_round(x[i * ld + j]);
  return out;
}

class ReferenceBackend final : public HostBackend {
 public:
  explicit ReferenceBackend(Precision precision) : precision_(precision) {}
  std::string name() const override { return "reference"; }
  Precision precision() const override { return precision_; }
  void gemm(const GemmParams& p) override {
    validate(p);
    ref::gemm(p, precision_);
  }
  void rms_norm(const RmsNormParams& p) override {
    validate(p);
    ref::rms_norm(p);
  }
  void layer_norm(const LayerNormParams& p) override {
    validate(p);
    ref::layer_norm(p);
  }
  void rope(const RopeParams& p) override {
    validate(p);
    ref::rope(p);
  }
  // Precision::kFast rounds the attention-side inputs too (ops.h Precision): queries, prefill's
  // expanded keys and values, and (paged_write) what the caches hold.
  void indexer_scores(const IndexerScoresParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast) return ref::indexer_scores(p);
    const std::vector<float> q = rounded(p.q, p.n_heads * p.head_dim, p.s, p.n_heads * p.head_dim);
    IndexerScoresParams r = p;
    r.q = q.data();
    ref::indexer_scores(r);
  }
  void topk(const TopkParams& p) override {
    validate(p);
    ref::topk(p);
  }
  void mla_prefill(const MlaPrefillParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast) return ref::mla_prefill(p);
    const int64_t dq = p.n_heads * (p.qk_nope_head_dim + p.qk_rope_head_dim);
    const int64_t dkv = p.n_heads * (p.qk_nope_head_dim + p.v_head_dim);
    const std::vector<float> q = rounded(p.q, dq, p.s, dq), kv = rounded(p.kv, dkv, p.t, dkv),
                             k_pe = rounded(p.k_pe, p.ld_k_pe, p.t, p.qk_rope_head_dim);
    MlaPrefillParams r = p;
    r.q = q.data(), r.kv = kv.data(), r.k_pe = k_pe.data(), r.ld_k_pe = p.qk_rope_head_dim;
    ref::mla_prefill(r);
  }
  void mla_decode(const MlaDecodeParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast) return ref::mla_decode(p);
    const int64_t w = p.n_heads * (p.kv_lora_rank + p.qk_rope_head_dim);
    const std::vector<float> q = rounded(p.q_lat, w, p.s, w);
    MlaDecodeParams r = p;
    r.q_lat = q.data();
    ref::mla_decode(r);
  }
  void router(const RouterParams& p) override {
    validate(p);
    ref::router(p);
  }
  void swiglu(const SwigluParams& p) override {
    validate(p);
    ref::swiglu(p);
  }
  void embedding(const EmbeddingParams& p) override {
    validate(p);
    ref::embedding(p);
  }
  void gather_rows(const GatherRowsParams& p) override {
    validate(p);
    ref::gather_rows(p);
  }
  void moe_combine(const MoeCombineParams& p) override {
    validate(p);
    ref::moe_combine(p);
  }
  void add(const AddParams& p) override {
    validate(p);
    ref::add(p);
  }
  void copy_2d(const Copy2dParams& p) override {
    validate(p);
    ref::copy_2d(p);
  }
  void paged_write(const PagedWriteParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast || p.pages.dtype != DType::F32) return ref::paged_write(p);
    const std::vector<float> src = rounded(p.src, p.ld_src, p.n, p.width);
    PagedWriteParams r = p;
    r.src = src.data(), r.ld_src = p.width;
    ref::paged_write(r);
  }

 private:
  Precision precision_;
};

}  // namespace glm5::kernels::cpu

namespace glm5::kernels {
std::unique_ptr<Backend> make_reference_backend(Precision precision) {
  return std::make_unique<cpu::ReferenceBackend>(precision);
}
}  // namespace glm5::kernels

// The reference backend: every op of ops.h as a plain single-threaded float32 loop, written to be
// read against the comments in ops.h. It is the spec other backends are compared with, so it
// favours the obvious formula over speed (weights are widened element by element, softmax is
// three passes, top-k is a full sort). Also the checks of host-memory contents the CPU backends run.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace glm5::kernels::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
// Checks of host-memory contents (the shared parameter checks are kernels/validate.h).

void validate_contents(const EmbeddingParams& p) {
  for (int64_t i = 0; p.ids && i < p.m; ++i)
    CHECK(p.ids[i] >= 0 && p.ids[i] < p.table.rows, "embedding: token id ", p.ids[i], " (row ", i,
          ") outside the table's [0, ", p.table.rows, ")");
}

void validate_contents(const GatherRowsParams& p) {
  for (int64_t i = 0; p.rows && i < p.n; ++i)
    CHECK(p.rows[i] >= 0, "gather_rows: source row ", p.rows[i], " (entry ", i, ") < 0");
}

void validate_contents(const MoeCombineParams& p) {
  for (int64_t i = 0; p.slots && i < p.m * p.top_k; ++i)
    CHECK(p.slots[i] >= -1, "moe_combine: slot ", p.slots[i], " (row ", i / p.top_k, ", j ", i % p.top_k, ") < -1");
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
    validate_contents(p);
    ref::embedding(p);
  }
  void gather_rows(const GatherRowsParams& p) override {
    validate(p);
    validate_contents(p);
    ref::gather_rows(p);
  }
  void moe_combine(const MoeCombineParams& p) override {
    validate(p);
    validate_contents(p);
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

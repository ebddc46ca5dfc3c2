// The parameter checks every backend runs before an op (kernels/validate.h).
#include "kernels/validate.h"

#include "kernels/core/check.h"
#include "kernels/core/quant.h"

namespace glm5::kernels {

namespace {

bool weight_dtype_ok(DType t) {
  return t == DType::BF16 || t == DType::F16 || t == DType::F32 || quant::is_quantized(t);
}

void check_weight_dtype(const char* op, const Weight& w) {
  CHECK(weight_dtype_ok(w.dtype), op, ": weight dtype ", dtype_name(w.dtype),
        " is not a weight dtype (expected BF16, F16, F32, F8_E4M3 or pack-quantized int4/int8)");
  if (!quant::is_quantized(w.dtype)) return;
  CHECK(w.scale && w.group > 0 && w.scale_block_rows > 0 && w.scale_ld >= (w.cols + w.group - 1) / w.group, op, ": ",
        dtype_name(w.dtype), " weight [", w.rows, ", ", w.cols, "] without valid scales (group ", w.group,
        ", scale_ld ", w.scale_ld, ")");
  CHECK(w.dtype != DType::Q4 || w.ld % 2 == 0, op, ": int4 weight ld ", w.ld, " is odd");
}

}  // namespace

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
}

void validate(const GatherRowsParams& p) {
  CHECK(p.n >= 0 && p.d >= 0, "gather_rows: negative n = ", p.n, " or d = ", p.d);
  CHECK(p.n == 0 || p.d == 0 || (p.src && p.rows && p.dst), "gather_rows: null pointer");
}

void validate(const MoeCombineParams& p) {
  CHECK(p.m >= 0 && p.top_k >= 0 && p.d >= 0, "moe_combine: negative m = ", p.m, ", top_k = ", p.top_k,
        " or d = ", p.d);
  CHECK(p.m == 0 || p.d == 0 || (p.out && (p.top_k == 0 || (p.slots && p.weights))), "moe_combine: null pointer");
  CHECK(!p.slots || p.m * p.top_k == 0 || p.d == 0 || p.expert_out, "moe_combine: expert_out is null");
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

}  // namespace glm5::kernels

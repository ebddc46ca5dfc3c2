// The op table: one params struct per op and the Backend interface every backend implements.
// All activations are float32 and row-major; weights keep their checkpoint dtype (BF16/F16/F32).
// Pointers live in the backend's memory (host for cpu, device for cuda). Every op must give each
// output row a result that does not depend on how many other rows are in the call (batch
// invariance: the reduction order of a row is fixed), which is what makes distributed runs and
// batched runs bitwise equal to a single sequence run alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/core/check.h"
#include "kernels/core/dtype.h"
#include "kernels/core/quant.h"

namespace glm5::kernels {

// How a weight's elements lie in memory. kRowMajor: element (r, c) at r * ld + c. kQuad16 (BF16,
// F16 or F32 only; made by the fast cpu backend for matrices used only as y = x W^T, see
// Backend::upload_gemm_matrix): rows in groups of 4, each group stored as ld / 16 chunks of
// 4 rows x 16 columns, so that a 4-row register tile reads one sequential stream (decode streams
// W at ~0.97 of the read bandwidth this way, ~0.90 from 4 separate rows); ld is cols rounded up
// to 16 and the rows are rounded up to 4, the padding zero. kTile16 (BF16 only; where the fast cpu
// backend's BF16 gemm runs on AMX tiles): the same scheme with groups of 16 rows and chunks of 32
// columns, so that every A tile (16 W rows x 32 k values) is one contiguous KiB and a W block
// streams as one sequence; ld is cols rounded up to 32, the rows rounded up to 16. kQuantQuad (Q8
// and F8_E4M3 with cols = ld a multiple of 64, Q4 with cols = ld and group multiples of 128,
// quant_quad_fits; how the fast cpu backend holds quantized gemm matrices where its AVX-512
// kernels run): the stored row bytes in groups of 4 rows, each group as
// chunks of 4 rows x 64 bytes, int4 nibbles in nibble128 order (core/quant.h, repack_quant_quad);
// rows rounded up to 4.
// kPair16 (BF16 only; where the fast cpu backend's fast-precision gemm runs on AVX512-BF16): groups
// of 16 rows, each stored as ld / 2 chunks of 16 rows x 2 columns, so that the 64 bytes of one k pair
// of a group are one vdpbf16ps operand (lane l: row 16 g + l); ld is cols rounded up to 2, the rows
// rounded up to 16, the padding zero.
enum class WeightLayout { kRowMajor, kQuad16, kTile16, kQuantQuad, kPair16 };

// How a backend multiplies (the precision policy; fixed when the backend is made, because its weights
// are laid out for it at upload):
//   kExact: float32 activations times the weights' exact values, accumulated in float32 (the reference
//           and the goldens' 1e-4; batch- and layout-invariant bit for bit).
//   kFast:  the inputs of every gemm (activations, F16 / F32 weights, dequantized FP8 / int4 / int8
//           values) rounded to bf16 (nearest even), their exact products accumulated in float32, as
//           bf16 engines do; so are the attention side's (the cpu backends: queries, what paged_write
//           stores in a float32 cache, prefill's expanded keys and values, and on AVX512-BF16 unless
//           the portable fast path is chosen, the softmax weights of the value products, as
//           FlashAttention's; the indexer's head weights stay float32). Each kernel path documents its
//           own recipe (cpu/fast_ops.h) and keeps the invariances on one machine and path; two paths (AVX512-BF16,
//           AMX, portable, CUDA) may differ by rounding. (CUDA: BF16-weight GEMMs on one bf16 term; its
//           attention kernels, quantized and F16 / F32 weights as in kExact.)
enum class Precision { kExact, kFast };
inline const char* precision_name(Precision p) { return p == Precision::kFast ? "fast" : "exact"; }
inline Precision parse_precision(const std::string& s, const std::string& what) {
  CHECK(s == "exact" || s == "fast", what, ": expected exact or fast, found '", s, "'");
  return s == "fast" ? Precision::kFast : Precision::kExact;
}
// v rounded to bf16 (nearest even) and widened back: a fast-precision gemm input.
inline float bf16_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Element (r, c) of a matrix in groups of G rows stored as ld / C chunks of G rows x C columns.
constexpr int64_t interleaved_offset(int64_t r, int64_t c, int64_t ld, int64_t G, int64_t C) {
  return (r / G) * G * ld + (c / C) * (G * C) + (r % G) * C + c % C;
}
// Element (r, c) of a kQuad16 / kTile16 matrix with row stride ld: the offset in elements.
constexpr int64_t quad16_offset(int64_t r, int64_t c, int64_t ld) { return interleaved_offset(r, c, ld, 4, 16); }
constexpr int64_t tile16_offset(int64_t r, int64_t c, int64_t ld) { return interleaved_offset(r, c, ld, 16, 32); }
constexpr int64_t pair16_offset(int64_t r, int64_t c, int64_t ld) { return interleaved_offset(r, c, ld, 16, 2); }
// Rows per group of an interleaved layout (1: row-major), and the multiple its ld must be.
constexpr int64_t layout_group_rows(WeightLayout l) {
  return l == WeightLayout::kQuad16 || l == WeightLayout::kQuantQuad ? 4
         : l == WeightLayout::kTile16 || l == WeightLayout::kPair16  ? 16
                                                                     : 1;
}
constexpr int64_t layout_ld_multiple(WeightLayout l) {
  return l == WeightLayout::kQuad16 ? 16 : l == WeightLayout::kTile16 ? 32 : l == WeightLayout::kPair16 ? 2 : 1;
}
// The element offset of (r, c) in a plain-dtype interleaved layout.
constexpr int64_t layout_offset(WeightLayout l, int64_t r, int64_t c, int64_t ld) {
  return l == WeightLayout::kQuad16   ? quad16_offset(r, c, ld)
         : l == WeightLayout::kTile16 ? tile16_offset(r, c, ld)
         : l == WeightLayout::kPair16 ? pair16_offset(r, c, ld)
                                      : r * ld + c;
}

// A 2-D weight matrix [rows, cols] in checkpoint dtype, row stride `ld` elements (ld >= cols).
// Quantized dtypes (F8_E4M3 block-scaled, Q4 / Q8 group-wise; element values in core/quant.h)
// carry their scales: element (r, c) uses scale[(r / scale_block_rows) * scale_ld + c / group],
// of dtype scale_dtype (FP8: F32, blocks of 128 x 128; Q4/Q8: BF16, F16 or F32, 1 x group).
struct Weight {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t rows = 0, cols = 0, ld = 0;
  const void* scale = nullptr;
  DType scale_dtype = DType::F32;
  int64_t scale_ld = 0, group = 0, scale_block_rows = 1;
  WeightLayout layout = WeightLayout::kRowMajor;
  // Rows [first, first + n) of this matrix (a view, no copy). A quantized matrix can be sliced
  // only at multiples of its scale blocks, a kQuad16 / kQuantQuad / kTile16 one only at multiples of
  // 4 / 4 / 16 rows.
  Weight slice_rows(int64_t first, int64_t n) const {
    CHECK(first % layout_group_rows(layout) == 0, "slice_rows: row ", first, " is inside a group of ",
          layout_group_rows(layout), " interleaved rows");
    Weight w = *this;
    const size_t row = dtype == DType::Q4 ? size_t(ld) / 2 : size_t(ld) * dtype_size(dtype);
    w.data = static_cast<const char*>(data) + size_t(first) * row;
    if (scale) {
      CHECK(first % scale_block_rows == 0, "slice_rows: row ", first, " is inside a scale block of ", scale_block_rows,
            " rows");
      w.scale = static_cast<const char*>(scale) +
                size_t(first / scale_block_rows) * size_t(scale_ld) * dtype_size(scale_dtype);
    }
    w.rows = n;
    return w;
  }
};

// Whether a quantized weight of these sizes can take (or has a valid) kQuantQuad layout: whole
// 64-byte chunks per row (int4: whole 128-column groups, the nibble128 blocks), cols == ld.
inline bool quant_quad_fits(DType t, int64_t cols, int64_t ld, int64_t group) {
  if (!quant::is_quantized(t) || cols != ld) return false;
  if (t == DType::Q4) return ld % quant::kNibbleBlock == 0 && group % quant::kNibbleBlock == 0;
  return ld % quant::kQuadChunk == 0;
}

// The stored code of element (r, c) of a quantized weight, row-major or kQuantQuad: the FP8 byte,
// Q8's q + 128, Q4's q + 8.
inline int quant_code(const Weight& w, int64_t r, int64_t c) {
  const auto* d = static_cast<const uint8_t*>(w.data);
  const size_t rb = quant::row_bytes(w.dtype, w.ld);
  if (w.layout == WeightLayout::kQuantQuad) {
    if (w.dtype != DType::Q4) return d[quant::quad_byte(r, c, rb)];
    return (d[quant::quad_byte(r, int64_t(quant::nibble128_byte(c)), rb)] >> quant::nibble128_shift(c)) & 0xf;
  }
  if (w.dtype == DType::F8_E4M3) return d[size_t(r) * rb + size_t(c)];
  return quant::int_at(w.dtype, d + size_t(r) * rb, c) + (w.dtype == DType::Q4 ? 8 : 128);
}

// Element (r, c) of a weight in host memory as float32: widened exactly, or dequantized by the
// rule of core/quant.h. The definition every kernel's weight values are checked against.
inline float weight_at(const Weight& w, int64_t r, int64_t c) {
  CHECK(w.layout == WeightLayout::kRowMajor || quant::is_quantized(w.dtype) == (w.layout == WeightLayout::kQuantQuad),
        "weight_at: a ", dtype_name(w.dtype), " weight cannot have layout ", int(w.layout));
  if (quant::is_quantized(w.dtype)) {
    const float s = quant::scale_at(w.scale_dtype, w.scale, (r / w.scale_block_rows) * w.scale_ld + c / w.group);
    const int code = quant_code(w, r, c);
    if (w.dtype == DType::F8_E4M3) return fp8_e4m3_to_f32(uint8_t(code)) * s;
    return quant::round_to(w.scale_dtype, float(code - (w.dtype == DType::Q4 ? 8 : 128)) * s);
  }
  if (w.layout != WeightLayout::kRowMajor) {  // plain dtypes only (validated)
    const size_t at = size_t(layout_offset(w.layout, r, c, w.ld));
    switch (w.dtype) {
      case DType::F32: {
        float v;
        std::memcpy(&v, static_cast<const uint8_t*>(w.data) + 4 * at, 4);
        return v;
      }
      case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(w.data)[at]);
      case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(w.data)[at]);
      default: GLM5_FAIL("weight_at: unsupported weight dtype ", dtype_name(w.dtype));
    }
  }
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + size_t(r) * quant::row_bytes(w.dtype, w.ld);
  switch (w.dtype) {
    case DType::F32: {
      float v;
      std::memcpy(&v, row + 4 * c, 4);
      return v;
    }
    case DType::BF16: return bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
    case DType::F16: return f16_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
    default: GLM5_FAIL("weight_at: unsupported weight dtype ", dtype_name(w.dtype));
  }
}

// y[m, n] (+)= sum_k x[m, k] * W[n, k]         (nn.Linear: y = x W^T), trans_w = false, W [n, k]
// y[m, n] (+)= sum_k x[m, k] * W[k, n]         trans_w = true,  W [k, n]  (MLA q absorption)
// Accumulation in float32, k in a fixed order for every row. In Precision::kFast both factors are
// bf16_round()ed first (their products are then exact in float32).
struct GemmParams {
  const float* x = nullptr;
  int64_t ldx = 0;
  Weight w;
  bool trans_w = false;
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  bool accumulate = false;
};

// y[i, :] = w * x[i, :] / sqrt(mean(x[i, :]^2) + eps)     (in place allowed: y == x)
struct RmsNormParams {
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* weight = nullptr;  // [d]
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t m = 0, d = 0;
  float eps = 1e-5f;
};

// y[i, :] = (x - mean) / sqrt(var + eps) * weight + bias    (biased variance; in place allowed)
struct LayerNormParams {
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* weight = nullptr;  // [d]
  const float* bias = nullptr;    // [d]
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t m = 0, d = 0;
  float eps = 1e-6f;
};

// Rotates, in place, the rope_dim-wide slice at `offset` of every head of every token:
//   x[token * token_stride + head * head_stride + offset + j],  angle_i = float(pos[token]) * inv_freq[i]
// interleaved (GPT-J):  pairs (2i, 2i+1);  half-split (NeoX): pairs (i, i + rope_dim/2).
// cos/sin are multiplied by mscale (YaRN attention factor; 1 for plain RoPE).
struct RopeParams {
  float* x = nullptr;
  int64_t m = 0, n_heads = 1, token_stride = 0, head_stride = 0, offset = 0, rope_dim = 0;
  const int32_t* positions = nullptr;  // [m]
  const float* inv_freq = nullptr;     // [rope_dim / 2]
  float mscale = 1.0f;
  bool interleaved = true;
};

#ifdef __CUDACC__
#define GLM5_HOST_DEVICE __host__ __device__
#else
#define GLM5_HOST_DEVICE
#endif

// Where the cached key (latent / indexer key) at position t of query row s lives. Without a
// block table the cache is contiguous: row t. With one (a paged cache: a pool of fixed-size
// blocks), row  block_table[s * ld_table + t / block_size] * block_size + t % block_size  of the
// pool; ld_table 0 means every query row reads one table (rows of one sequence), > 0 one table
// per row (decode rows of different sequences in one call). Only positions t <= q_pos[s] are
// ever used, so a row's table needs to cover its own positions only (with tiles, the rest of a
// covered block may be read and dropped).
// `dtype` is how the cached rows are stored: F32, or BF16 (a bf16 KV cache: the key pointer then
// points at uint16 elements, rows and strides counted in elements all the same).
// `tiled` (indexer keys only, see Backend::index_key_tiles): each block of block_size rows is
// stored transposed, [width][block_size], so that a scan reads 16 consecutive keys' element d as
// one vector; rows are then located by at(), and a contiguous tiled cache holds whole blocks.
struct KeyPages {
  const int32_t* block_table = nullptr;
  int64_t ld_table = 0, block_size = 0;
  DType dtype = DType::F32;
  bool tiled = false;
  GLM5_HOST_DEVICE int64_t row(int64_t s, int64_t t) const {
    if (!block_table) return t;
    return int64_t(block_table[s * ld_table + t / block_size]) * block_size + t % block_size;
  }
  // Element d of the width-element key at position t of query row s.
  GLM5_HOST_DEVICE int64_t at(int64_t s, int64_t t, int64_t d, int64_t width) const {
    const int64_t r = row(s, t);
    if (!tiled) return r * width + d;
    const int64_t j = r % block_size;
    return (r - j) * width + d * block_size + j;
  }
};

// DSA lightning-indexer scores of S query rows against T keys (see KeyPages for where key t is):
//   scores[s, t] = sum_h weights[s, h] * relu(q[s, h, :] . k[t, :])     for t <= q_pos[s]
//   scores[s, t] = -inf                                                  for t >  q_pos[s]
// `weights` already carry n_heads^-0.5 * head_dim^-0.5. Key t sits at position t.
struct IndexerScoresParams {
  const float* q = nullptr;        // [s, n_heads, head_dim]
  const float* weights = nullptr;  // [s, n_heads]
  const float* k = nullptr;        // [t, head_dim]
  const int32_t* q_pos = nullptr;  // [s]
  float* scores = nullptr;         // [s, ld_scores]
  int64_t s = 0, t = 0, n_heads = 0, head_dim = 0, ld_scores = 0;
  KeyPages pages;  // addressing of k (contiguous by default)
};

// Per row: the indices of the min(k, #finite) largest finite entries among scores[row, 0:cols],
// written sorted ascending into indices[row, 0:k], padded with -1. Ties go to the lower index.
struct TopkParams {
  const float* scores = nullptr;  // [rows, ld]
  int64_t rows = 0, cols = 0, ld = 0, k = 0;
  int32_t* indices = nullptr;  // [rows, k]
};

// Naive ("MHA mode") MLA attention, used for prefill. For query row s and head h:
//   score[t] = scale * (q_nope[s,h] . k_nope[t,h] + q_pe[s,h] . k_pe[t])   over allowed t
//   out[s,h] = sum_t softmax(score)[t] * v[t,h]
// Allowed keys: t <= q_pos[s] and, when topk != nullptr, t in topk[s, :] (entries -1 ignored).
struct MlaPrefillParams {
  const float* q = nullptr;     // [s, n_heads, qk_nope_head_dim + qk_rope_head_dim]
  const float* kv = nullptr;    // [t, n_heads, qk_nope_head_dim + v_head_dim]   (kv_b_proj of latents)
  const float* k_pe = nullptr;  // row t at k_pe + t * ld_k_pe, qk_rope_head_dim values
  int64_t ld_k_pe = 0;
  const int32_t* q_pos = nullptr;  // [s]
  const int32_t* topk = nullptr;   // [s, topk_len] or nullptr for dense causal
  int64_t topk_len = 0;
  float* out = nullptr;  // [s, n_heads, v_head_dim]
  int64_t s = 0, t = 0, n_heads = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  float scale = 1.0f;
};

// Weight-absorbed ("MQA mode") MLA attention over the latent cache, used for decode:
//   score[t]     = scale * (q_lat[s,h] . cache[t])      (dim kv_lora_rank + qk_rope_head_dim)
//   out_lat[s,h] = sum_t softmax(score)[t] * cache[t, 0:kv_lora_rank]
// Allowed keys as in MlaPrefillParams (causal, then the indexer's selection if given).
struct MlaDecodeParams {
  const float* q_lat = nullptr;  // [s, n_heads, kv_lora_rank + qk_rope_head_dim]
  const float* cache = nullptr;  // [t, kv_lora_rank + qk_rope_head_dim]   ([c_kv | k_pe])
  const int32_t* q_pos = nullptr;
  const int32_t* topk = nullptr;
  int64_t topk_len = 0;
  float* out_lat = nullptr;  // [s, n_heads, kv_lora_rank]
  int64_t s = 0, t = 0, n_heads = 0, kv_lora_rank = 0, qk_rope_head_dim = 0;
  float scale = 1.0f;
  KeyPages pages;  // addressing of cache rows (contiguous by default)
};

// The noaux_tc sigmoid router, per token row:
//   sc = sigmoid(logits); b = sc + bias (selection only); if n_group > 1 keep the topk_group groups
//   with the largest sum of their top-2 b; pick top_k experts by b; w = sc[picked];
//   if norm_topk_prob: w /= sum(w) + 1e-20; w *= routed_scaling_factor.
// Output expert ids sorted ascending (weights in the same order): this fixes the combine order.
struct RouterParams {
  const float* logits = nullptr;  // [m, n_experts]
  const float* bias = nullptr;    // [n_experts] or nullptr
  int64_t m = 0, n_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  int32_t* expert_ids = nullptr;    // [m, top_k]
  float* expert_weights = nullptr;  // [m, top_k]
};

// out[i, j] = silu(gate[i, j]) * up[i, j]
struct SwigluParams {
  const float* gate = nullptr;
  const float* up = nullptr;
  int64_t ld_in = 0;
  float* out = nullptr;
  int64_t ld_out = 0;
  int64_t m = 0, n = 0;
};

// out[i, :] = float(table[ids[i], :])
struct EmbeddingParams {
  Weight table;  // [vocab, hidden]
  const int32_t* ids = nullptr;
  int64_t m = 0;
  float* out = nullptr;  // [m, hidden]
};

// dst[i, :] = src[rows[i], :]   (MoE token permutation)
struct GatherRowsParams {
  const float* src = nullptr;
  const int32_t* rows = nullptr;
  int64_t n = 0, d = 0;
  float* dst = nullptr;
};

// out[i, :] (+)= sum_{j = 0..top_k-1, in this order} weights[i, j] * expert_out[slots[i, j], :]
// (slot -1 contributes nothing). The fixed j order makes the MoE result layout-invariant.
struct MoeCombineParams {
  const float* expert_out = nullptr;  // [n_slots, d]
  const int32_t* slots = nullptr;     // [m, top_k]
  const float* weights = nullptr;     // [m, top_k]
  float* out = nullptr;               // [m, d]
  int64_t m = 0, top_k = 0, d = 0;
  bool accumulate = false;
};

// dst[i, 0:cols] = src[i, 0:cols] for i < rows   (strided 2-D block copy: cache writes, slicing).
// Elements are F32 unless said otherwise; F32 -> BF16 rounds to nearest even (a bf16 KV cache's
// writes), BF16 -> F32 is exact (its reads). Strides are in elements of each side's dtype.
struct Copy2dParams {
  const void* src = nullptr;
  int64_t ld_src = 0;
  void* dst = nullptr;
  int64_t ld_dst = 0;
  int64_t rows = 0, cols = 0;
  DType src_dtype = DType::F32, dst_dtype = DType::F32;
};

// The KV cache write of a step: row i of src [n, width] (float32) goes to position pos[i] of its
// sequence in a paged pool [blocks * block_size, width] of pages.dtype elements (F32, or BF16
// rounded to nearest even), i.e. pool element pages.at(i, pos[i], j, width); ld_table 0: one sequence.
struct PagedWriteParams {
  const float* src = nullptr;
  int64_t ld_src = 0;
  const int32_t* pos = nullptr;  // [n]
  void* pool = nullptr;
  int64_t n = 0, width = 0;
  KeyPages pages;
};

// y[i] += x[i]
struct AddParams {
  const float* x = nullptr;
  float* y = nullptr;
  int64_t n = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // The precision policy this backend was made with (see Precision).
  virtual Precision precision() const { return Precision::kExact; }
  // True when backend memory is host memory (cpu backends): MPI can send it directly.
  virtual bool host_memory() const { return true; }

  // Memory in the backend's address space.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  virtual void to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void to_host(void* dst, const void* src, size_t bytes) = 0;
  // Weight bytes made usable by kernels: the cpu backend returns `host` itself (mmapped, no
  // copy); a device backend copies once and owns the copy until the backend is destroyed.
  virtual const void* upload(const void* host, size_t bytes) = 0;
  // upload() of bytes in a read-only file mapping (the checkpoint), which the caller may drop
  // afterwards when the result is not `mapped` itself. The fast cpu backend copies them into
  // huge-page memory (cpu/weight_arena.h); the default is upload().
  virtual const void* upload_mapped(const void* mapped, size_t bytes) { return upload(mapped, bytes); }
  // A streamed matrix the model uses only as y = x W^T over whole rows (never transposed or
  // sliced): `mapped` views it in the file mapping (`bytes` long). The result may use another
  // layout (the fast cpu backend: WeightLayout::kQuad16, kTile16 or kQuantQuad); the default is
  // upload_mapped().
  virtual Weight upload_gemm_matrix(const Weight& mapped, size_t bytes) {
    Weight w = mapped;
    w.data = upload_mapped(mapped.data, bytes);
    return w;
  }
  virtual void synchronize() {}
  // The in-order work queue the backend's ops run on (a cudaStream_t for cuda), so that a
  // communicator can order its transfers with them without a host sync; nullptr for host
  // backends, whose ops are complete when they return.
  virtual void* stream() const { return nullptr; }
  // Raw allocations made so far (cudaMalloc calls behind alloc(), the scratch of the ops and the
  // uploads): alloc()/free() serve the step loop from a cache, so a warm step adds none.
  virtual uint64_t raw_allocations() const { return 0; }

  virtual void gemm(const GemmParams& p) = 0;
  // Independent gemms: no output overlaps another's input or output. Results are bitwise those
  // of gemm() on each in turn (the default); a backend may run them together (the cpu backend
  // spreads their work over its threads in one parallel region).
  virtual void gemm_batch(const GemmParams* ps, size_t n) {
    for (size_t i = 0; i < n; ++i) gemm(ps[i]);
  }
  template <class Gemms>  // a std::vector or std::array of GemmParams
  void gemm_batch(const Gemms& ps) {
    gemm_batch(ps.data(), ps.size());
  }
  // The gemms of a MoE layer's experts (independent, as gemm_batch's): the default is gemm_batch.
  // A backend may run them with a kernel of its own (the cuda backend, GLM5_CUDA_EXPERT_GEMM=grouped:
  // one grouped tensor-core launch), whose results need not be gemm()'s bits but whose every row
  // depends only on that row, the weight and the precision: never on m or on the other gemms. The
  // model passes each weight through one of gemm / gemm_batch / gemm_grouped only, so the bits
  // stay independent of the batch either way.
  virtual void gemm_grouped(const GemmParams* ps, size_t n) { gemm_batch(ps, n); }
  template <class Gemms>
  void gemm_grouped(const Gemms& ps) {
    gemm_grouped(ps.data(), ps.size());
  }
  virtual void rms_norm(const RmsNormParams& p) = 0;
  virtual void layer_norm(const LayerNormParams& p) = 0;
  virtual void rope(const RopeParams& p) = 0;
  virtual void indexer_scores(const IndexerScoresParams& p) = 0;
  virtual void topk(const TopkParams& p) = 0;
  virtual void mla_prefill(const MlaPrefillParams& p) = 0;
  virtual void mla_decode(const MlaDecodeParams& p) = 0;
  virtual void router(const RouterParams& p) = 0;
  virtual void swiglu(const SwigluParams& p) = 0;
  virtual void embedding(const EmbeddingParams& p) = 0;
  virtual void gather_rows(const GatherRowsParams& p) = 0;
  virtual void moe_combine(const MoeCombineParams& p) = 0;
  virtual void add(const AddParams& p) = 0;
  virtual void copy_2d(const Copy2dParams& p) = 0;
  virtual void paged_write(const PagedWriteParams& p) = 0;
  // Whether the runtime should keep this backend's indexer keys in tiles of its 64-token blocks
  // (KeyPages::tiled): the fast cpu backend scores a tile's 64 keys without transposing them.
  virtual bool index_key_tiles() const { return false; }
  // The kernel this backend last ran for `op` ("mla_decode", "indexer_scores"), e.g. "tensor cores"
  // or "SIMT"; "" where it has one kind only (benchmarks name the kernel that ran, not the requested).
  virtual std::string kernel_ran(const std::string& /*op*/) const { return ""; }
};

// The reference backend: plain loops, float32, one thread. Every other backend is tested against it
// (in kFast its gemm rounds both factors to bf16 and sums in k order).
std::unique_ptr<Backend> make_reference_backend(Precision precision = Precision::kExact);
// The fast CPU backend (blocked, vectorised, multi-threaded over output columns); same results
// as the reference up to float32 reassociation, and batch-invariant.
std::unique_ptr<Backend> make_cpu_backend(Precision precision = Precision::kExact);
// Rows [r0, r0 + n) of a host weight as float32 into out (row stride ldo): weight_at's values, the
// quantized formats through the CPU backend's vectorised dequantization, rows on all threads
// (from 64 Ki values). For
// host-side readers (the model's embedding and norms at load, checkpoint conversion).
void weight_rows(const Weight& w, int64_t r0, int64_t n, float* out, int64_t ldo);
// The CPU backend's BF16 gemm path in use for a precision (cpu/fast_ops.h): ranks of one job compare it.
std::string cpu_gemm_path(Precision precision);
// The CUDA backend on `device`; throws glm5::Error when CUDA support is not built in or no GPU.
std::unique_ptr<Backend> make_cuda_backend(int device, Precision precision = Precision::kExact);
bool cuda_available();  // built with CUDA and a device is usable

}  // namespace glm5::kernels

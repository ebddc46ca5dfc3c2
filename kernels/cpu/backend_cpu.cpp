// make_cpu_backend(): the fast CPU backend the model runs on. gemm and the attention ops have their
// own kernels (cpu/gemm.cpp, cpu/attention.cpp); the cheap row-wise ops run the reference code
// (or a vectorised copy of it) on row ranges in parallel. Every op checks its parameters first
// with every backend's validate() (kernels/validate.h), and its host-memory contents with the
// reference backend's validate_contents().
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/core/quant.h"
#include "kernels/cpu/bf16_attention.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/weight_arena.h"

namespace glm5::kernels::cpu {

namespace {

// f(begin, end) over row ranges, split across threads when there is enough work to pay for it.
// f must not throw (parameters are checked before).
template <class F>
void parallel_rows(int64_t m, int64_t work_per_row, F f) {
  if (m < 2 || m * work_per_row < (1 << 15)) {
    f(int64_t(0), m);
    return;
  }
#pragma omp parallel
  {
    int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t b = m * id / nt, e = m * (id + 1) / nt;
    if (b < e) f(b, e);
  }
}

// rms_norm with a 16-lane sum of squares (fixed per row, so batch-invariant).
void rms_norm_rows(const RmsNormParams& p, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const float* x = p.x + i * p.ldx;
    float* y = p.y + i * p.ldy;
    simd::vf acc = simd::zero();
    int64_t j = 0;
    for (; j + simd::kLanes <= p.d; j += simd::kLanes) {
      simd::vf v = simd::load(x + j);
      acc = simd::fma(v, v, acc);
    }
    if (j < p.d) {
      simd::vf v = simd::load_n(x + j, int(p.d - j));
      acc = simd::fma(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(simd::reduce(acc) / float(p.d) + p.eps);
    for (j = 0; j < p.d; ++j) y[j] = p.weight[j] * (x[j] * r);
  }
}

// moe_combine: per row, acc = sum_j w[j] * expert_out[slot j] in j order, then (+)= into out.
void moe_combine_rows(const MoeCombineParams& p, int64_t b, int64_t e, std::vector<float>& acc) {
  acc.resize(size_t(p.d));
  for (int64_t i = b; i < e; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < p.top_k; ++j) {
      int32_t slot = p.slots[i * p.top_k + j];
      if (slot < 0) continue;
      const float w = p.weights[i * p.top_k + j];
      const float* src = p.expert_out + slot * p.d;
      for (int64_t c = 0; c < p.d; ++c) acc[c] += w * src[c];
    }
    float* out = p.out + i * p.d;
    if (p.accumulate)
      for (int64_t c = 0; c < p.d; ++c) out[c] = out[c] + acc[c];
    else
      std::memcpy(out, acc.data(), size_t(p.d) * 4);
  }
}

// A bf16-rounded copy of an op's float input, kept by the calling thread between calls.
const float* rounded(const float* x, int64_t ld, int64_t m, int64_t width, std::vector<float>& buf) {
  if (buf.size() < size_t(m * width)) buf.resize(size_t(m * width));
  fast::round_bf16_rows(x, ld, m, width, buf.data());
  return buf.data();
}

class CpuBackend final : public HostBackend {
 public:
  using Backend::gemm_batch;  // the vector / array overload
  explicit CpuBackend(Precision precision) : precision_(precision) {}
  std::string name() const override { return "cpu"; }
  Precision precision() const override { return precision_; }

  const void* upload_mapped(const void* mapped, size_t bytes) override {
    const void* copy = arena_.copy(mapped, bytes);
    return copy ? copy : mapped;
  }
  // Plain-dtype matrices copied interleaved: WeightLayout::kQuad16 (the fp32 gemm path's decode
  // tiles then read one stream), or kTile16 for BF16 where the gemm runs on AMX tiles (each A tile
  // one contiguous KiB).
  // Quantized ones in quads of rows (kQuantQuad) where their rows are whole 64-byte chunks (int4:
  // whole groups of 128 columns) and the AVX-512 kernels run (the portable ones read it more slowly
  // than rows as stored), so that decode reads each tile of 4 rows as one stream.
  Weight upload_gemm_matrix(const Weight& mapped, size_t bytes) override {
    if (mapped.layout == WeightLayout::kRowMajor && fast::quant_path() == "avx512" &&
        quant_quad_fits(mapped.dtype, mapped.cols, mapped.ld, mapped.group)) {
      Weight w = mapped;
      w.data =
          arena_.copy_quant_quad(mapped.data, mapped.dtype, mapped.rows, quant::row_bytes(mapped.dtype, mapped.ld));
      if (!w.data) return HostBackend::upload_gemm_matrix(mapped, bytes);  // the arena is off or full
      w.layout = WeightLayout::kQuantQuad;
      return w;
    }
    const bool plain = mapped.dtype == DType::BF16 || mapped.dtype == DType::F16 || mapped.dtype == DType::F32;
    if (!plain) return HostBackend::upload_gemm_matrix(mapped, bytes);
    if (precision_ == Precision::kFast) return upload_fast(mapped);
    const WeightLayout layout =
        mapped.dtype == DType::BF16 && fast::gemm_path() != "fp32" ? WeightLayout::kTile16 : WeightLayout::kQuad16;
    Weight w = mapped;
    w.data =
        arena_.copy_interleaved(mapped.data, dtype_size(mapped.dtype), mapped.rows, mapped.cols, mapped.ld, layout);
    if (!w.data) return HostBackend::upload_gemm_matrix(mapped, bytes);  // the arena is off or full
    w.layout = layout;
    w.ld = WeightArena::interleaved_ld(layout, mapped.cols);
    return w;
  }
  void gemm(const GemmParams& p) override {
    validate(p);
    fast::gemm(p, precision_);
  }
  void gemm_batch(const GemmParams* ps, size_t n) override {
    for (size_t i = 0; i < n; ++i) validate(ps[i]);
    fast::gemm_batch({ps, n}, precision_);
  }
  void rms_norm(const RmsNormParams& p) override {
    validate(p);
    parallel_rows(p.m, p.d, [&](int64_t b, int64_t e) { rms_norm_rows(p, b, e); });
  }
  void layer_norm(const LayerNormParams& p) override {
    validate(p);
    parallel_rows(p.m, 3 * p.d, [&](int64_t b, int64_t e) {
      LayerNormParams q = p;
      q.x += b * p.ldx;
      q.y += b * p.ldy;
      q.m = e - b;
      ref::layer_norm(q);
    });
  }
  void rope(const RopeParams& p) override {
    validate(p);
    parallel_rows(p.m, p.n_heads * p.rope_dim, [&](int64_t b, int64_t e) {
      RopeParams q = p;
      q.x += b * p.token_stride;
      q.positions += b;
      q.m = e - b;
      ref::rope(q);
    });
  }
  // Precision::kFast: the attention-side products take bf16 inputs too. The caches hold bf16 values
  // (paged_write rounds). With fast_bf16_dots() the ops run their vdpbf16ps recipes, which round
  // what they pack (queries, keys, values, and the softmax weights for the value products: cpu/
  // bf16_attention.h); otherwise each op rounds its float activations (queries; prefill's expanded
  // keys and values) into a copy for the exact kernels, softmax weights float32. The indexer's head
  // weights stay float32 either way.
  void indexer_scores(const IndexerScoresParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast) return fast::indexer_scores(p);
    thread_local std::vector<float> q;
    IndexerScoresParams r = p;
    r.q = rounded(p.q, p.n_heads * p.head_dim, p.s, p.n_heads * p.head_dim, q);
    fast::indexer_scores(r, fast::fast_bf16_dots());
  }
  void topk(const TopkParams& p) override {
    validate(p);
    fast::topk(p);
  }
  void mla_prefill(const MlaPrefillParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast) return fast::mla_prefill(p);
    if (fast::fast_bf16_dots()) return bf16::mla_prefill(p);  // (its packing rounds the inputs)
    thread_local std::vector<float> q, kv, k_pe;
    const int64_t dq = p.n_heads * (p.qk_nope_head_dim + p.qk_rope_head_dim);
    const int64_t dkv = p.n_heads * (p.qk_nope_head_dim + p.v_head_dim);
    MlaPrefillParams r = p;
    r.q = rounded(p.q, dq, p.s, dq, q);
    r.kv = rounded(p.kv, dkv, p.t, dkv, kv);
    r.k_pe = rounded(p.k_pe, p.ld_k_pe, p.t, p.qk_rope_head_dim, k_pe);
    r.ld_k_pe = p.qk_rope_head_dim;
    fast::mla_prefill(r);
  }
  void mla_decode(const MlaDecodeParams& p) override {
    validate(p);
    if (precision_ != Precision::kFast) return fast::mla_decode(p);
    if (fast::fast_bf16_dots()) return bf16::mla_decode(p);
    thread_local std::vector<float> q;
    const int64_t w = p.n_heads * (p.kv_lora_rank + p.qk_rope_head_dim);
    MlaDecodeParams r = p;
    r.q_lat = rounded(p.q_lat, w, p.s, w, q);
    fast::mla_decode(r);
  }
  void router(const RouterParams& p) override {
    validate(p);
    parallel_rows(p.m, 8 * p.n_experts, [&](int64_t b, int64_t e) {
      RouterParams q = p;
      q.logits += b * p.n_experts;
      q.expert_ids += b * p.top_k;
      q.expert_weights += b * p.top_k;
      q.m = e - b;
      ref::router(q);
    });
  }
  void swiglu(const SwigluParams& p) override {
    validate(p);
    parallel_rows(p.m, 8 * p.n, [&](int64_t b, int64_t e) {
      SwigluParams q = p;
      q.gate += b * p.ld_in;
      q.up += b * p.ld_in;
      q.out += b * p.ld_out;
      q.m = e - b;
      ref::swiglu(q);
    });
  }
  void embedding(const EmbeddingParams& p) override {
    validate(p);
    validate_contents(p);
    parallel_rows(p.m, p.table.cols, [&](int64_t b, int64_t e) {
      EmbeddingParams q = p;
      q.ids += b;
      q.out += b * p.table.cols;
      q.m = e - b;
      ref::embedding(q);
    });
  }
  void gather_rows(const GatherRowsParams& p) override {
    validate(p);
    validate_contents(p);
    parallel_rows(p.n, p.d, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) std::memcpy(p.dst + i * p.d, p.src + p.rows[i] * p.d, size_t(p.d) * 4);
    });
  }
  void moe_combine(const MoeCombineParams& p) override {
    validate(p);
    validate_contents(p);
    parallel_rows(p.m, p.top_k * p.d, [&](int64_t b, int64_t e) {
      std::vector<float> acc;
      moe_combine_rows(p, b, e, acc);
    });
  }
  void add(const AddParams& p) override {
    validate(p);
    parallel_rows(p.n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) p.y[i] += p.x[i];
    });
  }
  void copy_2d(const Copy2dParams& p) override {
    validate(p);
    if (p.src_dtype == p.dst_dtype) {
      const size_t es = dtype_size(p.src_dtype);
      parallel_rows(p.rows, p.cols, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i)
          std::memcpy(static_cast<char*>(p.dst) + size_t(i * p.ld_dst) * es,
                      static_cast<const char*>(p.src) + size_t(i * p.ld_src) * es, size_t(p.cols) * es);
      });
      return;
    }
    ref::copy_2d(p);  // a dtype conversion (bf16 KV cache rows): the reference's exact rounding
  }
  void paged_write(const PagedWriteParams& p) override {
    validate(p);
    parallel_rows(p.n, p.width, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t row = p.pages.row(i, p.pos[i]) * p.width;
        if (p.pages.tiled) {  // one key's elements lie block_size apart
          const int64_t at = p.pages.at(i, p.pos[i], 0, p.width), step = p.pages.block_size;
          for (int64_t j = 0; j < p.width; ++j) {
            const float v = p.src[i * p.ld_src + j];
            if (p.pages.dtype == DType::BF16)
              static_cast<uint16_t*>(p.pool)[at + j * step] = f32_to_bf16(v);
            else
              static_cast<float*>(p.pool)[at + j * step] = precision_ == Precision::kFast ? bf16_round(v) : v;
          }
        } else if (p.pages.dtype == DType::BF16) {
          uint16_t* dst = static_cast<uint16_t*>(p.pool) + row;
          for (int64_t j = 0; j < p.width; ++j) dst[j] = f32_to_bf16(p.src[i * p.ld_src + j]);
        } else if (precision_ == Precision::kFast) {  // bf16 values in a float32 cache
          fast::round_bf16_rows(p.src + i * p.ld_src, p.ld_src, 1, p.width, static_cast<float*>(p.pool) + row, false);
        } else {
          std::memcpy(static_cast<float*>(p.pool) + row, p.src + i * p.ld_src, size_t(p.width) * sizeof(float));
        }
      }
    });
  }
  bool index_key_tiles() const override { return true; }

 private:
  // Precision::kFast: a plain-dtype matrix held as BF16 (F16 / F32 rounded to nearest even once
  // here: what its gemm would read anyway, at half or a quarter of the bytes) in the layout of the
  // fast path in use (fast::fast_bf16_layout()).
  Weight upload_fast(const Weight& mapped) {
    std::vector<uint16_t> rounded;
    const void* src = mapped.data;
    int64_t ld = mapped.ld;
    if (mapped.dtype != DType::BF16) {
      rounded.resize(size_t(mapped.rows * mapped.cols));
      for (int64_t r = 0; r < mapped.rows; ++r)
        for (int64_t c = 0; c < mapped.cols; ++c)
          rounded[size_t(r * mapped.cols + c)] = f32_to_bf16(weight_at(mapped, r, c));
      src = rounded.data();
      ld = mapped.cols;
    }
    const WeightLayout layout = fast::fast_bf16_layout();
    Weight w = mapped;
    w.dtype = DType::BF16;
    w.data = arena_.copy_interleaved(src, 2, mapped.rows, mapped.cols, ld, layout);
    if (!w.data) {  // the arena is off or full: the heap, so that the recipe stays the path's
      owned_.emplace_back(new uint16_t[WeightArena::interleaved_bytes(2, mapped.rows, mapped.cols, layout) / 2]);
      WeightArena::interleave(owned_.back().get(), src, 2, mapped.rows, mapped.cols, ld, layout);
      w.data = owned_.back().get();
    }
    w.layout = layout;
    w.ld = WeightArena::interleaved_ld(layout, mapped.cols);
    return w;
  }

  Precision precision_;
  WeightArena arena_;
  std::vector<std::unique_ptr<uint16_t[]>> owned_;  // kFast matrices the arena did not take
};

}  // namespace

}  // namespace glm5::kernels::cpu

namespace glm5::kernels {
void weight_rows(const Weight& w, int64_t r0, int64_t n, float* out, int64_t ldo) {
  const bool quantized = quant::is_quantized(w.dtype);
#pragma omp parallel for schedule(static) if (n * w.cols >= (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i) {
    float* row = out + i * ldo;
    if (quantized)
      cpu::fast::dequantize_rows(w, r0 + i, 1, row, ldo);
    else
      for (int64_t c = 0; c < w.cols; ++c) row[c] = weight_at(w, r0 + i, c);
  }
}

std::string cpu_gemm_path(Precision precision) {
  return precision == Precision::kFast ? cpu::fast::fast_gemm_path() : cpu::fast::gemm_path();
}

std::unique_ptr<Backend> make_cpu_backend(Precision precision) { return std::make_unique<cpu::CpuBackend>(precision); }
}  // namespace glm5::kernels

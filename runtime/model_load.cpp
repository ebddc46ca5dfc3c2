// Loading the model (names and shapes from the schema, runtime/name_table.h, of runtime/spec/glm5.md
// §2.1): each rank uploads only the tensors it owns, in the form the backend multiplies them in.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "parallel/device_comm.h"
#include "parallel/moe_exchange.h"
#include "runtime/model_parts.h"
#include "runtime/name_table.h"
#include "runtime/safetensors.h"

namespace glm5::runtime {

// ---------------------------------------------------------------------------------------------
// Loading: a rank asks only for the tensors it owns.

// A matrix in its stored dtype, uploaded to the backend (the kernels dequantize in registers).
// FP8 block scales in BF16 (accepted from checkpoints) are widened to F32 here, exactly: every
// backend then sees F32 FP8 scales only.
Weight Model::matrix(const TensorSpec& spec, Use use) {
  const StoredTensor st = resolve_tensor(ckpt_, spec);
  Weight w = weight_view(st, spec.shape[0], spec.shape[1]);
  const bool streamed = use != Use::kLookup;
  if (use == Use::kGemm)
    w = backend_.upload_gemm_matrix(w, st.data->nbytes);
  else
    w.data = streamed ? backend_.upload_mapped(st.data->data, st.data->nbytes)
                      : backend_.upload(st.data->data, st.data->nbytes);
  weight_bytes_ += st.data->nbytes;
  // A copy is used: this process's mapping of the source pages goes (the page cache keeps them
  // until memory is needed).
  if (w.data != st.data->data) Checkpoint::release_bytes(st.data->data, st.data->nbytes);
  if (st.scale && st.dtype == DType::F8_E4M3 && st.scale->dtype == DType::BF16) {
    owned_.emplace_back(size_t(st.scale->numel()));
    for (size_t i = 0; i < owned_.back().size(); ++i)
      owned_.back()[i] = bf16_to_f32(static_cast<const uint16_t*>(st.scale->data)[i]);
    w.scale = backend_.upload(owned_.back().data(), owned_.back().size() * sizeof(float));
    w.scale_dtype = DType::F32;
    weight_bytes_ += owned_.back().size() * sizeof(float);
  } else if (st.scale) {
    w.scale = streamed ? backend_.upload_mapped(st.scale->data, st.scale->nbytes)
                       : backend_.upload(st.scale->data, st.scale->nbytes);
    weight_bytes_ += st.scale->nbytes;
    if (w.scale != st.scale->data) Checkpoint::release_bytes(st.scale->data, st.scale->nbytes);
  }
  return w;
}

static std::vector<float> to_f32(const TensorInfo& t) {
  std::vector<float> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (t.dtype) {
      case DType::F32: std::memcpy(&v[i], static_cast<const char*>(t.data) + 4 * i, 4); break;
      case DType::BF16: v[i] = bf16_to_f32(static_cast<const uint16_t*>(t.data)[i]); break;
      case DType::F16: v[i] = f16_to_f32(static_cast<const uint16_t*>(t.data)[i]); break;
      default: GLM5_FAIL("tensor '", t.name, "' in ", t.file, ": unsupported dtype ", t.dtype_name);
    }
  }
  return v;
}

// Norm weights, biases: converted once to float32 (tiny next to the matrices).
const float* Model::vector(const TensorSpec& spec, float scale) {
  const TensorInfo& t = ckpt_.get(spec.name, spec.shape);
  owned_.push_back(to_f32(t));
  for (float& x : owned_.back()) x *= scale;
  weight_bytes_ += owned_.back().size() * sizeof(float);  // held as float32
  return static_cast<const float*>(backend_.upload(owned_.back().data(), owned_.back().size() * sizeof(float)));
}

// The float32 values of a matrix as stored (widened or dequantized exactly), times `scale`.
static std::vector<float> dequantized(const StoredTensor& st, int64_t rows, int64_t cols, float scale) {
  const Weight hw = weight_view(st, rows, cols);
  std::vector<float> v(size_t(rows * cols));
  kernels::weight_rows(hw, 0, rows, v.data(), cols);
  if (scale != 1.0f)
    for (float& x : v) x *= scale;
  return v;
}

// A copy of a matrix held by the model in F32 or BF16, uploaded.
Weight Model::owned_matrix(std::vector<float> v, int64_t rows, int64_t cols, DType dtype) {
  Weight w;
  w.rows = rows;
  w.cols = cols;
  w.ld = cols;
  w.dtype = dtype;
  if (dtype == DType::BF16) {
    owned_bf16_.emplace_back(v.size());
    for (size_t i = 0; i < v.size(); ++i) owned_bf16_.back()[i] = f32_to_bf16(v[i]);
    w.data = backend_.upload(owned_bf16_.back().data(), v.size() * 2);
    weight_bytes_ += v.size() * 2;
  } else {
    owned_.push_back(std::move(v));
    w.data = backend_.upload(owned_.back().data(), owned_.back().size() * sizeof(float));
    weight_bytes_ += owned_.back().size() * sizeof(float);
  }
  return w;
}

// indexer.weights_proj is used only as (W x) * n_heads^-0.5 * head_dim^-0.5: the constant is
// folded into a float32 copy of this small [index_n_heads, hidden] matrix.
Weight Model::matrix_f32_scaled(const TensorSpec& spec, float scale) {
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  return owned_matrix(dequantized(resolve_tensor(ckpt_, spec), rows, cols, scale), rows, cols, DType::F32);
}

// matrix() unless the checkpoint stores it quantized and its use needs plain values (kv_b_proj's
// per-head slices cross scale blocks; the embedding lookup). Then its dequantized values, held in
// BF16 when every one is a bf16 number (int4/int8 with BF16 scales), else in F32: exact either way.
Weight Model::matrix_plain(const TensorSpec& spec, Use use) {
  const StoredTensor st = resolve_tensor(ckpt_, spec);
  if (!quant::is_quantized(st.dtype)) return matrix(spec, use);
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  std::vector<float> v = dequantized(st, rows, cols, 1.0f);
  const bool bf16 = std::all_of(v.begin(), v.end(), [](float x) { return bf16_to_f32(f32_to_bf16(x)) == x; });
  return owned_matrix(std::move(v), rows, cols, bf16 ? DType::BF16 : DType::F32);
}

// One decoder layer's weights (spec §2.1), names and shapes from the schema: MLA, the DSA
// indexer, and a dense MLP or this rank's share of the routed experts with the shared expert.
std::unique_ptr<Model::Layer> Model::load_layer(int l) {
  const ModelConfig& cfg = cfg_;
  const float index_weight_scale =
      float(1.0 / std::sqrt(double(cfg.index_n_heads)) / std::sqrt(double(cfg.index_head_dim)));
  const SchemaLookup schema(layer_tensors(cfg, l));
  auto n = [&](const std::string& rest) -> const TensorSpec& { return schema[layer_name(l, rest.c_str())]; };
  auto L = std::make_unique<Layer>();
  L->index = l;
  L->input_layernorm = vector(n("input_layernorm.weight"));
  L->post_attention_layernorm = vector(n("post_attention_layernorm.weight"));
  L->q_a_proj = matrix(n("self_attn.q_a_proj.weight"));
  L->q_a_layernorm = vector(n("self_attn.q_a_layernorm.weight"));
  L->q_b_proj = matrix(n("self_attn.q_b_proj.weight"));
  L->kv_a_proj_with_mqa = matrix(n("self_attn.kv_a_proj_with_mqa.weight"));
  L->kv_a_layernorm = vector(n("self_attn.kv_a_layernorm.weight"));
  L->kv_b_proj = matrix_plain(n("self_attn.kv_b_proj.weight"), Use::kStreamed);  // sliced per head
  L->o_proj = matrix(n("self_attn.o_proj.weight"));
  L->indexer = cfg.has_indexer(l);
  if (L->indexer) {
    L->wq_b = matrix(n("self_attn.indexer.wq_b.weight"));
    L->wk = matrix(n("self_attn.indexer.wk.weight"));
    L->k_norm_weight = vector(n("self_attn.indexer.k_norm.weight"));
    L->k_norm_bias = vector(n("self_attn.indexer.k_norm.bias"));
    L->weights_proj = matrix_f32_scaled(n("self_attn.indexer.weights_proj.weight"), index_weight_scale);
  }
  L->moe = cfg.is_moe_layer(l);
  if (!L->moe) {
    L->dense = {matrix(n("mlp.gate_proj.weight")), matrix(n("mlp.up_proj.weight")), matrix(n("mlp.down_proj.weight"))};
    return L;
  }
  const int64_t E = cfg.n_routed_experts;
  L->gate = matrix(n("mlp.gate.weight"));
  L->e_score_correction_bias = vector(n("mlp.gate.e_score_correction_bias"));
  CHECK(E % shard_.expert_parallel == 0, "n_routed_experts (", E, ") is not divisible by the expert-parallel degree (",
        shard_.expert_parallel, ")");
  const int64_t per = E / shard_.expert_parallel;
  for (int64_t e = shard_.column * per; e < (shard_.column + 1) * per; ++e) {
    const std::string p = "mlp.experts." + std::to_string(e) + ".";
    L->experts.push_back(
        {matrix(n(p + "gate_proj.weight")), matrix(n(p + "up_proj.weight")), matrix(n(p + "down_proj.weight"))});
  }
  if (cfg.n_shared_experts > 0)
    L->shared = {matrix(n("mlp.shared_experts.gate_proj.weight")), matrix(n("mlp.shared_experts.up_proj.weight")),
                 matrix(n("mlp.shared_experts.down_proj.weight"))};
  return L;
}

// The MTP layer (spec §3.9), stored after the decoder layers: enorm, hnorm, eh_proj [H, 2H], a
// decoder layer of its own and shared_head.norm; it uses the main embedding and lm_head.
void Model::load_mtp() {
  const int l = int(cfg_.num_hidden_layers);
  CHECK(cfg_.num_nextn_predict_layers >= 1 && ckpt_.has(layer_name(l, "eh_proj.weight")),
        "speculative decoding drafts with the MTP layer, but ", ckpt_.dir(),
        " has none (num_nextn_predict_layers = ", cfg_.num_nextn_predict_layers, ", tensor '",
        layer_name(l, "eh_proj.weight"), "' not found): set speculative_tokens to 0");
  CHECK(cfg_.has_indexer(l), "speculative decoding: the MTP layer of ", cfg_.source,
        " has no indexer of its own "
        "(indexer_types / index_share_for_mtp_iteration), which glm5 does not run yet: set speculative_tokens to 0");
  const SchemaLookup schema(layer_tensors(cfg_, l));
  mtp_ = std::make_unique<Mtp>();
  mtp_->enorm = vector(schema[layer_name(l, "enorm.weight")]);
  mtp_->hnorm = vector(schema[layer_name(l, "hnorm.weight")]);
  mtp_->eh_proj = matrix(schema[layer_name(l, "eh_proj.weight")]);
  mtp_->shared_head_norm = vector(schema[layer_name(l, "shared_head.norm.weight")]);
  mtp_->layer = load_layer(l);
  if (mtp_->layer->moe) router_load_.push_back({l, 0, std::vector<int64_t>(size_t(cfg_.n_routed_experts), 0)});
}

Model::Model(const ModelConfig& cfg, Checkpoint& ckpt, Backend& backend, const ModelShard& shard,
             parallel::Comm& stage_comm, parallel::Comm* payload_comm)
    : cfg_(cfg), ckpt_(ckpt), backend_(backend), shard_(shard), stage_comm_(stage_comm) {
  if (shard_.last_layer < 0) shard_.last_layer = int(cfg.num_hidden_layers);
  CHECK(0 <= shard_.first_layer && shard_.first_layer < shard_.last_layer && shard_.last_layer <= cfg.num_hidden_layers,
        "layer range [", shard_.first_layer, ", ", shard_.last_layer, ") is not inside the model's ",
        cfg.num_hidden_layers, " layers");

  CHECK(!shard_.mtp || shard_.head, "internal: the MTP layer goes where lm_head is");
  const SchemaLookup globals(global_tensors(cfg));
  if (shard_.embedding || shard_.mtp)  // looked up a few rows per step: stays mapped
    embed_tokens_ = matrix_plain(globals["model.embed_tokens.weight"], Use::kLookup);
  if (shard_.head) {
    final_norm_ = vector(globals["model.norm.weight"]);
    lm_head_ = matrix(globals[cfg.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"]);
  }
  inv_freq_host_ = cfg.inv_freq();
  inv_freq_ = static_cast<const float*>(backend_.upload(inv_freq_host_.data(), inv_freq_host_.size() * sizeof(float)));

  for (int l = shard_.first_layer; l < shard_.last_layer; ++l) layers_.push_back(load_layer(l));
  expert_tokens_.assign(size_t(cfg.n_routed_experts / shard_.expert_parallel), 0);
  for (const auto& L : layers_)
    if (L->moe) router_load_.push_back({L->index, 0, std::vector<int64_t>(size_t(cfg.n_routed_experts), 0)});
  if (shard_.mtp) load_mtp();
  exchange_ = backend_.host_memory() ? std::make_unique<Exchange>(stage_comm_)
                                     : std::make_unique<Exchange>(stage_comm_, backend_, payload_comm);
}

Model::~Model() = default;

size_t Model::moe_bytes_sent() const { return exchange_->ex.bytes_sent(); }
size_t Model::moe_payload_bytes_sent() const { return exchange_->ex.payload_bytes_sent(); }

}  // namespace glm5::runtime

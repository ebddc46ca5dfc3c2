// The HF tensor names and shapes of a glm_moe_dsa / deepseek_v32 checkpoint (spec §2.1), and the
// strict header-only check of a checkpoint against them. FP8 `weight_scale_inv` siblings are not
// in the table: FP8 tensors are refused before they would be reported as unknown.
#include "runtime/name_table.h"

#include <unordered_set>

#include "core/check.h"
#include "runtime/safetensors.h"

namespace glm5::runtime {

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::vector<TensorSpec> tensor_table(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, NH = c.num_attention_heads;
  std::vector<TensorSpec> t;
  t.push_back({"model.embed_tokens.weight", {V, H}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string P = "model.layers." + std::to_string(l) + ".";
    auto add = [&](const std::string& name, std::vector<int64_t> shape, int expert = -1) {
      t.push_back({P + name, std::move(shape), int(l), expert});
    };
    add("input_layernorm.weight", {H});
    add("post_attention_layernorm.weight", {H});
    // MLA: q per head [nope ‖ rope]; kv_a rows [latent ‖ k_rope]; kv_b per head rows [k_nope ‖ v].
    add("self_attn.q_a_proj.weight", {c.q_lora_rank, H});
    add("self_attn.q_a_layernorm.weight", {c.q_lora_rank});
    add("self_attn.q_b_proj.weight", {NH * c.qk_head_dim(), c.q_lora_rank});
    add("self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H});
    add("self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
    add("self_attn.kv_b_proj.weight", {NH * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
    add("self_attn.o_proj.weight", {H, NH * c.v_head_dim});
    // DSA indexer: wq_b per head [rope ‖ nope], k_norm is a LayerNorm with bias.
    add("self_attn.indexer.wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank});
    add("self_attn.indexer.wk.weight", {c.index_head_dim, H});
    add("self_attn.indexer.k_norm.weight", {c.index_head_dim});
    add("self_attn.indexer.k_norm.bias", {c.index_head_dim});
    add("self_attn.indexer.weights_proj.weight", {c.index_n_heads, H});
    if (!c.is_moe_layer(l)) {
      const int64_t I = c.intermediate_size;
      add("mlp.gate_proj.weight", {I, H});
      add("mlp.up_proj.weight", {I, H});
      add("mlp.down_proj.weight", {H, I});
      continue;
    }
    const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
    add("mlp.gate.weight", {E, H});
    add("mlp.gate.e_score_correction_bias", {E});  // topk_method noaux_tc (the only one accepted)
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = "mlp.experts." + std::to_string(e) + ".";
      add(X + "gate_proj.weight", {I, H}, int(e));
      add(X + "up_proj.weight", {I, H}, int(e));
      add(X + "down_proj.weight", {H, I}, int(e));
    }
    if (c.n_shared_experts > 0) {
      const int64_t S = I * c.n_shared_experts;
      add("mlp.shared_experts.gate_proj.weight", {S, H});
      add("mlp.shared_experts.up_proj.weight", {S, H});
      add("mlp.shared_experts.down_proj.weight", {H, S});
    }
  }
  t.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {V, H}});
  return t;
}

bool is_mtp_tensor(const ModelConfig& cfg, const std::string& name) {
  static const std::string prefix = "model.layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  size_t i = prefix.size(), j = i;
  int64_t layer = 0;
  while (j < name.size() && name[j] >= '0' && name[j] <= '9' && j - i < 12)
    layer = layer * 10 + (name[j++] - '0');
  if (j == i || j >= name.size() || name[j] != '.') return false;
  return layer >= cfg.num_hidden_layers;
}

void check_checkpoint(Checkpoint& ckpt, const ModelConfig& cfg) {
  const std::vector<TensorSpec> table = tensor_table(cfg);
  std::unordered_set<std::string> known;
  known.reserve(table.size());
  for (const TensorSpec& s : table) {
    known.insert(s.name);
    const TensorInfo* t = ckpt.find(s.name);
    CHECK(t, ckpt.dir(), ": tensor '", s.name, "' not found (expected shape ", shape_str(s.shape),
          ", from ", cfg.source, ")");
    CHECK(t->dtype != DType::F8_E4M3, "tensor ", s.name, " in ", t->file,
          " is F8_E4M3 (FP8 with weight_scale_inv); FP8 checkpoints are not supported yet");
    CHECK(t->dtype == DType::BF16 || t->dtype == DType::F16 || t->dtype == DType::F32, "tensor ",
          s.name, " in ", t->file, " has dtype ", t->dtype_name, "; expected BF16, F16 or F32");
    CHECK(t->shape == s.shape, "tensor ", s.name, " in ", t->file, ": expected shape ",
          shape_str(s.shape), " (from ", cfg.source, "), found ", shape_str(t->shape));
  }
  std::string first_unknown;
  size_t unknown = 0;
  for (const std::string& name : ckpt.names()) {
    if (known.count(name) || is_mtp_tensor(cfg, name)) continue;
    if (unknown++ == 0) first_unknown = name;
  }
  CHECK(unknown == 0, ckpt.dir(), ": tensor '", first_unknown, "' is not part of a ", cfg.model_type,
        " model with the config ", cfg.source, " (", unknown,
        " unknown tensor name(s); layers >= num_hidden_layers = ", cfg.num_hidden_layers,
        " are MTP and allowed)");
}

}  // namespace glm5::runtime

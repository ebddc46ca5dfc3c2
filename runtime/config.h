// The model configuration: HF config.json of glm_moe_dsa (GLM-5) and deepseek_v32 under their real
// key names, validated with errors that name the file, the field, the expected and the found value.
// Only architecture facts live here; where things run is the cluster config (launcher/).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glm5::runtime {

struct RopeScaling {
  std::string type = "default";  // "default" | "yarn"
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0, mscale = 1.0, mscale_all_dim = 0.0;
};

// `quantization_config` of config.json: what a checkpoint says about its stored weights. The
// loader decides per tensor from the tensors themselves (spec 1.2); this is for planning (inspect
// without headers) and for refusing formats we cannot load with a clear message.
struct QuantConfig {
  std::string method;      // "" (none) | "fp8" | "compressed-tensors"
  int64_t num_bits = 0;    // compressed-tensors: 4 or 8 (the first config group's weights)
  int64_t group_size = 0;  // compressed-tensors: 0 = per channel
};

struct ModelConfig {
  std::string source;      // path of the config.json this came from (for messages)
  std::string model_type;  // "glm_moe_dsa" | "deepseek_v32"
  std::string dtype;       // "bfloat16" ... (`dtype` or `torch_dtype`)

  int64_t vocab_size = 0, hidden_size = 0, num_hidden_layers = 0, num_attention_heads = 0;
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  int64_t intermediate_size = 0, moe_intermediate_size = 0;
  int64_t n_routed_experts = 0, n_shared_experts = 0, num_experts_per_tok = 0;
  int64_t n_group = 1, topk_group = 1, first_k_dense_replace = 0, moe_layer_freq = 1;
  int64_t num_nextn_predict_layers = 0, max_position_embeddings = 0;
  double routed_scaling_factor = 1.0, rms_norm_eps = 1e-6, rope_theta = 10000.0;
  bool norm_topk_prob = true, tie_word_embeddings = false;
  bool rope_interleave = true;          // MLA rope slice: interleaved pairs
  bool indexer_rope_interleave = true;  // default true for glm_moe_dsa, false for deepseek_v32
  RopeScaling rope_scaling;
  QuantConfig quantization;
  std::string scoring_func = "sigmoid", topk_method = "noaux_tc";
  std::vector<int32_t> eos_token_id;
  int32_t bos_token_id = -1, pad_token_id = -1;
  // Per decoder layer (num_hidden_layers entries, and the MTP layers' when indexer_types lists
  // them): 1 where the layer runs its own DSA indexer
  // ("full"), 0 where it reuses the top-k of the nearest full layer before it ("shared", GLM-5.2's
  // IndexShare). From `indexer_types`, `index_topk_pattern` or `index_topk_freq` /
  // `index_skip_topk_offset`, as transformers derives it; all full when none is given.
  std::vector<char> indexer_full;
  bool index_share_for_mtp_iteration = false;  // the MTP layer reuses the main model's top-k
  // Fields present in config.json that are known not to change what the model computes
  // (initializer_range, use_cache, ...), in file order: reported once, by name, by the launcher.
  std::vector<std::string> ignored_fields;

  // Derived quantities.
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const;  // layer >= first_k_dense_replace && layer % freq == 0
  // Whether `layer` runs its own DSA indexer (indexer_full; the MTP layer, index >= num_hidden_layers,
  // unless index_share_for_mtp_iteration), and the full layer whose top-k it uses (itself if full).
  bool has_indexer(int64_t layer) const;
  int64_t indexer_donor(int64_t layer) const;
  float softmax_scale() const;          // qk_head_dim^-0.5, times mscale^2 under YaRN
  std::vector<float> inv_freq() const;  // [qk_rope_head_dim / 2], YaRN-corrected if configured
  float rope_cos_sin_scale() const;     // 1 unless YaRN mscale != mscale_all_dim
};

// Reads and validates <model_dir>/config.json (throws glm5::Error naming file and field).
ModelConfig load_config(const std::string& model_dir);
// Same from JSON text; `source` names it in messages.
ModelConfig parse_config(const std::string& json_text, const std::string& source);

}  // namespace glm5::runtime

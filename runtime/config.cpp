// HF config.json -> ModelConfig: reads glm_moe_dsa and deepseek_v32 keys (both `dtype` spellings,
// both RoPE spellings, GLM-5.x's per-layer indexer and MLP types), validates types, ranges and
// cross-field consistency, and derives the softmax scale and the (YaRN-corrected) RoPE
// frequencies. Every key is either read, or known not to change the result (training-only or
// other engines' keys: initializer_range, ep_size, num_key_value_heads, head_dim, ...; listed in
// ModelConfig::ignored_fields), or refused by name: a key we do not know may change the math.
// runtime/spec/glm5.md §1.6 lists every published field and what happens to it.
#include "runtime/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numbers>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kernels/core/check.h"

namespace glm5::runtime {

namespace {

using json = nlohmann::json;

// A found value for messages; long values (a whole object) are cut.
std::string show(const json* v) {
  if (!v) return "nothing (the field is missing)";
  std::string s = v->dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// Reads fields of one JSON object, naming `source` and the dotted field path in every error.
struct Fields {
  const json& obj;
  const std::string& source;
  std::string prefix;  // "" or "rope_scaling."

  const json* find(const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }
  // A present, non-null value; null counts as absent (HF writes `"q_lora_rank": null` style).
  const json* value(const char* key) const {
    const json* v = find(key);
    return (v && !v->is_null()) ? v : nullptr;
  }
  [[noreturn]] void bad(const char* key, const std::string& expected, const json* found) const {
    GLM5_FAIL(source, ": field '", prefix, key, "': expected ", expected, ", found ", show(found));
  }

  int64_t integer(const char* key, int64_t min_value, const json* v) const {
    const char* expected = min_value > 0 ? "a positive integer" : "a non-negative integer";
    if (!v || !(v->is_number_integer() || v->is_number_unsigned())) bad(key, expected, v);
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      bad(key, expected, v);
    int64_t x = v->get<int64_t>();
    if (x < min_value) bad(key, expected, v);
    return x;
  }
  int64_t required_int(const char* key, int64_t min_value = 1) const { return integer(key, min_value, value(key)); }
  int64_t optional_int(const char* key, int64_t fallback, int64_t min_value) const {
    const json* v = value(key);
    return v ? integer(key, min_value, v) : fallback;
  }
  double number(const char* key, const json* v, bool positive) const {
    const char* expected = positive ? "a positive number" : "a number";
    if (!v || !v->is_number()) bad(key, expected, v);
    double x = v->get<double>();
    if (!std::isfinite(x) || (positive && !(x > 0))) bad(key, expected, v);
    return x;
  }
  double optional_number(const char* key, double fallback, bool positive) const {
    const json* v = value(key);
    return v ? number(key, v, positive) : fallback;
  }
  bool optional_bool(const char* key, bool fallback) const {
    const json* v = value(key);
    if (!v) return fallback;
    if (!v->is_boolean()) bad(key, "true or false", v);
    return v->get<bool>();
  }
  std::string optional_string(const char* key, const std::string& fallback) const {
    const json* v = value(key);
    if (!v) return fallback;
    if (!v->is_string()) bad(key, "a string", v);
    return v->get<std::string>();
  }
  int32_t token_id(const char* key, const json& v, int64_t vocab) const {
    const std::string expected = "a token id in [0, " + std::to_string(vocab) + ")";
    if (!(v.is_number_integer() || v.is_number_unsigned())) bad(key, expected, &v);
    int64_t x = v.get<int64_t>();
    if (x < 0 || x >= vocab) bad(key, expected, &v);
    return int32_t(x);
  }
};

// Whether a legacy `rope_scaling` object says what `rope_parameters` says: the same type (`type` or
// `rope_type`, "default" when absent) and the same value for every other key either has, rope_theta aside.
bool same_rope(const json& legacy, const json& params) {
  if (!legacy.is_object()) return false;
  auto type = [](const json& o) {
    const json& t = o.contains("rope_type") ? o["rope_type"] : o.contains("type") ? o["type"] : json("default");
    return t;
  };
  if (type(legacy) != type(params)) return false;
  for (const json* o : {&legacy, &params})
    for (auto it = o->begin(); it != o->end(); ++it) {
      const std::string& k = it.key();
      if (k == "type" || k == "rope_type" || k == "rope_theta") continue;
      const json& other = (o == &legacy) ? params : legacy;
      if (!other.contains(k) || other[k] != it.value()) return false;
    }
  return true;
}

// RoPE: transformers-v5 `rope_parameters` {rope_theta, rope_type, yarn keys...}, or the older
// top-level `rope_theta` plus `rope_scaling` {type | rope_type, factor, ...}.
void read_rope(const json& root, const std::string& source, ModelConfig& c) {
  Fields top{root, source, ""};
  const json* params = top.value("rope_parameters");
  const json* scaling = nullptr;
  std::string prefix;
  if (params) {
    if (!params->is_object()) top.bad("rope_parameters", "an object", params);
    Fields p{*params, source, "rope_parameters."};
    c.rope_theta = p.number("rope_theta", p.value("rope_theta"), true);
    scaling = params;
    prefix = "rope_parameters.";
    // The older spellings beside it would be ignored by transformers v5: refuse a disagreement.
    if (const json* t = top.value("rope_theta"); t && top.number("rope_theta", t, true) != c.rope_theta)
      top.bad("rope_theta", "rope_parameters.rope_theta = " + show(p.value("rope_theta")) + " or no field", t);
    // Exporters write the legacy rope_scaling beside it for older loaders: it must say the same.
    if (const json* rs = top.value("rope_scaling"); rs && !same_rope(*rs, *params))
      top.bad("rope_scaling", "null, or the same type and scaling fields as rope_parameters (" + show(params) + ")",
              rs);
  } else {
    const json* theta = top.value("rope_theta");
    if (!theta) top.bad("rope_theta", "a positive number (or a `rope_parameters` object)", nullptr);
    c.rope_theta = top.number("rope_theta", theta, true);
    scaling = top.value("rope_scaling");
    if (scaling && !scaling->is_object()) top.bad("rope_scaling", "an object or null", scaling);
    prefix = "rope_scaling.";
  }
  if (!scaling) return;

  Fields s{*scaling, source, prefix};
  const char* type_key = s.value("rope_type") ? "rope_type" : "type";
  std::string type = s.optional_string(type_key, "default");
  if (type == "default") {
    // YaRN's keys on an unscaled RoPE would be silently unused: say so instead.
    for (const char* k :
         {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"})
      if (s.value(k))
        GLM5_FAIL(source, ": field '", prefix, k, "' is set (", show(s.value(k)), ") but ", prefix, type_key,
                  " is \"default\" (no scaling): remove it, or set ", prefix, "rope_type to \"yarn\"");
    return;
  }
  if (type != "yarn") s.bad(type_key, "\"default\" or \"yarn\"", s.value(type_key));

  RopeScaling& r = c.rope_scaling;
  r.type = "yarn";
  r.factor = s.number("factor", s.value("factor"), true);
  if (r.factor < 1.0) s.bad("factor", "a number >= 1", s.value("factor"));
  // HF falls back to max_position_embeddings when the original length is not given.
  r.original_max_position_embeddings = s.optional_int("original_max_position_embeddings", c.max_position_embeddings, 1);
  r.beta_fast = s.optional_number("beta_fast", 32.0, true);
  r.beta_slow = s.optional_number("beta_slow", 1.0, true);
  if (r.beta_slow > r.beta_fast)
    GLM5_FAIL(source, ": field '", prefix, "beta_slow': expected at most beta_fast = ", r.beta_fast, ", found ",
              r.beta_slow);
  r.mscale = s.optional_number("mscale", 1.0, false);
  r.mscale_all_dim = s.optional_number("mscale_all_dim", 0.0, false);
}

// quantization_config: FP8 with 128 x 128 blocks, or compressed-tensors pack-quantized symmetric
// int4 / int8 (group or channel strategy). Anything else is refused here, naming the field.
void read_quantization(const json& root, const std::string& source, ModelConfig& c) {
  Fields top{root, source, ""};
  const json* q = top.value("quantization_config");
  if (!q) return;
  if (!q->is_object()) top.bad("quantization_config", "an object", q);
  Fields f{*q, source, "quantization_config."};
  QuantConfig& qc = c.quantization;
  qc.method = f.optional_string("quant_method", "");
  if (qc.method == "fp8") {
    if (const json* b = f.value("weight_block_size"))
      if (*b != json::array({128, 128})) f.bad("weight_block_size", "[128, 128]", b);
    const std::string fmt = f.optional_string("fmt", "e4m3");
    if (fmt != "e4m3") f.bad("fmt", "\"e4m3\"", f.value("fmt"));
    return;
  }
  if (qc.method != "compressed-tensors")
    f.bad("quant_method", "\"fp8\" or \"compressed-tensors\"", f.value("quant_method"));
  const std::string format = f.optional_string("format", "");
  if (format != "pack-quantized")
    f.bad("format", "\"pack-quantized\" (symmetric int4/int8 weights)", f.value("format"));
  const json* groups = f.value("config_groups");
  if (!groups || !groups->is_object() || groups->empty())
    f.bad("config_groups", "an object of quantization groups", groups);
  for (auto it = groups->begin(); it != groups->end(); ++it) {
    const std::string where = "quantization_config.config_groups." + it.key() + ".weights.";
    const json* w = it.value().is_object() && it.value().contains("weights") ? &it.value()["weights"] : nullptr;
    if (!w || !w->is_object()) GLM5_FAIL(source, ": field '", where, "': expected an object, found ", show(w));
    Fields g{*w, source, where};
    const int64_t bits = g.required_int("num_bits");
    if (bits != 4 && bits != 8) g.bad("num_bits", "4 or 8", g.value("num_bits"));
    if (g.optional_string("type", "int") != "int") g.bad("type", "\"int\"", g.value("type"));
    if (!g.optional_bool("symmetric", true))
      g.bad("symmetric", "true (zero points are not supported)", g.value("symmetric"));
    const std::string strategy = g.optional_string("strategy", "group");
    if (strategy != "group" && strategy != "channel")
      g.bad("strategy", "\"group\" or \"channel\"", g.value("strategy"));
    if (const json* a = g.value("actorder"); a && !(a->is_boolean() && !a->get<bool>()))
      g.bad("actorder", "null or false (activation reordering is not supported)", a);
    if (qc.num_bits == 0) {
      qc.num_bits = bits;
      qc.group_size = strategy == "group" ? g.required_int("group_size") : 0;
    }
  }
}

// A cross-field rule: `field` must satisfy `ok`; the message says what was expected.
void require(bool ok, const std::string& source, const char* field, const std::string& expected,
             const std::string& found) {
  if (!ok) GLM5_FAIL(source, ": field '", field, "': expected ", expected, ", found ", found);
}

constexpr int64_t kMaxLayers = 4096;

// Keys glm5 reads (parse_config and the helpers above and below).
const char* const kReadKeys[] = {"model_type",
                                 "dtype",
                                 "torch_dtype",
                                 "vocab_size",
                                 "hidden_size",
                                 "num_hidden_layers",
                                 "num_attention_heads",
                                 "q_lora_rank",
                                 "kv_lora_rank",
                                 "qk_nope_head_dim",
                                 "qk_rope_head_dim",
                                 "qk_head_dim",
                                 "v_head_dim",
                                 "index_n_heads",
                                 "index_head_dim",
                                 "index_topk",
                                 "intermediate_size",
                                 "max_position_embeddings",
                                 "n_routed_experts",
                                 "num_experts",
                                 "moe_intermediate_size",
                                 "num_experts_per_tok",
                                 "n_shared_experts",
                                 "n_group",
                                 "topk_group",
                                 "first_k_dense_replace",
                                 "moe_layer_freq",
                                 "num_nextn_predict_layers",
                                 "routed_scaling_factor",
                                 "rms_norm_eps",
                                 "norm_topk_prob",
                                 "tie_word_embeddings",
                                 "rope_interleave",
                                 "indexer_rope_interleave",
                                 "rope_parameters",
                                 "rope_theta",
                                 "rope_scaling",
                                 "quantization_config",
                                 "scoring_func",
                                 "topk_method",
                                 "hidden_act",
                                 "attention_bias",
                                 "mlp_bias",
                                 "eos_token_id",
                                 "bos_token_id",
                                 "pad_token_id",
                                 "indexer_types",
                                 "index_topk_pattern",
                                 "index_topk_freq",
                                 "index_skip_topk_offset",
                                 "index_share_for_mtp_iteration",
                                 "mlp_layer_types",
                                 "layer_types",
                                 "moe_router_dtype"};

// Keys known not to change what inference computes: training-only settings, other engines'
// bookkeeping, vestigial MLA fields, and the generic fields transformers writes into any config.
const char* const kIgnoredKeys[] = {
    "architectures", "transformers_version", "initializer_range", "use_cache", "ep_size", "pretraining_tp",
    "attention_dropout", "num_key_value_heads", "head_dim", "aux_loss_alpha", "seq_aux", "router_aux_loss_coef",
    "output_router_logits", "_name_or_path", "auto_map", "use_bfloat16", "output_attentions", "output_hidden_states",
    "return_dict", "torchscript", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "tf_legacy_loss", "pruned_heads",
    "finetuning_task", "task_specific_params", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "cross_attention_hidden_size", "_attn_implementation_autoset",
    // generation defaults older transformers wrote into every config (requests carry their own sampling)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens"};

// Every key of the file is read or known to be ignorable; returns the ignorable ones present.
std::vector<std::string> check_keys(const json& root, const std::string& source) {
  std::vector<std::string> ignored;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& k = it.key();
    auto is = [&](const auto& list) {
      return std::find_if(std::begin(list), std::end(list), [&](const char* x) { return k == x; }) != std::end(list);
    };
    if (is(kReadKeys)) continue;
    if (is(kIgnoredKeys)) {
      ignored.push_back(k);
      continue;
    }
    GLM5_FAIL(source, ": field '", k, "' is not a ", "glm_moe_dsa / deepseek_v32 field glm5 knows (", show(&*it),
              "); it may change what the model computes, so glm5 refuses to guess (runtime/spec/glm5.md §1.6 lists "
              "the fields it reads and ignores)");
  }
  return ignored;
}

// Per-layer indexer types (transformers' GlmMoeDsaConfig.__post_init__): `indexer_types`, else the
// string or list `index_topk_pattern` ("F" full, "S" shared), else layer i is full iff
// max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (freq 1: every layer full).
void read_indexer_types(const json& root, const std::string& source, ModelConfig& c) {
  Fields f{root, source, ""};
  const int64_t L = c.num_hidden_layers;
  std::vector<std::string> types;
  const char* key = nullptr;
  if (const json* t = f.value("indexer_types")) {
    key = "indexer_types";
    if (!t->is_array()) f.bad(key, "a list of \"full\" / \"shared\" per layer", t);
    for (const json& e : *t) types.push_back(e.is_string() ? e.get<std::string>() : e.dump());
  } else if (const json* p = f.value("index_topk_pattern")) {
    key = "index_topk_pattern";
    if (p->is_string()) {
      for (char ch : p->get<std::string>())
        types.push_back(ch == 'F' ? "full" : ch == 'S' ? "shared" : std::string(1, ch));
    } else if (p->is_array()) {  // "full" / "shared", or F / S, per entry
      for (const json& e : *p) {
        const std::string v = e.is_string() ? e.get<std::string>() : e.dump();
        types.push_back(v == "F" ? "full" : v == "S" ? "shared" : v);
      }
    } else {
      f.bad(key, "a string of F / S per layer or a list of \"full\" / \"shared\"", p);
    }
  }
  if (key) {
    // One entry per decoder layer, or also one per MTP layer after them (GLM-5.2 lists its MTP layer).
    const int64_t with_mtp = L + c.num_nextn_predict_layers;
    if (int64_t(types.size()) != L && int64_t(types.size()) != with_mtp)
      GLM5_FAIL(source, ": field '", key, "': expected one entry per layer (num_hidden_layers = ", L,
                with_mtp > L ? ", or " + std::to_string(with_mtp) + " with the MTP layers" : std::string(), "), found ",
                types.size());
    for (int64_t i = 0; i < int64_t(types.size()); ++i) {
      if (types[i] != "full" && types[i] != "shared")
        GLM5_FAIL(source, ": field '", key, "' entry ", i, ": expected \"full\" or \"shared\" (F or S), found ",
                  types[i]);
      c.indexer_full.push_back(types[i] == "full");
    }
  } else {
    const int64_t freq = f.optional_int("index_topk_freq", 1, 1);
    const int64_t offset = f.optional_int("index_skip_topk_offset", 2, 0);
    for (int64_t i = 0; i < L; ++i) c.indexer_full.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0);
  }
  if (!c.indexer_full[0])
    GLM5_FAIL(source, ": field '", key ? key : "index_skip_topk_offset",
              "': layer 0 must be \"full\" (a shared layer reuses the top-k of a full layer before it)");
  c.index_share_for_mtp_iteration = f.optional_bool("index_share_for_mtp_iteration", false);
}

// GLM-5.x's `mlp_layer_types` ("dense" / "sparse" per layer) must say what first_k_dense_replace and
// moe_layer_freq say; `layer_types` is transformers' derived list (every layer
// "deepseek_sparse_attention"); `moe_router_dtype` float32 is what glm5 does anyway.
void read_layer_kinds(const json& root, const std::string& source, const ModelConfig& c) {
  Fields f{root, source, ""};
  const int64_t L = c.num_hidden_layers;
  if (const json* m = f.value("mlp_layer_types")) {
    if (!m->is_array() || int64_t(m->size()) != L)
      f.bad("mlp_layer_types", "a list of \"dense\" / \"sparse\" with one entry per layer (" + std::to_string(L) + ")",
            m);
    for (int64_t i = 0; i < L; ++i) {
      const std::string want = c.is_moe_layer(i) ? "sparse" : "dense";
      if ((*m)[size_t(i)] != want)
        GLM5_FAIL(source, ": field 'mlp_layer_types' entry ", i, ": expected \"", want,
                  "\" (first_k_dense_replace = ", c.first_k_dense_replace, ", moe_layer_freq = ", c.moe_layer_freq,
                  "), found ", show(&(*m)[size_t(i)]));
    }
  }
  if (const json* t = f.value("layer_types")) {
    if (!t->is_array()) f.bad("layer_types", "a list", t);
    for (const json& e : *t)
      if (e != "deepseek_sparse_attention")
        f.bad("layer_types", "\"deepseek_sparse_attention\" for every layer (MLA with the DSA indexer)", &e);
  }
  const std::string router = f.optional_string("moe_router_dtype", "float32");
  if (router != "float32" && router != "fp32")
    f.bad("moe_router_dtype", "\"float32\" (glm5 computes the router in float32)", f.value("moe_router_dtype"));
  if (f.optional_bool("mlp_bias", false)) f.bad("mlp_bias", "false (the MLPs have no bias)", f.value("mlp_bias"));
  if (const json* n = f.value("num_experts"))
    if (f.integer("num_experts", 0, n) != c.n_routed_experts)
      f.bad("num_experts", "n_routed_experts = " + std::to_string(c.n_routed_experts) + " (it is an alias)", n);
}

// yarn_get_mscale of the DeepSeek / HF code: 1 for no scaling.
double yarn_mscale(double factor, double mscale) { return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

}  // namespace

bool ModelConfig::has_indexer(int64_t layer) const {
  if (layer < int64_t(indexer_full.size())) return indexer_full[size_t(layer)] != 0;
  return layer < num_hidden_layers || !index_share_for_mtp_iteration;  // an MTP layer the list leaves out
}

int64_t ModelConfig::indexer_donor(int64_t layer) const {
  while (layer > 0 && !has_indexer(layer)) --layer;
  return layer;
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
}

float ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(double(qk_head_dim()));
  const RopeScaling& r = rope_scaling;
  if (r.type == "yarn" && r.mscale_all_dim != 0.0 && r.factor > 1.0) {
    double m = yarn_mscale(r.factor, r.mscale_all_dim);
    scale *= m * m;
  }
  return float(scale);
}

// DeepSeek reference precompute_freqs_cis: plain theta^(-2i/d); under YaRN the dims whose
// wavelength exceeds the original context are divided by `factor`, with a linear ramp between
// the beta_fast and beta_slow correction dims.
std::vector<float> ModelConfig::inv_freq() const {
  const int64_t dim = qk_rope_head_dim, half = dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f[i] = 1.0 / std::pow(rope_theta, double(2 * i) / double(dim));
  const RopeScaling& r = rope_scaling;
  if (r.type == "yarn") {
    const double orig = double(r.original_max_position_embeddings), ln_theta = std::log(rope_theta);
    auto correction_dim = [&](double rotations) {
      return double(dim) * std::log(orig / (rotations * 2.0 * std::numbers::pi)) / (2.0 * ln_theta);
    };
    double low = std::max(std::floor(correction_dim(r.beta_fast)), 0.0);
    double high = std::min(std::ceil(correction_dim(r.beta_slow)), double(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
      double smooth = 1.0 - ramp;
      f[i] = f[i] / r.factor * (1.0 - smooth) + f[i] * smooth;
    }
  }
  return std::vector<float>(f.begin(), f.end());
}

float ModelConfig::rope_cos_sin_scale() const {
  const RopeScaling& r = rope_scaling;
  if (r.type != "yarn") return 1.0f;
  return float(yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim));
}

namespace {

// The sizes: vocabulary, layers (bounded before anything is sized by them), attention, indexer.
void read_sizes(const Fields& f, ModelConfig& c) {
  c.vocab_size = f.required_int("vocab_size");
  c.hidden_size = f.required_int("hidden_size");
  c.num_hidden_layers = f.required_int("num_hidden_layers");
  // A bound before anything is sized by it (the checkpoint check compares it with the tensors).
  if (c.num_hidden_layers > kMaxLayers)
    f.bad("num_hidden_layers", "at most " + std::to_string(kMaxLayers) + " (GLM-5 has 78)",
          f.value("num_hidden_layers"));
  c.num_attention_heads = f.required_int("num_attention_heads");
  c.q_lora_rank = f.required_int("q_lora_rank");
  c.kv_lora_rank = f.required_int("kv_lora_rank");
  c.qk_nope_head_dim = f.required_int("qk_nope_head_dim");
  c.qk_rope_head_dim = f.required_int("qk_rope_head_dim");
  c.v_head_dim = f.required_int("v_head_dim");
  c.index_n_heads = f.required_int("index_n_heads");
  c.index_head_dim = f.required_int("index_head_dim");
  c.index_topk = f.required_int("index_topk");
  c.intermediate_size = f.required_int("intermediate_size");
  c.max_position_embeddings = f.required_int("max_position_embeddings");
}

// The MoE's sizes and grouping; without routed experts their sizes may be absent.
void read_moe(const Fields& f, ModelConfig& c) {
  c.n_routed_experts = f.required_int("n_routed_experts", 0);
  if (c.n_routed_experts > 0) {
    c.moe_intermediate_size = f.required_int("moe_intermediate_size");
    c.num_experts_per_tok = f.required_int("num_experts_per_tok");
    c.n_shared_experts = f.required_int("n_shared_experts", 0);
  } else {
    c.moe_intermediate_size = f.optional_int("moe_intermediate_size", 0, 0);
    c.num_experts_per_tok = f.optional_int("num_experts_per_tok", 0, 0);
    c.n_shared_experts = f.optional_int("n_shared_experts", 0, 0);
  }
  c.n_group = f.optional_int("n_group", 1, 1);
  c.topk_group = f.optional_int("topk_group", 1, 1);
  c.first_k_dense_replace = f.optional_int("first_k_dense_replace", 0, 0);
  c.moe_layer_freq = f.optional_int("moe_layer_freq", 1, 1);
  c.num_nextn_predict_layers = f.optional_int("num_nextn_predict_layers", 0, 0);
}

// Scalars and flags with their defaults.
void read_scalars(const Fields& f, ModelConfig& c) {
  c.routed_scaling_factor = f.optional_number("routed_scaling_factor", 1.0, true);
  c.rms_norm_eps = f.optional_number("rms_norm_eps", 1e-6, true);
  c.norm_topk_prob = f.optional_bool("norm_topk_prob", true);
  c.tie_word_embeddings = f.optional_bool("tie_word_embeddings", false);
  c.rope_interleave = f.optional_bool("rope_interleave", true);
  c.indexer_rope_interleave = f.optional_bool("indexer_rope_interleave", c.model_type == "glm_moe_dsa");
}

// The fields that name a function glm5 computes one way only.
void check_supported(const Fields& f, ModelConfig& c) {
  c.scoring_func = f.optional_string("scoring_func", "sigmoid");
  c.topk_method = f.optional_string("topk_method", "noaux_tc");
  if (c.scoring_func != "sigmoid") f.bad("scoring_func", "\"sigmoid\"", f.value("scoring_func"));
  if (c.topk_method != "noaux_tc") f.bad("topk_method", "\"noaux_tc\"", f.value("topk_method"));
  std::string act = f.optional_string("hidden_act", "silu");
  if (act != "silu") f.bad("hidden_act", "\"silu\"", f.value("hidden_act"));
  if (f.optional_bool("attention_bias", false))
    f.bad("attention_bias", "false (attention projections have no bias)", f.value("attention_bias"));
}

// Token ids: eos may be one id or a list; bos/pad may be absent or null (-1).
void read_token_ids(const Fields& f, ModelConfig& c) {
  if (const json* eos = f.value("eos_token_id")) {
    if (eos->is_array()) {
      for (const json& e : *eos) c.eos_token_id.push_back(f.token_id("eos_token_id", e, c.vocab_size));
    } else {
      c.eos_token_id.push_back(f.token_id("eos_token_id", *eos, c.vocab_size));
    }
  }
  if (const json* v = f.value("bos_token_id")) c.bos_token_id = f.token_id("bos_token_id", *v, c.vocab_size);
  if (const json* v = f.value("pad_token_id")) c.pad_token_id = f.token_id("pad_token_id", *v, c.vocab_size);
}

// Cross-field consistency.
void check_cross_fields(const Fields& f, const ModelConfig& c) {
  const std::string& s = f.source;
  require(c.qk_rope_head_dim % 2 == 0, s, "qk_rope_head_dim", "an even number (RoPE rotates pairs)",
          std::to_string(c.qk_rope_head_dim));
  if (const json* qk = f.value("qk_head_dim")) {
    int64_t v = f.integer("qk_head_dim", 1, qk);
    require(v == c.qk_head_dim(), s, "qk_head_dim",
            "qk_nope_head_dim + qk_rope_head_dim = " + std::to_string(c.qk_head_dim()), std::to_string(v));
  }
  require(c.index_head_dim >= c.qk_rope_head_dim, s, "index_head_dim",
          "at least qk_rope_head_dim = " + std::to_string(c.qk_rope_head_dim) +
              " (the indexer rotates its first qk_rope_head_dim dims)",
          std::to_string(c.index_head_dim));
  if (c.n_routed_experts > 0) {
    require(c.n_routed_experts % c.n_group == 0, s, "n_group",
            "a divisor of n_routed_experts = " + std::to_string(c.n_routed_experts), std::to_string(c.n_group));
    require(c.topk_group <= c.n_group, s, "topk_group", "at most n_group = " + std::to_string(c.n_group),
            std::to_string(c.topk_group));
    require(c.num_experts_per_tok <= c.n_routed_experts, s, "num_experts_per_tok",
            "at most n_routed_experts = " + std::to_string(c.n_routed_experts), std::to_string(c.num_experts_per_tok));
    const int64_t reachable = c.topk_group * (c.n_routed_experts / c.n_group);
    require(c.num_experts_per_tok <= reachable, s, "num_experts_per_tok",
            "at most topk_group * n_routed_experts / n_group = " + std::to_string(reachable),
            std::to_string(c.num_experts_per_tok));
  }
}

}  // namespace

ModelConfig parse_config(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    GLM5_FAIL(source, ": not valid JSON: ", e.what());
  }
  if (!root.is_object()) GLM5_FAIL(source, ": expected a JSON object, found ", show(&root));

  ModelConfig c;
  c.source = source;
  Fields f{root, source, ""};

  const json* mt = f.value("model_type");
  if (!mt || !mt->is_string() || (mt->get<std::string>() != "glm_moe_dsa" && mt->get<std::string>() != "deepseek_v32"))
    f.bad("model_type", "\"glm_moe_dsa\" or \"deepseek_v32\"", mt);
  c.model_type = mt->get<std::string>();
  c.ignored_fields = check_keys(root, source);  // after model_type: another model gets that message

  // `dtype` (transformers v5) wins over the older `torch_dtype`.
  c.dtype = f.value("dtype") ? f.optional_string("dtype", "") : f.optional_string("torch_dtype", "bfloat16");
  read_sizes(f, c);
  read_moe(f, c);
  read_scalars(f, c);
  read_rope(root, source, c);
  read_quantization(root, source, c);
  read_indexer_types(root, source, c);
  read_layer_kinds(root, source, c);
  check_supported(f, c);
  read_token_ids(f, c);
  check_cross_fields(f, c);
  return c;
}

ModelConfig load_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  CHECK(in.good(), path, ": cannot open the model config (expected an HF config.json in ", model_dir, ")");
  std::ostringstream text;
  text << in.rdbuf();
  CHECK(!in.bad(), path, ": read error");
  return parse_config(text.str(), path);
}

}  // namespace glm5::runtime

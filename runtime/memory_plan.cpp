// The memory plan of `glm5 inspect` (memory_plan.h): stored forms from the index names or the
// config, resident bytes by the loader's rules, per-rank totals, and the step activation estimate.
#include "runtime/memory_plan.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_set>

#include "kernels/core/check.h"
#include "kernels/core/quant.h"
#include "runtime/kv_cache.h"
#include "runtime/safetensors.h"

namespace glm5::runtime {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Matrices the loader keeps as float32 copies when the checkpoint stores them quantized
// (glm5.cpp matrix_plain): kv_b_proj (sliced per head across scale blocks) and the embedding.
bool dequantized_when_quantized(const TensorSpec& s) {
  return s.role == Role::Embedding || ends_with(s.name, "self_attn.kv_b_proj.weight");
}

DType config_dtype(const ModelConfig& cfg) {
  if (cfg.dtype == "float32") return DType::F32;
  if (cfg.dtype == "float16") return DType::F16;
  return DType::BF16;  // "bfloat16" and anything else a release writes
}

StoredForm int_form(const ModelConfig& cfg, const TensorSpec& s, DType scale_dtype) {
  const int64_t cols = s.shape.size() == 2 ? s.shape[1] : 1;
  return {cfg.quantization.num_bits == 8 ? DType::Q8 : DType::Q4,
          cfg.quantization.group_size > 0 ? cfg.quantization.group_size : cols,  // 0: per channel
          scale_dtype};
}

// The scale dtype of a checkpoint's pack-quantized tensors: that of its first X.weight_scale, from
// the header of the shard the index names for it (one header read; the config does not say, and
// convert --scale-dtype f32 writes F32). BF16 (what llm-compressor writes) when there is none or
// the shard is not there (an index alone).
DType stored_scale_dtype(const std::filesystem::path& dir, const nlohmann::json& weight_map) {
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    if (!ends_with(it.key(), ".weight_scale") || !it.value().is_string()) continue;
    const std::filesystem::path shard = dir / it.value().get<std::string>();
    if (!std::filesystem::exists(shard)) return DType::BF16;
    const SafetensorsFile f(shard.string());
    const TensorInfo* t = f.find(it.key());
    return t ? t->dtype : DType::BF16;
  }
  return DType::BF16;
}

bool fp8_role(Role r) {
  return r == Role::Attention || r == Role::Indexer || r == Role::DenseMlp || r == Role::Expert ||
         r == Role::SharedExpert;
}

std::string with_commas(size_t v) {
  const std::string d = std::to_string(v);
  std::string s;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i > 0 && (d.size() - i) % 3 == 0) s += ',';
    s += d[i];
  }
  return s;
}

}  // namespace

std::string form_name(const StoredForm& f) {
  switch (f.dtype) {
    case DType::F8_E4M3: return "FP8";
    case DType::Q4:
    case DType::Q8:
      return std::string(f.dtype == DType::Q4 ? "int4 g" : "int8 g") + std::to_string(f.group) +
             (f.scale_dtype == DType::F32 ? " f32 scales" : "");
    default: return std::string(dtype_name(f.dtype));
  }
}

namespace {

// A matrix uploaded as stored (glm5.cpp matrix()): data plus scales.
size_t as_stored_bytes(const TensorSpec& spec, const StoredForm& form) {
  switch (form.dtype) {
    case DType::Q4:
    case DType::Q8:
      return stored_bytes(spec, form.dtype, form.group, int64_t(dtype_size(form.scale_dtype))) -
             16;  // weight_shape stays on the host
    case DType::F8_E4M3: return stored_bytes(spec, form.dtype, quant::kFp8Block);
    default: return size_t(spec.numel()) * dtype_size(form.dtype);
  }
}

}  // namespace

size_t resident_bytes(const TensorSpec& spec, const StoredForm& form) {
  const int64_t n = spec.numel();
  if (spec.shape.size() != 2 || spec.role == Role::IndexerWeights) return size_t(n) * 4;
  // Held dequantized: in BF16 when every value is a bf16 number (int4/int8 with BF16 scales, the
  // form llm-compressor and convert write by default), else F32 (FP8: fp8 x f32 scale, int with
  // F32 scales; counted as F32 even when power-of-two scales would make them bf16-exact).
  if (quant::is_quantized(form.dtype) && dequantized_when_quantized(spec))
    return size_t(n) * (form.dtype == DType::F8_E4M3 || form.scale_dtype == DType::F32 ? 4 : 2);
  return as_stored_bytes(spec, form);
}

// The tensor names of a checkpoint's index (model.safetensors.index.json), and the dtype its
// int4 / int8 scales are stored in.
static std::unordered_set<std::string> index_names(const std::filesystem::path& index_path, DType& int_scale_dtype) {
  std::ifstream f(index_path);
  CHECK(f, index_path.string(), ": cannot be read");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    GLM5_FAIL(index_path.string(), ": not valid JSON: ", e.what());
  }
  CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index_path.string(),
        ": field 'weight_map': expected an object of tensor name -> shard file");
  std::unordered_set<std::string> names;
  names.reserve(j["weight_map"].size());
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) names.insert(it.key());
  int_scale_dtype = stored_scale_dtype(index_path.parent_path(), j["weight_map"]);
  return names;
}

namespace {

// The stored form of each tensor: from the index's names when there is an index, else from
// config.quantization; then what the plan (if any) converts it to.
struct FormPlanner {
  const ModelConfig& cfg;
  const QuantPlan* plan;
  DType plain;
  std::filesystem::path index_path;
  bool from_index = false;
  std::unordered_set<std::string> names;  // the index's
  DType int_scale_dtype = DType::BF16;

  FormPlanner(const ModelConfig& c, const std::string& model_dir, const QuantPlan* p)
      : cfg(c), plan(p), plain(config_dtype(c)) {
    index_path = std::filesystem::path(model_dir) / "model.safetensors.index.json";
    from_index = std::filesystem::exists(index_path);
    if (from_index) names = index_names(index_path, int_scale_dtype);
  }

  // Where the forms come from, for the report.
  std::string source() const {
    const QuantConfig& qc = cfg.quantization;
    if (from_index)
      return index_path.string() + " (" + with_commas(names.size()) + " names; plain tensors as config dtype " +
             (cfg.dtype.empty() ? "bfloat16" : cfg.dtype) + ")";
    if (qc.method == "fp8")
      return cfg.source +
             " quantization_config fp8, no index (attention, indexer, dense and expert matrices FP8, the rest " +
             std::string(dtype_name(plain)) + ")";
    if (qc.method == "compressed-tensors")
      return cfg.source + " quantization_config compressed-tensors int" + std::to_string(qc.num_bits) +
             (qc.group_size > 0 ? " g" + std::to_string(qc.group_size) : std::string(" per channel")) +
             ", no index (routed and shared experts quantized, the rest " + std::string(dtype_name(plain)) + ")";
    return cfg.source + " dtype " + (cfg.dtype.empty() ? "bfloat16" : cfg.dtype) + ", no index";
  }

  // How `s` is stored. `missing`: the index lacks it (planned in the config dtype).
  StoredForm stored(const TensorSpec& s, bool& missing) const {
    const QuantConfig& qc = cfg.quantization;
    StoredForm form{plain, 0};
    if (s.role == Role::RouterBias) form.dtype = DType::F32;
    if (from_index) {
      if (names.count(fp8_scale_name(s.name))) return {DType::F8_E4M3, quant::kFp8Block};
      if (names.count(packed_name(s.name, "packed"))) {
        CHECK(qc.method == "compressed-tensors" && qc.num_bits > 0, index_path.string(), ": tensor ",
              packed_name(s.name, "packed"), " is pack-quantized, but ", cfg.source,
              " has no compressed-tensors quantization_config saying its num_bits and group_size");
        return int_form(cfg, s, int_scale_dtype);
      }
      missing = !names.count(s.name);
    } else if (s.shape.size() == 2) {
      if (qc.method == "fp8" && fp8_role(s.role)) return {DType::F8_E4M3, quant::kFp8Block};
      if (qc.method == "compressed-tensors" && (s.role == Role::Expert || s.role == Role::SharedExpert))
        return int_form(cfg, s, DType::BF16);
    }
    return form;
  }

  // The stored form after the plan; `converted`: the plan changes it.
  StoredForm planned(const TensorSpec& s, bool& missing, bool& converted) const {
    const StoredForm form = stored(s, missing);
    if (!plan || !plan->converts(s) || plan->stored_as_target(form.dtype, form.group, form.scale_dtype)) return form;
    StoredForm to{plan->target, 0};
    if (to.dtype == DType::Q4 || to.dtype == DType::Q8) {
      to.group = plan->group_size;
      to.scale_dtype = plan->scale_dtype;
    }
    if (to.dtype == DType::F8_E4M3) to.group = quant::kFp8Block;
    converted = true;
    return to;
  }
};

}  // namespace

WeightPlan plan_weights(const ModelConfig& cfg, const std::string& model_dir, const QuantPlan* plan) {
  const FormPlanner forms(cfg, model_dir, plan);
  WeightPlan w;
  w.tensors = tensor_table(cfg);
  w.from_index = forms.from_index;
  w.source = forms.source();
  w.stored.reserve(w.tensors.size());
  w.resident.reserve(w.tensors.size());
  for (const TensorSpec& s : w.tensors) {
    bool missing = false, converted = false;
    const StoredForm form = forms.planned(s, missing, converted);
    if (missing && w.missing++ == 0) w.first_missing = s.name;
    w.converted += converted;
    if (s.shape.size() == 2 && quant::is_quantized(form.dtype) && dequantized_when_quantized(s)) ++w.dequantized_f32;
    w.stored.push_back(form);
    w.resident.push_back(resident_bytes(s, form));
  }
  // The MTP layers, as a speculating last stage holds them (its own parts and a decoder layer).
  w.mtp_tensors = mtp_tensor_table(cfg);
  for (const TensorSpec& s : w.mtp_tensors) {
    bool missing = false, converted = false;
    w.mtp_resident.push_back(resident_bytes(s, forms.planned(s, missing, converted)));
  }
  if (plan) w.plan = describe(*plan);
  if (cfg.tie_word_embeddings) {
    // lm_head is matrix("model.embed_tokens.weight"): the stored form, uploaded a second time.
    CHECK(!w.tensors.empty() && w.tensors[0].role == Role::Embedding, "internal: embedding not first in the table");
    w.tied_head_bytes = as_stored_bytes(w.tensors[0], w.stored[0]);
  }
  return w;
}

size_t shard_weight_bytes(const WeightPlan& w, const ModelConfig& cfg, const ModelShard& shard) {
  const int last = shard.last_layer < 0 ? int(cfg.num_hidden_layers) : shard.last_layer;
  const int64_t per = cfg.n_routed_experts / std::max(1, shard.expert_parallel);
  // Not a routed expert, or one of this rank's column.
  auto in_column = [&](const TensorSpec& s) {
    return s.expert < 0 || (s.expert >= shard.column * per && s.expert < (shard.column + 1) * per);
  };
  size_t total = 0;
  for (size_t i = 0; i < w.tensors.size(); ++i) {
    const TensorSpec& s = w.tensors[i];
    bool held;
    if (s.layer >= 0) {
      held = s.layer >= shard.first_layer && s.layer < last && in_column(s);
    } else if (s.role == Role::Embedding) {
      held = shard.embedding || shard.mtp;  // the MTP layer embeds the tokens it drafts on
    } else {                                // model.norm, lm_head
      held = shard.head;
    }
    if (held) total += w.resident[i];
  }
  if (shard.head) total += w.tied_head_bytes;
  // The MTP layer the loader takes (the first) when speculating, on the last stage.
  if (shard.mtp)
    for (size_t i = 0; i < w.mtp_tensors.size(); ++i)
      if (w.mtp_tensors[i].layer == cfg.num_hidden_layers && in_column(w.mtp_tensors[i])) total += w.mtp_resident[i];
  return total;
}

double ActivationEstimate::total() const { return residual + std::max({attention, mlp, logits}) + fixed; }

ActivationEstimate estimate_activations(const ModelConfig& c, const StepShape& s) {
  const double f = 4.0;  // float32 activations
  const double m = double(std::max<int64_t>(1, s.max_step_tokens));
  const double H = double(c.hidden_size), NH = double(c.num_attention_heads), QR = double(c.q_lora_rank);
  const double R = double(c.kv_lora_rank), dr = double(c.qk_rope_head_dim), dn = double(c.qk_nope_head_dim);
  const double dv = double(c.v_head_dim), LAT = R + dr, DQ = dn + dr, DKV = dn + dv;
  const double IH = double(c.index_n_heads), ID = double(c.index_head_dim), TOPK = double(c.index_topk);
  const double ctx = double(c.max_position_embeddings);
  ActivationEstimate a;
  // Engine h [m, H], forward's a and y [m, H].
  a.residual = 3 * m * H * f;
  // attention(): c_q, q, kv, qi, ki, iw, attn; absorbed_attention(): gathered q / qi / iw / attn
  // (mixed steps), q_lat, o_lat, top-k ids; one indexer-score group (a prompt chunk or the decode
  // rows) over the whole context; the block tables of every row and of the absorbed rows.
  const double proj = QR + NH * DQ + LAT + IH * ID + ID + IH + NH * dv;
  const double absorbed = NH * DQ + IH * ID + IH + NH * dv + NH * LAT + NH * R + TOPK;
  const double score_rows = std::min(m, double(std::max(s.prefill_chunk, s.max_batch)));
  const double tables = 2 * m * double(blocks_for(c.max_position_embeddings + 1)) * 4;
  const double naive = std::min(TOPK, ctx) * (LAT + NH * DKV);  // keys of one naive span, expanded
  a.attention = m * proj * f + std::max(m * absorbed * f + score_rows * ctx * f, naive * f) + tables;
  // Dense MLP gate / up; MoE: router logits, received token table (each token once per rank it
  // reaches: <= min(E, K) per token), expert outputs and combined results (K rows per token),
  // one expert's input / gate / up, the shared expert's output and gate / up.
  const double dense = 2 * m * double(c.intermediate_size) * f;
  double moe = 0;
  if (c.n_routed_experts > 0) {
    const double K = double(c.num_experts_per_tok), I = double(c.moe_intermediate_size);
    const double ep = double(std::max(1, s.expert_parallel));
    const double local = std::max(1.0, double(c.n_routed_experts) / ep);
    const double run = m * K / local;  // rows of one local expert, balanced
    moe = m * (double(c.n_routed_experts) + 2 * K) * f + m * std::min(ep, K) * H * f + 2 * m * K * H * f +
          2 * m * K * 4 + run * (H + 2 * I) * f +
          (c.n_shared_experts > 0 ? m * (H + 2 * I * double(c.n_shared_experts)) * f : 0);
    // A device backend's exchange also packs, in one wire, its outgoing rows (each token once per
    // other rank it reaches) and later the results going back (<= K rows per token).
    if (s.device && ep > 1) moe += m * std::max(std::min(ep - 1, K), K) * H * f;
  }
  a.mlp = std::max(dense, moe);
  const double lrows = std::min(m, double(std::max<int64_t>(1, s.max_batch)));
  a.logits = lrows * (2 * H + double(c.vocab_size)) * f;
  a.fixed = s.device ? 1e9 : 0;
  return a;
}

}  // namespace glm5::runtime

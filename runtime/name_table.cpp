// The HF tensor names, shapes and roles of a glm_moe_dsa / deepseek_v32 checkpoint (spec §2.1),
// the stored forms a matrix may take (plain, FP8 §2.2, compressed-tensors int), and the strict
// header-only check of a checkpoint against them.
#include "runtime/name_table.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_set>

#include "kernels/core/check.h"
#include "kernels/core/quant.h"
#include "runtime/safetensors.h"

namespace glm5::runtime {

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool plain_dtype(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const char* role_name(Role r) {
  switch (r) {
    case Role::Embedding: return "embedding";
    case Role::Norm: return "norms";
    case Role::Attention: return "attention";
    case Role::Indexer: return "indexer";
    case Role::IndexerWeights: return "indexer_weights";
    case Role::Router: return "router";
    case Role::RouterBias: return "router_bias";
    case Role::DenseMlp: return "dense";
    case Role::Expert: return "experts";
    case Role::SharedExpert: return "shared";
    case Role::LmHead: return "lm_head";
    case Role::MtpProjection: return "mtp";
  }
  return "?";
}

bool quantizable(Role r) {
  return r == Role::Attention || r == Role::Indexer || r == Role::DenseMlp || r == Role::Expert ||
         r == Role::SharedExpert || r == Role::LmHead;
}

std::string fp8_scale_name(const std::string& weight_name) { return weight_name + "_scale_inv"; }
std::string packed_name(const std::string& weight_name, const char* part) {
  return weight_name + "_" + part;  // X.weight -> X.weight_packed, X.weight_scale, X.weight_shape
}

size_t StoredTensor::nbytes() const { return (data ? data->nbytes : 0) + (scale ? scale->nbytes : 0); }

std::vector<int64_t> stored_shape(const TensorInfo& t) {
  std::vector<int64_t> v;
  if ((t.dtype != DType::I64 && t.dtype != DType::I32) || t.numel() != 2) return v;
  for (int i = 0; i < 2; ++i) {  // memcpy: the mmapped data need not be aligned
    if (t.dtype == DType::I64) {
      int64_t x;
      std::memcpy(&x, static_cast<const char*>(t.data) + 8 * i, 8);
      v.push_back(x);
    } else {
      int32_t x;
      std::memcpy(&x, static_cast<const char*>(t.data) + 4 * i, 4);
      v.push_back(x);
    }
  }
  return v;
}

namespace {

StoredTensor resolve_fp8(Checkpoint& ckpt, const TensorSpec& s, const TensorInfo* t) {
  const std::string sname = fp8_scale_name(s.name);
  const TensorInfo* sc = ckpt.find(sname);
  CHECK(sc, "tensor ", s.name, " in ", t->file, " is F8_E4M3 but its block scales '", sname,
        "' are missing (FP8 weights need <name>_scale_inv, F32 [ceil(rows/128), ceil(cols/128)])");
  CHECK(s.shape.size() == 2, "tensor ", s.name, " in ", t->file, " is F8_E4M3, but FP8 is only for matrices (expected ",
        shape_str(s.shape), " ", "BF16, F16 or F32)");
  CHECK(t->shape == s.shape, "tensor ", s.name, " in ", t->file, ": expected shape ", shape_str(s.shape), ", found ",
        shape_str(t->shape));
  const std::vector<int64_t> want{ceil_div(s.shape[0], quant::kFp8Block), ceil_div(s.shape[1], quant::kFp8Block)};
  CHECK(sc->dtype == DType::F32 || sc->dtype == DType::BF16, "tensor ", sname, " in ", sc->file,
        ": FP8 block scales must be F32 (or BF16), found ", sc->dtype_name);
  CHECK(sc->shape == want, "tensor ", sname, " in ", sc->file, ": expected shape ", shape_str(want),
        " (128 x 128 blocks of ", shape_str(s.shape), "), found ", shape_str(sc->shape));
  return {DType::F8_E4M3, t, sc, quant::kFp8Block};
}

StoredTensor resolve_packed(Checkpoint& ckpt, const TensorSpec& s, const TensorInfo* packed) {
  const std::string pname = packed->name;
  CHECK(s.shape.size() == 2, "tensor ", pname, " in ", packed->file, ": ", s.name, " ", shape_str(s.shape),
        " is not a matrix and cannot be pack-quantized");
  const int64_t rows = s.shape[0], cols = s.shape[1];
  CHECK(packed->dtype == DType::I32 && packed->shape.size() == 2 && packed->shape[0] == rows, "tensor ", pname, " in ",
        packed->file, ": expected I32 [", rows, ", ceil(", cols, " * bits / 32)], found ", packed->dtype_name, " ",
        shape_str(packed->shape));
  DType dt = DType::Unknown;
  if (packed->shape[1] == ceil_div(cols, 8))
    dt = DType::Q4;
  else if (packed->shape[1] == ceil_div(cols, 4))
    dt = DType::Q8;
  CHECK(dt != DType::Unknown, "tensor ", pname, " in ", packed->file, ": ", packed->shape[1],
        " int32 per row fit neither int4 (", ceil_div(cols, 8), ") nor int8 (", ceil_div(cols, 4), ") for ", cols,
        " columns");
  for (const char* unsupported : {"zero_point", "g_idx"}) {
    const std::string n = packed_name(s.name, unsupported);
    CHECK(!ckpt.has(n), "tensor ", n,
          ": asymmetric (zero point) and activation-ordered (g_idx) int weights are "
          "not supported; expected symmetric pack-quantized weights");
  }
  const std::string sname = packed_name(s.name, "scale");
  const TensorInfo* sc = ckpt.find(sname);
  CHECK(sc, ckpt.dir(), ": tensor '", sname, "' not found (", pname, " needs its group scales [", rows,
        ", cols / group_size])");
  CHECK((sc->dtype == DType::BF16 || sc->dtype == DType::F16 || sc->dtype == DType::F32) && sc->shape.size() == 2 &&
            sc->shape[0] == rows && sc->shape[1] > 0 && cols % sc->shape[1] == 0,
        "tensor ", sname, " in ", sc->file, ": expected BF16, F16 or F32 [", rows,
        ", cols / group_size] with group_size dividing ", cols, ", found ", sc->dtype_name, " ", shape_str(sc->shape));
  const std::string shname = packed_name(s.name, "shape");
  const TensorInfo* sh = ckpt.find(shname);
  CHECK(sh, ckpt.dir(), ": tensor '", shname, "' not found (compressed-tensors stores the unpacked shape)");
  const std::vector<int64_t> stored = stored_shape(*sh);
  CHECK(stored == s.shape, "tensor ", shname, " in ", sh->file, ": expected I64 [2] = ", shape_str(s.shape), ", found ",
        sh->dtype_name, " ", shape_str(sh->shape), stored.empty() ? "" : " = ",
        stored.empty() ? "" : shape_str(stored));
  // The group size, from the scales' shape: cols / scale columns, a power of two (compressed-tensors'
  // group sizes) or the whole row (per-channel). A ragged layout (ceil(cols / group) scales, the
  // last group partial) could fake another even split, so anything else is refused.
  const int64_t group = cols / sc->shape[1];
  CHECK(sc->shape[1] == 1 || (group >= 8 && (group & (group - 1)) == 0), "tensor ", sname, " in ", sc->file, ": ",
        sc->shape[1], " scales per row of ", cols, " columns give a group size of ", group,
        "; expected a power of two >= 8 dividing the row, or one scale per row (ragged groups are not supported)");
  return {dt, packed, sc, group};
}

}  // namespace

StoredTensor resolve_tensor(Checkpoint& ckpt, const TensorSpec& s) {
  if (const TensorInfo* t = ckpt.find(s.name)) {
    if (t->dtype == DType::F8_E4M3) return resolve_fp8(ckpt, s, t);
    CHECK(plain_dtype(t->dtype), "tensor ", s.name, " in ", t->file, " has dtype ", t->dtype_name,
          "; expected BF16, F16 or F32 (or F8_E4M3 with ", fp8_scale_name(s.name), ")");
    CHECK(t->shape == s.shape, "tensor ", s.name, " in ", t->file, ": expected shape ", shape_str(s.shape), ", found ",
          shape_str(t->shape));
    return {t->dtype, t, nullptr, 0};
  }
  if (const TensorInfo* p = ckpt.find(packed_name(s.name, "packed"))) return resolve_packed(ckpt, s, p);
  GLM5_FAIL(ckpt.dir(), ": tensor '", s.name, "' not found (expected shape ", shape_str(s.shape),
            s.shape.size() == 2 ? ", or its pack-quantized form " + packed_name(s.name, "packed") : std::string(), ")");
}

kernels::Weight weight_view(const StoredTensor& st, int64_t rows, int64_t cols) {
  kernels::Weight w;
  w.data = st.data->data;
  w.dtype = st.dtype;
  w.rows = rows;
  w.cols = cols;
  w.ld = st.dtype == DType::Q4 ? st.data->shape[1] * 8 : st.dtype == DType::Q8 ? st.data->shape[1] * 4 : cols;
  if (st.scale) {
    w.scale = st.scale->data;
    w.scale_dtype = st.scale->dtype;
    w.scale_ld = st.scale->shape[1];
    w.group = st.group;
    w.scale_block_rows = st.dtype == DType::F8_E4M3 ? quant::kFp8Block : 1;
  }
  return w;
}

namespace {

// An MTP layer's own parts after its decoder layer (spec §3.9). It embeds with the main table and
// projects with the main lm_head: a checkpoint's copies of those (DeepSeek's embed_tokens,
// shared_head.head) are not part of it.
void add_mtp_parts(const ModelConfig& c, int64_t l, std::vector<TensorSpec>& t) {
  if (l < c.num_hidden_layers) return;
  const int64_t H = c.hidden_size;
  const std::string P = "model.layers." + std::to_string(l) + ".";
  t.push_back({P + "eh_proj.weight", {H, 2 * H}, int(l), -1, Role::MtpProjection});
  t.push_back({P + "enorm.weight", {H}, int(l), -1, Role::Norm});
  t.push_back({P + "hnorm.weight", {H}, int(l), -1, Role::Norm});
  t.push_back({P + "shared_head.norm.weight", {H}, int(l), -1, Role::Norm});
}

}  // namespace

std::vector<TensorSpec> layer_tensors(const ModelConfig& c, int64_t l) {
  CHECK(l >= 0 && l < c.num_hidden_layers + c.num_nextn_predict_layers, "internal: layer ", l, " outside the ",
        c.num_hidden_layers, " + ", c.num_nextn_predict_layers, " layers of ", c.source);
  const int64_t H = c.hidden_size, NH = c.num_attention_heads;
  const std::string P = "model.layers." + std::to_string(l) + ".";
  std::vector<TensorSpec> t;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, Role role, int expert = -1) {
    t.push_back({P + name, std::move(shape), int(l), expert, role});
  };
  add("input_layernorm.weight", {H}, Role::Norm);
  add("post_attention_layernorm.weight", {H}, Role::Norm);
  // MLA: q per head [nope ‖ rope]; kv_a rows [latent ‖ k_rope]; kv_b per head rows [k_nope ‖ v].
  add("self_attn.q_a_proj.weight", {c.q_lora_rank, H}, Role::Attention);
  add("self_attn.q_a_layernorm.weight", {c.q_lora_rank}, Role::Norm);
  add("self_attn.q_b_proj.weight", {NH * c.qk_head_dim(), c.q_lora_rank}, Role::Attention);
  add("self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H}, Role::Attention);
  add("self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, Role::Norm);
  add("self_attn.kv_b_proj.weight", {NH * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, Role::Attention);
  add("self_attn.o_proj.weight", {H, NH * c.v_head_dim}, Role::Attention);
  // DSA indexer: wq_b per head [rope ‖ nope], k_norm is a LayerNorm with bias. A "shared" layer
  // (GLM-5.2 IndexShare) has none: it uses the top-k of the full layer before it.
  if (c.has_indexer(l)) {
    add("self_attn.indexer.wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank}, Role::Indexer);
    add("self_attn.indexer.wk.weight", {c.index_head_dim, H}, Role::Indexer);
    add("self_attn.indexer.k_norm.weight", {c.index_head_dim}, Role::Norm);
    add("self_attn.indexer.k_norm.bias", {c.index_head_dim}, Role::Norm);
    add("self_attn.indexer.weights_proj.weight", {c.index_n_heads, H}, Role::IndexerWeights);
  }
  if (!c.is_moe_layer(l)) {
    const int64_t I = c.intermediate_size;
    add("mlp.gate_proj.weight", {I, H}, Role::DenseMlp);
    add("mlp.up_proj.weight", {I, H}, Role::DenseMlp);
    add("mlp.down_proj.weight", {H, I}, Role::DenseMlp);
  } else {
    const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
    add("mlp.gate.weight", {E, H}, Role::Router);
    add("mlp.gate.e_score_correction_bias", {E}, Role::RouterBias);  // topk_method noaux_tc (the only one accepted)
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = "mlp.experts." + std::to_string(e) + ".";
      add(X + "gate_proj.weight", {I, H}, Role::Expert, int(e));
      add(X + "up_proj.weight", {I, H}, Role::Expert, int(e));
      add(X + "down_proj.weight", {H, I}, Role::Expert, int(e));
    }
    if (c.n_shared_experts > 0) {
      const int64_t S = I * c.n_shared_experts;
      add("mlp.shared_experts.gate_proj.weight", {S, H}, Role::SharedExpert);
      add("mlp.shared_experts.up_proj.weight", {S, H}, Role::SharedExpert);
      add("mlp.shared_experts.down_proj.weight", {H, S}, Role::SharedExpert);
    }
  }
  add_mtp_parts(c, l, t);
  return t;
}

std::vector<TensorSpec> global_tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  std::vector<TensorSpec> t;
  t.push_back({"model.embed_tokens.weight", {V, H}, -1, -1, Role::Embedding});
  t.push_back({"model.norm.weight", {H}, -1, -1, Role::Norm});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {V, H}, -1, -1, Role::LmHead});
  return t;
}

namespace {

// Appends the tensors of layers [first, last).
void append_layers(const ModelConfig& c, int64_t first, int64_t last, std::vector<TensorSpec>& t) {
  for (int64_t l = first; l < last; ++l) {
    std::vector<TensorSpec> layer = layer_tensors(c, l);
    t.insert(t.end(), std::make_move_iterator(layer.begin()), std::make_move_iterator(layer.end()));
  }
}

}  // namespace

std::vector<TensorSpec> tensor_table(const ModelConfig& c) {
  std::vector<TensorSpec> globals = global_tensors(c);
  std::vector<TensorSpec> t;
  t.push_back(std::move(globals[0]));  // the embedding first, then the layers, then the head
  append_layers(c, 0, c.num_hidden_layers, t);
  t.insert(t.end(), std::make_move_iterator(globals.begin() + 1), std::make_move_iterator(globals.end()));
  return t;
}

SchemaLookup::SchemaLookup(std::vector<TensorSpec> specs) {
  by_name_.reserve(specs.size());
  for (TensorSpec& s : specs) {
    std::string name = s.name;
    by_name_.emplace(std::move(name), std::move(s));
  }
}

const TensorSpec& SchemaLookup::operator[](const std::string& name) const {
  const auto it = by_name_.find(name);
  CHECK(it != by_name_.end(), "internal: tensor '", name, "' is not in the schema (runtime/name_table.cpp)");
  return it->second;
}

std::vector<TensorSpec> mtp_tensor_table(const ModelConfig& c) {
  std::vector<TensorSpec> t;
  append_layers(c, c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers, t);
  return t;
}

std::vector<TensorSpec> mtp_tensors_held(const Checkpoint& ckpt, const ModelConfig& c) {
  std::vector<TensorSpec> t = mtp_tensor_table(c);
  std::erase_if(t, [&](const TensorSpec& s) { return !ckpt.has(s.name) && !ckpt.has(packed_name(s.name, "packed")); });
  return t;
}

namespace {

// The layer index of a "model.layers.<i>." tensor name, or -1.
int64_t layer_of(const std::string& name) {
  static const std::string prefix = "model.layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  size_t i = prefix.size(), j = i;
  int64_t layer = 0;
  while (j < name.size() && name[j] >= '0' && name[j] <= '9' && j - i < 12) layer = layer * 10 + (name[j++] - '0');
  return (j == i || j >= name.size() || name[j] != '.') ? -1 : layer;
}

// num_hidden_layers and num_nextn_predict_layers against the layers the checkpoint holds, before
// anything is sized by them: decoder layers 0..N-1 all present, and MTP layers N.. either absent
// (transformers does not save them) or exactly num_nextn_predict_layers of them (any number when the
// config declares none: they are not run).
void check_layer_count(const Checkpoint& ckpt, const ModelConfig& cfg) {
  std::set<int64_t> layers;
  for (const std::string& name : ckpt.names())
    if (int64_t l = layer_of(name); l >= 0) layers.insert(l);
  const int64_t N = cfg.num_hidden_layers, nextn = cfg.num_nextn_predict_layers, K = int64_t(layers.size());
  // nextn 0 beside a stored MTP layer: the layer is not used (as before this check), so it may stay.
  CHECK(K == N || K == N + nextn || (nextn == 0 && K > N), ckpt.dir(), " holds ", K,
        " layers (model.layers.<i>, i up to ", K ? *layers.rbegin() : -1, "), but ", cfg.source,
        " says num_hidden_layers = ", N, " and num_nextn_predict_layers = ", nextn, ": expected ", N,
        " decoder layers, then none or ", nextn, " MTP layer(s)");
}

}  // namespace

bool is_mtp_tensor(const ModelConfig& cfg, const std::string& name) { return layer_of(name) >= cfg.num_hidden_layers; }

void check_checkpoint(Checkpoint& ckpt, const ModelConfig& cfg) {
  check_layer_count(ckpt, cfg);
  std::vector<TensorSpec> table = tensor_table(cfg);
  for (TensorSpec& s : mtp_tensors_held(ckpt, cfg)) table.push_back(std::move(s));
  std::unordered_set<std::string> known;
  known.reserve(table.size() * 2);
  for (const TensorSpec& s : table) {
    StoredTensor st;
    try {
      st = resolve_tensor(ckpt, s);
    } catch (const Error& e) {  // the expected shapes come from the config: say which
      throw Error(std::string(e.what()) + " (expected from " + cfg.source + ")");
    }
    known.insert(st.data->name);
    if (st.scale) known.insert(st.scale->name);
    if (st.dtype == DType::Q4 || st.dtype == DType::Q8) known.insert(packed_name(s.name, "shape"));
  }
  std::string first_unknown;
  size_t unknown = 0;
  for (const std::string& name : ckpt.names()) {
    if (known.count(name) || is_mtp_tensor(cfg, name)) continue;
    if (unknown++ == 0) first_unknown = name;
  }
  CHECK(unknown == 0, ckpt.dir(), ": tensor '", first_unknown, "' is not part of a ", cfg.model_type,
        " model with the config ", cfg.source, " (", unknown,
        " unknown tensor name(s); layers >= num_hidden_layers = ", cfg.num_hidden_layers, " are MTP and allowed)");
}

}  // namespace glm5::runtime

// Name table: the HF names and shapes for the goldens and for full-size GLM-5 (spec §2.1 counts),
// MTP names recognised, and check_checkpoint on the goldens and on small checkpoints written
// from the table and then spoiled one way each (missing, misshaped, FP8, unknown name).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kernels/core/check.h"
#include "runtime/config.h"
#include "runtime/name_table.h"
#include "runtime/safetensors.h"
#include "tests/test_support.h"

namespace glm5::runtime {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kData = GLM5_TEST_DATA;

using glm5::testing::expect_error;

std::map<std::string, std::vector<int64_t>> by_name(const std::vector<TensorSpec>& table) {
  std::map<std::string, std::vector<int64_t>> m;
  for (const TensorSpec& s : table) EXPECT_TRUE(m.emplace(s.name, s.shape).second) << "duplicate " << s.name;
  return m;
}

// GLM-5's config.json as quoted in spec §1.1.
const char* kGlm5Config = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
  "hidden_size": 6144, "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64,
  "head_dim": 64, "qk_head_dim": 256, "q_lora_rank": 2048, "kv_lora_rank": 512,
  "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_n_heads": 32,
  "index_head_dim": 128, "index_topk": 2048, "indexer_rope_interleave": true, "rope_interleave": true,
  "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
  "max_position_embeddings": 202752, "intermediate_size": 12288, "moe_intermediate_size": 2048,
  "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
  "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid",
  "topk_method": "noaux_tc", "first_k_dense_replace": 3, "moe_layer_freq": 1,
  "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-05,
  "attention_bias": false, "attention_dropout": 0.0, "tie_word_embeddings": false,
  "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820, "dtype": "bfloat16",
  "ep_size": 1, "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": true,
  "transformers_version": "5.0.2.dev0"})";

TEST(NameTableTest, FullSizeGlm5MatchesSpecInventory) {
  ModelConfig c = parse_config(kGlm5Config, "glm5/config.json");
  EXPECT_FLOAT_EQ(c.softmax_scale(), 0.0625f);
  std::vector<TensorSpec> table = tensor_table(c);
  // Spec §2.1: 59,079 tensors for layers 0..77 + globals; 743.91 B parameters.
  EXPECT_EQ(table.size(), 59079u);
  double params = 0;
  for (const TensorSpec& s : table) {
    double n = 1;
    for (int64_t d : s.shape) n *= double(d);
    params += n;
  }
  EXPECT_NEAR(params / 1e9, 743.91, 0.01);

  auto m = by_name(table);
  EXPECT_EQ(m["model.embed_tokens.weight"], (std::vector<int64_t>{154880, 6144}));
  EXPECT_EQ(m["lm_head.weight"], (std::vector<int64_t>{154880, 6144}));
  EXPECT_EQ(m["model.norm.weight"], (std::vector<int64_t>{6144}));
  const std::string P = "model.layers.5.";
  EXPECT_EQ(m[P + "self_attn.q_a_proj.weight"], (std::vector<int64_t>{2048, 6144}));
  EXPECT_EQ(m[P + "self_attn.q_b_proj.weight"], (std::vector<int64_t>{16384, 2048}));
  EXPECT_EQ(m[P + "self_attn.kv_a_proj_with_mqa.weight"], (std::vector<int64_t>{576, 6144}));
  EXPECT_EQ(m[P + "self_attn.kv_a_layernorm.weight"], (std::vector<int64_t>{512}));
  EXPECT_EQ(m[P + "self_attn.kv_b_proj.weight"], (std::vector<int64_t>{28672, 512}));
  EXPECT_EQ(m[P + "self_attn.o_proj.weight"], (std::vector<int64_t>{6144, 16384}));
  EXPECT_EQ(m[P + "self_attn.indexer.wq_b.weight"], (std::vector<int64_t>{4096, 2048}));
  EXPECT_EQ(m[P + "self_attn.indexer.wk.weight"], (std::vector<int64_t>{128, 6144}));
  EXPECT_EQ(m[P + "self_attn.indexer.k_norm.bias"], (std::vector<int64_t>{128}));
  EXPECT_EQ(m[P + "self_attn.indexer.weights_proj.weight"], (std::vector<int64_t>{32, 6144}));
  EXPECT_EQ(m[P + "mlp.gate.weight"], (std::vector<int64_t>{256, 6144}));
  EXPECT_EQ(m[P + "mlp.gate.e_score_correction_bias"], (std::vector<int64_t>{256}));
  EXPECT_EQ(m[P + "mlp.experts.255.down_proj.weight"], (std::vector<int64_t>{6144, 2048}));
  EXPECT_EQ(m[P + "mlp.shared_experts.up_proj.weight"], (std::vector<int64_t>{2048, 6144}));
  EXPECT_EQ(m["model.layers.2.mlp.gate_proj.weight"], (std::vector<int64_t>{12288, 6144}));
  EXPECT_EQ(m.count("model.layers.2.mlp.gate.weight"), 0u);
  EXPECT_EQ(m.count("model.layers.78.input_layernorm.weight"), 0u);

  EXPECT_TRUE(is_mtp_tensor(c, "model.layers.78.eh_proj.weight"));
  EXPECT_TRUE(is_mtp_tensor(c, "model.layers.78.mlp.experts.3.up_proj.weight"));
  EXPECT_FALSE(is_mtp_tensor(c, "model.layers.77.eh_proj.weight"));
  EXPECT_FALSE(is_mtp_tensor(c, "model.layers.7"));
  EXPECT_FALSE(is_mtp_tensor(c, "model.layers.x78.eh_proj.weight"));
  EXPECT_FALSE(is_mtp_tensor(c, "lm_head.weight"));
}

TEST(NameTableTest, LayerAndExpertTags) {
  ModelConfig c = load_config(kData + "/tiny-a");
  std::vector<TensorSpec> table = tensor_table(c);
  ASSERT_FALSE(table.empty());
  EXPECT_EQ(table.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(table.front().layer, -1);
  EXPECT_EQ(table.back().name, "lm_head.weight");
  EXPECT_EQ(table.back().layer, -1);
  int experts = 0;
  for (const TensorSpec& s : table) {
    if (s.name.rfind("model.layers.", 0) == 0) {
      EXPECT_EQ(s.name.rfind("model.layers." + std::to_string(s.layer) + ".", 0), 0u) << s.name;
    }
    if (s.expert >= 0) {
      ++experts;
      EXPECT_NE(s.name.find("mlp.experts." + std::to_string(s.expert) + "."), std::string::npos) << s.name;
    }
  }
  EXPECT_EQ(experts, 3 * 16 * 3);  // 3 MoE layers x 16 experts x gate/up/down
  auto m = by_name(table);
  EXPECT_EQ(m["model.layers.1.mlp.shared_experts.down_proj.weight"], (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(m["model.layers.0.mlp.down_proj.weight"], (std::vector<int64_t>{256, 256}));
}

TEST(NameTableTest, MoeLayerPattern) {
  ModelConfig c = load_config(kData + "/tiny-a");
  c.num_hidden_layers = 6;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 2;
  auto m = by_name(tensor_table(c));
  for (int l = 0; l < 6; ++l) {
    const std::string P = "model.layers." + std::to_string(l) + ".";
    const bool moe = l >= 1 && l % 2 == 0;
    EXPECT_EQ(c.is_moe_layer(l), moe) << l;
    EXPECT_EQ(m.count(P + "mlp.gate.e_score_correction_bias"), moe ? 1u : 0u) << l;
    EXPECT_EQ(m.count(P + "mlp.gate_proj.weight"), moe ? 0u : 1u) << l;
  }
  c.n_routed_experts = 0;  // no experts at all: every layer dense
  EXPECT_FALSE(c.is_moe_layer(2));
}

TEST(NameTableTest, TiedEmbeddingsHaveNoLmHead) {
  ModelConfig c = load_config(kData + "/tiny-a");
  c.tie_word_embeddings = true;
  auto m = by_name(tensor_table(c));
  EXPECT_EQ(m.count("lm_head.weight"), 0u);
  EXPECT_EQ(m.count("model.embed_tokens.weight"), 1u);
}

TEST(NameTableTest, NoSharedExperts) {
  ModelConfig c = load_config(kData + "/tiny-a");
  c.n_shared_experts = 0;
  auto m = by_name(tensor_table(c));
  EXPECT_EQ(m.count("model.layers.1.mlp.shared_experts.up_proj.weight"), 0u);
}

// Both goldens: the main table is exactly the checkpoint minus its MTP layer, the MTP table exactly
// that layer but for its copies of the embedding and lm_head, and the check passes.
void check_golden(const std::string& name, size_t total, size_t mtp, size_t mtp_copies) {
  ModelConfig c = load_config(kData + "/" + name);
  Checkpoint ck(kData + "/" + name);
  auto m = by_name(tensor_table(c));
  auto mtp_table = by_name(mtp_tensor_table(c));
  size_t n_mtp = 0, n_copies = 0;
  for (const std::string& n : ck.names()) {
    EXPECT_EQ(m.count(n), is_mtp_tensor(c, n) ? 0u : 1u) << n;
    if (!is_mtp_tensor(c, n)) continue;
    ++n_mtp;
    if (mtp_table.count(n)) {
      EXPECT_EQ(ck.find(n)->shape, mtp_table.at(n)) << n;
    } else {
      EXPECT_TRUE(n.ends_with(".embed_tokens.weight") || n.ends_with(".shared_head.head.weight")) << n;
      ++n_copies;
    }
  }
  EXPECT_EQ(ck.names().size(), total);
  EXPECT_EQ(n_mtp, mtp);
  EXPECT_EQ(n_copies, mtp_copies);
  EXPECT_EQ(m.size(), total - mtp);
  EXPECT_EQ(mtp_table.size(), mtp - mtp_copies);
  EXPECT_NO_THROW(check_checkpoint(ck, c));
  EXPECT_EQ(ck.bytes_loaded(), 0u);  // headers only
}

TEST(NameTableTest, TinyAPassesCheck) { check_golden("tiny-a", 292, 71, 0); }
// tiny-v32's MTP layer also has its own embed_tokens and shared_head.head copies.
TEST(NameTableTest, TinyV32PassesCheck) { check_golden("tiny-v32", 227, 73, 2); }

// The MTP layer (spec §3.9): a decoder layer of the model's shapes, then eh_proj [H, 2H] and the
// three norms, at index num_hidden_layers (GLM-5: layer 78, 791 tensors).
TEST(NameTableTest, MtpTableOfGlm5) {
  const ModelConfig c = load_config(kData + "/glm5-config");
  const std::vector<TensorSpec> t = mtp_tensor_table(c);
  EXPECT_EQ(t.size(), 791u);
  const auto m = by_name(t);
  ASSERT_EQ(m.count("model.layers.78.eh_proj.weight"), 1u);
  EXPECT_EQ(m.at("model.layers.78.eh_proj.weight"), (std::vector<int64_t>{6144, 12288}));
  const auto eh =
      std::find_if(t.begin(), t.end(), [](const TensorSpec& s) { return s.name.ends_with("eh_proj.weight"); });
  EXPECT_EQ(eh->role, Role::MtpProjection);
  EXPECT_FALSE(quantizable(Role::MtpProjection));
  EXPECT_EQ(m.count("model.layers.78.mlp.experts.255.down_proj.weight"), 1u);
  EXPECT_EQ(m.count("model.layers.78.shared_head.norm.weight"), 1u);
  for (const TensorSpec& s : t) EXPECT_EQ(s.layer, 78) << s.name;
  EXPECT_EQ(tensor_table(c).size(), 59079u);  // spec §2.1's counts
}

// A small synthetic checkpoint written from the table (zero data), spoilt by `edit`.
struct Synthetic {
  fs::path dir;
  ModelConfig cfg;
  explicit Synthetic(const std::function<void(std::vector<TensorToWrite>&)>& edit) {
    static std::atomic<int> counter{0};
    dir = fs::temp_directory_path() /
          ("glm5-test-name-table-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(dir);
    fs::create_directories(dir);
    cfg = load_config(kData + "/tiny-a");
    cfg.num_hidden_layers = 2;
    cfg.n_routed_experts = 4;
    cfg.n_group = 1;
    cfg.topk_group = 1;
    std::vector<TensorToWrite> ts;
    for (const TensorSpec& s : tensor_table(cfg)) {
      DType dt = s.name.find("e_score_correction_bias") != std::string::npos ? DType::F32 : DType::BF16;
      ts.push_back({s.name, dt, s.shape, nullptr});
    }
    edit(ts);
    std::vector<std::vector<uint8_t>> data(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      if (ts[i].data) continue;
      size_t n = dtype_size(ts[i].dtype);
      for (int64_t d : ts[i].shape) n *= size_t(d);
      data[i].assign(n, 0);
      ts[i].data = data[i].data();
    }
    write_safetensors((dir / "model.safetensors").string(), ts);
  }
  ~Synthetic() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  void check() {
    Checkpoint ck(dir.string());
    check_checkpoint(ck, cfg);
  }
};

// An MTP tensor the checkpoint holds is checked as any other: a wrong shape is refused, by name.
TEST(NameTableTest, MisshapedMtpTensor) {
  Synthetic s([](std::vector<TensorToWrite>& ts) {
    ts.push_back({"model.layers.2.eh_proj.weight", DType::BF16, {256, 256}, nullptr});
  });
  expect_error([&] { s.check(); }, {"model.layers.2.eh_proj.weight", "expected shape [256, 512]", "found [256, 256]"});
}

TEST(NameTableTest, SyntheticCheckpointPasses) {
  Synthetic s([](auto&) {});
  EXPECT_NO_THROW(s.check());
}

TEST(NameTableTest, MtpNamesAllowedAndF16Accepted) {
  Synthetic s([](std::vector<TensorToWrite>& ts) {
    ts.push_back({"model.layers.2.eh_proj.weight", DType::BF16, {256, 512}, nullptr});
    ts.push_back({"model.layers.2.embed_tokens.weight", DType::BF16, {512, 256}, nullptr});
    for (TensorToWrite& t : ts)
      if (t.name == "model.norm.weight")
        t.dtype = DType::F16;
      else if (t.name == "model.layers.1.mlp.gate.e_score_correction_bias")
        t.dtype = DType::BF16;
  });
  EXPECT_NO_THROW(s.check());
}

// num_hidden_layers and num_nextn_predict_layers are held to the layers the checkpoint has, before
// anything is sized by them (a corrupt count fails at once instead of allocating for it).
TEST(NameTableTest, LayerCountsAgainstTheCheckpoint) {
  Synthetic s([](auto&) {});
  s.cfg.num_hidden_layers = 3;  // the checkpoint has layers 0 and 1
  expect_error([&] { s.check(); }, {"holds 2 layers", "num_hidden_layers = 3"});
  Synthetic m([](std::vector<TensorToWrite>& ts) {
    ts.push_back({"model.layers.2.eh_proj.weight", DType::BF16, {256, 512}, nullptr});
  });
  m.cfg.num_nextn_predict_layers = 50;  // one MTP layer present
  expect_error([&] { m.check(); }, {"holds 3 layers", "num_nextn_predict_layers = 50"});
  m.cfg.num_nextn_predict_layers = 1;
  EXPECT_NO_THROW(m.check());
  m.cfg.num_nextn_predict_layers = 0;  // an MTP layer the config does not declare: not run, allowed
  EXPECT_NO_THROW(m.check());
  m.cfg.num_nextn_predict_layers = 2;
  expect_error([&] { m.check(); }, {"holds 3 layers", "num_nextn_predict_layers = 2"});
}

TEST(NameTableTest, MissingTensor) {
  const std::string gone = "model.layers.1.mlp.experts.3.up_proj.weight";
  Synthetic s([&](std::vector<TensorToWrite>& ts) {
    std::erase_if(ts, [&](const TensorToWrite& t) { return t.name == gone; });
  });
  expect_error([&] { s.check(); }, {s.dir.string(), "tensor '" + gone + "' not found (expected shape [64, 256]"});
}

TEST(NameTableTest, MisshapedTensor) {
  const std::string name = "model.layers.0.self_attn.kv_b_proj.weight";  // [4 * 64, 32]
  Synthetic s([&](std::vector<TensorToWrite>& ts) {
    for (TensorToWrite& t : ts)
      if (t.name == name) t.shape = {4 * 48, 32};
  });
  expect_error([&] { s.check(); }, {name, "model.safetensors", "expected shape [256, 32]", "found [192, 32]"});
}

TEST(NameTableTest, Fp8WithoutScalesAndIntegerDtypesRefused) {
  const std::string name = "model.layers.1.self_attn.o_proj.weight";
  Synthetic fp8([&](std::vector<TensorToWrite>& ts) {
    for (TensorToWrite& t : ts)
      if (t.name == name) t.dtype = DType::F8_E4M3;
  });
  expect_error([&] { fp8.check(); }, {"tensor " + name, "model.safetensors", "is F8_E4M3",
                                      "block scales '" + name + "_scale_inv' are missing"});
  Synthetic i32([&](std::vector<TensorToWrite>& ts) {
    for (TensorToWrite& t : ts)
      if (t.name == name) t.dtype = DType::I32;
  });
  expect_error([&] { i32.check(); }, {"tensor " + name, "has dtype I32", "expected BF16, F16 or F32 (or F8_E4M3"});
}

TEST(NameTableTest, UnknownName) {
  Synthetic s([](std::vector<TensorToWrite>& ts) {
    ts.push_back({"model.layers.0.self_attn.q_proj.weight", DType::BF16, {4}, nullptr});
    ts.push_back({"model.layers.1.self_attn.q_proj.weight", DType::BF16, {4}, nullptr});
  });
  expect_error([&] { s.check(); },
               {s.dir.string(), "'model.layers.0.self_attn.q_proj.weight'", "2 unknown", "glm_moe_dsa"});
}

// ---- Stored forms: pack-quantized and FP8 tensors, and every way their parts can disagree ------

const std::string kExpert = "model.layers.1.mlp.experts.0.gate_proj.weight";  // [64, 256]

// Replaces kExpert by a compressed-tensors triple: packed I32 [64, words], scale [64, groups],
// shape I64 [2] = shape_vals.
void make_packed(std::vector<TensorToWrite>& ts, int64_t words, int64_t groups, DType scale_dtype,
                 const int64_t* shape_vals) {
  for (auto it = ts.begin(); it != ts.end(); ++it)
    if (it->name == kExpert) {
      ts.erase(it);
      break;
    }
  ts.push_back({kExpert + "_packed", DType::I32, {64, words}, nullptr});
  ts.push_back({kExpert + "_scale", scale_dtype, {64, groups}, nullptr});
  ts.push_back({kExpert + "_shape", DType::I64, {2}, shape_vals});
}

TEST(NameTableTest, PackQuantizedFormResolves) {
  static const int64_t shape[2] = {64, 256};
  Synthetic s([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 32, 8, DType::BF16, shape); });
  s.check();
  Checkpoint ck(s.dir.string());
  const StoredTensor st = resolve_tensor(ck, {kExpert, {64, 256}});
  EXPECT_EQ(st.dtype, DType::Q4);
  EXPECT_EQ(st.group, 32);
  Synthetic s8([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 64, 2, DType::F32, shape); });
  Checkpoint ck8(s8.dir.string());
  const StoredTensor st8 = resolve_tensor(ck8, {kExpert, {64, 256}});
  EXPECT_EQ(st8.dtype, DType::Q8);
  EXPECT_EQ(st8.group, 128);
}

TEST(NameTableTest, PackQuantizedPartsThatDisagreeAreRefused) {
  static const int64_t shape[2] = {64, 256}, lying[2] = {64, 255};
  Synthetic bad_shape([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 32, 8, DType::BF16, lying); });
  expect_error([&] { bad_shape.check(); }, {kExpert + "_shape", "expected I64 [2] = [64, 256]", "= [64, 255]"});
  Synthetic bad_words([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 40, 8, DType::BF16, shape); });
  expect_error([&] { bad_words.check(); }, {kExpert + "_packed", "fit neither int4 (32) nor int8 (64)"});
  Synthetic bad_groups([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 32, 3, DType::BF16, shape); });
  expect_error([&] { bad_groups.check(); }, {kExpert + "_scale", "group_size dividing 256", "[64, 3]"});
  // 128 scales per row of 256 columns: a group of 2, below the smallest group size (8): refused.
  Synthetic tiny_group([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 32, 128, DType::BF16, shape); });
  expect_error([&] { tiny_group.check(); }, {kExpert + "_scale", "group size of 2", "power of two"});
  Synthetic zp([&](std::vector<TensorToWrite>& ts) {
    make_packed(ts, 32, 8, DType::BF16, shape);
    ts.push_back({kExpert + "_zero_point", DType::I32, {8, 8}, nullptr});
  });
  expect_error([&] { zp.check(); }, {kExpert + "_zero_point", "asymmetric"});
  Synthetic int_scale([&](std::vector<TensorToWrite>& ts) { make_packed(ts, 32, 8, DType::I32, shape); });
  expect_error([&] { int_scale.check(); }, {kExpert + "_scale", "expected BF16, F16 or F32", "found I32"});
}

TEST(NameTableTest, Fp8ScalesMustMatchTheirBlocks) {
  auto fp8 = [](std::vector<TensorToWrite>& ts, std::vector<int64_t> scale_shape, DType scale_dtype) {
    for (TensorToWrite& t : ts)
      if (t.name == kExpert) t.dtype = DType::F8_E4M3;
    ts.push_back({kExpert + "_scale_inv", scale_dtype, std::move(scale_shape), nullptr});
  };
  Synthetic ok([&](std::vector<TensorToWrite>& ts) { fp8(ts, {1, 2}, DType::F32); });
  ok.check();
  Checkpoint ck(ok.dir.string());
  EXPECT_EQ(resolve_tensor(ck, {kExpert, {64, 256}}).dtype, DType::F8_E4M3);
  Synthetic shape([&](std::vector<TensorToWrite>& ts) { fp8(ts, {1, 3}, DType::F32); });
  expect_error([&] { shape.check(); }, {kExpert + "_scale_inv", "expected shape [1, 2]", "found [1, 3]"});
  Synthetic dtype([&](std::vector<TensorToWrite>& ts) { fp8(ts, {1, 2}, DType::I32); });
  expect_error([&] { dtype.check(); }, {kExpert + "_scale_inv", "must be F32 (or BF16), found I32"});
}

}  // namespace
}  // namespace glm5::runtime

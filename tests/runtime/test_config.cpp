// ModelConfig: the two golden configs parse to the values their READMEs state (softmax scale,
// YaRN inverse frequencies, RoPE conventions), both spellings of dtype and RoPE are accepted, and
// each bad input gets a message naming the file, the field, the expected and the found value.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kernels/core/check.h"
#include "runtime/config.h"
#include "tests/test_support.h"

namespace glm5::runtime {
namespace {

using json = nlohmann::json;

const std::string kData = GLM5_TEST_DATA;

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

using glm5::testing::expect_error;

// tiny-a's config.json with one edit applied, parsed under a recognisable source name.
ModelConfig parse_edited(const std::function<void(json&)>& edit, const std::string& base = "tiny-a") {
  json j = read_json(kData + "/" + base + "/config.json");
  edit(j);
  return parse_config(j.dump(2), "edited/config.json");
}

void expect_edit_error(const std::function<void(json&)>& edit, std::vector<std::string> parts,
                       const std::string& base = "tiny-a") {
  parts.push_back("edited/config.json");
  expect_error([&] { parse_edited(edit, base); }, parts);
}

TEST(ConfigTest, TinyAParses) {
  ModelConfig c = load_config(kData + "/tiny-a");
  EXPECT_EQ(c.source, kData + "/tiny-a/config.json");
  EXPECT_EQ(c.model_type, "glm_moe_dsa");
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 64);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.qk_head_dim(), 48);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.index_n_heads, 8);
  EXPECT_EQ(c.index_head_dim, 32);
  EXPECT_EQ(c.index_topk, 16);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_scaling.type, "default");
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_TRUE(c.indexer_rope_interleave);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.eos_token_id, (std::vector<int32_t>{509, 510, 511}));
  EXPECT_EQ(c.pad_token_id, 509);
  EXPECT_EQ(c.bos_token_id, -1);

  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_FLOAT_EQ(c.softmax_scale(), float(1.0 / std::sqrt(48.0)));
  EXPECT_FLOAT_EQ(c.rope_cos_sin_scale(), 1.0f);
  std::vector<float> f = c.inv_freq();
  ASSERT_EQ(f.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(f[i], float(std::pow(1e6, -2.0 * i / 16.0))) << i;
}

TEST(ConfigTest, TinyV32Parses) {
  ModelConfig c = load_config(kData + "/tiny-v32");
  EXPECT_EQ(c.model_type, "deepseek_v32");
  EXPECT_EQ(c.dtype, "bfloat16");  // from torch_dtype
  EXPECT_EQ(c.vocab_size, 400);
  EXPECT_EQ(c.hidden_size, 192);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.intermediate_size, 384);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale_all_dim, 1.0);
  EXPECT_EQ(c.eos_token_id, (std::vector<int32_t>{1}));
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.pad_token_id, -1);
  // No interleave keys in the file: MLA interleaved, indexer half-split for deepseek_v32.
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_FALSE(c.indexer_rope_interleave);

  // README: m = 0.1 ln 4 + 1 = 1.138629, scale = 48^-0.5 m^2 = 0.187130.
  EXPECT_NEAR(c.softmax_scale(), 0.187130f, 5e-7);
  EXPECT_FLOAT_EQ(c.rope_cos_sin_scale(), 1.0f);

  // README table (6 significant digits), and the closed form it comes from:
  // inv_freq_i = theta^(-2i/16) (1 - ramp_i + ramp_i / 4), ramp = [0, 1/3, 2/3, 1, 1, ...].
  const double table[8] = {1, 0.237171, 0.05, 0.00790569, 0.0025, 0.000790569, 0.00025, 7.90569e-05};
  std::vector<float> f = c.inv_freq();
  ASSERT_EQ(f.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(f[i], table[i], table[i] * 2e-6) << i;
    double ramp = std::min(i / 3.0, 1.0);
    EXPECT_FLOAT_EQ(f[i], float(std::pow(1e4, -2.0 * i / 16.0) * (1.0 - ramp + ramp / 4.0))) << i;
  }
}

TEST(ConfigTest, FullSizeDeepSeekV32SoftmaxScale) {
  // Spec §1.3 / §3.3: 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.135234.
  ModelConfig c = parse_edited(
      [](json& j) {
        j["qk_nope_head_dim"] = 128;
        j["qk_rope_head_dim"] = 64;
        j["index_head_dim"] = 128;
        j["rope_scaling"]["factor"] = 40;
        j["rope_scaling"]["original_max_position_embeddings"] = 4096;
        j["max_position_embeddings"] = 163840;
      },
      "tiny-v32");
  EXPECT_NEAR(c.softmax_scale(), 0.135234f, 1e-6);
}

TEST(ConfigTest, DtypeAndTorchDtypeAreTheSame) {
  ModelConfig a = parse_edited([](json& j) {
    j.erase("dtype");
    j["torch_dtype"] = "float16";
  });
  ModelConfig b = parse_edited([](json& j) { j["dtype"] = "float16"; });
  EXPECT_EQ(a.dtype, "float16");
  EXPECT_EQ(b.dtype, "float16");
  // Both present: the v5 key wins.
  ModelConfig both = parse_edited([](json& j) {
    j["dtype"] = "bfloat16";
    j["torch_dtype"] = "float32";
  });
  EXPECT_EQ(both.dtype, "bfloat16");
  expect_edit_error([](json& j) { j["dtype"] = 16; }, {"'dtype'", "a string", "16"});
}

TEST(ConfigTest, RopeParametersAndTopLevelRopeThetaAgree) {
  ModelConfig v5 = parse_edited([](json&) {});
  ModelConfig v4 = parse_edited([](json& j) {
    j.erase("rope_parameters");
    j["rope_theta"] = 1000000.0;
    j["rope_scaling"] = nullptr;
  });
  EXPECT_DOUBLE_EQ(v4.rope_theta, 1e6);
  EXPECT_EQ(v4.rope_scaling.type, "default");
  EXPECT_EQ(v4.inv_freq(), v5.inv_freq());
  EXPECT_EQ(v4.softmax_scale(), v5.softmax_scale());

  // tiny-v32's YaRN written transformers-v5 style gives the same frequencies and scale.
  ModelConfig old_style = load_config(kData + "/tiny-v32");
  ModelConfig new_style = parse_edited(
      [](json& j) {
        json p = j["rope_scaling"];
        p.erase("type");
        p["rope_type"] = "yarn";
        p["rope_theta"] = j["rope_theta"];
        j.erase("rope_scaling");
        j.erase("rope_theta");
        j["rope_parameters"] = p;
      },
      "tiny-v32");
  EXPECT_EQ(new_style.rope_scaling.type, "yarn");
  EXPECT_EQ(new_style.inv_freq(), old_style.inv_freq());
  EXPECT_EQ(new_style.softmax_scale(), old_style.softmax_scale());
}

TEST(ConfigTest, MissingRopeTheta) {
  expect_edit_error([](json& j) { j.erase("rope_parameters"); }, {"'rope_theta'", "missing"});
  expect_edit_error([](json& j) { j["rope_parameters"].erase("rope_theta"); },
                    {"'rope_parameters.rope_theta'", "a positive number", "missing"});
}

TEST(ConfigTest, RopeScalingErrors) {
  expect_edit_error([](json& j) { j["rope_scaling"]["type"] = "linear"; },
                    {"'rope_scaling.type'", "\"yarn\"", "\"linear\""}, "tiny-v32");
  expect_edit_error([](json& j) { j["rope_scaling"]["factor"] = "4"; },
                    {"'rope_scaling.factor'", "a positive number", "\"4\""}, "tiny-v32");
  expect_edit_error([](json& j) { j["rope_scaling"]["factor"] = 0.5; }, {"'rope_scaling.factor'", ">= 1", "0.5"},
                    "tiny-v32");
}

TEST(ConfigTest, YarnMscaleDifferentFromMscaleAllDimScalesCosSin) {
  ModelConfig c = parse_edited([](json& j) { j["rope_scaling"]["mscale"] = 0.707; }, "tiny-v32");
  const double m = 0.1 * 0.707 * std::log(4.0) + 1.0, m_all = 0.1 * std::log(4.0) + 1.0;
  EXPECT_FLOAT_EQ(c.rope_cos_sin_scale(), float(m / m_all));
  // No mscale_all_dim: no softmax correction.
  ModelConfig d = parse_edited([](json& j) { j["rope_scaling"].erase("mscale_all_dim"); }, "tiny-v32");
  EXPECT_FLOAT_EQ(d.softmax_scale(), float(1.0 / std::sqrt(48.0)));
}

TEST(ConfigTest, InterleaveDefaultsAndOverrides) {
  ModelConfig glm = parse_edited([](json& j) {
    j.erase("rope_interleave");
    j.erase("indexer_rope_interleave");
  });
  EXPECT_TRUE(glm.rope_interleave);
  EXPECT_TRUE(glm.indexer_rope_interleave);
  ModelConfig v32 = parse_edited([](json& j) { j["indexer_rope_interleave"] = true; }, "tiny-v32");
  EXPECT_TRUE(v32.indexer_rope_interleave);
  ModelConfig glm_off = parse_edited([](json& j) { j["indexer_rope_interleave"] = false; });
  EXPECT_FALSE(glm_off.indexer_rope_interleave);
  expect_edit_error([](json& j) { j["rope_interleave"] = "yes"; }, {"'rope_interleave'", "true or false", "\"yes\""});
}

TEST(ConfigTest, EosTokenIdIntOrList) {
  EXPECT_EQ(parse_edited([](json& j) { j["eos_token_id"] = 7; }).eos_token_id, (std::vector<int32_t>{7}));
  EXPECT_TRUE(parse_edited([](json& j) { j.erase("eos_token_id"); }).eos_token_id.empty());
  expect_edit_error([](json& j) { j["eos_token_id"] = "</s>"; }, {"'eos_token_id'", "\"</s>\""});
  expect_edit_error([](json& j) { j["eos_token_id"] = json::array({1, 512}); }, {"'eos_token_id'", "[0, 512)", "512"});
}

TEST(ConfigTest, MissingRequiredField) {
  expect_edit_error([](json& j) { j.erase("kv_lora_rank"); },
                    {"field 'kv_lora_rank': expected a positive integer, found", "missing"});
  expect_edit_error([](json& j) { j["index_topk"] = nullptr; }, {"field 'index_topk': expected a positive integer"});
  std::string err;
  try {
    load_config(kData + "/no-such-model");
  } catch (const Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("no-such-model/config.json"), std::string::npos) << err;
}

TEST(ConfigTest, WrongType) {
  expect_edit_error([](json& j) { j["kv_lora_rank"] = "32"; },
                    {"field 'kv_lora_rank': expected a positive integer, found \"32\""});
  expect_edit_error([](json& j) { j["kv_lora_rank"] = 32.5; },
                    {"field 'kv_lora_rank': expected a positive integer, found 32.5"});
  expect_edit_error([](json& j) { j["hidden_size"] = -256; },
                    {"field 'hidden_size': expected a positive integer, found -256"});
  expect_edit_error([](json& j) { j["num_hidden_layers"] = 0; },
                    {"field 'num_hidden_layers': expected a positive integer, found 0"});
  expect_edit_error([](json& j) { j["first_k_dense_replace"] = -1; },
                    {"'first_k_dense_replace': expected a non-negative integer, found -1"});
  expect_edit_error([](json& j) { j["rms_norm_eps"] = "1e-5"; }, {"'rms_norm_eps'", "a positive number", "\"1e-5\""});
  expect_edit_error([](json& j) { j["tie_word_embeddings"] = 0; }, {"'tie_word_embeddings'", "true or false", "0"});
}

TEST(ConfigTest, BadModelType) {
  expect_edit_error([](json& j) { j["model_type"] = "llama"; },
                    {"'model_type'", "\"glm_moe_dsa\" or \"deepseek_v32\"", "\"llama\""});
  expect_edit_error([](json& j) { j.erase("model_type"); }, {"'model_type'", "missing"});
}

TEST(ConfigTest, NotJson) {
  expect_error([] { parse_config("{\"model_type\": ", "broken/config.json"); },
               {"broken/config.json", "not valid JSON"});
  expect_error([] { parse_config("[1, 2]", "list/config.json"); }, {"list/config.json", "object"});
}

TEST(ConfigTest, ConsistencyErrors) {
  expect_edit_error([](json& j) { j["scoring_func"] = "softmax"; }, {"'scoring_func'", "\"sigmoid\"", "\"softmax\""});
  expect_edit_error([](json& j) { j["topk_method"] = "greedy"; }, {"'topk_method'", "\"noaux_tc\"", "\"greedy\""});
  EXPECT_EQ(parse_edited([](json& j) { j.erase("topk_method"); }).topk_method, "noaux_tc");
  expect_edit_error([](json& j) { j["hidden_act"] = "gelu"; }, {"'hidden_act'", "\"silu\"", "\"gelu\""});
  expect_edit_error([](json& j) { j["n_group"] = 3; }, {"'n_group'", "divisor of n_routed_experts = 16", "found 3"});
  expect_edit_error([](json& j) { j["topk_group"] = 5; }, {"'topk_group'", "at most n_group = 4", "found 5"});
  expect_edit_error([](json& j) { j["num_experts_per_tok"] = 17; },
                    {"'num_experts_per_tok'", "at most n_routed_experts = 16", "found 17"});
  expect_edit_error([](json& j) { j["num_experts_per_tok"] = 9; },
                    {"'num_experts_per_tok'", "topk_group * n_routed_experts / n_group = 8", "found 9"});
  expect_edit_error([](json& j) { j["qk_rope_head_dim"] = 15; }, {"'qk_rope_head_dim'", "even", "found 15"});
  expect_edit_error([](json& j) { j["qk_head_dim"] = 64; },
                    {"'qk_head_dim'", "qk_nope_head_dim + qk_rope_head_dim = 48", "found 64"});
  expect_edit_error([](json& j) { j["index_topk"] = 0; }, {"'index_topk'", "positive integer", "found 0"});
  expect_edit_error([](json& j) { j["attention_bias"] = true; }, {"'attention_bias'", "false", "true"});
  // head_dim is present in GLM-5's config and means nothing for MLA: any value is accepted.
  EXPECT_EQ(parse_edited([](json& j) { j["head_dim"] = 64; }).qk_head_dim(), 48);
}

// Every key is read, known to be ignorable (listed by name), or refused by name.
TEST(ConfigTest, UnknownFieldsRefusedIgnorableOnesListed) {
  ModelConfig c = parse_edited([](json& j) { j["aux_loss_alpha"] = 0.001; });
  EXPECT_NE(std::find(c.ignored_fields.begin(), c.ignored_fields.end(), "initializer_range"), c.ignored_fields.end());
  EXPECT_NE(std::find(c.ignored_fields.begin(), c.ignored_fields.end(), "aux_loss_alpha"), c.ignored_fields.end());
  expect_edit_error([](json& j) { j["logit_softcapping"] = 30.0; }, {"'logit_softcapping'", "refuses to guess"});
  expect_edit_error([](json& j) { j["mlp_bias"] = true; }, {"'mlp_bias'", "false"});
  expect_edit_error([](json& j) { j["moe_router_dtype"] = "bfloat16"; }, {"'moe_router_dtype'", "float32"});
  expect_edit_error([](json& j) { j["num_experts"] = 8; }, {"'num_experts'", "alias"});
  EXPECT_EQ(parse_edited([](json& j) { j["num_experts"] = 16; }).n_routed_experts, 16);
}

// The rope fields that transformers v5 would leave unused are refused, not ignored.
TEST(ConfigTest, RopeFieldsThatWouldBeUnused) {
  expect_edit_error([](json& j) { j["rope_parameters"]["factor"] = -4; },
                    {"'rope_parameters.factor'", "\"default\"", "-4"});
  expect_edit_error([](json& j) { j["rope_theta"] = 0; }, {"'rope_theta'", "positive"});
  expect_edit_error([](json& j) { j["rope_theta"] = 10000.0; }, {"'rope_theta'", "rope_parameters.rope_theta"});
  expect_edit_error([](json& j) { j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4}}; }, {"'rope_scaling'"});
  // The legacy copy an exporter writes beside rope_parameters is accepted when it says the same.
  EXPECT_NO_THROW(parse_edited([](json& j) { j["rope_scaling"] = {{"rope_type", "default"}}; }));
  EXPECT_NO_THROW(parse_edited([](json& j) { j["max_length"] = 20, j["do_sample"] = false; }));
  expect_edit_error([](json& j) { j["model_type"] = "qwen3", j["sliding_window"] = 4096; }, {"'model_type'"});
  EXPECT_DOUBLE_EQ(parse_edited([](json& j) { j["rope_theta"] = 1000000.0; }).rope_theta, 1e6);
  expect_edit_error([](json& j) { j["num_hidden_layers"] = 1000000000; }, {"'num_hidden_layers'", "at most"});
}

// GLM-5.x indexer types, as transformers derives them (GLM-5.2's IndexShare: "shared" layers).
TEST(ConfigTest, IndexerTypes) {
  EXPECT_EQ(parse_edited([](json&) {}).indexer_full, std::vector<char>(4, 1));
  EXPECT_EQ(parse_edited([](json& j) {
              j["indexer_types"] = {"full", "full", "full", "full"};
            }).indexer_full,
            std::vector<char>(4, 1));
  EXPECT_EQ(parse_edited([](json& j) { j["index_topk_pattern"] = "FFFF"; }).indexer_full, std::vector<char>(4, 1));
  const ModelConfig fsff = parse_edited([](json& j) { j["indexer_types"] = {"full", "shared", "full", "full"}; });
  EXPECT_EQ(fsff.indexer_full, (std::vector<char>{1, 0, 1, 1}));
  EXPECT_TRUE(fsff.has_indexer(0) && !fsff.has_indexer(1) && fsff.has_indexer(2));
  EXPECT_EQ(fsff.indexer_donor(1), 0);
  EXPECT_EQ(fsff.indexer_donor(3), 3);
  EXPECT_TRUE(fsff.has_indexer(4));  // the MTP layer keeps its own unless index_share_for_mtp_iteration
  // GLM-5.2 lists its MTP layer too (num_hidden_layers + num_nextn_predict_layers entries).
  EXPECT_FALSE(parse_edited([](json& j) {
                 j["indexer_types"] = {"full", "full", "full", "full", "shared"};
               }).has_indexer(4));
  // GLM-5.2's schedule: freq 4, offset 3 gives full layers 0, 1, 2, 6, ... (layer 3 shared).
  EXPECT_EQ(parse_edited([](json& j) { j["index_topk_freq"] = 4, j["index_skip_topk_offset"] = 3; }).indexer_full,
            (std::vector<char>{1, 1, 1, 0}));
  EXPECT_EQ(parse_edited([](json& j) { j["index_topk_pattern"] = "FSSF"; }).indexer_full,
            (std::vector<char>{1, 0, 0, 1}));
  expect_edit_error(
      [](json& j) {
        j["indexer_types"] = {"full", "full"};
      },
      {"'indexer_types'", "one entry per layer", "2"});
  expect_edit_error([](json& j) { j["index_topk_pattern"] = "FFXF"; }, {"'index_topk_pattern' entry 2", "X"});
  expect_edit_error([](json& j) { j["indexer_types"] = {"shared", "full", "full", "full"}; }, {"layer 0", "full"});
  const ModelConfig share = parse_edited([](json& j) { j["index_share_for_mtp_iteration"] = true; });
  EXPECT_TRUE(share.index_share_for_mtp_iteration);
  EXPECT_FALSE(share.has_indexer(4));
}

TEST(ConfigTest, MlpAndLayerTypesAgreeWithFirstKDense) {
  EXPECT_NO_THROW(parse_edited([](json& j) { j["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"}; }));
  expect_edit_error(
      [](json& j) {
        j["mlp_layer_types"] = {"dense", "dense", "sparse", "sparse"};
      },
      {"'mlp_layer_types' entry 1", "\"sparse\"", "first_k_dense_replace = 1"});
  expect_edit_error([](json& j) { j["layer_types"] = {"full_attention"}; },
                    {"'layer_types'", "deepseek_sparse_attention"});
}

}  // namespace
}  // namespace glm5::runtime

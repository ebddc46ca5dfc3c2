// The forward pass against the upstream reference goldens (tests/data/*/golden.safetensors):
// prefill logits, greedy decode tokens and logits through the cached weight-absorbed path, and
// the intermediate values (layer outputs, indexer selections, routed experts) of the prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tests/runtime/model_fixture.h"

using namespace glm5;
using namespace glm5::testing;

namespace {

struct GoldenCase {
  const char* dir;
  int n_moe_first;  // first MoE layer (prefill_moe_experts covers MoE layers from here)
};

void check_golden(const std::string& dir, bool reference_backend) {
  Golden g(dir + "/golden.safetensors");
  OneProcessModel m(dir, reference_backend);
  auto prompt = g.get<int32_t>("prompt_ids");
  auto tokens = g.get<int32_t>("decode_tokens");
  const int64_t V = m.cfg.vocab_size, N = int64_t(tokens.size());
  auto res = m.run({golden_request(prompt, int(N))});
  ASSERT_EQ(res.size(), 1u);
  const runtime::Result& r = res[0];
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.tokens, tokens);
  ASSERT_EQ(int64_t(r.prompt_logits.size()), int64_t(prompt.size()) * V);
  ASSERT_EQ(int64_t(r.decode_logits.size()), N * V);
  EXPECT_LT(max_abs_diff(r.prompt_logits, g.get<float>("prefill_logits")), 1e-4f);
  EXPECT_LT(max_abs_diff(r.decode_logits, g.get<float>("decode_logits")), 1e-4f);
}

// Runs the prefill once with a debug hook and compares what the hook saw with the golden.
void check_golden_internals(const std::string& dir) {
  Golden g(dir + "/golden.safetensors");
  OneProcessModel m(dir);
  auto prompt = g.get<int32_t>("prompt_ids");
  const int64_t P = int64_t(prompt.size()), H = m.cfg.hidden_size, K = m.cfg.index_topk;
  const int64_t L = m.cfg.num_hidden_layers;
  std::vector<float> layers(size_t(L * P * H)), final_hidden;
  std::vector<int32_t> topk(size_t(L * P * K), -2), experts;
  m.model->set_debug_hook([&](const std::string& name, int layer, const void* data, DType, int64_t rows, int64_t cols) {
    if (name == "layer_output") {
      std::memcpy(layers.data() + layer * P * H, data, size_t(rows * cols) * sizeof(float));
    } else if (name == "indexer_topk") {
      std::memcpy(topk.data() + (layer * P + (P - rows)) * K, data, size_t(rows * cols) * 4);
    } else if (name == "moe_experts") {
      auto* p = static_cast<const int32_t*>(data);
      experts.insert(experts.end(), p, p + rows * cols);
    } else if (name == "final_hidden") {
      auto* p = static_cast<const float*>(data);
      final_hidden.assign(p, p + rows * cols);
    }
  });
  runtime::KvPool pool(m.model->backend(), m.cfg, 0, int(L), runtime::blocks_for(P));
  std::vector<int32_t> table(size_t(runtime::blocks_for(P)));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  m.model->set_kv_pool(&pool);
  std::vector<float> h(size_t(P * H)), logits(size_t(P * m.cfg.vocab_size));
  m.model->embed(prompt.data(), P, h.data());
  m.model->forward({{table.data(), 0, P, P}}, h.data());
  m.model->set_kv_pool(nullptr);
  m.model->logits(h.data(), P, logits.data());

  EXPECT_LT(max_abs_diff(layers, g.get<float>("prefill_layer_output")), 1e-4f);
  EXPECT_LT(max_abs_diff(final_hidden, g.get<float>("prefill_final_hidden")), 1e-4f);
  EXPECT_EQ(experts, g.get<int32_t>("prefill_moe_experts"));
  // Indexer sets: rows with more causal keys than index_topk (the model skips the indexer for
  // the others, where top-k keeps every causal key and attention is dense).
  auto gold = g.get<int32_t>("prefill_indexer_topk");
  int64_t compared = 0;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t s = K; s < P; ++s) {
      std::vector<int32_t> a(topk.begin() + (l * P + s) * K, topk.begin() + (l * P + s + 1) * K);
      std::vector<int32_t> b(gold.begin() + (l * P + s) * K, gold.begin() + (l * P + s + 1) * K);
      EXPECT_EQ(a, b) << "layer " << l << " row " << s;
      ++compared;
    }
  EXPECT_GT(compared, 0);
}

// A compact golden (scripts/check_trained_vs_hf.py golden): HF's logits at selected rows of a
// real-text prompt longer than index_topk, and greedy decode through the cache.
void check_compact_golden(const std::string& dir) {
  Golden g(dir + "/golden.safetensors");
  OneProcessModel m(dir);
  auto prompt = g.get<int32_t>("prompt_ids");
  auto rows = g.get<int32_t>("logit_rows");
  auto tokens = g.get<int32_t>("decode_tokens");
  const int64_t V = m.cfg.vocab_size, N = int64_t(tokens.size());
  ASSERT_GT(int64_t(prompt.size()), 2 * m.cfg.index_topk);  // the indexer really drops keys
  auto res = m.run({golden_request(prompt, int(N))});
  ASSERT_EQ(res.size(), 1u);
  const runtime::Result& r = res[0];
  ASSERT_TRUE(r.error.empty()) << r.error;
  ASSERT_EQ(int64_t(r.prompt_logits.size()), int64_t(prompt.size()) * V);
  std::vector<float> picked;
  for (int32_t row : rows)
    picked.insert(picked.end(), r.prompt_logits.begin() + row * V, r.prompt_logits.begin() + (row + 1) * V);
  EXPECT_LT(max_abs_diff(picked, g.get<float>("logits")), 1e-4f);
  EXPECT_EQ(r.tokens, tokens);
  EXPECT_LT(max_abs_diff(r.decode_logits, g.get<float>("decode_logits")), 1e-4f);
}

}  // namespace

TEST(Golden, TinyA) { check_golden(std::string(GLM5_TEST_DATA) + "/tiny-a", false); }
TEST(Golden, TinyAReferenceBackend) { check_golden(std::string(GLM5_TEST_DATA) + "/tiny-a", true); }
TEST(Golden, TinyAInternals) { check_golden_internals(std::string(GLM5_TEST_DATA) + "/tiny-a"); }
// The trained small model: HF transformers on 1,100 tokens of held-out text (index_topk 64).
TEST(Golden, Glm5Kjv) { check_compact_golden(std::string(GLM5_TEST_DATA) + "/glm5-kjv"); }
TEST(Golden, TinyV32) { check_golden(std::string(GLM5_TEST_DATA) + "/tiny-v32", false); }
TEST(Golden, TinyV32Internals) { check_golden_internals(std::string(GLM5_TEST_DATA) + "/tiny-v32"); }
// tiny-b: another shape (2 dense layers, 2 shared experts, 5 heads, theta 1e4, prompt of 100 >
// index_topk 24), golden from Hugging Face transformers' GlmMoeDsaForCausalLM (float32).
// tiny-glm52: GLM-5.2's IndexShare (indexer_types FFFSSSFS: layers 3-5 use layer 2's top-k, layer 7
// layer 6's; no indexer tensors or index keys for them), against transformers 5.13 and the float64
// reference (scripts/ref_forward_f64.py), which agree; a prompt of 100 > index_topk 16.
TEST(Golden, TinyGlm52) { check_golden(std::string(GLM5_TEST_DATA) + "/tiny-glm52", false); }
TEST(Golden, TinyGlm52ReferenceBackend) { check_golden(std::string(GLM5_TEST_DATA) + "/tiny-glm52", true); }
TEST(Golden, TinyGlm52Internals) { check_golden_internals(std::string(GLM5_TEST_DATA) + "/tiny-glm52"); }
TEST(Golden, TinyB) { check_golden(std::string(GLM5_TEST_DATA) + "/tiny-b", false); }
TEST(Golden, TinyBInternals) { check_golden_internals(std::string(GLM5_TEST_DATA) + "/tiny-b"); }

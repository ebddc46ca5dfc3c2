// `glm5 inspect` tells the truth about memory: the per-tensor plan (runtime/memory_plan.h) equals
// what the loader really uploads (tiny-a BF16, its int4 compressed-tensors twin, and an FP8
// conversion), the stored forms follow the index names or the config, and on GLM-5's real config
// (tests/data/glm5-config, glm5-fp8-config: config.json only) the H100 layouts come out as their
// cluster-config comments say. Also the GPU binding (launcher/cluster/gpu_binding.h): local rank -> device.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "launcher/cluster/gpu_binding.h"
#include "parallel/comm.h"
#include "runtime/config.h"
#include "runtime/memory_plan.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
const std::string kTinyA = kData + "/tiny-a";
const std::string kTinyCt = kData + "/tiny-a-w4a16-ct";
const std::string kGlm5 = kData + "/glm5-config";
const std::string kGlm5Fp8 = kData + "/glm5-fp8-config";
const std::string kH100x8 = kSrc + "/cluster-configs/h100x8.yaml";
const std::string kH100x16 = kSrc + "/cluster-configs/h100x16-2nodes.yaml";

using glm5::testing::contains;
using glm5::testing::Proc;
using glm5::testing::slurp;

const glm5::testing::ScratchDir scratch("glm5_inspect");

Proc run(const std::string& cmd) {
  static int n = 0;
  ++n;
  return glm5::testing::run_captured(cmd, scratch("run" + std::to_string(n) + ".out"),
                                     scratch("run" + std::to_string(n) + ".err"));
}

Proc inspect(const std::string& model, const std::string& cluster, const std::string& extra = "") {
  return run(kBin + " inspect --model " + model + (cluster.empty() ? "" : " --cluster " + cluster) +
             (extra.empty() ? "" : " " + extra));
}

// One row of the per-rank table: rank stage column layers weights kv/token [kv-room kv-tokens kv-budget].
struct Row {
  std::vector<std::string> cols;
  double gb(size_t i) const { return std::stod(cols.at(i)); }  // "57.57GB" -> 57.57
};

std::vector<Row> rows(const std::string& out) {
  std::vector<Row> r;
  std::stringstream ss(out);
  bool table = false;
  for (std::string l; std::getline(ss, l);) {
    std::stringstream ls(l);
    std::vector<std::string> cols;
    for (std::string c; ls >> c;) cols.push_back(c);
    if (cols.empty()) continue;
    if (cols[0] == "rank")
      table = true;
    else if (table && std::isdigit(static_cast<unsigned char>(cols[0][0])))
      r.push_back({cols});
    else if (table)
      break;
  }
  return r;
}

std::string line_starting(const std::string& out, const std::string& head) {
  std::stringstream ss(out);
  for (std::string l; std::getline(ss, l);)
    if (l.rfind(head, 0) == 0) return l;
  return "";
}

// The number after `before` in `s` (NaN when absent).
double number_after(const std::string& s, const std::string& before) {
  const size_t at = s.find(before);
  if (at == std::string::npos) return std::nan("");
  return std::stod(s.substr(at + before.size()));
}

// ---------------------------------------------------------------------------------------------
// GLM-5, real config, the shipped H100 layouts.

TEST(Inspect, TestConfigsAreConfigJsonOnly) {
  for (const std::string& dir : {kGlm5, kGlm5Fp8}) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"config.json"}) << dir;
  }
  const glm5::runtime::ModelConfig bf16 = glm5::runtime::load_config(kGlm5);
  const glm5::runtime::ModelConfig fp8 = glm5::runtime::load_config(kGlm5Fp8);
  EXPECT_EQ(bf16.quantization.method, "");
  EXPECT_EQ(fp8.quantization.method, "fp8");
  EXPECT_EQ(fp8.num_hidden_layers, 78);
  EXPECT_EQ(fp8.n_routed_experts, 256);
}

TEST(Inspect, Glm5Bf16DoesNotFitTwoNodes) {
  const Proc p = inspect(kGlm5, kH100x16);
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_TRUE(contains(p.out, "parameters 7.439e+11")) << p.out;
  EXPECT_TRUE(contains(line_starting(p.out, "stored"), "59079 tensors: BF16 59004, F32 75")) << p.out;
  EXPECT_TRUE(contains(p.out, "dtype bfloat16, no index")) << p.out;
  // bf16 KV: 1408 B per layer and token, as the config now says.
  EXPECT_TRUE(
      contains(line_starting(p.out, "kv cache"),
               "107.25 KiB per token (bf16: latent 576 values x 78 layers + indexer key 128 values x 78 layers"))
      << p.out;
  const auto r = rows(p.out);
  ASSERT_EQ(r.size(), 16u) << p.out;
  for (const Row& row : r) {
    ASSERT_EQ(row.cols.size(), 9u) << p.out;
    EXPECT_GT(row.gb(4), 100.0) << p.out;  // ~110 GB of BF16 weights per rank
    EXPECT_LT(row.gb(4), 120.0) << p.out;
    EXPECT_LT(row.gb(6), 0.0) << p.out;  // no room left for KV
    EXPECT_EQ(row.cols[7], "0") << p.out;
    EXPECT_TRUE(contains(row.cols[8], ":NO")) << p.out;
  }
  EXPECT_EQ(r[0].cols[3], "0-39");
  EXPECT_EQ(r[8].cols[3], "40-77");
  const std::string mem = line_starting(p.out, "memory");
  EXPECT_TRUE(contains(mem, "of 80.0 GB device memory: DOES NOT FIT by ")) << mem;
  const double by = number_after(mem, "DOES NOT FIT by ");
  EXPECT_GT(by, 40.0) << mem;
  EXPECT_LT(by, 60.0) << mem;
  EXPECT_TRUE(contains(line_starting(p.out, "reserve"), "max_step_tokens 8192")) << p.out;
}

TEST(Inspect, Glm5Fp8FitsTwoNodes) {
  const Proc p = inspect(kGlm5Fp8, kH100x16);
  ASSERT_EQ(p.code, 0) << p.err;
  const std::string stored = line_starting(p.out, "stored");
  // 75 router biases F32; embedding, lm_head, norms (1-D, stored BF16), routers, weights_proj
  // BF16; every attention / indexer / MLP / expert matrix FP8.
  EXPECT_TRUE(contains(stored, "59079 tensors: BF16 624, F32 75, FP8 58380")) << p.out;
  EXPECT_TRUE(contains(p.out, "quantization_config fp8, no index")) << p.out;
  EXPECT_TRUE(contains(p.out, "78 quantized kv_b_proj / embed_tokens held dequantized (BF16 from int, F32 from FP8)"))
      << p.out;
  const auto r = rows(p.out);
  ASSERT_EQ(r.size(), 16u) << p.out;
  for (const Row& row : r) {
    EXPECT_GT(row.gb(4), 50.0) << p.out;
    EXPECT_LT(row.gb(4), 65.0) << p.out;
    EXPECT_GT(row.gb(6), 12.0) << p.out;                  // KV room beyond the 12 GB budget
    EXPECT_GT(std::stoll(row.cols[7]), 200000) << p.out;  // tokens of KV that fit in it
    EXPECT_TRUE(contains(row.cols[8], ":fits")) << p.out;
  }
  const std::string mem = line_starting(p.out, "memory");
  EXPECT_TRUE(contains(mem, "of 80.0 GB device memory: fits, ")) << mem;
  EXPECT_GT(number_after(mem, "fits, "), 1.0) << mem;
  EXPECT_TRUE(contains(line_starting(p.out, "kv room"), "kv_budget_gb 12 allocates 213056 tokens")) << p.out;
  // FP8 weights are about half of BF16 plus the F32 kv_b_proj copies and scales.
  const double bf16 = rows(inspect(kGlm5, kH100x16).out).at(0).gb(4);
  EXPECT_GT(r[0].gb(4), 0.5 * bf16);
  EXPECT_LT(r[0].gb(4), 0.55 * bf16);
  // The same from a --quant fp8 plan of the BF16 config over the same roles.
  const Proc q = inspect(kGlm5, kH100x16, "--quant fp8 --quantize experts,shared,dense,attention,indexer");
  ASSERT_EQ(q.code, 0) << q.err;
  EXPECT_EQ(rows(q.out).at(0).cols[4], r[0].cols[4]) << q.out;
  EXPECT_TRUE(contains(q.out, "then --quant fp8 (128x128 blocks)")) << q.out;
}

TEST(Inspect, Glm5Int4OnOneNode) {
  // int4 routed + shared experts (the convert default) leave 78 BF16 attention blocks, ~27 GB
  // replicated on every rank: 80.8 GB of weights, over an H100 before any KV.
  const Proc p = inspect(kGlm5, kH100x8, "--quant int4");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_TRUE(contains(p.out, "then --quant int4 g128 (experts, shared)")) << p.out;
  EXPECT_TRUE(contains(line_starting(p.out, "stored"), "int4 g128 57825")) << p.out;  // 75 x (768 + 3)
  auto r = rows(p.out);
  ASSERT_EQ(r.size(), 8u) << p.out;
  EXPECT_GT(r[0].gb(4), 78.0) << p.out;
  EXPECT_LT(r[0].gb(4), 84.0) << p.out;
  std::string mem = line_starting(p.out, "memory");
  EXPECT_TRUE(contains(mem, "DOES NOT FIT by ")) << mem;
  EXPECT_GT(number_after(mem, "DOES NOT FIT by "), 10.0) << mem;
  // Everything quantizable in int4 fits, with room for tens of thousands of tokens.
  const Proc all = inspect(kGlm5, kH100x8, "--quant int4 --quantize all");
  ASSERT_EQ(all.code, 0) << all.err;
  r = rows(all.out);
  ASSERT_EQ(r.size(), 8u) << all.out;
  EXPECT_GT(r[0].gb(4), 55.0) << all.out;
  EXPECT_LT(r[0].gb(4), 68.0) << all.out;
  EXPECT_GT(std::stoll(r[0].cols[7]), 50000) << all.out;
  EXPECT_TRUE(contains(r[0].cols[8], ":fits")) << all.out;
  mem = line_starting(all.out, "memory");
  EXPECT_TRUE(contains(mem, "of 80.0 GB device memory: fits")) << mem;
  EXPECT_TRUE(contains(line_starting(all.out, "precision"), "fast: gemm inputs rounded to bf16")) << all.out;
  // Smaller groups cost more scales, and so do F32 scales.
  const Proc g32 = inspect(kGlm5, kH100x8, "--quant int4 --quantize all --group-size 32");
  ASSERT_EQ(g32.code, 0) << g32.err;
  EXPECT_GT(rows(g32.out).at(0).gb(4), r[0].gb(4));
  const Proc f32s = inspect(kGlm5, kH100x8, "--quant int4 --quantize all --scale-dtype f32");
  ASSERT_EQ(f32s.code, 0) << f32s.err;
  EXPECT_TRUE(contains(f32s.out, "int4 g128 f32 scales")) << f32s.out;
  EXPECT_GT(rows(f32s.out).at(0).gb(4), r[0].gb(4));
}

TEST(Inspect, CpuConfigPrintsWeightsAndKvPerTokenOnly) {
  const Proc p = inspect(kGlm5, kSrc + "/cluster-configs/cpu-pp2-ep2.yaml");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_TRUE(contains(line_starting(p.out, "precision"), "exact: float32 activations")) << p.out;
  const auto r = rows(p.out);
  ASSERT_EQ(r.size(), 4u) << p.out;
  for (const Row& row : r) EXPECT_EQ(row.cols.size(), 6u) << p.out;
  EXPECT_EQ(line_starting(p.out, "memory"), "") << p.out;
  EXPECT_EQ(line_starting(p.out, "reserve"), "") << p.out;
  EXPECT_TRUE(contains(line_starting(p.out, "kv cache"),
                       "(f32: latent 576 values x 78 layers + indexer key 128 values x 78 layers with an indexer)"))
      << p.out;
}

// GLM-5.2's config (IndexShare): 21 of 78 layers keep index keys, so a token costs 93.00 KiB of bf16
// KV instead of GLM-5's 107.25 (BENCHMARKS.md).
TEST(Inspect, Glm52KvCacheCountsOnlyLayersWithAnIndexer) {
  const fs::path cfg = scratch("bf16-kv.yaml");
  std::ofstream(cfg) << "kv_dtype: bf16\n";
  const Proc p = inspect(kData + "/glm52-config", cfg.string());
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_TRUE(contains(line_starting(p.out, "kv cache"),
                       "93.00 KiB per token (bf16: latent 576 values x 78 layers + indexer key 128 values x 21 layers"))
      << p.out;
}

// A directory with config.json alone plans like the checkpoint itself (its index says BF16).
TEST(Inspect, ConfigJsonAloneIsEnough) {
  const fs::path dir = scratch("tiny-config-only/config.json").parent_path();
  fs::copy_file(kTinyA + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  const Proc alone = inspect(dir.string(), kSrc + "/cluster-configs/cpu-pp2-ep2.yaml");
  const Proc full = inspect(kTinyA, kSrc + "/cluster-configs/cpu-pp2-ep2.yaml");
  ASSERT_EQ(alone.code, 0) << alone.err;
  ASSERT_EQ(full.code, 0) << full.err;
  EXPECT_TRUE(contains(alone.out, "no index")) << alone.out;
  EXPECT_TRUE(contains(full.out, "model.safetensors.index.json")) << full.out;
  EXPECT_EQ(line_starting(alone.out, "stored"), line_starting(full.out, "stored"));
  const auto a = rows(alone.out), f = rows(full.out);
  ASSERT_EQ(a.size(), f.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].cols, f[i].cols);
  // The compressed-tensors twin: int4 g32 experts, from its index names.
  const Proc ct = inspect(kTinyCt, "");
  ASSERT_EQ(ct.code, 0) << ct.err;
  EXPECT_TRUE(contains(line_starting(ct.out, "stored"), "int4 g32 ")) << ct.out;
}

void expect_one_clear_error(const Proc& p, const std::vector<std::string>& words, int code) {
  EXPECT_EQ(p.code, code) << p.err;
  EXPECT_FALSE(p.signaled);
  size_t lines = 0;
  std::stringstream ss(p.err);
  for (std::string l; std::getline(ss, l);) lines += !l.empty();
  EXPECT_EQ(lines, 1u) << p.err;
  for (const std::string& w : words) EXPECT_TRUE(contains(p.err, w)) << "missing '" << w << "' in " << p.err;
  EXPECT_EQ(p.out, "") << "nothing is printed before the error";
}

TEST(Inspect, BadQuantIsOneClearError) {
  expect_one_clear_error(inspect(kGlm5, kH100x8, "--quant int3"),
                         {"glm5: error: --quant", "int4, int8, fp8, bf16 or f32", "'int3'"}, 1);
  expect_one_clear_error(inspect(kGlm5, kH100x8, "--quant int4 --quantize experts,router"),
                         {"glm5: error: --quantize", "'router'"}, 1);
  expect_one_clear_error(inspect(kGlm5, kH100x8, "--quant int4 --group-size 48"), {"glm5: error: --group-size", "48"},
                         1);
  // --quantize / --group-size without --quant: a usage error.
  const Proc p = inspect(kGlm5, kH100x8, "--quantize all");
  EXPECT_EQ(p.code, 2) << p.err;
  EXPECT_TRUE(contains(p.err, "--quant")) << p.err;
}

// ---------------------------------------------------------------------------------------------
// The plan against the loader: a backend that counts what the model uploads.

class CountingBackend final : public glm5::kernels::Backend {
 public:
  size_t uploaded = 0;
  std::string name() const override { return "counting"; }
  void* alloc(size_t b) override { return cpu_->alloc(b); }
  void free(void* p) override { cpu_->free(p); }
  void to_device(void* d, const void* s, size_t b) override { cpu_->to_device(d, s, b); }
  void to_host(void* d, const void* s, size_t b) override { cpu_->to_host(d, s, b); }
  const void* upload(const void* h, size_t b) override {
    uploaded += b;
    return cpu_->upload(h, b);
  }
#define FORWARD(op, P) \
  void op(const glm5::kernels::P& p) override { cpu_->op(p); }
  FORWARD(gemm, GemmParams)
  FORWARD(rms_norm, RmsNormParams)
  FORWARD(layer_norm, LayerNormParams)
  FORWARD(rope, RopeParams)
  FORWARD(indexer_scores, IndexerScoresParams)
  FORWARD(topk, TopkParams)
  FORWARD(mla_prefill, MlaPrefillParams)
  FORWARD(mla_decode, MlaDecodeParams)
  FORWARD(router, RouterParams)
  FORWARD(swiglu, SwigluParams)
  FORWARD(embedding, EmbeddingParams)
  FORWARD(gather_rows, GatherRowsParams)
  FORWARD(moe_combine, MoeCombineParams)
  FORWARD(add, AddParams)
  FORWARD(copy_2d, Copy2dParams)
  FORWARD(paged_write, PagedWriteParams)
#undef FORWARD

 private:
  std::unique_ptr<glm5::kernels::Backend> cpu_ = glm5::kernels::make_cpu_backend();
};

// Bytes the loader uploads for `shard`, less the RoPE table (not a weight).
size_t loaded_bytes(const std::string& dir, const glm5::runtime::ModelShard& shard) {
  const glm5::runtime::ModelConfig cfg = glm5::runtime::load_config(dir);
  glm5::runtime::Checkpoint ckpt(dir);
  CountingBackend be;
  auto stage = glm5::parallel::make_self_comm();
  glm5::runtime::Model model(cfg, ckpt, be, shard, *stage);
  return be.uploaded - size_t(cfg.qk_rope_head_dim / 2) * sizeof(float);
}

std::vector<glm5::runtime::ModelShard> shards_of(const glm5::runtime::ModelConfig& cfg) {
  const int L = int(cfg.num_hidden_layers);
  std::vector<glm5::runtime::ModelShard> s;
  s.push_back({0, L, true, true, 1, 0});   // the whole model
  s.push_back({0, 1, true, false, 2, 0});  // stage 0 of 2, column 0 of 2
  s.push_back({1, L, false, true, 2, 1});  // last stage, column 1 of 2
  if (L >= 3 && cfg.n_routed_experts % 4 == 0) s.push_back({1, L - 1, false, false, 4, 3});  // middle, column 3 of 4
  return s;
}

void expect_plan_matches_loader(const std::string& dir, const glm5::runtime::QuantPlan* plan = nullptr) {
  SCOPED_TRACE(dir);
  const glm5::runtime::ModelConfig cfg = glm5::runtime::load_config(dir);
  const glm5::runtime::WeightPlan wp = glm5::runtime::plan_weights(cfg, dir, plan);
  EXPECT_TRUE(wp.from_index);
  EXPECT_EQ(wp.missing, 0u) << wp.first_missing;
  for (const auto& shard : shards_of(cfg)) {
    SCOPED_TRACE("layers " + std::to_string(shard.first_layer) + "-" + std::to_string(shard.last_layer) + " column " +
                 std::to_string(shard.column) + " of " + std::to_string(shard.expert_parallel));
    EXPECT_EQ(glm5::runtime::shard_weight_bytes(wp, cfg, shard), loaded_bytes(dir, shard));
  }
}

TEST(MemoryPlan, MatchesWhatTheLoaderUploadsBf16) {
  for (const char* m : {"tiny-a", "tiny-b", "tiny-moe", "tiny-v32", "real-dims"})
    expect_plan_matches_loader(kData + "/" + m);
}

// tie_word_embeddings: the last stage uploads the embedding matrix again as lm_head.
TEST(MemoryPlan, MatchesWhatTheLoaderUploadsTied) {
  const fs::path dir = scratch("tied/config.json").parent_path();
  json cfg = json::parse(slurp(kTinyA + "/config.json"));
  cfg["tie_word_embeddings"] = true;
  std::ofstream(dir / "config.json") << cfg.dump(1);
  for (const auto& e : fs::directory_iterator(kTinyA)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".safetensors") && n.starts_with("model") && !fs::exists(dir / n))
      fs::create_symlink(e.path(), dir / n);
  }
  fs::copy_file(kTinyA + "/model.safetensors.index.json", dir / "model.safetensors.index.json",
                fs::copy_options::overwrite_existing);
  const glm5::runtime::WeightPlan wp =
      glm5::runtime::plan_weights(glm5::runtime::load_config(dir.string()), dir.string());
  EXPECT_GT(wp.tied_head_bytes, 0u);
  expect_plan_matches_loader(dir.string());
}

TEST(MemoryPlan, MatchesWhatTheLoaderUploadsInt4) {
  const glm5::runtime::ModelConfig cfg = glm5::runtime::load_config(kTinyCt);
  const glm5::runtime::WeightPlan wp = glm5::runtime::plan_weights(cfg, kTinyCt);
  size_t q4 = 0;
  for (const auto& f : wp.stored) q4 += f.dtype == glm5::DType::Q4 && f.group == 32;
  EXPECT_EQ(q4, 3u * 16 * 3 + 3u * 3);  // layers 1-3: 16 experts x 3 + shared x 3
  expect_plan_matches_loader(kTinyCt);
}

// An FP8 conversion of tiny-a: the --quant plan of the source, the index names of the output and
// the loader's uploads of the output agree (kv_b_proj held dequantized included).
TEST(MemoryPlan, MatchesWhatTheLoaderUploadsFp8) {
  const fs::path out = scratch("tiny-a-fp8");
  const std::string roles = "experts,shared,dense,attention,indexer";
  const Proc conv = run(kBin + " convert --no-progress --model " + kTinyA + " --out " + out.string() +
                        " --quant fp8 --quantize " + roles);
  ASSERT_EQ(conv.code, 0) << conv.err;
  expect_plan_matches_loader(out.string());
  const glm5::runtime::ModelConfig cfg = glm5::runtime::load_config(kTinyA);
  const glm5::runtime::QuantPlan plan = glm5::runtime::parse_quant_plan("fp8", 128, roles);
  const glm5::runtime::WeightPlan planned = glm5::runtime::plan_weights(cfg, kTinyA, &plan);
  const glm5::runtime::WeightPlan written =
      glm5::runtime::plan_weights(glm5::runtime::load_config(out.string()), out.string());
  ASSERT_EQ(planned.stored.size(), written.stored.size());
  for (size_t i = 0; i < planned.stored.size(); ++i) {
    EXPECT_EQ(glm5::runtime::form_name(planned.stored[i]), glm5::runtime::form_name(written.stored[i]))
        << planned.tensors[i].name;
    EXPECT_EQ(planned.resident[i], written.resident[i]) << planned.tensors[i].name;
  }
  EXPECT_GT(planned.dequantized_f32, 0u);
}

// An int8 conversion with F32 scales: the plan reads the scales' dtype from a shard header and
// counts them (and kv_b_proj's dequantized copies, F32 then) as the loader uploads them.
TEST(MemoryPlan, MatchesWhatTheLoaderUploadsF32Scales) {
  const fs::path out = scratch("tiny-a-int8-f32s");
  const Proc conv = run(kBin + " convert --no-progress --model " + kTinyA + " --out " + out.string() +
                        " --quant int8 --group-size 32 --quantize all --scale-dtype f32");
  ASSERT_EQ(conv.code, 0) << conv.err;
  expect_plan_matches_loader(out.string());
  const glm5::runtime::WeightPlan wp =
      glm5::runtime::plan_weights(glm5::runtime::load_config(out.string()), out.string());
  size_t f32s = 0;
  for (const auto& f : wp.stored) f32s += f.dtype == glm5::DType::Q8 && f.scale_dtype == glm5::DType::F32;
  EXPECT_GT(f32s, 10u);
  EXPECT_GT(wp.dequantized_f32, 0u);
}

TEST(MemoryPlan, ResidentRules) {
  using glm5::DType;
  using glm5::runtime::resident_bytes;
  using glm5::runtime::Role;
  const glm5::runtime::TensorSpec kvb{
      "model.layers.3.self_attn.kv_b_proj.weight", {28672, 512}, 3, -1, Role::Attention};
  EXPECT_EQ(resident_bytes(kvb, {DType::BF16, 0}), 28672u * 512 * 2);
  EXPECT_EQ(resident_bytes(kvb, {DType::F8_E4M3, 128}), 28672u * 512 * 4);  // dequantized
  EXPECT_EQ(resident_bytes(kvb, {DType::Q4, 128}), 28672u * 512 * 2);       // dequantized, bf16-exact
  const glm5::runtime::TensorSpec q_b{
      "model.layers.3.self_attn.q_b_proj.weight", {16384, 2048}, 3, -1, Role::Attention};
  EXPECT_EQ(resident_bytes(q_b, {DType::F8_E4M3, 128}), 16384u * 2048 + 128u * 16 * 4);
  const glm5::runtime::TensorSpec kva{
      "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", {576, 6144}, 3, -1, Role::Attention};
  EXPECT_EQ(resident_bytes(kva, {DType::F8_E4M3, 128}), 576u * 6144 + 5u * 48 * 4);  // partial edge block
  const glm5::runtime::TensorSpec up{"model.layers.3.mlp.experts.7.up_proj.weight", {2048, 6144}, 3, 7, Role::Expert};
  EXPECT_EQ(resident_bytes(up, {DType::Q4, 128}), 2048u * 6144 / 2 + 2048u * 48 * 2);
  EXPECT_EQ(resident_bytes(up, {DType::Q8, 32}), 2048u * 6144 + 2048u * 192 * 2);
  EXPECT_EQ(resident_bytes(up, {DType::Q8, 32, DType::F32}), 2048u * 6144 + 2048u * 192 * 4);  // F32 scales
  EXPECT_EQ(resident_bytes(kvb, {DType::Q8, 128, DType::F32}), 28672u * 512 * 4);  // dequantized, F32 values
  const glm5::runtime::TensorSpec wp{
      "model.layers.3.self_attn.indexer.weights_proj.weight", {32, 6144}, 3, -1, Role::IndexerWeights};
  EXPECT_EQ(resident_bytes(wp, {DType::BF16, 0}), 32u * 6144 * 4);
  const glm5::runtime::TensorSpec norm{"model.norm.weight", {6144}, -1, -1, Role::Norm};
  EXPECT_EQ(resident_bytes(norm, {DType::BF16, 0}), 6144u * 4);
  const glm5::runtime::TensorSpec emb{"model.embed_tokens.weight", {154880, 6144}, -1, -1, Role::Embedding};
  EXPECT_EQ(resident_bytes(emb, {DType::BF16, 0}), 154880u * 6144 * 2);
  EXPECT_EQ(resident_bytes(emb, {DType::F8_E4M3, 128}), 154880u * 6144 * 4);
}

// With an index, names decide: <name>_scale_inv -> FP8, <name>_packed -> int (bits from the
// config); a pack-quantized name without a compressed-tensors config is an error naming both.
TEST(MemoryPlan, IndexNamesDecideTheStoredForm) {
  const fs::path dir = scratch("names/config.json").parent_path();
  fs::copy_file(kTinyA + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  json index = json::parse(slurp(kTinyA + "/model.safetensors.index.json"));
  index["weight_map"]["model.layers.1.self_attn.o_proj.weight_scale_inv"] = "x.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  const glm5::runtime::ModelConfig cfg = glm5::runtime::load_config(dir.string());
  glm5::runtime::WeightPlan wp = glm5::runtime::plan_weights(cfg, dir.string());
  size_t fp8 = 0;
  for (size_t i = 0; i < wp.tensors.size(); ++i)
    if (wp.stored[i].dtype == glm5::DType::F8_E4M3) {
      ++fp8;
      EXPECT_EQ(wp.tensors[i].name, "model.layers.1.self_attn.o_proj.weight");
    }
  EXPECT_EQ(fp8, 1u);
  index["weight_map"].erase("model.layers.2.self_attn.q_a_proj.weight");
  index["weight_map"]["model.layers.2.self_attn.q_a_proj.weight_packed"] = "x.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  glm5::testing::expect_error(
      [&] { glm5::runtime::plan_weights(cfg, dir.string()); },
      {"model.safetensors.index.json", "q_a_proj.weight_packed", "no compressed-tensors quantization_config"});
  index["weight_map"].erase("model.layers.2.self_attn.q_a_proj.weight_packed");
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  wp = glm5::runtime::plan_weights(cfg, dir.string());
  EXPECT_EQ(wp.missing, 1u);
  EXPECT_EQ(wp.first_missing, "model.layers.2.self_attn.q_a_proj.weight");
}

// ---------------------------------------------------------------------------------------------
// GPU binding.

glm5::launcher::GpuBindingEnv env_of(const std::map<std::string, std::string>& vars, int visible) {
  auto e = glm5::launcher::read_gpu_binding_env(
      [&](const char* name) -> const char* {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
      },
      false);
  e.visible_devices = visible;
  return e;
}

TEST(GpuBinding, LocalRankPicksTheDevice) {
  using glm5::launcher::cuda_device_for;
  EXPECT_EQ(cuda_device_for(env_of({}, 8)), 0);  // one process
  EXPECT_EQ(cuda_device_for(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "5"}}, 8)), 5);
  EXPECT_EQ(cuda_device_for(env_of({{"MPI_LOCALRANKID", "3"}}, 4)), 3);
  EXPECT_EQ(cuda_device_for(env_of({{"SLURM_LOCALID", "1"}}, 2)), 1);
  // Open MPI's variable wins over the others.
  auto e = env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"SLURM_LOCALID", "7"}}, 8);
  EXPECT_EQ(e.local_rank_from, "OMPI_COMM_WORLD_LOCAL_RANK");
  EXPECT_EQ(cuda_device_for(e), 2);
  // CUDA_VISIBLE_DEVICES is applied by the driver: the index is relative to what it shows.
  EXPECT_EQ(cuda_device_for(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"CUDA_VISIBLE_DEVICES", "4,5"}}, 2)), 1);
  // Unknown device count (no driver): the local rank; the backend reports what it finds.
  EXPECT_EQ(cuda_device_for(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}}, -1)), 3);
  // An explicit choice.
  EXPECT_EQ(cuda_device_for(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"GLM5_CUDA_DEVICE", "0"}}, 1)), 0);
}

TEST(GpuBinding, MoreLocalRanksThanDevicesIsAnError) {
  using glm5::launcher::cuda_device_for;
  glm5::testing::expect_error(
      [] {
        cuda_device_for(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"CUDA_VISIBLE_DEVICES", "0,1"}}, 2));
      },
      {"local rank 2", "OMPI_COMM_WORLD_LOCAL_RANK", "shows 2 device(s)", "CUDA_VISIBLE_DEVICES=0,1",
       "GLM5_CUDA_DEVICE"});
  glm5::testing::expect_error(
      [] {
        cuda_device_for(env_of({{"SLURM_LOCALID", "8"}}, 8));
      },
      {"local rank 8", "SLURM_LOCALID", "shows 8 device(s)", "CUDA_VISIBLE_DEVICES unset"});
  glm5::testing::expect_error(
      [] {
        cuda_device_for(env_of({{"GLM5_CUDA_DEVICE", "2"}}, 2));
      },
      {"GLM5_CUDA_DEVICE=2", "shows 2 device(s)"});
  glm5::testing::expect_error(
      [] {
        cuda_device_for(env_of({{"GLM5_CUDA_DEVICE", "gpu1"}}, 2));
      },
      {"GLM5_CUDA_DEVICE", "'gpu1'"});
  glm5::testing::expect_error(
      [] {
        env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "-1"}}, 2);
      },
      {"OMPI_COMM_WORLD_LOCAL_RANK", "'-1'"});
}

}  // namespace

// glm5 simulate: the workload and hardware parsers, the cost model's phase rules (naive vs
// absorbed attention, when the indexer runs, routed-expert bytes), the scheduler replay (ticks a
// workload takes, exactly), how the prediction responds to bandwidth, micro-batches and expert
// parallelism, and the command line (tables, JSON, errors, --calibrate).
#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "launcher/cluster/cluster_config.h"
#include "launcher/simulate/hardware.h"
#include "launcher/simulate/sim_cost.h"
#include "launcher/simulate/sim_schedule.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/memory_plan.h"
#include "tests/test_support.h"

namespace glm5::launcher {
namespace {

using namespace glm5::testing;
namespace fs = std::filesystem;

const ScratchDir scratch("glm5_simulate");
const std::string kMoe = kData + "/tiny-moe";

// A GPU-like rank with round numbers: no host sharing, no call overhead unless asked.
Hardware flat_hardware(double bw = 1e12, double flops = 1e15) {
  Hardware hw;
  hw.name = "test";
  hw.kind = "gpu";
  hw.devices_per_node = 8;
  hw.memory_gb = 80;
  hw.gemm_flops = hw.attention_flops = flops;
  hw.mem_bw_core = hw.mem_bw = bw;
  hw.topk_rate = 1e15;
  hw.intra_node_bw = hw.inter_node_bw = 1e15;
  return hw;
}

struct Sim {
  runtime::ModelConfig cfg = runtime::load_config(kMoe);
  runtime::WeightPlan plan = runtime::plan_weights(cfg, kMoe);
  ClusterConfig cc = default_cluster_config();
  Hardware hw = flat_hardware();
  std::vector<double> acceptance;  // with cc.speculative_tokens
  Prediction run(const std::string& workload, std::vector<std::vector<double>> share = {}) {
    cc.backend = hw.gpu() ? "cuda" : "cpu";
    const StepCost cost(cfg, plan, cc.expert_parallel, std::move(share));
    const SimSetup s{.cfg = &cfg,
                     .cluster = &cc,
                     .stages = plan_stages(cc, cfg, cc.world_size()),
                     .hw = &hw,
                     .cost = &cost,
                     .work = parse_workload(workload),
                     .acceptance = acceptance};
    return simulate_run(s);
  }
};

TEST(Simulate, WorkloadParsing) {
  const Workload w = parse_workload("prompts=64,in=2048,out=512,prefix=1024");
  EXPECT_EQ(w.prompts, 64);
  EXPECT_EQ(w.in, 2048);
  EXPECT_EQ(w.out, 512);
  EXPECT_EQ(w.prefix, 1024);
  expect_error([] { parse_workload("prompts=4,in=8"); }, {"prompts, in and out are required"});
  expect_error([] { parse_workload("prompts=4,in=x8,out=2"); }, {"field 'in'", "whole number", "'x8'"});
  expect_error([] { parse_workload("prompts=4,in=8,out=2,batch=3"); }, {"unknown field 'batch'"});
  expect_error([] { parse_workload("prompts=4,in=8,out=2,prefix=9"); }, {"prefix (9) must be <= in (8)"});
  expect_error([] { parse_workload("prompts=0,in=8,out=2"); }, {"must be >= 1"});
}

TEST(Simulate, HardwareFiles) {
  for (const char* f : {"h100-sxm.yaml", "h200-sxm.yaml"}) {
    const Hardware hw = load_hardware(kSrc + "/cluster-configs/hardware/" + f);
    EXPECT_TRUE(hw.gpu());
    EXPECT_EQ(hw.devices_per_node, 8);
    EXPECT_DOUBLE_EQ(hw.gemm_flops, 989e12);
    EXPECT_DOUBLE_EQ(hw.intra_node_bw, 450e9);
    EXPECT_DOUBLE_EQ(hw.inter_node_bw, 50e9);
  }
  EXPECT_DOUBLE_EQ(load_hardware(kSrc + "/cluster-configs/hardware/h200-sxm.yaml").mem_bw, 4.8e12);
  const Hardware h100 = load_hardware(kSrc + "/cluster-configs/hardware/h100-sxm.yaml");
  EXPECT_DOUBLE_EQ(h100.mem_bw, 3.35e12);
  EXPECT_DOUBLE_EQ(h100.op_overhead_s, 4e-6);
  // What hardware_yaml writes reads back to the same rates.
  const Hardware again = parse_hardware(hardware_yaml(h100, "a comment"), "round trip");
  EXPECT_EQ(again.name, h100.name);
  EXPECT_NEAR(again.gemm_efficiency, h100.gemm_efficiency, 1e-12);
  EXPECT_NEAR(again.op_overhead_s, h100.op_overhead_s, 1e-12);
  // A name with quotes, '#' and a backslash writes back as the same name (found by fuzzing: it was
  // written between bare quotes).
  Hardware odd = h100;
  odd.name = "V\"NIDIA # H100 \\ 80GB";
  EXPECT_EQ(parse_hardware(hardware_yaml(odd, ""), "odd name").name, odd.name);
  // A name with control characters or invalid UTF-8 is refused (found by fuzzing: one with a byte
  // 0x9f did not write back as itself).
  expect_error([] { parse_hardware("name: \"a\\tb\"\nkind: cpu\n", "f.yaml"); }, {"key 'name'", "printable UTF-8"});
  expect_error([] { parse_hardware("name: \"a\x9f\"\nkind: cpu\n", "f.yaml"); }, {"key 'name'", "printable UTF-8"});
  // A key that is not a name (a YAML complex key) is refused as such (found by fuzzing: yaml-cpp's
  // bad-conversion exception escaped).
  expect_error([] { parse_hardware("? {a: 1}\n: 2\nname: x\n", "f.yaml"); }, {"f.yaml", "(top level)", "a key name"});
  const std::string text = slurp(kSrc + "/cluster-configs/hardware/h100-sxm.yaml");
  expect_error([&] { parse_hardware(text + "gemm_flop: 3\n", "f.yaml"); },
               {"f.yaml", "'gemm_flop'", "one of the keys"});
  expect_error([&] { parse_hardware("name: x\nkind: tpu\n", "f.yaml"); }, {"key 'kind'", "cpu or gpu", "'tpu'"});
  std::string no_bw = text;
  const size_t at = no_bw.find("\nmem_bw: ");
  no_bw.erase(at, no_bw.find('\n', at + 1) - at);
  expect_error([&] { parse_hardware(no_bw, "f.yaml"); }, {"key 'mem_bw'", "the key is missing"});
  std::string bad_eff = text;
  bad_eff.replace(bad_eff.find("gemm_efficiency: 0.75"), 21, "gemm_efficiency: 1.5");
  expect_error([&] { parse_hardware(bad_eff, "f.yaml"); }, {"gemm_efficiency", "(0, 1]"});
  expect_error([] { load_hardware("/nonexistent/hw.yaml"); }, {"/nonexistent/hw.yaml", "cannot open"});
  // glm5's own kernels as measured (the `glm5:` map) beside the published kernels' efficiencies.
  const Hardware h200 = load_hardware(kSrc + "/cluster-configs/hardware/h200-sxm.yaml");
  ASSERT_TRUE(h200.has_measured);
  EXPECT_TRUE(contains(h200.measured.by, "H200"));
  const Hardware ours = h200.as_measured();
  EXPECT_DOUBLE_EQ(ours.gemm_efficiency, 0.263);
  EXPECT_DOUBLE_EQ(ours.exact_gemm_cost, 1.70);  // (measured: exact's three terms took 1.70x one term's time)
  EXPECT_DOUBLE_EQ(h200.exact_gemm_cost, 3);     // (published kernels: three times the tensor-core work)
  EXPECT_DOUBLE_EQ(ours.attention_mem_eff(), 0.008);
  EXPECT_DOUBLE_EQ(h200.gemm_efficiency, 0.75);
  EXPECT_DOUBLE_EQ(h200.attention_mem_eff(), 0.9);                   // (mem_bw_efficiency when not given)
  const std::string top = text.substr(0, text.find("\nglm5:") + 1);  // the file without its glm5 map
  EXPECT_FALSE(parse_hardware(top, "f.yaml").has_measured);
  expect_error([&] { parse_hardware(top + "glm5: {measured_by: x, gemm_eff: 0.1}\n", "f.yaml"); },
               {"f.yaml", "glm5.gemm_eff", "one of measured_by"});
  expect_error([&] { parse_hardware(top + "glm5: {gemm_efficiency: 0.1}\n", "f.yaml"); }, {"glm5.measured_by"});
  expect_error([&] { parse_hardware(top + "glm5: {measured_by: x, gemm_efficiency: 2}\n", "f.yaml"); },
               {"glm5.gemm_efficiency", "(0, 1]"});
  expect_error([&] { parse_hardware(top + "glm5: {? [1]: 2}\n", "f.yaml"); }, {"f.yaml", "key 'glm5'", "a key name"});
}

// By default simulate predicts glm5 as its kernels were measured; the published kernels are a
// labelled what-if that predicts more.
TEST(Simulate, GpuPredictionsUseGlm5sMeasuredKernelsUnlessAskedForTheWhatIf) {
  // GLM-5-FP8 on 8 GPUs (a tiny model would be bound by launch overheads either way).
  const std::string cmd = kBin + " simulate --model " + kData + "/glm5-fp8-config --cluster " + kSrc +
                          "/cluster-configs/h100x8.yaml --workload prompts=8,in=128,out=4 --hardware " + kSrc +
                          "/cluster-configs/hardware/h200-sxm.yaml --json ";
  Proc ours = run_captured(cmd + scratch("ours.json").string(), scratch("o5"), scratch("e5"));
  ASSERT_EQ(ours.code, 0) << ours.err;
  EXPECT_TRUE(contains(ours.out, "kernels    glm5's, at the efficiencies measured by")) << ours.out;
  Proc what_if =
      run_captured(cmd + scratch("pub.json").string() + " --published-kernels", scratch("o6"), scratch("e6"));
  ASSERT_EQ(what_if.code, 0) << what_if.err;
  EXPECT_TRUE(contains(what_if.out, "what-if    kernels at the best published efficiencies")) << what_if.out;
  const auto a = nlohmann::json::parse(slurp(scratch("ours.json"))),
             b = nlohmann::json::parse(slurp(scratch("pub.json")));
  EXPECT_EQ(a.at("kernels"), "glm5 measured");
  EXPECT_EQ(b.at("kernels"), "published what-if");
  EXPECT_GT(b.at("generated_tokens_per_s").get<double>(), 2 * a.at("generated_tokens_per_s").get<double>());
}

// The precision: exact GEMMs cost exact_gemm_cost times fast's (a prediction with the same kernels
// otherwise); the output names the mode.
TEST(Simulate, PrecisionExactCostsMoreGemmTimeThanFast) {
  std::string yaml = slurp(kSrc + "/cluster-configs/h100x8.yaml");
  ASSERT_TRUE(contains(yaml, "precision: fast"));
  const fs::path exact_cfg = scratch("h100x8-exact.yaml");
  std::ofstream(exact_cfg) << yaml.replace(yaml.find("precision: fast"), 15, "precision: exact");
  const auto run = [&](const std::string& cluster, const std::string& tag) {
    const std::string cmd = kBin + " simulate --model " + kData + "/glm5-fp8-config --cluster " + cluster +
                            " --workload prompts=64,in=2048,out=4 --hardware " + kSrc +
                            "/cluster-configs/hardware/h200-sxm.yaml --json " + scratch(tag + ".json").string();
    Proc p = run_captured(cmd, scratch(tag + ".o"), scratch(tag + ".e"));
    EXPECT_EQ(p.code, 0) << p.err;
    EXPECT_TRUE(contains(p.out, "precision  " + tag)) << p.out;
    return nlohmann::json::parse(slurp(scratch(tag + ".json")));
  };
  const auto fast = run(kSrc + "/cluster-configs/h100x8.yaml", "fast"), exact = run(exact_cfg.string(), "exact");
  EXPECT_EQ(fast.at("precision"), "fast");
  EXPECT_EQ(exact.at("precision"), "exact");
  EXPECT_GT(fast.at("generated_tokens_per_s").get<double>(), exact.at("generated_tokens_per_s").get<double>());
  expect_error([] { parse_hardware("name: x\nkind: gpu\nexact_gemm_cost: 0.5\n", "f.yaml"); }, {"f.yaml"});
}

TEST(Simulate, CostModelPhases) {
  Sim s;
  const StepCost cost(s.cfg, s.plan, 1);
  Rates r;  // memory at 1e12 B/s, compute too fast to count: seconds x 1e12 read as bytes
  r.gemm_flops = r.gemm_flops_small = r.attention_flops = r.topk_rate = 1e30;
  r.mem_bw = 1e12;
  const int64_t topk = s.cfg.index_topk;  // 16 on tiny-moe
  // Prompt rows below index_topk attend naively; no indexer while every span fits in top-k.
  PhaseTimes t;
  cost.attention(1, {{0, topk, 4 * topk, false}}, r, t);
  EXPECT_GT(t["attention_naive"], 0);
  EXPECT_EQ(t.count("indexer_scores"), 0u);
  EXPECT_EQ(t.count("attention"), 0u);
  // The chunk's rows past index_topk take the absorbed form with the indexer and top-k.
  t.clear();
  cost.attention(1, {{topk, 2 * topk, 4 * topk, false}}, r, t);
  EXPECT_EQ(t.count("attention_naive"), 0u);
  EXPECT_GT(t["indexer_scores"], 0);
  EXPECT_GT(t["topk"], 0);
  EXPECT_GT(t["attention"], 0);
  // A decode row reads its sequence's keys: the indexer's cost grows with the context, the
  // attention's stops growing at index_topk.
  PhaseTimes a, b;
  cost.attention(1, {{10 * topk, 1, 8, true}}, r, a);
  cost.attention(1, {{100 * topk, 1, 8, true}}, r, b);
  EXPECT_GT(b["indexer_scores"], 5 * a["indexer_scores"]);
  EXPECT_GT(b["topk"], 0);
  EXPECT_NEAR(b["attention"], a["attention"], 1e-12);
  // Projections of one row stream exactly their weights (plus the row's activations).
  double w = 0;
  for (size_t i = 0; i < s.plan.tensors.size(); ++i)
    for (const char* n : {"q_a_proj", "kv_a_proj_with_mqa", "indexer.wk.", "weights_proj", "q_b_proj", "indexer.wq_b"})
      if (s.plan.tensors[i].layer == 1 && contains(s.plan.tensors[i].name, n)) w += double(s.plan.resident[i]);
  EXPECT_GT(a["projections"] * 1e12, w);
  EXPECT_LT(a["projections"] * 1e12, w * 1.1);
  // Routed experts: one row activates k experts' bytes; many rows all experts'.
  const double one = cost.active_expert_bytes(1, 0, 1), all = cost.active_expert_bytes(1, 0, 100000);
  EXPECT_NEAR(one / all, double(s.cfg.num_experts_per_tok) / double(s.cfg.n_routed_experts), 1e-9);
  // Routing statistics move the picks: everything on expert 0 -> column 0 of 2 gets all of them.
  std::vector<std::vector<double>> share(size_t(s.cfg.num_hidden_layers));
  share[1].assign(size_t(s.cfg.n_routed_experts), 0.0);
  share[1][0] = 1.0;
  const StepCost skewed(s.cfg, s.plan, 2, share);
  EXPECT_DOUBLE_EQ(skewed.expert_picks(1, 0, 10), 10.0 * double(s.cfg.num_experts_per_tok));
  EXPECT_DOUBLE_EQ(skewed.expert_picks(1, 1, 10), 0.0);
  EXPECT_DOUBLE_EQ(StepCost(s.cfg, s.plan, 2).expert_picks(1, 1, 10), 5.0 * double(s.cfg.num_experts_per_tok));
  EXPECT_EQ(StepCost(s.cfg, s.plan, 1).exchange_bytes(100).total(), 0.0);
  const StepCost::ExchangeBytes two = StepCost(s.cfg, s.plan, 2).exchange_bytes(100);
  EXPECT_GT(two.payload, 100.0 * double(s.cfg.hidden_size) * 4);
  // The plan: one 32-byte header to the other rank and an 8-byte entry per remote slot (half of
  // the 100 x k slots on two ranks, uniform routing).
  EXPECT_DOUBLE_EQ(two.plan, 32.0 + 8.0 * 100 * double(s.cfg.num_experts_per_tok) / 2);
}

// A phase costs sqrt(compute^2 + memory^2) plus its calls; small GEMMs run at the small-GEMM rate.
TEST(Simulate, RooflineOfOnePhase) {
  Rates r;
  r.gemm_flops = 4e12;
  r.gemm_flops_small = 1e12;
  r.mem_bw = 1e12;
  r.op_overhead_s = 1e-6;
  Work w;
  w.flops = 3e12;
  w.bytes = 4e12;
  w.calls = 2;
  EXPECT_NEAR(w.seconds(r), std::sqrt(0.75 * 0.75 + 16.0) + 2e-6, 1e-9);  // 256 rows: the large rate
  w.rows = 16;
  EXPECT_NEAR(w.seconds(r), 5.0 + 2e-6, 1e-9);  // 3 s of compute at the small rate, 4 s of memory
  w.rows = 64;                                  // halfway (geometrically): 2e12 FLOP/s
  EXPECT_NEAR(w.seconds(r), std::sqrt(1.5 * 1.5 + 16.0) + 2e-6, 1e-9);
}

// GLM-5.2's IndexShare (tiny-glm52: layers 3-5 and 7 share): a shared layer costs no indexer scores,
// no top-k and no index keys; its attention reads the same keys as its donor's.
TEST(Simulate, SharedIndexerLayersCostNoIndexerWork) {
  const runtime::ModelConfig cfg = runtime::load_config(kData + "/tiny-glm52");
  const runtime::WeightPlan plan = runtime::plan_weights(cfg, kData + "/tiny-glm52");
  const StepCost cost(cfg, plan, 1);
  Rates r;
  r.gemm_flops = r.gemm_flops_small = r.attention_flops = r.topk_rate = 1e12;
  r.mem_bw = 1e12;
  const std::vector<SimSeq> decode{{1000, 1, 8, true}};
  PhaseTimes full, shared;
  cost.attention(2, decode, r, full);
  cost.attention(3, decode, r, shared);
  EXPECT_GT(full["indexer_scores"], 0);
  EXPECT_GT(full["topk"], 0);
  EXPECT_EQ(shared.count("indexer_scores"), 0u);
  EXPECT_EQ(shared.count("topk"), 0u);
  EXPECT_NEAR(shared["attention"], full["attention"], 1e-15);
  EXPECT_LT(shared["projections"], full["projections"]);
  EXPECT_LT(shared["kv_write"], full["kv_write"]);
}

// The replay takes the ticks the scheduler's rules give (runtime/scheduler.h), counted by hand.
TEST(Simulate, ReplayCountsTicks) {
  Sim s;
  Prediction p = s.run("prompts=8,in=20,out=5");  // one prefill step, then 4 decode steps
  EXPECT_EQ(p.generated, 40);
  EXPECT_EQ(p.ticks, 5);
  s.cc.max_batch = 1;  // one sequence at a time
  p = s.run("prompts=3,in=20,out=5");
  EXPECT_EQ(p.ticks, 15);
  s.cc.max_batch = 64;
  s.cc.prefill_chunk = 8;  // prompt chunks of 8, 8, 4, then the first token comes back
  p = s.run("prompts=1,in=20,out=5");
  EXPECT_EQ(p.ticks, 3 + 4);
  s.cc.prefill_chunk = 256;
  s.cc.max_step_tokens = 64;  // 8 prompts of 20 = 160 rows: 3 steps of prefill (64 + 64 + 32)
  p = s.run("prompts=8,in=20,out=1");
  EXPECT_EQ(p.ticks, 3);
  s.cc.max_step_tokens = 8192;
  s.cc.expert_parallel = 2;  // two columns share the prompts: still one prefill + 4 decode ticks
  p = s.run("prompts=8,in=20,out=5");
  EXPECT_EQ(p.generated, 40);
  EXPECT_EQ(p.ticks, 5);
  EXPECT_GT(p.exchange_bytes_per_layer, 0);
  EXPECT_GT(p.exchange_plan_bytes_per_layer, 0);
  EXPECT_LT(p.exchange_plan_bytes_per_layer, p.exchange_bytes_per_layer / 4);  // rows dominate
}

// Speculative decoding: a decode step yields 1 + the drafts the acceptance model accepts, and the
// MTP layer's work is charged to the last stage.
TEST(Simulate, SpeculativeDecodingFollowsTheAcceptanceModel) {
  Sim s;
  s.hw = flat_hardware(1e11);  // decode reads weights: memory-bound, as on a GPU
  const Prediction plain = s.run("prompts=1,in=20,out=13");
  EXPECT_EQ(plain.ticks, 13);
  s.cc.speculative_tokens = 3;
  s.cc.speculative_max_batch = 64;
  s.acceptance = {1, 1, 1};  // every draft accepted: the first token, then 4 per step
  const Prediction all = s.run("prompts=1,in=20,out=13");
  EXPECT_EQ(all.generated, 13);
  EXPECT_EQ(all.ticks, 1 + 3);
  EXPECT_GT(all.decode_per_s, 1.3 * plain.decode_per_s);  // 4 tokens a step, for 4 rows (more experts) and 3 MTP passes
  EXPECT_GT(all.stages.back().phases.count("mtp_experts"), 0u);
  s.acceptance = {0, 0, 0};  // none: one token per step, and the drafting costs time
  const Prediction none = s.run("prompts=1,in=20,out=13");
  EXPECT_EQ(none.generated, 13);
  EXPECT_EQ(none.ticks, 13);
  EXPECT_LT(none.decode_per_s, plain.decode_per_s);
  s.cc.speculative_max_batch = 0;  // the policy: no step speculates, only the prompt's MTP rows remain
  const Prediction off = s.run("prompts=1,in=20,out=13");
  EXPECT_EQ(off.ticks, 13);
  EXPECT_NEAR(off.decode_per_s, plain.decode_per_s, 1e-9 * plain.decode_per_s);
  EXPECT_EQ(parse_acceptance("0.9,0.7", 2), (std::vector<double>{0.9, 0.7}));
  expect_error([] { parse_acceptance("0.9", 2); }, {"--acceptance '0.9'", "1 values for speculative_tokens 2"});
  expect_error([] { parse_acceptance("0.5,0.7", 2); }, {"'0.7'", "each at most the one before"});
  expect_error([] { parse_acceptance("1.5", 1); }, {"'1.5'", "[0, 1]"});
}

// The drafts of a step are the last stage's: the first, then one per chained step while the
// chain's position is inside the sequence's KV blocks (runtime/engine/last_stage.cpp). A 63-token
// prompt in a pool too tight for look-ahead blocks holds one block (64 positions) after its
// prefill: 2 drafts, not 3. Every draft accepted: 1, then 3, 4, 4 tokens and a last one (5 ticks;
// with 3 drafts it would be 1 + 4 + 4 + 4 in 4).
TEST(Simulate, DraftsStopAtTheSequencesBlocks) {
  Sim s;
  s.cc.speculative_tokens = 3;
  s.cc.speculative_max_batch = 64;
  s.acceptance = {1, 1, 1};
  EXPECT_EQ(s.run("prompts=1,in=20,out=13").ticks, 1 + 3);  // room for every draft
  const double per_block =
      double(kv_bytes_per_token(s.cc, s.cfg, plan_stages(s.cc, s.cfg, 1))) * double(runtime::kBlockTokens);
  s.cc.kv_budget_gb = 2.5 * per_block / 1e9;  // 2 blocks: no look-ahead block beside the first
  const Prediction p = s.run("prompts=1,in=63,out=13");
  EXPECT_EQ(p.generated, 13);
  EXPECT_EQ(p.preemptions, 0);
  EXPECT_EQ(p.ticks, 5);
}

TEST(Simulate, PredictionFollowsTheRates) {
  Sim s;
  const double slow = s.run("prompts=4,in=8,out=32").makespan_s;
  s.hw.mem_bw = s.hw.mem_bw_core = 2e12;  // decode of a tiny batch is bandwidth-bound
  const double fast = s.run("prompts=4,in=8,out=32").makespan_s;
  EXPECT_NEAR(fast / slow, 0.5, 0.02);
  s.hw.op_overhead_s = 1e-3;  // ~tens of kernel calls per layer: overhead dominates
  EXPECT_GT(s.run("prompts=4,in=8,out=32").makespan_s, 10 * fast);
}

TEST(Simulate, MicroBatchesFillThePipeline) {
  Sim s;
  s.hw = flat_hardware(1e15, 1e9);  // compute-bound: a step's time grows with its rows
  const double one_stage = s.run("prompts=32,in=8,out=32").makespan_s;
  s.cc.stages = 2;
  s.cc.micro_batches = 1;  // one step in flight: the stages take turns
  const Prediction mb1 = s.run("prompts=32,in=8,out=32");
  s.cc.micro_batches = 2;
  const Prediction mb2 = s.run("prompts=32,in=8,out=32");
  EXPECT_GT(mb1.makespan_s, 0.9 * one_stage);
  EXPECT_LT(mb2.makespan_s, 0.75 * mb1.makespan_s);
  ASSERT_EQ(mb2.stages.size(), 2u);
  EXPECT_GT(mb2.pipeline_bytes_per_step, 0);
  for (double u : mb1.rank_utilisation) EXPECT_LT(u, 0.7);
}

TEST(Simulate, CpuRanksShareTheirHost) {
  Sim s;
  s.hw = flat_hardware(1e10, 1e11);
  s.hw.kind = "cpu";
  s.hw.cores = 2;
  s.hw.mem_bw_core = 0.6e10;  // one core streams 60 % of the host's bandwidth
  const double one = s.run("prompts=16,in=8,out=16").makespan_s;
  // Two columns on one host: each rank gets one core and they share the bandwidth.
  s.cc.expert_parallel = 2;
  const Prediction two = s.run("prompts=16,in=8,out=16");
  EXPECT_GT(two.makespan_s, 0.8 * one);
  // The same ranks on two hosts do not share.
  s.cc.hosts = {{"a", 1}, {"b", 1}};
  EXPECT_LT(s.run("prompts=16,in=8,out=16").makespan_s, 0.95 * two.makespan_s);
}

// The replay runs the engine's own scheduler and distributor: on a KV pool too small for every
// sequence at once (preemption and recomputation), the simulator's ticks, preemptions and tokens are
// those of a real `glm5 batch` of the same workload on the same cluster config.
TEST(Simulate, ReplaysTheEnginesScheduler) {
  Sim s;
  const int64_t in = 20, out = 70, prompts = 6;
  const double per_block =
      double(runtime::KvPool::bytes_per_token(s.cfg, 0, int(s.cfg.num_hidden_layers), DType::F32)) *
      double(runtime::kBlockTokens);
  const fs::path cluster = scratch("kv-small.yaml");
  char budget[64];
  std::snprintf(budget, sizeof budget, "%.17g", 3.5 * per_block / 1e9);  // 3 blocks: 2 sequences of 90 rows
  std::ofstream(cluster) << "stages: 1\nexpert_parallel: 1\nbackend: cpu\nmax_batch: 4\nkv_budget_gb: " << budget
                         << "\n";
  const fs::path input = scratch("kv-small.jsonl"), records = scratch("kv-small.out.jsonl"),
                 report = scratch("kv-small.report.json");
  {
    std::ofstream f(input);
    for (int64_t i = 0; i < prompts; ++i) {
      std::vector<int> ids;
      for (int64_t t = 0; t < in; ++t) ids.push_back(int(1 + (i * in + t) % 200));
      f << nlohmann::json({{"custom_id", "r" + std::to_string(i)},
                           {"prompt_ids", ids},
                           {"max_tokens", out},
                           {"ignore_eos", true},
                           {"temperature", 0}})
               .dump()
        << "\n";
    }
  }
  const Proc run = run_captured(kBin + " batch --model " + kMoe + " --cluster " + cluster.string() + " --input " +
                                    input.string() + " --output " + records.string() + " --report " + report.string(),
                                scratch("kv-small.o"), scratch("kv-small.e"));
  ASSERT_EQ(run.code, 0) << run.err;
  const nlohmann::json rank = nlohmann::json::parse(slurp(report)).at("ranks").at(0);
  s.cc = load_cluster_config(cluster.string());
  const Prediction p = s.run("prompts=6,in=20,out=70");
  EXPECT_GT(rank.at("preemptions").get<int64_t>(), 0);  // the case this test is about
  EXPECT_EQ(p.preemptions, rank.at("preemptions").get<int64_t>());
  // The engine's ticks also count its idle ones: before the input reader's first lines arrive and
  // the one that hands back the last results.
  EXPECT_GE(rank.at("ticks").get<int64_t>(), p.ticks);
  EXPECT_LE(rank.at("ticks").get<int64_t>(), p.ticks + 25);  // backing off 2 ms -> 50 ms while idle
  EXPECT_EQ(p.generated, rank.at("tokens_generated").get<int64_t>());
  EXPECT_EQ(p.generated, prompts * out);
}

TEST(Simulate, CommandLine) {
  const fs::path json = scratch("pred.json");
  const std::string cmd = kBin + " simulate --model " + kMoe + " --cluster " + kSrc +
                          "/cluster-configs/cpu-pp2-ep2.yaml --workload prompts=8,in=40,out=6 --hardware ";
  // A CPU cluster with a GPU hardware file is refused with the reason.
  Proc p = run_captured(cmd + kSrc + "/cluster-configs/hardware/h100-sxm.yaml", scratch("o1"), scratch("e1"));
  EXPECT_EQ(p.code, 1);
  EXPECT_TRUE(contains(p.err, "kind gpu but the cluster config's backend is cpu")) << p.err;
  // With a CPU hardware file: the tables and the JSON.
  const fs::path hw = scratch("cpu.yaml");
  Hardware h = flat_hardware(2e10, 1e11);
  h.kind = "cpu";
  h.cores = 2;
  std::ofstream(hw) << hardware_yaml(h, "test");
  p = run_captured(cmd + hw.string() + " --json " + json.string(), scratch("o2"), scratch("e2"));
  ASSERT_EQ(p.code, 0) << p.err;
  for (const char* want : {"predicted ", "generated tokens/s", "| stage | layers |", "bottleneck stage", "moe ",
                           "pipeline ", "memory     rank"})
    EXPECT_TRUE(contains(p.out, want)) << want << " not in:\n" << p.out;
  const nlohmann::json j = nlohmann::json::parse(slurp(json));
  EXPECT_GT(j.at("generated_tokens_per_s").get<double>(), 0);
  EXPECT_EQ(j.at("stages").size(), 2u);
  EXPECT_EQ(j.at("memory").size(), 4u);
  EXPECT_GT(j.at("stages")[0].at("phases").at("projections").get<double>(), 0);
  // Routing from a report of another model is refused, naming the file.
  const fs::path rep = scratch("report.json");
  std::ofstream(rep) << R"({"moe": {"layers": [{"layer": 1, "expert_tokens": [1, 2, 3]}]}})";
  p = run_captured(cmd + hw.string() + " --routing " + rep.string(), scratch("o3"), scratch("e3"));
  EXPECT_EQ(p.code, 1);
  EXPECT_TRUE(contains(p.err, rep.string()) && contains(p.err, "3 expert counts")) << p.err;
  p = run_captured(
      kBin + " simulate --model " + kMoe + "/config.json --workload prompts=1,in=2048,out=1 --hardware " + hw.string(),
      scratch("o5"), scratch("e5"));
  EXPECT_EQ(p.code, 1);
  EXPECT_TRUE(contains(p.err, "in + out = 2049 tokens exceeds the model's max_position_embeddings (2048")) << p.err;
  p = run_captured(kBin + " simulate --model " + kMoe + " --workload prompts=1,in=8", scratch("o4"), scratch("e4"));
  EXPECT_EQ(p.code, 1);
  EXPECT_TRUE(contains(p.err, "prompts, in and out are required")) << p.err;
}

TEST(Simulate, CalibrateWritesAHardwareFile) {
  const fs::path out = scratch("calibrated.yaml");
  const Proc p = run_captured(kBin + " simulate --calibrate --out " + out.string(), scratch("oc"), scratch("ec"));
  ASSERT_EQ(p.code, 0) << p.err;
  const Hardware hw = load_hardware(out.string());
  EXPECT_EQ(hw.kind, "cpu");
  EXPECT_GE(hw.cores, 1);
  EXPECT_GT(hw.gemm_flops, 1e8);
  EXPECT_GT(hw.mem_bw_core, 1e8);
  EXPECT_GE(hw.mem_bw, hw.mem_bw_core);
  EXPECT_GT(hw.attention_flops, 1e8);
  EXPECT_GT(hw.topk_rate, 1e5);
}

}  // namespace
}  // namespace glm5::launcher

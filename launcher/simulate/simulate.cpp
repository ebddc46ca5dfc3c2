// `glm5 simulate`: loads the model config, the cluster config, a hardware file (or calibrates this
// CPU) and optionally a report's routing statistics, replays the workload (sim_schedule.h) and
// prints the predicted throughput, per-stage utilisation, the bottleneck, the memory per rank and
// the bytes the MoE exchange and the pipeline move.
#include "launcher/simulate/simulate.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kernels/core/check.h"
#include "launcher/cluster/cluster_config.h"
#include "launcher/simulate/hardware.h"
#include "launcher/simulate/sim_cost.h"
#include "launcher/simulate/sim_schedule.h"
#include "runtime/kv_cache.h"
#include "runtime/memory_plan.h"

namespace glm5::launcher {

using nlohmann::json;

namespace {

// --model DIR or --model DIR/config.json: the config, and the directory for the index.
runtime::ModelConfig read_model(const std::string& path, std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::is_regular_file(path)) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    dir = fs::path(path).parent_path().string();
    if (dir.empty()) dir = ".";
    return runtime::parse_config(ss.str(), path);
  }
  dir = path;
  return runtime::load_config(path);
}

// Per MoE layer, each expert's share of the routed picks in a batch --report.
std::vector<std::vector<double>> read_routing(const std::string& path, const runtime::ModelConfig& cfg) {
  std::ifstream f(path);
  CHECK(f, "--routing ", path, ": cannot open it");
  json r;
  try {
    r = json::parse(f);
  } catch (const json::exception& e) {
    GLM5_FAIL("--routing ", path, ": not a report (JSON): ", e.what());
  }
  CHECK(r.contains("moe") && r["moe"].contains("layers"), "--routing ", path,
        ": no 'moe' section with 'layers' (write it with glm5 batch --report on an MoE model)");
  std::vector<std::vector<double>> share(size_t(cfg.num_hidden_layers));
  for (const json& l : r["moe"]["layers"]) {
    const int layer = l.at("layer").get<int>();
    const auto tokens = l.at("expert_tokens").get<std::vector<double>>();
    CHECK(layer >= 0 && layer < cfg.num_hidden_layers && int64_t(tokens.size()) == cfg.n_routed_experts, "--routing ",
          path, ": layer ", layer, " with ", tokens.size(), " expert counts: expected a layer below ",
          cfg.num_hidden_layers, " with ", cfg.n_routed_experts, " counts (a report of this model)");
    double sum = 0;
    for (double t : tokens) sum += t;
    if (sum <= 0) continue;
    auto& s = share[size_t(layer)];
    for (double t : tokens) s.push_back(t / sum);
  }
  return share;
}

}  // namespace

namespace {

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", bytes / 1e9);
  return b;
}

// Memory of one rank: its weights, the KV cache its sequences need at the workload's peak, and
// the activation reserve of one step; `room` is what the rank has (0: unknown).
struct RankMemory {
  double weights = 0, kv = 0, activations = 0, room = 0;
  double total() const { return weights + kv + activations; }
};

std::vector<RankMemory> plan_memory(const runtime::ModelConfig& cfg, const ClusterConfig& cc, const Hardware& hw,
                                    const std::vector<parallel::LayerRange>& stages, const runtime::WeightPlan& wp,
                                    const Workload& w) {
  const parallel::Grid g = cc.grid();
  const int64_t per_column = (w.prompts + cc.expert_parallel - 1) / cc.expert_parallel;
  const int64_t live = std::min<int64_t>(cc.max_batch, per_column);
  const int64_t blocks = (w.in + w.out + runtime::kBlockTokens - 1) / runtime::kBlockTokens;
  runtime::StepShape shape;
  shape.limits() = cc.limits();
  shape.expert_parallel = cc.expert_parallel;
  shape.device = hw.gpu();
  const double act = runtime::estimate_activations(cfg, shape).total();
  const std::vector<int> host = host_of_ranks(cc, hw);  // a CPU host's memory is shared by its ranks
  std::vector<RankMemory> out;
  for (int r = 0; r < cc.world_size(); ++r) {
    const int s = g.stage_of(r);
    RankMemory m;
    m.weights = double(runtime::shard_weight_bytes(wp, cfg, rank_shard(cc, stages, r)));
    m.kv = double(live * blocks) * double(runtime::kBlockTokens) *
           double(stage_kv_bytes_per_token(cc, cfg, stages, size_t(s)));
    m.activations = act;
    m.room = cc.device_memory_gb > 0 ? cc.device_memory_gb * 1e9
             : hw.gpu()              ? hw.memory_gb * 1e9
                        : hw.memory_gb * 1e9 / double(std::count(host.begin(), host.end(), host[size_t(r)]));
    out.push_back(m);
  }
  return out;
}

// The heaviest phases of a stage as "experts 41 %, attention 20 %, ...".
std::string top_phases(const StagePrediction& sp, size_t n) {
  std::vector<std::pair<std::string, double>> v(sp.phases.begin(), sp.phases.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string s;
  for (size_t i = 0; i < v.size() && i < n; ++i) {
    char b[96];
    std::snprintf(b, sizeof b, "%s%s %.0f %%", s.empty() ? "" : ", ", v[i].first.c_str(),
                  100 * v[i].second / std::max(sp.busy_s, 1e-12));
    s += b;
  }
  return s;
}

// The expert shape the calibration streams: the model's when --model is given, else GLM-5's.
Hardware calibrate_for(const std::string& model) {
  if (model.empty()) return calibrate_cpu();
  std::string dir;
  const runtime::ModelConfig cfg = read_model(model, dir);
  return calibrate_cpu(cfg.hidden_size,
                       cfg.moe_intermediate_size > 0 ? cfg.moe_intermediate_size : cfg.intermediate_size);
}

int write_calibration(const SimulateArgs& a) {
  CHECK(!a.out.empty(), "simulate --calibrate: --out FILE is required (the hardware YAML to write)");
  std::fprintf(stderr, "[glm5] simulate: calibrating this CPU (GEMM, weight streaming, attention, top-k) ...\n");
  const Hardware hw = calibrate_for(a.model);
  const std::string text =
      hardware_yaml(hw, "This machine, measured by `glm5 simulate --calibrate` with the CPU backend's kernels" +
                            std::string(a.model.empty() ? "" : " (experts shaped as " + a.model + "'s)") +
                            ".\n"
                            "intra_node_latency_us and the inter_node values are assumptions, not measurements.");
  std::ofstream f(a.out);
  CHECK(f, "simulate --calibrate: cannot write ", a.out);
  f << text;
  f.close();
  CHECK(f, "simulate --calibrate: writing ", a.out, " failed (disk full?)");
  std::printf("%s", text.c_str());
  return 0;
}

}  // namespace

namespace {

// The hardware file, or this CPU calibrated now; its kind must be the cluster config's backend.
Hardware hardware_for(const SimulateArgs& a, const ClusterConfig& cc) {
  Hardware hw;
  if (!a.hardware.empty()) {
    hw = load_hardware(a.hardware);
  } else {
    CHECK(cc.backend == "cpu", "simulate: backend ", cc.backend,
          " needs --hardware FILE (cluster-configs/hardware/h100-sxm.yaml, h200-sxm.yaml)");
    std::fprintf(stderr, "[glm5] simulate: no --hardware; calibrating this CPU first (see --calibrate)\n");
    hw = calibrate_for(a.model);
  }
  CHECK(hw.gpu() == (cc.backend == "cuda"), "simulate: hardware ", hw.source.empty() ? hw.name : hw.source, " is kind ",
        hw.kind, " but the cluster config's backend is ", cc.backend);
  CHECK(hw.gpu() == (cc.backend == "cuda"), "simulate: hardware ", hw.source.empty() ? hw.name : hw.source, " is kind ",
        hw.kind, " but the cluster config's backend is ", cc.backend);
  return hw;
}

// What is simulated: the model, layout, hardware, precision, kernels and workload.
void print_setup(const SimulateArgs& a, const SimSetup& setup, const runtime::WeightPlan& wp, bool measured) {
  const runtime::ModelConfig& cfg = *setup.cfg;
  const ClusterConfig& cc = *setup.cluster;
  const Hardware& hw = *setup.hw;
  const Workload& work = setup.work;
  std::printf("model      %s: %lld layers, %lld routed experts (top %lld), index_topk %lld\n", cfg.source.c_str(),
              (long long)cfg.num_hidden_layers, (long long)cfg.n_routed_experts, (long long)cfg.num_experts_per_tok,
              (long long)cfg.index_topk);
  std::printf(
      "layout     %d stage(s) x %d expert-parallel = %d rank(s), micro_batches %d, max_batch %lld, "
      "prefill_chunk %lld\n",
      cc.stages, cc.expert_parallel, cc.world_size(), cc.micro_batches, (long long)cc.max_batch,
      (long long)cc.prefill_chunk);
  std::printf("hardware   %s (%s%s)\n", hw.name.c_str(), hw.kind.c_str(),
              a.hardware.empty() ? ", calibrated now" : (", " + a.hardware).c_str());
  std::printf("precision  %s: GEMMs at %.3g FLOP/s%s\n", cc.precision.c_str(),
              hw.gemm_flops * hw.gemm_efficiency / (cc.precision == "exact" ? hw.exact_gemm_cost : 1.0),
              cc.precision == "exact" && hw.exact_gemm_cost > 1
                  ? (" (exact takes " + std::to_string(hw.exact_gemm_cost).substr(0, 4) + "x fast's time)").c_str()
                  : "");
  const bool quantized = std::any_of(wp.stored.begin(), wp.stored.end(), [](const runtime::StoredForm& f) {
    return f.dtype == DType::F8_E4M3 || f.dtype == DType::Q4 || f.dtype == DType::Q8;
  });
  if (quantized && hw.exact_gemm_cost > 1)
    std::printf(
        "note       the checkpoint has quantized matrices, whose GEMMs run the same kernels in both precisions: "
        "exact's extra cost is applied to every GEMM here, so exact is predicted slower than it runs\n");
  if (measured)
    std::printf(
        "kernels    glm5's, at the efficiencies measured by %s (--published-kernels: the what-if of the "
        "best published kernels)\n",
        hw.measured.by.c_str());
  else if (hw.has_measured)
    std::printf(
        "what-if    kernels at the best published efficiencies (the hardware file's top level), not glm5's "
        "(measured by %s)\n",
        hw.measured.by.c_str());
  if (a.overlap || a.exchange_bytes != 4)
    std::printf("what-if    MoE exchange of %g byte(s) per value%s (glm5 itself sends f32, not overlapped)\n",
                a.exchange_bytes, a.overlap ? ", overlapped with compute" : "");
  std::printf("workload   %lld prompts x %lld in + %lld out tokens%s; routing %s\n", (long long)work.prompts,
              (long long)work.in, (long long)work.out,
              work.prefix ? (", shared prefix " + std::to_string(work.prefix)).c_str() : "",
              a.routing.empty() ? "uniform" : a.routing.c_str());
}

// The prediction: rates, the per-stage table, the bottleneck and the traffic. Returns the
// bottleneck stage.
int print_prediction(const Prediction& p, const ClusterConfig& cc, const Hardware& hw, const Workload& work) {
  std::printf(
      "predicted  %.1f generated tokens/s (%.1f tokens/s prompt + generated), %.4g s for the run, "
      "mean time to first token %.4g s, %lld ticks\n",
      p.generated_per_s, p.tokens_per_s, p.makespan_s, p.mean_ttft_s, (long long)p.ticks);
  if (p.decode_per_s > 0)
    std::printf("           %.1f tokens/s in the decode-only steps (steady state)\n", p.decode_per_s);
  if (p.preemptions > 0)
    std::printf("           %lld preemptions: the KV pool (kv_budget_gb) holds fewer sequences than max_batch\n",
                (long long)p.preemptions);
  std::printf("\n| stage | layers | busy s | utilisation | comm s | heaviest phases |\n|---|---|---|---|---|---|\n");
  int bottleneck = 0;
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const StagePrediction& sp = p.stages[s];
    if (sp.busy_s > p.stages[size_t(bottleneck)].busy_s) bottleneck = int(s);
    std::printf("| %zu | %d-%d | %.3f | %.0f %% | %.3f | %s |\n", s, sp.first_layer, sp.last_layer - 1, sp.busy_s,
                100 * sp.busy_s / std::max(p.makespan_s, 1e-12), sp.comm_s, top_phases(sp, 4).c_str());
  }
  const StagePrediction& b = p.stages[size_t(bottleneck)];
  std::printf("\nbottleneck stage %d (%.0f %% busy): %s\n", bottleneck, 100 * b.busy_s / std::max(p.makespan_s, 1e-12),
              top_phases(b, 2).c_str());
  if (cc.expert_parallel > 1)
    std::printf(
        "moe        %.1f KB sent per rank per MoE layer per step (mean): %.1f KB payload (rows out, "
        "results back) over %s, %.2f KB plan (count headers, slot entries) over MPI\n",
        p.exchange_bytes_per_layer / 1e3, (p.exchange_bytes_per_layer - p.exchange_plan_bytes_per_layer) / 1e3,
        hw.gpu() ? "NVLink / the network (comm: nccl)" : "MPI", p.exchange_plan_bytes_per_layer / 1e3);
  if (work.prefix > 0 && cc.expert_parallel > 1)
    std::printf(
        "note       the replay does not keep requests with a shared prefix on one column (the engine's "
        "distributor prefers the column holding it): prefix hits are underestimated\n");
  if (cc.stages > 1)
    std::printf("pipeline   %.1f KB of hidden states per stage hop (mean)\n", p.pipeline_bytes_per_step / 1e3);
  return bottleneck;
}

// The rank that needs the most memory, and whether it fits.
void print_memory(const std::vector<RankMemory>& mem) {
  double worst = 0;
  int worst_rank = 0;
  for (size_t r = 0; r < mem.size(); ++r)
    if (mem[r].total() > worst) worst = mem[r].total(), worst_rank = int(r);
  const RankMemory& m = mem[size_t(worst_rank)];
  std::printf("memory     rank %d needs %s (weights %s + KV %s + activations %s)", worst_rank, gb(m.total()).c_str(),
              gb(m.weights).c_str(), gb(m.kv).c_str(), gb(m.activations).c_str());
  if (m.room > 0)
    std::printf(" of %s: %s\n", gb(m.room).c_str(), m.total() <= m.room ? "fits" : "DOES NOT FIT");
  else
    std::printf("\n");
}

void write_json(const SimulateArgs& a, const SimSetup& setup, const Prediction& p, const std::vector<RankMemory>& mem,
                bool measured, int bottleneck) {
  const ClusterConfig& cc = *setup.cluster;
  const Hardware& hw = *setup.hw;
  const Workload& work = setup.work;
  json j;
  j["generated_tokens_per_s"] = p.generated_per_s;
  j["tokens_per_s"] = p.tokens_per_s;
  j["makespan_s"] = p.makespan_s;
  j["mean_ttft_s"] = p.mean_ttft_s;
  j["decode_tokens_per_s"] = p.decode_per_s;
  j["ticks"] = p.ticks;
  j["preemptions"] = p.preemptions;
  j["bottleneck_stage"] = bottleneck;
  j["exchange_bytes_per_layer"] = p.exchange_bytes_per_layer;
  j["exchange_plan_bytes_per_layer"] = p.exchange_plan_bytes_per_layer;
  j["pipeline_bytes_per_step"] = p.pipeline_bytes_per_step;
  j["layout"] = {{"stages", cc.stages}, {"expert_parallel", cc.expert_parallel}, {"micro_batches", cc.micro_batches}};
  j["workload"] = {{"prompts", work.prompts}, {"in", work.in}, {"out", work.out}, {"prefix", work.prefix}};
  j["hardware"] = hw.name;
  j["kernels"] = measured ? "glm5 measured" : hw.has_measured ? "published what-if" : "hardware file";
  j["precision"] = cc.precision;
  for (const StagePrediction& sp : p.stages)
    j["stages"].push_back({{"first_layer", sp.first_layer},
                           {"last_layer", sp.last_layer},
                           {"busy_s", sp.busy_s},
                           {"comm_s", sp.comm_s},
                           {"phases", sp.phases}});
  for (const RankMemory& r : mem)
    j["memory"].push_back({{"weights", r.weights}, {"kv", r.kv}, {"activations", r.activations}, {"room", r.room}});
  std::ofstream f(a.json);
  CHECK(f, "simulate: cannot write ", a.json);
  f << j.dump(2) << "\n";
  f.close();
  CHECK(f, "simulate: writing ", a.json, " failed (disk full?)");
}

}  // namespace

int run_simulate(const SimulateArgs& a) {
  if (a.calibrate) return write_calibration(a);
  CHECK(!a.model.empty(), "simulate: --model DIR (or its config.json) is required");
  CHECK(!a.workload.empty(), "simulate: --workload prompts=N,in=T,out=T is required");
  const Workload work = parse_workload(a.workload);
  std::string dir;
  const runtime::ModelConfig cfg = read_model(a.model, dir);
  CHECK(cfg.max_position_embeddings <= 0 || work.in + work.out <= cfg.max_position_embeddings, "--workload '",
        a.workload, "': in + out = ", work.in + work.out, " tokens exceeds the model's max_position_embeddings (",
        cfg.max_position_embeddings, ", ", cfg.source, "): the engine would refuse these requests");
  const ClusterConfig cc = a.cluster.empty() ? default_cluster_config() : load_cluster_config(a.cluster);
  const std::vector<parallel::LayerRange> stages = plan_stages(cc, cfg, cc.world_size());
  Hardware hw = hardware_for(a, cc);
  // glm5 as it runs (its kernels' measured efficiencies) unless the published kernels' what-if is asked.
  const bool measured = hw.has_measured && !a.published_kernels;
  if (measured) hw = hw.as_measured();
  const runtime::WeightPlan wp = runtime::plan_weights(cfg, dir);
  const StepCost cost(cfg, wp, cc.expert_parallel,
                      a.routing.empty() ? std::vector<std::vector<double>>{} : read_routing(a.routing, cfg),
                      double(dtype_size(cc.kv_cache_dtype())));
  SimSetup setup{&cfg, &cc, stages, &hw, &cost, work, a.exchange_bytes, a.overlap, {}};
  CHECK(cc.speculative_tokens == 0 || !a.acceptance.empty(), "simulate: ", cc.source, " sets speculative_tokens ",
        cc.speculative_tokens,
        ": give --acceptance (the fraction of verify steps whose drafts 1..j were all accepted, "
        "j = 1..k, e.g. a batch report's spec_accepted_at / spec_verify_steps)");
  if (cc.speculative_tokens > 0) setup.acceptance = parse_acceptance(a.acceptance, cc.speculative_tokens);
  const Prediction p = simulate_run(setup);
  const std::vector<RankMemory> mem = plan_memory(cfg, cc, hw, stages, wp, work);
  print_setup(a, setup, wp, measured);
  const int bottleneck = print_prediction(p, cc, hw, work);
  print_memory(mem);
  if (!a.json.empty()) write_json(a, setup, p, mem, measured, bottleneck);
  return 0;
}

}  // namespace glm5::launcher

// `glm5 inspect` (inspect.h): the model's shape, its stored forms, the run's settings, then one
// line per rank of weights and KV cache, and with device_memory_gb whether the worst rank fits.
#include "launcher/inspect/inspect.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <vector>

#include "launcher/cluster/cluster_config.h"
#include "runtime/kv_cache.h"
#include "runtime/memory_plan.h"
#include "runtime/quant_plan.h"

namespace glm5::launcher {

namespace {

// Bytes as "1.23 GiB".
std::string human_bytes(double b) {
  char buf[64];
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  std::snprintf(buf, sizeof buf, "%.2f %s", b, unit[u]);
  return buf;
}

// Decimal units (device_memory_gb and kv_budget_gb are 1e9 bytes), no space: one table column.
std::string dec(double b) {
  char buf[32];
  if (std::abs(b) >= 1e9 || b == 0)
    std::snprintf(buf, sizeof buf, "%.2fGB", b / 1e9);
  else if (std::abs(b) >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fMB", b / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.1fKB", b / 1e3);
  return buf;
}

void print_model(const runtime::ModelConfig& mc) {
  const int64_t H = mc.hidden_size, V = mc.vocab_size;
  std::printf("model      %s (%s)\n", mc.model_type.c_str(), mc.source.c_str());
  std::printf("shape      hidden %lld, layers %lld (+%lld MTP, loaded when speculating), heads %lld, vocab %lld\n",
              (long long)H, (long long)mc.num_hidden_layers, (long long)mc.num_nextn_predict_layers,
              (long long)mc.num_attention_heads, (long long)V);
  std::printf("mla        q_lora %lld, kv_lora %lld, qk nope/rope/v %lld/%lld/%lld, scale %.6g, rope %s\n",
              (long long)mc.q_lora_rank, (long long)mc.kv_lora_rank, (long long)mc.qk_nope_head_dim,
              (long long)mc.qk_rope_head_dim, (long long)mc.v_head_dim, mc.softmax_scale(),
              mc.rope_interleave ? "interleaved" : "half-split");
  std::printf("indexer    %lld heads x %lld, top-%lld, rope %s\n", (long long)mc.index_n_heads,
              (long long)mc.index_head_dim, (long long)mc.index_topk,
              mc.indexer_rope_interleave ? "interleaved" : "half-split");
  std::printf("moe        %lld experts top-%lld, %lld shared, groups %lld keep %lld, scale %g, dense layers %lld\n",
              (long long)mc.n_routed_experts, (long long)mc.num_experts_per_tok, (long long)mc.n_shared_experts,
              (long long)mc.n_group, (long long)mc.topk_group, mc.routed_scaling_factor,
              (long long)mc.first_k_dense_replace);
  double total = 2.0 * double(V * H) + double(H);
  for (int l = 0; l < mc.num_hidden_layers; ++l) total += layer_parameters(mc, l);
  std::printf("parameters %.4g (%s in bf16)\n", total, human_bytes(total * 2.0).c_str());
}

// Stored forms: counts per form, where they come from, and one copy's resident bytes.
void print_storage(const runtime::WeightPlan& wp, bool converted) {
  std::map<std::string, size_t> forms;
  size_t all_bytes = 0;
  for (size_t i = 0; i < wp.tensors.size(); ++i) {
    ++forms[runtime::form_name(wp.stored[i])];
    all_bytes += wp.resident[i];
  }
  std::string counts;
  for (const auto& [name, n] : forms) counts += (counts.empty() ? "" : ", ") + name + " " + std::to_string(n);
  std::printf("stored     %zu tensors: %s\n", wp.tensors.size(), counts.c_str());
  std::printf("           from %s\n", wp.source.c_str());
  if (converted)
    std::printf("           then --quant %s, as `glm5 convert` would write it: %zu tensor(s) change form\n",
                wp.plan.c_str(), wp.converted);
  if (wp.missing)
    std::printf(
        "warning    %zu schema tensor(s) are not in the index (first: %s); planned in the config dtype, "
        "but this checkpoint will not load as it is\n",
        wp.missing, wp.first_missing.c_str());
  std::printf(
      "resident   %s for one copy of everything: matrices in their stored form, %zu quantized "
      "kv_b_proj / embed_tokens held dequantized (BF16 from int, F32 from FP8), indexer weights_proj F32, "
      "norms and biases F32\n",
      dec(double(all_bytes)).c_str(), wp.dequantized_f32);
}

// The KV cache per token, the layout, the precision and (with device memory) the activation reserve.
void print_run(const runtime::ModelConfig& mc, const ClusterConfig& cc, const runtime::ActivationEstimate& act) {
  const int L = int(mc.num_hidden_layers);
  const DType kv_dtype = cc.kv_cache_dtype();
  const double kv_token = double(runtime::KvPool::bytes_per_token(mc, 0, L, kv_dtype));
  int full = 0;
  for (int l = 0; l < L; ++l) full += mc.has_indexer(l);
  std::printf(
      "kv cache   %s per token (%s: latent %lld values x %d layers + indexer key %lld values x %d layers with "
      "an indexer%s), paged in blocks of %lld tokens\n",
      human_bytes(kv_token).c_str(), cc.kv_dtype.c_str(), (long long)(mc.kv_lora_rank + mc.qk_rope_head_dim), L,
      (long long)mc.index_head_dim, full, full < L ? ": the others share one (IndexShare)" : "",
      (long long)runtime::kBlockTokens);
  std::printf("cluster    %s: %d stage(s) x %d expert-parallel = %d rank(s), backend %s, comm %s\n",
              cc.source.empty() ? "(single process)" : cc.source.c_str(), cc.stages, cc.expert_parallel,
              cc.world_size(), cc.backend.c_str(), cc.comm.c_str());
  std::printf("precision  %s: %s\n", cc.precision.c_str(),
              cc.precision == "fast"
                  ? "gemm inputs rounded to bf16, float32 accumulation (the cpu backend holds F16 / F32 gemm matrices "
                    "as BF16); results within bf16 rounding of exact, invariant per machine and kernel path"
                  : "float32 activations, exact weight values (the goldens' 1e-4; bitwise across layouts and "
                    "batches)");
  if (cc.device_memory_gb > 0)
    std::printf(
        "reserve    %.2f GB per rank for activations: estimated peak of one step at max_step_tokens %lld, "
        "float32, balanced routing = hidden states %.2f + max(attention %.2f, %s %.2f, logits %.2f) + "
        "%s %.2f GB\n",
        act.total() / 1e9, (long long)cc.max_step_tokens, act.residual / 1e9, act.attention / 1e9,
        mc.n_routed_experts > 0 ? "moe" : "mlp", act.mlp / 1e9, act.logits / 1e9,
        cc.backend == "cuda" ? "CUDA context/cuBLAS/allocator" : "no device overhead", act.fixed / 1e9);
}

// The per-rank table's inputs: the KV pool's blocks are sized by the budget over the largest
// stage's layers, the same count on every stage of a column (runtime/engine/engine.cpp); each rank
// allocates them for its own layers (the last stage also caches the MTP layer when speculating).
struct Ranks {
  const runtime::ModelConfig& mc;
  const ClusterConfig& cc;
  const std::vector<parallel::LayerRange>& stages;
  const runtime::WeightPlan& wp;
  double reserve = 0;  // activations per rank (device memory only)

  size_t kv_per_token(size_t s) const { return stage_kv_bytes_per_token(cc, mc, stages, s); }
  int64_t budget_blocks() const {
    if (cc.kv_budget_gb <= 0) return 0;
    return runtime::KvPool::blocks_for_budget(mc, kv_bytes_per_token(cc, mc, stages), cc.kv_budget_gb * 1e9,
                                              int(cc.max_batch));
  }
};

// With device memory: the worst rank's need against it, and how many tokens of KV a column holds.
struct Verdict {
  double short_by = -1e300, need = 0, weights = 0, kv = 0;
  int rank = 0;
  int64_t column_tokens = -1;
  int limit_stage = 0;
};

// One rank's line of the table (and its share of the verdict).
void print_rank(const Ranks& in, int r, int64_t budget_blocks, Verdict& v) {
  const parallel::Grid g = in.cc.grid();
  const int s = g.stage_of(r);
  const runtime::ModelShard shard = rank_shard(in.cc, in.stages, r);
  const double w = double(runtime::shard_weight_bytes(in.wp, in.mc, shard));
  const double per_token = double(in.kv_per_token(size_t(s)));
  char layers[32];
  std::snprintf(layers, sizeof layers, "%d-%d", in.stages[size_t(s)].first, in.stages[size_t(s)].last - 1);
  if (in.cc.device_memory_gb <= 0) {
    std::printf("%-5d %-6d %-6d %-9s %-12s %s\n", r, s, shard.column, layers, dec(w).c_str(), dec(per_token).c_str());
    return;
  }
  const double pool = double(budget_blocks) * per_token * double(runtime::kBlockTokens);
  const double room = in.cc.device_memory_gb * 1e9 - w - in.reserve;
  const int64_t tokens =
      room > 0 ? int64_t(room / (per_token * double(runtime::kBlockTokens))) * runtime::kBlockTokens : 0;
  if (g.column_of(r) == 0 && (v.column_tokens < 0 || tokens < v.column_tokens))
    v.column_tokens = tokens, v.limit_stage = s;
  const std::string btxt = in.cc.kv_budget_gb > 0 ? dec(pool) + (pool <= room ? ":fits" : ":NO") : std::string("none");
  std::printf("%-5d %-6d %-6d %-9s %-12s %-12s %-12s %-13lld %s\n", r, s, shard.column, layers, dec(w).c_str(),
              dec(per_token).c_str(), dec(room).c_str(), (long long)tokens, btxt.c_str());
  const double need = w + in.reserve + pool;
  if (need - in.cc.device_memory_gb * 1e9 > v.short_by)
    v = Verdict{need - in.cc.device_memory_gb * 1e9, need, w, pool, r, v.column_tokens, v.limit_stage};
}

void print_verdict(const Ranks& in, int64_t budget_blocks, const Verdict& v) {
  const ClusterConfig& cc = in.cc;
  if (cc.kv_budget_gb > 0)
    std::printf(
        "kv room    a column has room for %lld tokens of KV (stage %d is the limit); kv_budget_gb %g "
        "allocates %lld tokens per column\n",
        (long long)v.column_tokens, v.limit_stage, cc.kv_budget_gb, (long long)(budget_blocks * runtime::kBlockTokens));
  else
    std::printf("kv room    a column has room for %lld tokens of KV (stage %d is the limit); no kv_budget_gb set\n",
                (long long)v.column_tokens, v.limit_stage);
  char verdict[96];
  if (v.short_by <= 0)
    std::snprintf(verdict, sizeof verdict, "fits, %.2f GB to spare", -v.short_by / 1e9);
  else
    std::snprintf(verdict, sizeof verdict, "DOES NOT FIT by %.2f GB", v.short_by / 1e9);
  std::printf(
      "memory     worst rank %d needs %.2f GB (weights %.2f + activation reserve %.2f + KV pool %.2f) "
      "of %.1f GB device memory: %s\n",
      v.rank, v.need / 1e9, v.weights / 1e9, in.reserve / 1e9, v.kv / 1e9, cc.device_memory_gb, verdict);
}

void print_ranks(const Ranks& in) {
  const bool device = in.cc.device_memory_gb > 0;
  if (device)
    std::printf("%-5s %-6s %-6s %-9s %-12s %-12s %-12s %-13s %s\n", "rank", "stage", "column", "layers", "weights",
                "kv/token", "kv-room", "kv-tokens", "kv-budget");
  else
    std::printf("%-5s %-6s %-6s %-9s %-12s %s\n", "rank", "stage", "column", "layers", "weights", "kv/token");
  const int64_t blocks = in.budget_blocks();
  Verdict v;
  for (int r = 0; r < in.cc.world_size(); ++r) print_rank(in, r, blocks, v);
  if (device) print_verdict(in, blocks, v);
}

}  // namespace

int run_inspect(const InspectArgs& a) {
  std::unique_ptr<runtime::QuantPlan> plan;
  if (!a.quant.empty())
    plan = std::make_unique<runtime::QuantPlan>(
        runtime::parse_quant_plan(a.quant, a.group_size, a.quantize, a.scale_dtype));
  const runtime::ModelConfig mc = runtime::load_config(a.model);
  const ClusterConfig cc = a.cluster.empty() ? default_cluster_config() : load_cluster_config(a.cluster);
  const std::vector<parallel::LayerRange> stages = plan_stages(cc, mc, cc.world_size());
  print_model(mc);
  const runtime::WeightPlan wp = runtime::plan_weights(mc, a.model, plan.get());
  print_storage(wp, plan != nullptr);
  const runtime::ActivationEstimate act =
      runtime::estimate_activations(mc, {cc.limits(), cc.expert_parallel, cc.backend == "cuda"});
  print_run(mc, cc, act);
  print_ranks(Ranks{mc, cc, stages, wp, act.total()});
  return 0;
}

}  // namespace glm5::launcher

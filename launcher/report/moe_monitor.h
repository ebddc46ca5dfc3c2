// MoE routing health from a run's router counts (runtime::Model::router_load on every rank), for
// the run report: per MoE layer the rows routed, the activation ratio (picks / (rows x experts):
// k / E when every row picks k experts), the coefficient of variation and max / mean of the
// per-expert load, the per-EP-rank load max / mean (what expert placement, EPLB, evens out), and
// the rows whose picks were not k distinct experts (must be 0). Warnings name the layer and the
// number. Also a rank's engine counters as JSON and the Prometheus text exposition of a report's
// counters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace glm5::runtime {
struct EngineStats;
}

namespace glm5::launcher {

struct MoeLayerHealth {
  int layer = 0;
  int64_t rows = 0;
  std::vector<int64_t> picks;       // per expert
  std::vector<int64_t> rank_picks;  // per EP rank (column): experts [c * E / EP, (c + 1) * E / EP)
  int experts_active = 0;           // experts with at least one pick (dead experts: E - this)
  double activation_ratio = 0, load_cv = 0, load_max_over_mean = 0, rank_max_over_mean = 0;
};

struct MoeHealth {
  int n_experts = 0, top_k = 0, expert_parallel = 1;
  std::vector<MoeLayerHealth> layers;  // ascending layer index
  int64_t rows_not_k = 0;
  std::vector<std::string> warnings;
};

// `ranks`: the report's per-rank objects, each with "router" ([{layer, rows, picks}]) and
// "rows_not_k" (routings of a row in a layer that were not k distinct experts). A layer's counts
// are summed over the ranks that hold it. Warns when, with EP > 1, a layer's busiest EP rank gets
// more than rank_warn x the mean load (and the mean is at least 256 picks), or any routing was not
// k distinct experts.
MoeHealth moe_health(const nlohmann::json& ranks, int n_experts, int top_k, int expert_parallel, double rank_warn);
nlohmann::json to_json(const MoeHealth& h);

// A rank's engine counters as the report writes them (`ranks[]` of --report; the server's /metrics
// builds its rank entry from it too, and prometheus_text exports the counters it lists).
nlohmann::json to_json(const runtime::EngineStats& st);

// Prometheus text exposition (version 0.0.4) of a report: per-rank counters and, with "moe",
// per-layer expert loads and the health figures.
std::string prometheus_text(const nlohmann::json& report);

}  // namespace glm5::launcher

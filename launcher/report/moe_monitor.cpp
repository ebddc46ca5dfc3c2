// moe_health / prometheus_text: see moe_monitor.h.
#include "launcher/report/moe_monitor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <sstream>

#include "runtime/engine/engine.h"

namespace glm5::launcher {

using nlohmann::json;

namespace {

// Picks an EP rank must get on average before a layer's imbalance is worth a warning (uniform
// routing over few picks is uneven by chance: ~10 % spread at 256).
constexpr double kMinPicksPerRankToWarn = 256;

double mean(const std::vector<int64_t>& v) {
  return v.empty() ? 0.0 : double(std::accumulate(v.begin(), v.end(), int64_t(0))) / double(v.size());
}

double max_over_mean(const std::vector<int64_t>& v) {
  const double m = mean(v);
  return m > 0 ? double(*std::max_element(v.begin(), v.end())) / m : 0.0;
}

double cv(const std::vector<int64_t>& v) {  // population standard deviation / mean
  const double m = mean(v);
  if (m <= 0) return 0.0;
  double s = 0;
  for (int64_t x : v) s += (double(x) - m) * (double(x) - m);
  return std::sqrt(s / double(v.size())) / m;
}

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", v);
  return b;
}

}  // namespace

MoeHealth moe_health(const json& ranks, int n_experts, int top_k, int expert_parallel, double rank_warn) {
  MoeHealth h;
  h.n_experts = n_experts;
  h.top_k = top_k;
  h.expert_parallel = std::max(expert_parallel, 1);
  if (n_experts <= 0) return h;
  std::map<int, MoeLayerHealth> by_layer;
  for (const json& r : ranks) {
    h.rows_not_k += r.value("rows_not_k", int64_t(0));
    for (const json& l : r.value("router", json::array())) {
      MoeLayerHealth& m = by_layer[l.at("layer").get<int>()];
      m.layer = l.at("layer").get<int>();
      m.rows += l.at("rows").get<int64_t>();
      const auto picks = l.at("picks").get<std::vector<int64_t>>();
      m.picks.resize(std::max(m.picks.size(), picks.size()), 0);
      for (size_t e = 0; e < picks.size(); ++e) m.picks[e] += picks[e];
    }
  }
  // Expert e lives on column e / (E / EP) (the model refuses E not divisible by EP; a report that
  // says otherwise gets no per-rank figures).
  const bool split = n_experts % h.expert_parallel == 0;
  const int per = split ? n_experts / h.expert_parallel : n_experts;
  for (auto& [layer, m] : by_layer) {
    m.picks.resize(size_t(n_experts), 0);
    if (split) {
      m.rank_picks.assign(size_t(h.expert_parallel), 0);
      for (int e = 0; e < n_experts; ++e) m.rank_picks[size_t(e / per)] += m.picks[size_t(e)];
    }
    const int64_t total = std::accumulate(m.picks.begin(), m.picks.end(), int64_t(0));
    m.activation_ratio = m.rows > 0 ? double(total) / (double(m.rows) * n_experts) : 0.0;
    m.experts_active = int(std::count_if(m.picks.begin(), m.picks.end(), [](int64_t x) { return x > 0; }));
    m.load_cv = cv(m.picks);
    m.load_max_over_mean = max_over_mean(m.picks);
    m.rank_max_over_mean = split ? max_over_mean(m.rank_picks) : 0.0;
    if (h.expert_parallel > 1 && m.rank_max_over_mean > rank_warn &&
        double(total) / h.expert_parallel >= kMinPicksPerRankToWarn)
      h.warnings.push_back("MoE layer " + std::to_string(layer) + ": the busiest of " +
                           std::to_string(h.expert_parallel) + " EP ranks gets " + fmt(m.rank_max_over_mean) +
                           "x the mean load (warning above " + fmt(rank_warn) + "x; expert loads: max " +
                           fmt(m.load_max_over_mean) + "x mean, CV " + fmt(m.load_cv) + ")");
    h.layers.push_back(m);
  }
  if (h.rows_not_k > 0)
    h.warnings.push_back(std::to_string(h.rows_not_k) + " routings of a row in a layer did not pick " +
                         std::to_string(top_k) + " distinct experts");
  return h;
}

json to_json(const MoeHealth& h) {
  json layers = json::array();
  for (const MoeLayerHealth& m : h.layers)
    layers.push_back({{"layer", m.layer},
                      {"rows", m.rows},
                      {"expert_tokens", m.picks},
                      {"rank_tokens", m.rank_picks},
                      {"activation_ratio", m.activation_ratio},
                      {"expected_activation_ratio", double(h.top_k) / std::max(h.n_experts, 1)},
                      {"experts_active", m.experts_active},
                      {"experts_idle", h.n_experts - m.experts_active},
                      {"expert_load_cv", m.load_cv},
                      {"expert_load_max_over_mean", m.load_max_over_mean},
                      {"rank_load_max_over_mean", m.rank_max_over_mean}});
  return {{"n_routed_experts", h.n_experts},
          {"num_experts_per_tok", h.top_k},
          {"expert_parallel", h.expert_parallel},
          {"rows_not_k", h.rows_not_k},
          {"layers", layers},
          {"warnings", h.warnings}};
}

json to_json(const runtime::EngineStats& st) {
  return {
      {"rank", st.rank},
      {"stage", st.stage},
      {"column", st.column},
      {"wall_s", st.wall_s},
      {"compute_s", st.compute_s},
      {"comm_s", st.comm_s},
      {"idle_s", st.idle_s},
      {"bytes_sent", st.bytes_sent},
      {"tokens_generated", st.tokens_generated},
      {"prompt_tokens", st.prompt_tokens},
      {"ticks", st.ticks},
      {"max_step_rows", st.max_step_rows},
      {"kv_blocks", st.kv_blocks},
      {"kv_blocks_peak", st.kv_blocks_peak},
      {"preemptions", st.preemptions},
      {"prefix_hit_tokens", st.prefix_hit_tokens},
      {"spec_verify_steps", st.spec_steps},
      {"spec_draft_tokens", st.spec_drafted},
      {"spec_accepted_tokens", st.spec_accepted},
      {"spec_accepted_at", st.spec_accepted_at},
      {"spec_mean_acceptance_length", st.spec_steps > 0 ? 1.0 + double(st.spec_accepted) / double(st.spec_steps) : 0.0},
      {"expert_tokens", st.expert_tokens},
      {"peak_rss_kb", st.peak_rss_kb}};
}

std::string prometheus_text(const json& report) {
  std::ostringstream o;
  auto family = [&](const char* name, const char* type, const char* help) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  };
  struct Counter {
    const char *key, *name, *type, *help;
  };
  const Counter per_rank[] = {
      {"tokens_generated", "glm5_tokens_generated_total", "counter", "Tokens generated (sampled) by the rank."},
      {"prompt_tokens", "glm5_prompt_tokens_total", "counter", "Prompt tokens the rank processed."},
      {"compute_s", "glm5_compute_seconds_total", "counter", "Seconds in kernels."},
      {"comm_s", "glm5_comm_seconds_total", "counter", "Seconds sending, in collectives and the MoE exchange."},
      {"idle_s", "glm5_idle_seconds_total", "counter", "Seconds waiting for the neighbouring pipeline stage."},
      {"bytes_sent", "glm5_bytes_sent_total", "counter", "Bytes the rank sent."},
      {"preemptions", "glm5_preemptions_total", "counter", "Sequences preempted."},
      {"prefix_hit_tokens", "glm5_prefix_hit_tokens_total", "counter", "Prompt positions served from shared blocks."},
      {"kv_blocks_peak", "glm5_kv_blocks_peak", "gauge", "Most KV blocks in use at once."},
      {"spec_verify_steps", "glm5_spec_verify_steps_total", "counter", "Decode steps that verified MTP drafts."},
      {"spec_draft_tokens", "glm5_spec_draft_tokens_total", "counter", "MTP draft tokens verified."},
      {"spec_accepted_tokens", "glm5_spec_accepted_tokens_total", "counter", "MTP draft tokens accepted."},
      {"peak_rss_kb", "glm5_peak_rss_bytes", "gauge", "Peak resident set size."},
      {"rows_not_k", "glm5_moe_rows_not_k_total", "counter", "Routed rows whose picks were not k distinct experts."},
  };
  for (const Counter& c : per_rank) {
    family(c.name, c.type, c.help);
    for (const json& r : report.at("ranks"))
      if (r.contains(c.key) && r.at(c.key).is_number())
        o << c.name << "{rank=\"" << r.at("rank").get<int>() << "\"} "
          << (c.key == std::string("peak_rss_kb") ? json(r.at(c.key).get<int64_t>() * 1024) : r.at(c.key)).dump()
          << '\n';
  }
  family("glm5_spec_accepted_at_total", "counter", "Verify steps whose draft at this position was accepted.");
  for (const json& r : report.at("ranks"))
    if (r.contains("spec_accepted_at"))
      for (size_t j = 0; j < r.at("spec_accepted_at").size(); ++j)
        o << "glm5_spec_accepted_at_total{rank=\"" << r.at("rank").get<int>() << "\",position=\"" << j + 1 << "\"} "
          << r.at("spec_accepted_at")[j].dump() << '\n';
  if (report.contains("moe")) {
    const json& moe = report.at("moe");
    family("glm5_moe_expert_tokens_total", "counter", "Rows routed to an expert, per MoE layer.");
    for (const json& l : moe.at("layers")) {
      const auto& picks = l.at("expert_tokens");
      for (size_t e = 0; e < picks.size(); ++e)
        o << "glm5_moe_expert_tokens_total{layer=\"" << l.at("layer").get<int>() << "\",expert=\"" << e << "\"} "
          << picks[e].dump() << '\n';
    }
    const std::pair<const char*, const char*> gauges[] = {
        {"activation_ratio", "Expert picks / (rows x experts); k / E when every row picks k."},
        {"expert_load_cv", "Coefficient of variation of the per-expert load."},
        {"expert_load_max_over_mean", "Busiest expert's load over the mean."},
        {"rank_load_max_over_mean", "Busiest EP rank's load over the mean."},
        {"experts_active", "Experts that got at least one row."}};
    for (const auto& [key, help] : gauges) {
      const std::string name = std::string("glm5_moe_") + key;
      family(name.c_str(), "gauge", help);
      for (const json& l : moe.at("layers"))
        o << name << "{layer=\"" << l.at("layer").get<int>() << "\"} " << l.at(key).dump() << '\n';
    }
  }
  return o.str();
}

}  // namespace glm5::launcher

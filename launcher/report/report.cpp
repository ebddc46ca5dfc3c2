// `glm5 report FILE`: a batch --report file as tables: per rank its wall time split into compute /
// communication / pipeline idle; with --profile, each phase's seconds and share of the rank's wall
// time (summed over layers), heaviest first, and the heaviest layers; with MoE layers, the routing
// health of launcher/report/moe_monitor.h.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/core/check.h"
#include "launcher/report/report.h"

namespace glm5::launcher {

using nlohmann::json;

namespace {

json read_json(const std::string& path) {
  std::ifstream f(path);
  CHECK(f, "cannot open report ", path);
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    GLM5_FAIL(path, ": not a report (JSON): ", e.what());
  }
}

void print_profile(const json& r) {
  const double wall = r.value("wall_s", 0.0);
  std::map<std::string, std::pair<double, int64_t>> by_phase;  // seconds, calls
  std::map<int, double> by_layer;
  for (const json& p : r.at("profile")) {
    auto& t = by_phase[p.at("phase").get<std::string>()];
    t.first += p.at("seconds").get<double>();
    t.second += p.at("calls").get<int64_t>();
    if (p.at("layer").get<int>() >= 0) by_layer[p.at("layer").get<int>()] += p.at("seconds").get<double>();
  }
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(by_phase.begin(), by_phase.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  double sum = 0;
  std::printf("  | phase | seconds | share of wall | calls |\n  |---|---|---|---|\n");
  for (const auto& [name, t] : rows) {
    sum += t.first;
    std::printf("  | %s | %.4f | %.1f %% | %lld |\n", name.c_str(), t.first, wall > 0 ? 100 * t.first / wall : 0.0,
                (long long)t.second);
  }
  std::printf("  | (not in a phase: scheduling, messages, norms, waits) | %.4f | %.1f %% | |\n", wall - sum,
              wall > 0 ? 100 * (wall - sum) / wall : 0.0);
  std::vector<std::pair<int, double>> layers(by_layer.begin(), by_layer.end());
  std::sort(layers.begin(), layers.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::printf("  heaviest layers:");
  for (size_t i = 0; i < layers.size() && i < 5; ++i) std::printf(" %d (%.4f s)", layers[i].first, layers[i].second);
  std::printf("\n");
}

void print_report(const std::string& path, const json& rep) {
  CHECK(rep.contains("ranks") && rep.at("ranks").is_array(), path,
        ": no \"ranks\" array (not a glm5 batch --report file)");
  std::printf(
      "%s: %d rank(s)\n\n| rank | stage | column | wall s | compute | comm | idle | tokens/s | peak RSS MiB |\n"
      "|---|---|---|---|---|---|---|---|---|\n",
      path.c_str(), rep.value("world_size", 0));
  for (const json& r : rep.at("ranks")) {
    const double wall = r.value("wall_s", 0.0), pct = wall > 0 ? 100 / wall : 0;
    std::printf("| %d | %d | %d | %.3f | %.1f %% | %.1f %% | %.1f %% | %.1f | %.1f |\n", r.value("rank", 0),
                r.value("stage", 0), r.value("column", 0), wall, r.value("compute_s", 0.0) * pct,
                r.value("comm_s", 0.0) * pct, r.value("idle_s", 0.0) * pct, r.value("tokens_per_s", 0.0),
                r.value("peak_rss_kb", 0.0) / 1024);
  }
  for (const json& r : rep.at("ranks"))
    if (r.value("spec_verify_steps", int64_t(0)) > 0)
      std::printf(
          "\nrank %d speculative decoding: %lld verify steps, %lld drafts, %lld accepted, per position %s, "
          "mean acceptance length %.2f\n",
          r.value("rank", 0), (long long)r.value("spec_verify_steps", int64_t(0)),
          (long long)r.value("spec_draft_tokens", int64_t(0)), (long long)r.value("spec_accepted_tokens", int64_t(0)),
          r.value("spec_accepted_at", json::array()).dump().c_str(), r.value("spec_mean_acceptance_length", 0.0));
  for (const json& r : rep.at("ranks"))
    if (r.contains("profile")) {
      std::printf("\nrank %d profile (wall %.3f s):\n", r.value("rank", 0), r.value("wall_s", 0.0));
      print_profile(r);
    }
  if (rep.contains("moe")) {
    const json& moe = rep.at("moe");
    std::printf("\nMoE routing (%d experts, k = %d, %d EP ranks): rows not picking k experts: %lld\n\n",
                moe.value("n_routed_experts", 0), moe.value("num_experts_per_tok", 0), moe.value("expert_parallel", 1),
                (long long)moe.value("rows_not_k", int64_t(0)));
    std::printf(
        "| layer | rows | activation ratio (k/E = %.4f) | experts active | expert load CV | expert max/mean | "
        "EP rank max/mean |\n|---|---|---|---|---|---|---|\n",
        moe.at("layers").empty() ? 0.0 : moe.at("layers")[0].value("expected_activation_ratio", 0.0));
    for (const json& l : moe.at("layers"))
      std::printf("| %d | %lld | %.4f | %d | %.3f | %.3f | %.3f |\n", l.value("layer", 0),
                  (long long)l.value("rows", int64_t(0)), l.value("activation_ratio", 0.0),
                  l.value("experts_active", 0), l.value("expert_load_cv", 0.0),
                  l.value("expert_load_max_over_mean", 0.0), l.value("rank_load_max_over_mean", 0.0));
    for (const json& w : moe.value("warnings", json::array()))
      std::printf("warning: %s\n", w.get<std::string>().c_str());
  }
}

}  // namespace

int run_report(const std::string& path) {
  const json rep = read_json(path);
  try {
    print_report(path, rep);
  } catch (const json::exception& e) {  // a field missing or of the wrong type
    GLM5_FAIL(path, ": not a glm5 batch --report file as expected: ", e.what());
  }
  return 0;
}

}  // namespace glm5::launcher
